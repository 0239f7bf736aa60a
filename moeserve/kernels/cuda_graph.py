"""Capturing a piece of GPU work as a CUDA graph, the one helper for it: the engine's decode graphs, the offload/hybrid
slot pass (both replay fixed-shape work whose launches cost the host more than the GPU's run) and the kernel tuner's
timings."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable[[], torch.Tensor], warmup: int, device: torch.device,
            pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its static output) of `step`, after `warmup` eager runs on a side stream (Triton compiles,
    allocator fills) as capturing requires; pool: a memory pool shared with other graphs."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
