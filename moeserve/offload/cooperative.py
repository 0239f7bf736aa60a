"""CPU-GPU cooperative execution: a missed expert is computed on the CPU from its slow-memory copy when
that finishes before a copy to the GPU would.

The choice is a cost comparison with measured numbers: the CPU's time for one expert at a precision
(timed once here, for 1 and 8 rows, linear in between and beyond) plus what the CPU already took on in
this layer, against the copy queue's backlog plus the expert's bytes over the measured host->device
bandwidth. Several misses in one layer thus split between the link and the CPU, which run at once.
Low-precision experts run through the generated CPU kernels (kernels/cpu), high ones through torch.
"""

from __future__ import annotations

import time

import torch

from moeserve.offload.host_compute import HostExperts
from moeserve.offload.store import ExpertStore

TIMED_ROWS = (1, 8)


class CpuExperts(HostExperts):
    """HostExperts with a cost model: each precision timed once at 1 and 8 rows."""

    def __init__(self, store: ExpertStore, dtype: torch.dtype | None = None):
        super().__init__(store, dtype)
        self.seconds = {low: [self._time(low, rows) for rows in TIMED_ROWS] for low in (False, True)}

    def cost(self, low: bool, rows: int) -> float:
        """Predicted seconds to compute `rows` rows of one expert at a precision on the CPU."""
        (r0, r1), (t0, t1) = TIMED_ROWS, self.seconds[low]
        return max(t0 + (rows - r0) * (t1 - t0) / (r1 - r0), t0)

    def _time(self, low: bool, rows: int) -> float:
        layer = self.store.meta["layers"][0]
        x = torch.randn(rows, self.store.meta["hidden"])
        self.run(layer, 0, low, x)  # warm: kernel build, repack, page-in
        start = time.perf_counter()
        self.run(layer, 0, low, x)
        return time.perf_counter() - start


def choose_cpu(cpu: CpuExperts, low: bool, rows: int, cpu_busy: float, copy_backlog: float,
               expert_bytes: int, bandwidth: float) -> bool:
    """True when the CPU would finish this expert before the GPU could have it copied."""
    return cpu_busy + cpu.cost(low, rows) < copy_backlog + expert_bytes / bandwidth
