"""Decode steps as CUDA graphs: capture `MoETransformer.decode_step` once, replay it for every token.

At small batch, GPU decode is launch-bound: hundreds of small kernels a token, each costing more to
launch from Python than to run. A graph replays them all from one launch. Capturing needs a step of
fixed shapes that never reads the device from the host: the static decode step over a KV cache (write
slot and masks on the device), and expert paths in model/paths.py GRAPH_SAFE (the fused Triton and
grouped-GEMM paths; not the CPU loop, nor offloading, which read routing on the host).
"""

from __future__ import annotations

import warnings

import torch

from moeserve.model.kv_cache import KVCache
from moeserve.model.paths import GRAPH_SAFE


def graph_safe(model, batch: int) -> bool:
    """Whether the decode step of `model` at `batch` tokens can be captured: CUDA, and every MoE layer's expert
    path at that size one that never reads the device from the host (model/paths.py GRAPH_SAFE)."""
    if model.device.type != "cuda":
        return False
    x = torch.empty(batch, model.spec.hidden_size, device=model.device, dtype=model.dtype)  # [B, D] probe
    return all(layer.mlp.experts.kernel_path(x, batch) in GRAPH_SAFE
               for layer in model.model.layers if hasattr(layer.mlp, "experts"))


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
        try:
            self._capture(*inputs)
            return True
        except RuntimeError as e:
            warnings.warn(f"moeserve: CUDA-graph capture of the decode step failed ({str(e).splitlines()[0]}); "
                          "decoding without a graph (--no-cuda-graph silences this)", stacklevel=3)
            self.use_graph, self.graph = False, None
            return False

    def _capture(self, *inputs: torch.Tensor) -> None:
        """Warm-up runs (Triton compiles, allocator fills) write only the slot this step writes anyway."""
        self.inputs = [x.clone() for x in inputs]
        side = torch.cuda.Stream(device=self.kv.index.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.model.decode_step(*self.inputs, self.kv)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model.decode_step(*self.inputs, self.kv)
