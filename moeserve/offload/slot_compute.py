"""Experts held in cache slots, computed in one routed pass on the slots' device.

The pools' slots are numbered one after another (virtual expert = the slot's place in that numbering: the first
pool's slots, then the next pool's), and the host, which chose each (token, k) pair's slot, builds the routing
table: only the pairs in the pass are gathered, each used slot computes its rows, and the counts are host numbers,
so the pass never reads the device. Each slot's CUDA events order the pass after its load and the next load after
the pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.routing import RoutingTable, combine
from moeserve.model.experts import swiglu
from moeserve.offload.slots import SlotPool


class SlotExperts:
    def __init__(self, pools: list[SlotPool]):
        self.pools = pools
        self.starts = [sum(p.num_slots for p in pools[:i]) for i in range(len(pools))]  # first virtual id per pool
        self.num_slots = sum(p.num_slots for p in pools)
        self.none = self.num_slots  # the virtual id of a pair that is not in the pass

    def virtual(self, pool: int, slot: int) -> int:
        return self.starts[pool] + slot

    def _slot(self, v: int) -> tuple[SlotPool, int]:
        for pool, start in zip(reversed(self.pools), reversed(self.starts)):
            if v >= start:
                return pool, v - start
        raise IndexError(v)

    def compute(self, x: torch.Tensor, expert_weights: torch.Tensor, virtual: torch.Tensor) -> torch.Tensor:
        """x [T, D], expert_weights [T, k] on the slots' device; virtual [T, k] host long (self.none: a pair
        not in this pass) -> the weighted sum of the pairs' slot outputs, [T, D]."""
        T, k = virtual.shape
        flat = virtual.reshape(-1)  # [T*k]
        pairs = (flat < self.none).nonzero().squeeze(1)  # [n]
        order = pairs[torch.argsort(flat[pairs], stable=True)]  # [n] pair index, grouped by slot
        slots, counts = torch.unique_consecutive(flat[order], return_counts=True)
        used = [(self._slot(v), n) for v, n in zip(slots.tolist(), counts.tolist())]
        order_dev = order.to(x.device, non_blocking=True)
        table = RoutingTable(token_ids=order_dev // k, weights=expert_weights.reshape(-1)[order_dev], counts=counts,
                             offsets=torch.cumsum(counts, 0).to(torch.int32), num_tokens=T)
        if x.is_cuda:
            for (pool, slot), _ in used:
                torch.cuda.current_stream().wait_event(pool.loaded[slot])
        x_sorted = x[table.token_ids]  # [n, D]
        y = torch.empty_like(x_sorted)  # [n, D]
        start = 0
        for (pool, slot), n in used:
            y[start:start + n] = self.expert_ffn(pool.weights[slot], x_sorted[start:start + n])
            start += n
        out = combine(y, table, T, x.dtype)  # [T, D]
        if x.is_cuda:
            done = torch.cuda.Event()
            done.record()
            for (pool, slot), _ in used:
                pool.used[slot] = done
        return out

    @staticmethod
    def expert_ffn(weights, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] through one slot's expert: (gate_up, down) tensors or QuantizedLinear modules."""
        gate_up, down = weights
        if isinstance(gate_up, torch.Tensor):
            return F.linear(swiglu(F.linear(rows, gate_up)), down)
        return down(swiglu(gate_up(rows)))
