"""Decode steps as CUDA graphs: capture `MoETransformer.decode_step` once, replay it for every token
(StaticDecoder: a fixed batch over a KVCache; SlotDecoder: changing rows of a SlotKVCache, a graph per padded
batch size; SegmentedDecoder: the GPU work between the layers whose experts read the routing on the host, as one
graph per segment).

At small batch, GPU decode is launch-bound: hundreds of small kernels a token, each costing more to
launch from Python than to run. A graph replays them all from one launch. Capturing needs a step of
fixed shapes that never reads the device from the host: the static decode step over a KV cache (write
slot and masks on the device), and expert paths in model/paths.py GRAPH_SAFE (the fused Triton and
grouped-GEMM paths; not the CPU loop, nor offloading, which read routing on the host).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from moeserve.kernels.cuda_graph import capture
from moeserve.model.kv_cache import KVCache, SlotKVCache
from moeserve.model.paths import GRAPH_SAFE
from moeserve.model.transformer import DecodeState


def host_layers(model, batch: int) -> list[int]:
    """The MoE layers of `model` whose experts at `batch` tokens read the device from the host (a path outside
    model/paths.py GRAPH_SAFE: hybrid CPU experts, offload), in order."""
    x = torch.empty(batch, model.spec.hidden_size, device=model.device, dtype=model.dtype)  # [B, D] probe
    return [i for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts") and layer.mlp.experts.kernel_path(x, batch) not in GRAPH_SAFE]


def graph_safe(model, batch: int) -> bool:
    """Whether the decode step of `model` at `batch` tokens can be captured: CUDA, and every MoE layer's expert
    path at that size one that never reads the device from the host (model/paths.py GRAPH_SAFE)."""
    return model.device.type == "cuda" and not host_layers(model, batch)


class StaticDecoder:
    """One decode step over a fixed KV cache: `model.decode_step`, eagerly or as a CUDA graph captured on the
    first call (warm-up on a side stream, then capture) and replayed after, reading fresh inputs from static
    buffers. Either way a call advances the cache by one slot, as `model(tokens, positions, kv=kv, ...)` does.
    """

    def __init__(self, model, kv: KVCache, graph: bool, warmup: int = 2):
        self.model, self.kv, self.use_graph, self.warmup = model, kv, graph, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []  # static tokens, positions, valid [B, 1] (once captured)
        self.logits: torch.Tensor | None = None  # [B, 1, V] static output, overwritten by every replay

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """tokens/positions/valid [B, 1] -> logits [B, 1, V] (with a graph: valid until the next call)."""
        self.kv.reserve_step()
        if not self.use_graph or (self.graph is None and not self._captured(tokens, positions, valid)):
            logits = self.model.decode_step(tokens, positions, valid, self.kv)
        else:
            for buf, x in zip(self.inputs, (tokens, positions, valid)):
                buf.copy_(x)
            self.graph.replay()
            logits = self.logits
        self.kv.commit()
        return logits

    def _captured(self, *inputs: torch.Tensor) -> bool:
        """Capture the step; if that fails (a backend that claimed to be sync-free is not), say so once and
        decode eagerly from then on rather than stop the generation."""
        if captured(lambda: self._capture(*inputs), "the decode step"):
            return True
        self.use_graph, self.graph = False, None
        return False

    def _capture(self, *inputs: torch.Tensor) -> None:
        """Warm-up runs (Triton compiles, allocator fills) write only the slot this step writes anyway."""
        self.inputs = [x.clone() for x in inputs]
        self.graph, self.logits = capture(lambda: self.model.decode_step(*self.inputs, self.kv), self.warmup,
                                          self.kv.index.device)


class SegmentedDecoder:
    """Decode steps over a fixed KV cache when some MoE layers' experts read the routing on the host (the hybrid
    backend's CPU experts, offloading): `model.decode_step` cut at those layers' experts. Each segment of GPU work
    between two such layers (the first: embedding to the first layer's router; the last: after the last layer's
    experts to the logits) is captured as a CUDA graph on the first call and replayed after; between replays the
    host runs that layer's experts (MoEBlock.finish) eagerly and copies their output where the next segment reads
    it. The host then pays a replay and the experts' own calls per layer instead of every launch of attention,
    norms and router. A capture that fails warns once and the step runs as the dynamic forward after that.
    graph=False runs the same pieces eagerly (the reference, and the CPU tests of the cut)."""

    def __init__(self, model, kv: KVCache, layers: list[int], graph: bool = True, warmup: int = 1):
        self.model, self.kv, self.layers, self.use_graph, self.warmup = model, kv, layers, graph, warmup
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list = []  # per segment, its static output (graphs)
        self.inputs: list[torch.Tensor] = []  # tokens, positions, valid [B, 1] (static with graphs)
        self.carried: list[torch.Tensor] = []  # per host layer: the residual stream [B, 1, D] after its attention
        self.pending: list[torch.Tensor] = []  # per host layer: its experts' output [B, 1, D], read by the next segment
        self.begun: DecodeState | None = None  # the first segment's state: the step's rotary tables and masks
        self.failed = False

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """tokens/positions/valid [B, 1] -> logits [B, 1, V] (with graphs: valid until the next call)."""
        if self.failed:
            return self.model(tokens, positions, kv=self.kv, valid=valid, last_only=True)
        self.kv.reserve_step()  # the slot the captures' warm-up runs write, then the real step
        if self.use_graph and not self.graphs and not self._captured(tokens, positions, valid):
            return self.model(tokens, positions, kv=self.kv, valid=valid, last_only=True)  # reserves the slot again
        if self.use_graph:
            for buf, x in zip(self.inputs, (tokens, positions, valid)):
                buf.copy_(x)
        else:
            self.inputs, self.carried, self.pending = [tokens, positions, valid], [], []
        for i in range(len(self.layers) + 1):
            if self.use_graph:
                self.graphs[i].replay()
                out = self.outputs[i]
            else:
                out = self._segment(i)()
            if i == len(self.layers):
                break
            x, normed, routed = out
            layer = self.model.model.layers[self.layers[i]]
            y = layer.residual(layer.mlp.finish(normed.reshape(-1, normed.shape[-1]), *routed))  # [B, D]
            if self.use_graph:
                self.pending[i].copy_(y.reshape(normed.shape))  # [B, 1, D]
            else:
                self.carried.append(x)
                self.pending.append(y.reshape(normed.shape))
        self.kv.commit()
        return out

    def _segment(self, i: int) -> Callable:
        """Segment i as a function of what the segments and host layers before it left: -> (residual stream,
        the host layer's normed MLP input, MoEBlock.route's output), or the logits for the last segment."""
        model, kv, layers = self.model, self.kv, self.layers
        start = layers[i - 1] + 1 if i else 0
        stop = layers[i] if i < len(layers) else len(model.model.layers)

        def run():
            if i == 0:
                state = self.begun = model.decode_begin(*self.inputs, kv)
            else:
                state = replace(self.begun, x=self.carried[i - 1], pending=self.pending[i - 1])
            state = model.decode_layers(state, start, stop, kv)
            if i == len(layers):
                return model.decode_end(state)
            state, normed = model.decode_to_mlp(state, stop, kv)
            return state.x, normed, model.model.layers[stop].mlp.route(normed.reshape(-1, normed.shape[-1]))

        return run

    def _captured(self, *inputs: torch.Tensor) -> bool:
        if captured(lambda: self._capture(*inputs), "the decode segments"):
            return True
        self.failed, self.graphs = True, []
        return False

    def _capture(self, *inputs: torch.Tensor) -> None:
        """Each segment after `warmup` eager runs on a side stream (Triton compiles, allocator fills; a segment's
        inputs are the static tensors of the segments before it, written by the real step that follows: the
        warm-up runs write only the KV slot that step writes anyway)."""
        self.inputs = [x.clone() for x in inputs]
        device, pool = self.kv.index.device, torch.cuda.graph_pool_handle()
        for i in range(len(self.layers) + 1):
            graph, out = capture(self._segment(i), self.warmup, device, pool)
            self.graphs.append(graph)
            self.outputs.append(out)
            if i < len(self.layers):
                self.carried.append(out[0])
                self.pending.append(torch.zeros_like(out[1]))


def captured(capture_fn: Callable[[], None], what: str) -> bool:
    """Run capture_fn; if capturing fails (a backend that claimed to be sync-free is not), warn once and return
    False: the caller decodes without graphs from then on rather than stop the generation."""
    try:
        capture_fn()
        return True
    except RuntimeError as e:
        warnings.warn(f"moeserve: CUDA-graph capture of {what} failed ({str(e).splitlines()[0]}); decoding without "
                      "graphs (--no-cuda-graph silences this)", stacklevel=4)
        return False


def padded_batch(batch: int, slots: int) -> int:
    """The graph size a batch of `batch` decode rows runs at: the next power of two, at most `slots`."""
    return min(1 << (batch - 1).bit_length(), slots)


def padded_sizes(slots: int) -> list[int]:
    """Every size padded_batch gives for 1..slots rows, smallest first."""
    return sorted({padded_batch(b, slots) for b in range(1, slots + 1)})


class SlotDecoder:
    """Decode steps over a SlotKVCache whose rows change from step to step (continuous batching).

    Dynamic (off CUDA, and wherever a graph cannot serve): the forward over the rows in use, attending over the
    columns up to the furthest position. Static: `model.decode_step` at a padded batch size (padded_batch; pad
    entries write the cache's spare row) over all columns, the shapes a CUDA graph needs; with `graph`, each padded
    size is captured on first use (one memory pool for all) and replayed after. A size the experts cannot run
    sync-free decodes dynamically; a capture that fails warns once and every later step decodes dynamically.
    """

    def __init__(self, model, kv: SlotKVCache, graph: bool, static: bool | None = None, warmup: int = 2):
        """static: run the static step even without graphs (eagerly; tests use it on the CPU)."""
        self.model, self.kv, self.use_graph, self.warmup = model, kv, graph, warmup
        self.static = graph if static is None else static
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self.dynamic_sizes: set[int] = set()  # padded sizes graph_safe refused
        self.pool = None

    def __call__(self, tokens: list[int], positions: list[int], rows: list[int]) -> torch.Tensor:
        """One token for each of the cache rows `rows`, at `positions` -> logits [B, V]."""
        device, B = self.model.device, len(rows)
        size = padded_batch(B, self.kv.slots)
        if self.static and (not self.use_graph or self._capturable(size)):
            pad = size - B
            inputs = [torch.tensor(tokens + [0] * pad, device=device)[:, None],  # tokens [Bp, 1]
                      torch.tensor(positions + [0] * pad, device=device)[:, None],  # positions [Bp, 1]
                      torch.tensor(rows + [self.kv.spare] * pad, device=device)]  # rows [Bp]
            if self.use_graph and (size in self.graphs or self._captured(size, inputs)):
                graph, buffers, logits = self.graphs[size]
                for buf, x in zip(buffers, inputs):
                    buf.copy_(x)
                graph.replay()
            else:  # static without graphs, or the capture just failed
                logits = self._step(*inputs)
            self.kv.commit()
            return logits[:B, -1]
        self.kv.use(rows, max(positions) + 1)
        tokens_t, positions_t = (torch.tensor(x, device=device)[:, None] for x in (tokens, positions))  # [B, 1]
        return self.model(tokens_t, positions_t, kv=self.kv, last_only=True)[:, -1]

    def graphed_sizes(self) -> list[int]:
        """The padded sizes whose step is a captured graph."""
        return sorted(self.graphs)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.kv.use(rows, None)
        return self.model.decode_step(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), self.kv)

    def _capturable(self, size: int) -> bool:
        """Whether the step at `size` rows is captured or can be: the experts run it sync-free (asked once)."""
        if size not in self.graphs and size not in self.dynamic_sizes and not graph_safe(self.model, size):
            self.dynamic_sizes.add(size)
        return size not in self.dynamic_sizes

    def _captured(self, size: int, inputs: list[torch.Tensor]) -> bool:
        """Capture the step at `size` rows (its warm-up runs write what this step writes anyway); on failure, warn
        and decode dynamically from now on."""
        buffers = [x.clone() for x in inputs]

        def capture_size():
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph, logits = capture(lambda: self._step(*buffers), self.warmup, self.model.device, self.pool)
            self.graphs[size] = (graph, buffers, logits)

        if captured(capture_size, "the decode step"):
            return True
        self.use_graph = self.static = False
        return False
