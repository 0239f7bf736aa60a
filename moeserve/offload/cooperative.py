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
import torch.nn.functional as F

from moeserve.model.experts import swiglu
from moeserve.offload.store import ExpertStore

TIMED_ROWS = (1, 8)


class CpuExperts:
    def __init__(self, store: ExpertStore):
        self.store = store
        self._modules: dict[int, tuple] = {}  # low experts as CPU QuantizedLinear pairs, by weight address
        self.seconds = {low: [self._time(low, rows) for rows in TIMED_ROWS] for low in (False, True)}

    def cost(self, low: bool, rows: int) -> float:
        """Predicted seconds to compute `rows` rows of one expert at a precision on the CPU."""
        (r0, r1), (t0, t1) = TIMED_ROWS, self.seconds[low]
        return max(t0 + (rows - r0) * (t1 - t0) / (r1 - r0), t0)

    def run(self, layer: int, expert: int, low: bool, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] on the CPU -> expert output [n, D] (in `rows`' dtype)."""
        parts = self.store.host_parts(layer, expert, low)
        if not low:  # in the store's dtype: no conversion pass over the weights
            gate_up, down = parts
            return F.linear(swiglu(F.linear(rows.to(gate_up.dtype), gate_up)), down).to(rows.dtype)
        key = parts[0].data_ptr()
        if key not in self._modules:  # the CPU kernels repack a weight once; keep the modules
            self._modules[key] = self.store.quantized_modules(parts)
        gate_up, down = self._modules[key]
        return down(swiglu(gate_up(rows.float()))).to(rows.dtype)

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
