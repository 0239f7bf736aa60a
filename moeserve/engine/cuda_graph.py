"""Decode steps as CUDA graphs: capture `MoETransformer.decode_step` once per padded batch size, replay it for every
token. One runner (StepRunner) runs the step at fixed shapes, whole or cut before the experts that read the routing
on the host (hybrid CPU experts, offloading), each piece captured once; SlotDecoder drives one runner per padded
batch size over the changing rows of a SlotKVCache (the engine loop, engine/batching.py: generate, bench and serve).

At small batch, GPU decode is launch-bound: hundreds of small kernels a token, each costing more to
launch from Python than to run. A graph replays them all from one launch. Capturing needs a step of
fixed shapes that never reads the device from the host: the static decode step over a SlotKVCache (rows, positions
and masks on the device), and expert paths in model/paths.py GRAPH_SAFE (the fused Triton and grouped-GEMM paths;
not the CPU loop, nor offloading, which read routing on the host).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from moeserve.kernels.cuda_graph import capture
from moeserve.model.kv_cache import SlotKVCache
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


class StepRunner:
    """One decode step at fixed shapes (`model.decode_step`), cut before the experts of `cuts`: the MoE layers
    whose experts read the routing on the host (hybrid CPU experts, offloading; host_layers). Each segment of GPU
    work between two cuts (the first: embedding to the first cut's router; the last: after the last cut's experts
    to the logits) runs eagerly or, with `graph`, is captured as a CUDA graph on the first call and replayed after;
    between segments the host runs that layer's experts (MoEBlock.finish) and copies their output where the next
    segment reads it. No cuts: the whole step is one graph. A capture that fails warns once and the same pieces run
    eagerly from then on. `begin(inputs)` starts the step (model.decode_begin over the decoder's cache); the KV
    bookkeeping around a call (reserve, commit) is the decoder's. The inputs are the same tensors every call (the
    decoder's buffers, SlotDecoder._stage), which the graphs read in place."""

    def __init__(self, model, kv: SlotKVCache, cuts: list[int], begin: Callable[..., DecodeState],
                 graph: bool, warmup: int, pool=None):
        self.model, self.kv, self.cuts, self.begin, self.use_graph = model, kv, cuts, begin, graph
        self.warmup, self.pool = warmup, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list = []  # per segment, its static output (graphs)
        self.inputs: list[torch.Tensor] = []  # the step's inputs (static with graphs)
        self.carried: list[torch.Tensor] = []  # per cut: the residual stream [B, 1, D] after its attention
        self.pending: list[torch.Tensor] = []  # per cut: its experts' output [B, 1, D], read by the next segment
        self.begun: DecodeState | None = None  # the first segment's state: the step's rotary tables and masks

    @property
    def graphed(self) -> bool:
        return bool(self.graphs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The step's inputs -> logits [B, 1, V] (with graphs: valid until the next call)."""
        if self.use_graph and not self.graphs and not captured(lambda: self._capture(inputs), "the decode step"):
            self.use_graph, self.graphs, self.outputs, self.carried, self.pending = False, [], [], [], []
        if not self.use_graph:
            self.inputs, self.carried, self.pending = list(inputs), [], []
        for i in range(len(self.cuts) + 1):
            if self.use_graph:
                self.graphs[i].replay()
                out = self.outputs[i]
            else:
                out = self._segment(i)()
            if i == len(self.cuts):
                return out
            x, normed, routed = out
            layer = self.model.model.layers[self.cuts[i]]
            y = layer.residual(layer.mlp.finish(normed.reshape(-1, normed.shape[-1]), *routed))  # [B, D]
            if self.use_graph:
                self.pending[i].copy_(y.reshape(normed.shape))  # [B, 1, D]
            else:
                self.carried.append(x)
                self.pending.append(y.reshape(normed.shape))

    def _segment(self, i: int) -> Callable:
        """Segment i as a function of what the segments and cuts before it left: -> (residual stream, the cut
        layer's normed MLP input, MoEBlock.route's output), or the logits for the last segment."""
        model, kv, cuts = self.model, self.kv, self.cuts
        start = cuts[i - 1] + 1 if i else 0
        stop = cuts[i] if i < len(cuts) else len(model.model.layers)

        def run():
            if i == 0:
                state = self.begun = self.begin(*self.inputs)
            else:
                state = replace(self.begun, x=self.carried[i - 1], pending=self.pending[i - 1])
            state = model.decode_layers(state, start, stop, kv)
            if i == len(cuts):
                return model.decode_end(state)
            state, normed = model.decode_to_mlp(state, stop, kv)
            return state.x, normed, model.model.layers[stop].mlp.route(normed.reshape(-1, normed.shape[-1]))

        return run

    def _capture(self, inputs) -> None:
        """Each segment after `warmup` eager runs on a side stream (Triton compiles, allocator fills; a segment's
        inputs are the static tensors of the segments before it, written by the real step that follows: the
        warm-up runs write only the KV slot that step writes anyway)."""
        self.inputs = list(inputs)  # the decoder's buffers, the same tensors every call
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        for i in range(len(self.cuts) + 1):
            graph, out = capture(self._segment(i), self.warmup, self.model.device, pool)
            self.graphs.append(graph)
            self.outputs.append(out)
            if i < len(self.cuts):
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

    Dynamic (off CUDA unless `static`): the forward over the rows in use, attending over the columns up to the
    furthest position. Static: the step at a padded batch size (padded_batch; pad entries write the cache's spare
    row) over all columns, the shapes a CUDA graph needs: one StepRunner per padded size, cut before the experts
    that read the routing on the host at that size (hybrid CPU experts, offloading), each captured on first use
    with `graph` (one memory pool for all) and replayed after. A capture that fails warns once and that size runs
    its pieces eagerly.
    """

    def __init__(self, model, kv: SlotKVCache, graph: bool, static: bool | None = None, warmup: int = 2):
        """static: run the static step even without graphs (eagerly; tests use it on the CPU)."""
        self.model, self.kv, self.use_graph, self.warmup = model, kv, graph, warmup
        self.static = graph if static is None else static
        self.runners: dict[int, StepRunner] = {}  # padded size -> its step
        self.staged: dict[int, tuple] = {}  # padded size -> (pinned host, device, copy event, input views): _stage
        self.pool = None

    def __call__(self, tokens: list[int], positions: list[int], rows: list[int]) -> torch.Tensor:
        """One token for each of the cache rows `rows`, at `positions` -> logits [B, V]."""
        device, B = self.model.device, len(rows)
        if self.static:
            size = padded_batch(B, self.kv.slots)
            logits = self._runner(size)(*self._stage(size, tokens, positions, rows))
            self.kv.commit()
            return logits[:B, -1]
        self.kv.use(rows, max(positions) + 1)
        tokens_t, positions_t = (torch.tensor(x, device=device)[:, None] for x in (tokens, positions))  # [B, 1]
        return self.model(tokens_t, positions_t, kv=self.kv, last_only=True)[:, -1]

    def _stage(self, size: int, tokens: list[int], positions: list[int], rows: list[int]) -> tuple[torch.Tensor, ...]:
        """The step's inputs at padded size `size` (pad entries: token 0 at position 0 in the cache's spare row) in
        the decoder's own buffers: written in a pinned host buffer, then one copy to the device; -> tokens [Bp, 1],
        positions [Bp, 1], rows [Bp], the same tensors every step (a graph's static inputs)."""
        if size not in self.staged:
            cuda = self.model.device.type == "cuda"
            host = torch.empty(3, size, dtype=torch.long, pin_memory=cuda)  # [3, Bp]: tokens, positions, rows
            dev = host.to(self.model.device) if cuda else host
            self.staged[size] = (host, dev, torch.cuda.Event() if cuda else None,
                                 (dev[0].view(size, 1), dev[1].view(size, 1), dev[2]))
        host, dev, copied, inputs = self.staged[size]
        if copied is not None:
            copied.synchronize()  # the last step's copy has read the host buffer (done: its logits were read)
        B, view = len(rows), host.numpy()
        view[0, :B], view[1, :B], view[2, :B] = tokens, positions, rows
        view[:2, B:], view[2, B:] = 0, self.kv.spare
        if copied is not None:
            dev.copy_(host, non_blocking=True)
            copied.record()
        return inputs

    def graphed_sizes(self) -> list[int]:
        """The padded sizes whose step is captured (whole, or in segments)."""
        return sorted(size for size, runner in self.runners.items() if runner.graphed)

    def cut_sizes(self) -> list[int]:
        """The padded sizes whose step is cut at host layers."""
        return sorted(size for size, runner in self.runners.items() if runner.cuts)

    def _begin(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> DecodeState:
        self.kv.use(rows, None)
        return self.model.decode_begin(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), self.kv)

    def _runner(self, size: int) -> StepRunner:
        if size not in self.runners:
            if self.use_graph and self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.runners[size] = StepRunner(self.model, self.kv, host_layers(self.model, size), self._begin,
                                            self.use_graph, self.warmup, self.pool)
        return self.runners[size]
