"""Experts held in cache slots, computed in one routed pass on the slots' device.

The pools' slots are numbered one after another (virtual expert = the slot's place in that numbering: the first
pool's slots, then the next pool's), and the host, which chose each (token, k) pair's slot, builds the routing
table: only the pairs in the pass are gathered, each used slot computes its rows, and the counts are host numbers,
so the pass never reads the device. Each slot's CUDA events order the pass after its load and the next load after
the pass.

One token through a pool of low-bit slots on a GPU is one fused pass instead (the Triton low-bit MoE kernels in slot
order over the pool's buffers, which are stacked already): the pool's pairs keep their gate weights, the others point
at one of its slots (read again from L2) with weight zero. From its second call that pass is a CUDA graph (OneTokenPass:
its inputs copied into static buffers, one replay), since its launches cost the host more than the GPU's work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.kernels import triton_serves
from moeserve.kernels.cuda_graph import capture
from moeserve.kernels.routing import RoutingTable, build_routing_table, combine, slot_order_pays
from moeserve.model.experts import gated_ffn, glu
from moeserve.offload.slots import SlotPool
from moeserve.quant.mxfp4 import TRITON_DTYPES, Mxfp4Expert
from moeserve.quant.qlinear import QuantizedLinear, triton_applies
from moeserve.spec import ClampedSwiGLU

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


def after_loads(x: torch.Tensor, slots: list[tuple[SlotPool, int]]) -> None:
    """Order the work enqueued next (on x's CUDA stream) after the loads of these (pool, slot)s."""
    if x.is_cuda and slots:
        stream = torch.cuda.current_stream(x.device)
        for pool, slot in slots:
            stream.wait_event(pool.loaded[slot])


def mark_read(x: torch.Tensor, slots: list[tuple[SlotPool, int]]) -> None:
    """Record that the work enqueued so far read these (pool, slot)s: their next load waits for it."""
    if x.is_cuda:
        done = torch.cuda.Event()
        done.record()
        for pool, slot in slots:
            pool.used[slot] = done


def slot_ffn(weights, rows: torch.Tensor, act: ClampedSwiGLU | None) -> torch.Tensor:
    """rows [n, D] through one slot's expert: its float parts (gate_up, down, and the biases of biased experts:
    ExpertStore.part_names' order), its MXFP4 parts (an Mxfp4Expert: dequantized as it computes) or its (gate_up,
    down) QuantizedLinear modules (biases held on them); act: the gated activation (model/experts.glu)."""
    if isinstance(weights, Mxfp4Expert):
        return weights.ffn(rows, act)
    if isinstance(weights[0], torch.Tensor):
        return gated_ffn(rows, *weights, act=act)
    gate_up, down = weights
    return down(glu(gate_up(rows), act))


def grouped_pass(x: torch.Tensor, expert_weights: torch.Tensor, keys: torch.Tensor, none: int,
                 run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The weighted sum of the (token, k) pairs' outputs, [T, D], computed a group of pairs at a time.

    x [T, D] and expert_weights [T, k] on the compute device; keys [T, k] host long: the group of each pair (none:
    the pair is not in the pass). run(key, rows [n, D]) -> [n, D] is called once per group, in key order, with the
    group's rows; the counts are host numbers, so the pass never reads the device."""
    T, k = keys.shape
    flat = keys.reshape(-1)  # [T*k]
    pairs = (flat < none).nonzero().squeeze(1)  # [n]
    order = pairs[torch.argsort(flat[pairs], stable=True)]  # [n] pair index, grouped by key
    groups, counts = torch.unique_consecutive(flat[order], return_counts=True)
    order_dev = order.to(x.device, non_blocking=True)
    table = RoutingTable(token_ids=order_dev // k, weights=expert_weights.reshape(-1)[order_dev], counts=counts,
                         offsets=torch.cumsum(counts, 0).to(torch.int32), num_tokens=T)
    x_sorted = x[table.token_ids]  # [n, D]
    y = torch.empty_like(x_sorted)  # [n, D]
    start = 0
    for key, n in zip(groups.tolist(), counts.tolist()):
        y[start:start + n] = run(key, x_sorted[start:start + n])
        start += n
    return combine(y, table, T, x.dtype)


class OneTokenPass:
    """One pool's fused one-token pass as a CUDA graph over static inputs: x [1, D], gate weights [1, k] and the
    slots with their in-pool mask [2, 1, k]. The first call runs eagerly (kernels compile and tune), the second captures,
    later ones replay. A capture that fails leaves the pass eager."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        self.run, self.calls, self.graph, self.failed = run, 0, None, False
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.out: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [1, D], weights [1, k] on the device, slots [2, 1, k] long on the host -> [1, D]."""
        self.calls += 1
        if self.graph is None and (self.failed or self.calls == 1 or not self._capture(x, weights, slots)):
            return self.run(x, weights, slots.to(x.device, non_blocking=True))
        for buf, value in zip(self.inputs, (x, weights, slots)):
            buf.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.out.clone()

    def _capture(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> bool:
        self.inputs = (x.clone(), weights.clone(), slots.to(x.device))
        try:
            self.graph, self.out = capture(lambda: self.run(*self.inputs), 1, x.device)
        except RuntimeError:
            self.failed = True
            return False
        return True


class SlotExperts:
    def __init__(self, pools: list[SlotPool], act: ClampedSwiGLU | None = None):
        """act: the experts' gated activation (the store's: None for silu(gate) * up)."""
        self.pools, self.act = pools, act
        self.starts = [sum(p.num_slots for p in pools[:i]) for i in range(len(pools))]  # first virtual id per pool
        self.num_slots = sum(p.num_slots for p in pools)
        self.none = self.num_slots  # the virtual id of a pair that is not in the pass
        self._stacks: dict[int, tuple] = {}  # pool index -> (gate_up, down) StackedLowbit over its buffers
        self._passes: dict[tuple, OneTokenPass] = {}  # (pool index, k, x's dtype) -> its one-token pass

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
        if all(self.fused_applies(i, x, T) for i in range(len(self.pools))):
            return self.fused(x, expert_weights, virtual)
        read = []

        def run(v: int, rows: torch.Tensor) -> torch.Tensor:
            pool, slot = self._slot(v)
            after_loads(x, [(pool, slot)])
            read.append((pool, slot))
            return slot_ffn(pool.weights[slot], rows, self.act)

        out = grouped_pass(x, expert_weights, virtual, self.none, run)
        mark_read(x, read)
        return out

    def fused_applies(self, pool: int, x: torch.Tensor, tokens: int) -> bool:
        """One token, a pool of low-bit slots, and a layout the Triton low-bit kernels read on x's device."""
        return (slot_order_pays(tokens) and not isinstance(self.pools[pool].weights[0], Mxfp4Expert)
                and self.triton_reads(pool, x, tokens))

    def triton_reads(self, pool: int, x: torch.Tensor, tokens: int) -> bool:
        """A pool of low-bit slots without compensators (a MiLo checkpoint's slots compute expert by expert, each
        QuantizedLinear adding its own) whose layout the Triton low-bit kernels read for `tokens` rows of x's kind, or
        of MXFP4 slots the Triton MXFP4 kernels read on x's device (device_pass)."""
        first = self.pools[pool].weights[0]
        if isinstance(first, Mxfp4Expert):
            return triton_serves(x) and x.dtype in TRITON_DTYPES
        return (isinstance(first, tuple) and isinstance(first[0], QuantizedLinear) and not any(m.rank for m in first)
                and all(triton_applies(x, tokens, m.bits, m.group, m.in_features) for m in first))

    def stacks(self, pool: int):
        """(gate_up, down) StackedLowbit over a low-bit pool's buffers [S, ...] (views, no copy): each projection's
        qweight, scale and zero, and its biases [S, N] where the experts have them (the pool's last two buffers)."""
        if pool not in self._stacks:
            from moeserve.kernels.triton.lowbit import StackedLowbit

            p = self.pools[pool]
            biases = p.buffers[6:8] or (None, None)  # [S, 2F], [S, D]
            self._stacks[pool] = tuple(
                StackedLowbit(qweight=b[0], scale=b[1], zero=b[2], bits=m.bits, group=m.group,
                              in_features=m.in_features, u=None, v=None, bias=bias)
                for b, m, bias in ((p.buffers[0:3], p.weights[0][0], biases[0]),
                                   (p.buffers[3:6], p.weights[0][1], biases[1])))
        return self._stacks[pool]

    def fused(self, x: torch.Tensor, expert_weights: torch.Tensor, virtual: torch.Tensor) -> torch.Tensor:
        """compute() for one token over low-bit pools: one fused pass per pool with pairs in it."""
        k = virtual.shape[1]
        out, read = None, []
        for i, (pool, start) in enumerate(zip(self.pools, self.starts)):
            local = virtual - start  # [1, k] slot in this pool where 0 <= local < its slots
            in_pool = (local >= 0) & (local < pool.num_slots)  # [1, k]
            if not in_pool.any():
                continue
            slots = local[in_pool]
            ids = torch.where(in_pool, local, slots[0])  # [1, k]: the others read the first pair's slot again
            pool_slots = [(pool, s) for s in slots.tolist()]
            after_loads(x, pool_slots)
            key = (i, k, x.dtype)
            if key not in self._passes:
                self._passes[key] = OneTokenPass(  # dev [2, 1, k]: slots, in-pool mask
                    lambda x, w, dev, i=i: self.device_pass(i, x, w, dev[0], dev[1] > 0))
            part = self._passes[key](x, expert_weights, torch.stack([ids, in_pool.long()]))  # [1, D]
            out = part if out is None else out + part
            read += pool_slots
        mark_read(x, read)
        return out if out is not None else torch.zeros_like(x)

    def device_pass(self, pool: int, x: torch.Tensor, expert_weights: torch.Tensor, slots: torch.Tensor,
                    kept: torch.Tensor) -> torch.Tensor:
        """x [T, D], expert_weights, slots (long, each in range) and kept (bool) [T, k], all on the device -> [T, D]:
        the kept pairs' slot outputs times their gate weights, summed per token; a pair not kept computes its slot
        with weight zero. One token in slot order, more over expert-sorted rows (a routing table built on the
        device, as the resident experts run them); nothing is read on the host (capturable). A low-bit pool whose
        layout the Triton kernels read, or an MXFP4 pool (its stacked buffers are Mxfp4Experts' layout: the Triton
        MXFP4 kernels over expert-sorted rows) (triton_reads)."""
        from moeserve.kernels.triton.lowbit import lowbit_experts
        from moeserve.kernels.triton.routing_table import gather_combine

        weights = expert_weights * kept.to(expert_weights.dtype)  # [T, k]
        if isinstance(self.pools[pool].weights[0], Mxfp4Expert):
            return self._mxfp4_pass(pool, x, weights, slots)
        if slot_order_pays(x.shape[0]):
            y = lowbit_experts(x, *self.stacks(pool), slots, act=self.act)  # [k, D] fp32, slot order
            return gather_combine(y, None, weights, slots.shape[1], x.dtype)
        table = build_routing_table(slots, weights, self.pools[pool].num_slots)
        y = lowbit_experts(x[table.token_ids], *self.stacks(pool), table, act=self.act)  # [T*k, D] fp32
        return combine(y, table, x.shape[0], x.dtype)

    def _mxfp4_pass(self, pool: int, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """device_pass over an MXFP4 pool: its buffers [S, ...] (gate_up blocks, scales, down blocks, scales, then
        the biases of biased experts) are the stacked weights the Triton MXFP4 kernels read, slot = expert."""
        from moeserve.kernels.triton.mxfp4 import Mxfp4Weights, mxfp4_experts

        p = self.pools[pool]
        biases = p.buffers[4:6] or (None, None)  # [S, 2F], [S, D]
        gate_up = Mxfp4Weights(p.buffers[0], p.buffers[1], biases[0])
        down = Mxfp4Weights(p.buffers[2], p.buffers[3], biases[1])
        table = build_routing_table(slots, weights, p.num_slots)
        y = mxfp4_experts(x, gate_up, down, table, self.act, None, table.token_ids)  # [T*k, D] fp32, sorted rows
        return combine(y, table, x.shape[0], x.dtype)
