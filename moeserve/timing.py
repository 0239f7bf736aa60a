"""Timing primitives shared by the hardware profile (plan/) and the expert copier (offload/): the median
wall time of a call, and a link's copy bandwidth. Plain Python over tensors the caller made; no torch import."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], sync: Callable[[], None], budget_s: float) -> float:
    """Median wall time of fn() over repeats that fill about `budget_s` (at least 3, after one warm-up)."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def link_bandwidth(src, dst, chunk_bytes: int, sync, budget_s: float) -> float:
    """Bytes per second copying `src` into `dst` (same size) in chunks of `chunk_bytes`."""
    n, step = src.numel(), max(chunk_bytes // src.element_size(), 1)

    def copy():
        for i in range(0, n, step):
            dst[i:i + step].copy_(src[i:i + step], non_blocking=True)

    return n * src.element_size() / seconds_per_call(copy, sync, budget_s)
