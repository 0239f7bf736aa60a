"""Experts held in cache slots, computed in one routed pass on the slots' device.

The pools' slots are numbered one after another (virtual expert = the slot's place in that numbering: the first
pool's slots, then the next pool's), and the host, which chose each (token, k) pair's slot, builds the routing
table: only the pairs in the pass are gathered, and the expert counts are host numbers, so the pass never reads
the device. Each slot's CUDA events order the pass after its load and the next load after the pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.routing import RoutingTable, combine
from moeserve.model.experts import LoopedExperts, swiglu
from moeserve.offload.slots import SlotPool


class SlotExperts(LoopedExperts):
    def __init__(self, pools: list[SlotPool]):
        super().__init__()
        self.pools = pools
        self.starts = [sum(p.num_slots for p in pools[:i]) for i in range(len(pools))]  # first virtual id per pool
        self.num_experts = sum(p.num_slots for p in pools)
        self.none = self.num_experts  # the virtual id of a pair that is not in the pass

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
        counts = torch.zeros(self.num_experts, dtype=torch.long).index_add_(0, flat[order], torch.ones_like(order))
        used = [self._slot(v) for v in torch.nonzero(counts).squeeze(1).tolist()]
        order_dev = order.to(x.device, non_blocking=True)
        table = RoutingTable(token_ids=order_dev // k, weights=expert_weights.reshape(-1)[order_dev], counts=counts,
                             offsets=torch.cumsum(counts, 0).to(torch.int32), num_tokens=T)
        if x.is_cuda:
            for pool, slot in used:
                torch.cuda.current_stream().wait_event(pool.loaded[slot])
        y = combine(self.run_sorted(x[table.token_ids], table), table, T, x.dtype)  # [T, D]
        if x.is_cuda:
            done = torch.cuda.Event()
            done.record()
            for pool, slot in used:
                pool.used[slot] = done
        return y

    def expert_ffn(self, v: int, rows: torch.Tensor) -> torch.Tensor:
        pool, slot = self._slot(v)
        gate_up, down = pool.weights[slot]
        if isinstance(gate_up, torch.Tensor):
            return F.linear(swiglu(F.linear(rows, gate_up)), down)
        return down(swiglu(gate_up(rows)))
