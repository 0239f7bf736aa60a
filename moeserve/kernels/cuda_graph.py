"""Capturing a piece of GPU work as a CUDA graph, the one helper for it: the engine's decode graphs, the offload/hybrid
slot pass (both replay fixed-shape work whose launches cost the host more than the GPU's run) and the kernel tuner's
timings.

Every capture warms up and records on one side stream per device (`side_stream`): torch gives each (cuBLAS handle,
stream) pair its own cuBLAS workspace (32 MiB on Hopper), so a fresh stream per capture would hold one more workspace
for each graph a run captures. With one stream a run holds two: the default stream's and this one's (the footprint
ledger counts both, plan/footprint.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream captures on `device` run on (module docstring)."""
    device = torch.device(device)
    key = torch.device(device.type, torch.cuda.current_device() if device.index is None else device.index)
    if key not in SIDE_STREAMS:
        SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return SIDE_STREAMS[key]


def capture(step: Callable[[], torch.Tensor], warmup: int, device: torch.device,
            pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its static output) of `step`, after `warmup` eager runs on a side stream (Triton compiles,
    allocator fills) as capturing requires, then the capture on the same stream; pool: a memory pool shared with
    other graphs."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        out = step()
    return graph, out
