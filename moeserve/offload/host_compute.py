"""Experts computed on the CPU straight from their store copies: the high (float) copy through torch in the
model's dtype, an MXFP4 high copy (a store that keeps GPT-OSS's experts as shipped) through the generated MXFP4
kernels (dequantize + matmul in the model's dtype where they do not build), the low-bit copy through QuantizedLinear
(the generated CPU kernels for a few rows, else dequantize + matmul), each with the store's biases and gated
activation (GPT-OSS) as the resident experts apply them. Shared by offload's cooperative mode and the hybrid backend.
A store of a quantized checkpoint's experts has one copy, its low-bit one, which serves either precision: each expert
as the resident QuantizedExperts computes it (its compensator at its own rank added in torch: (x V^T) U^T).

A layer's CPU work is one call, `run_layer`. When every pair reads a low-bit copy the generated kernels read, or
every pair reads an MXFP4 high copy, that is one native call for the whole layer (kernels/cpu moe_layer: grouping,
both projections, the biases and gated activation of GPT-OSS's experts or silu(gate) * up, and the weighted sum in
one parallel region).
Otherwise its (token, k) pairs are grouped per expert and precision in a routing table (kernels/routing.sorted_table),
each float group runs through its expert, the MXFP4 groups and the low-bit groups each through one batched kernel
call per projection (biases added and the activation applied in torch between the two), and the weighted outputs are
added back to their tokens by the resident backend's combine (same order, so the result matches it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moeserve.kernels.cpu.gemv import (MAX_ROWS, CpuKernel, LayerExperts, PackedForCpu, PendingLayer, applies,
                                       default_kernel, moe_layer, pack_mxfp4_for_cpu, packed_weight,
                                       quantized_linear_batch)
from moeserve.kernels.cpu.machine import check_int8_dots
from moeserve.kernels.routing import combine, sorted_table
from moeserve.model.experts import gated_ffn, glu
from moeserve.offload.disk_cache import DiskCache
from moeserve.offload.store import ExpertStore, layer_experts
from moeserve.quant.mxfp4 import Mxfp4Expert


@dataclass
class CpuMxfp4Expert:
    """An MXFP4 expert repacked for the generated MXFP4 kernels, its biases as float32 (None without)."""

    gate_up: PackedForCpu  # out 2F (gate rows, then up rows)
    down: PackedForCpu  # out D
    gate_up_bias: torch.Tensor | None  # [2F] float32
    down_bias: torch.Tensor | None  # [D] float32


@dataclass
class CpuPairs:
    """A layer's (token, k) pairs for the CPU, host tensors: pair (t, j) runs token t through expert
    expert_ids[t, j] scaled by weights[t, j], when mask[t, j] (mask None: every pair), from the low-bit copy where
    low says so (a [T, k] bool tensor, or one bool for every pair)."""

    expert_ids: torch.Tensor  # [T, k] long
    weights: torch.Tensor  # [T, k] gate weights, in the router's dtype
    mask: torch.Tensor | None = None  # [T, k] bool
    low: torch.Tensor | bool = False  # [T, k] bool, or one for all


class HostExperts:
    def __init__(self, store: ExpertStore, dtype: torch.dtype | None = None, disk: DiskCache | None = None,
                 int8: bool = False):
        """dtype: the compute dtype of high-precision experts (the model's); store copies of another dtype are
        converted once, on first use, and kept. disk: the disk tier's RAM cache the experts are read through (a
        store larger than the RAM given to it): then nothing derived from an expert is kept here (it would outgrow
        the budget), each expert computes from its cache slot one after another (a low-bit one, at decode, from the
        slot's kernel form where the cache keeps one: repacked once, at the miss that read it), and the native
        whole-layer calls are off. int8 (--cpu-int8): the native whole-layer calls and the MXFP4 kernels quantize
        their inputs to int8 and multiply on the CPU's int8 dots (kernels/cpu/codegen_int8.py; about 1% relative
        error per expert); a MoeserveError here on a CPU without them."""
        if int8:
            check_int8_dots()
        self.store, self.dtype, self.disk, self.int8 = store, dtype, disk, int8
        self._high: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._low: dict[int, tuple] = {}  # low experts as CPU QuantizedLinear pairs, by weight address
        self._layers: dict[tuple[int, bool], LayerExperts | None] = {}  # (layer, low) -> moe_layer's experts
        self._mxfp4: dict[int, CpuMxfp4Expert] = {}  # an MXFP4 store's high copies, repacked, by blocks address

    def native(self, low: bool) -> bool:
        """Whether a layer whose every pair reads the low-bit copies (low) or the high ones can be one native call:
        low-bit copies can (where the kernels read their layout: native_layer), high ones when they are MXFP4 (float
        copies run through torch)."""
        return self.disk is None and (low or self.store.mxfp4 or self.store.quantized)

    def parts(self, layer: int, expert: int, low: bool) -> list[torch.Tensor]:
        """One expert's tensors: from the disk tier's cache (valid until its next miss) or the store itself."""
        return self.disk.parts(layer, expert, low) if self.disk is not None else self.store.host_parts(layer, expert,
                                                                                                        low)

    def native_kernel(self, low: bool) -> CpuKernel | None:
        """The generated kernel native layers of this precision run on (None: none builds here)."""
        if low or self.store.quantized:
            return default_kernel(self.store.meta["low_bits"], int8=self.int8)
        return self.mxfp4_kernel()

    def mxfp4_kernel(self) -> CpuKernel | None:
        """The generated kernel an MXFP4 store's high copies are repacked for and run on (None: none builds here)."""
        return default_kernel(4, mxfp4=True, int8=self.int8)

    def high(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """A float store's (gate_up [2F, D], down [D, F], and the biases gate_up [2F], down [D] of biased experts) in
        the compute dtype (the store's tensors when it matches: no copy)."""
        key = (layer, expert)
        if self.disk is not None:
            return tuple(p if self.dtype in (None, p.dtype) else p.to(self.dtype) for p in self.parts(*key, low=False))
        if key not in self._high:
            parts = self.store.host_parts(layer, expert, low=False)
            self._high[key] = tuple(p if self.dtype in (None, p.dtype) else p.to(self.dtype) for p in parts)
        return self._high[key]

    def mxfp4_expert(self, layer: int, expert: int) -> CpuMxfp4Expert | None:
        """An MXFP4 store's high copy repacked for the generated MXFP4 kernels (once per copy in RAM, then kept: layers
        that share one, as a bench's store does, share the repack), or None where they do not build on this
        machine."""
        kernel = self.mxfp4_kernel()
        if kernel is None or self.disk is not None:
            return None
        parts = self.store.host_parts(layer, expert, low=False)
        key = parts[0].data_ptr()
        if key not in self._mxfp4:
            w = Mxfp4Expert.of_parts(parts)
            self._mxfp4[key] = CpuMxfp4Expert(
                pack_mxfp4_for_cpu(w.gate_up_blocks, w.gate_up_scales, kernel),
                pack_mxfp4_for_cpu(w.down_blocks, w.down_scales, kernel),
                *(None if b is None else b.float() for b in (w.gate_up_bias, w.down_bias)))
        return self._mxfp4[key]

    def low(self, layer: int, expert: int) -> tuple:
        """(gate_up, down) QuantizedLinear over the store's low-bit copy (the CPU kernels repack it once; through the
        disk tier, over the parts its cache gives: decode rows of a kept kernel form go through run_kept instead,
        other stores' experts are repacked at each call)."""
        if self.disk is not None:
            return self.store.quantized_modules(self.parts(layer, expert, low=True),
                                                self.store.expert_ranks(layer, expert))
        key = self.store.host_parts(layer, expert, low=True)[0].data_ptr()
        if key not in self._low:
            self._low[key] = self.store.expert_modules(layer, expert)
        return self._low[key]

    def with_copy(self, pairs: CpuPairs) -> CpuPairs:
        """pairs as they read the store: every pair from the low-bit copy in a store of a quantized checkpoint."""
        return replace(pairs, low=True) if self.store.quantized and pairs.low is not True else pairs

    def warm(self, layers: list[int], low: bool) -> None:
        """Prepare every expert of these layers now rather than at its first token: a float copy converted to the
        compute dtype (or an MXFP4 one repacked for the CPU kernels), a low-bit one repacked for the CPU kernels
        (where they read it); pages a mapped store in. Through the disk tier, nothing: no expert is kept beyond its
        cache slot."""
        if self.disk is not None:
            return
        probe = torch.empty(1, self.store.meta["hidden"])  # [1, D]: a decode row
        low = low or self.store.quantized
        for layer in layers:
            for e in range(layer_experts(self.store.meta, layer)):
                if not low:
                    if self.store.mxfp4:
                        self.mxfp4_expert(layer, e)
                    else:
                        self.high(layer, e)
                    continue
                for m in self.low(layer, e):
                    if applies(m, probe, 1):
                        packed_weight(m, default_kernel(m.bits))
            if self.native(low):
                self.native_layer(layer, probe, low)

    def run(self, layer: int, expert: int, low: bool, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] on the CPU -> expert output [n, D] in rows' dtype."""
        low = low or self.store.quantized
        if low and self.disk is not None and self.disk.kernel is not None and rows.shape[0] <= MAX_ROWS:
            return self.run_kept(layer, expert, rows)
        if not low and self.store.mxfp4:
            return self.run_mxfp4(layer, [(expert, rows.shape[0])], rows)
        if not low:
            parts = self.high(layer, expert)
            x = rows if rows.dtype == parts[0].dtype else rows.to(parts[0].dtype)
            y = gated_ffn(x, *parts, act=self.store.act)
            return y if y.dtype == rows.dtype else y.to(rows.dtype)
        gate_up, down = self.low(layer, expert)
        return down(glu(gate_up(rows.float()), self.store.act)).to(rows.dtype)

    def run_kept(self, layer: int, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [n <= MAX_ROWS, D] through a low-bit expert the disk tier keeps in the CPU kernel's form -> [n, D] in
        rows' dtype: each projection one kernel call on the slot's repacked weight, as QuantizedLinear computes it
        (float32 in, its bias added), the activation between them."""
        kept, kernel = self.disk.kernel_expert(layer, expert), self.disk.kernel
        bias = kept.biases or (None, None)

        def project(x: torch.Tensor, packed: PackedForCpu, b: torch.Tensor | None) -> torch.Tensor:
            y = kernel(x, packed)  # [n, out] float32
            return y if b is None else y + b.to(y.dtype)

        h = project(rows.float(), kept.gate_up, bias[0])  # [n, 2F]
        return project(glu(h, self.store.act), kept.down, bias[1]).to(rows.dtype)  # [n, D]

    def native_layer(self, layer: int, x: torch.Tensor, low: bool = True) -> LayerExperts | None:
        """Every expert of the layer at a precision (low-bit copies, or MXFP4 high copies) repacked for the native
        MoE call with its biases and the store's activation (once per layer), or None where the generated kernels
        do not read them (float high copies, a layout they do not read, no kernel on this machine)."""
        low = low or self.store.quantized
        key = (layer, low)
        if key not in self._layers:
            self._layers[key] = self._native_experts(layer, x, low) if self.native(low) else None
        return self._layers[key]

    def _native_experts(self, layer: int, x: torch.Tensor, low: bool) -> LayerExperts | None:
        n, act = layer_experts(self.store.meta, layer), self.store.act
        if not low:
            experts = [self.mxfp4_expert(layer, e) for e in range(n)]
            if None in experts:
                return None
            biases = ([e.gate_up_bias for e in experts], [e.down_bias for e in experts]) if self.store.biased else None
            return LayerExperts.of([e.gate_up for e in experts], [e.down for e in experts], biases, act)
        mods = [self.low(layer, e) for e in range(n)]
        kernel = self.native_kernel(True)
        if kernel is None or not all(applies(m, x, None) for m in mods[0]) or any(m.rank for p in mods for m in p):
            return None  # compensators (a MiLo checkpoint's) are added in torch, expert by expert
        biases = ([g.bias for g, _ in mods], [d.bias for _, d in mods]) if self.store.biased else None
        return LayerExperts.of([packed_weight(g, kernel) for g, _ in mods], [packed_weight(d, kernel) for _, d in mods],
                               biases, act)

    def start_layer(self, layer: int, x: torch.Tensor, pairs: CpuPairs, threads: int) -> PendingLayer | None:
        """run_layer on `threads` of the native pool's helpers, returning at once (the result, float32, from
        PendingLayer.result()), where the layer is one native call; else None."""
        pairs = self.with_copy(pairs)
        experts = self._native_for(layer, x, pairs)
        if experts is None:
            return None
        return moe_layer(self.native_kernel(pairs.low), experts, x, pairs.expert_ids, pairs.weights, pairs.mask,
                         threads, start=True)

    def _native_for(self, layer: int, x: torch.Tensor, pairs: CpuPairs) -> LayerExperts | None:
        """The layer's native experts when every pair reads one precision that has them, else None."""
        if not isinstance(pairs.low, bool) or not self.native(pairs.low):
            return None
        return self.native_layer(layer, x, pairs.low)

    def run_layer(self, layer: int, x: torch.Tensor, pairs: CpuPairs) -> torch.Tensor:
        """x [T, D] on the CPU -> [T, D] in x's dtype: the sum over the pairs of weight * expert(x[token])."""
        pairs = self.with_copy(pairs)
        experts = self._native_for(layer, x, pairs)
        if experts is not None:
            return moe_layer(self.native_kernel(pairs.low), experts, x, pairs.expert_ids, pairs.weights,
                             pairs.mask).to(x.dtype)
        E = self.store.meta["num_experts"]  # the most of any layer: unit ids stay apart
        low_copy = pairs.low.long() if isinstance(pairs.low, torch.Tensor) else int(pairs.low)
        units = pairs.expert_ids + low_copy * E  # [T, k]: expert, + E on a low-bit copy (float copies sort first)
        table = sorted_table(units, pairs.weights, 2 * E, mask=pairs.mask)  # the pairs in unit order
        x_sorted = x[table.token_ids]  # [n, D]
        y = torch.empty_like(x_sorted)  # [n, D]
        used = table.counts.nonzero().squeeze(1)  # units with pairs, ascending
        high, low = [], []  # (expert, rows) of the float copies' units, then the low-bit ones'
        for u, n in zip(used.tolist(), table.counts[used].tolist()):
            (low if u >= E else high).append((u % E, n))
        start = sum(n for _, n in high)
        if high and self.store.mxfp4:
            y[:start] = self.run_mxfp4(layer, high, x_sorted[:start])
        elif high:
            first = 0
            for e, n in high:
                y[first:first + n] = self.run(layer, e, False, x_sorted[first:first + n])
                first += n
        if low:
            y[start:] = self.run_low(layer, low, x_sorted[start:])
        return combine(y, table, x.shape[0], x.dtype)

    def run_mxfp4(self, layer: int, groups: list[tuple[int, int]], x: torch.Tensor) -> torch.Tensor:
        """Row blocks of x [n, D] through the MXFP4 high copies of groups' (expert, rows) -> [n, D] in x's dtype:
        each projection of every expert in one native call, the biases added and the activation applied in torch
        between them; where the kernels do not build, each expert dequantized in x's dtype (as the resident loop)."""
        experts = [self.mxfp4_expert(layer, e) for e, _ in groups]
        if None in experts:
            out, start = torch.empty_like(x), 0
            for e, n in groups:
                w = Mxfp4Expert.of_parts(self.parts(layer, e, low=False))
                out[start:start + n] = w.ffn(x[start:start + n], self.store.act)
                start += n
            return out
        kernel, rows = self.mxfp4_kernel(), [n for _, n in groups]

        def project(inputs: torch.Tensor, packed: list[PackedForCpu], biases: list) -> torch.Tensor:
            y = kernel.batch(inputs, rows, packed)  # [n, out] float32
            return y if biases[0] is None else y + torch.cat([b.expand(m, -1) for b, m in zip(biases, rows)])

        h = project(x.float(), [e.gate_up for e in experts], [e.gate_up_bias for e in experts])  # [n, 2F]
        y = project(glu(h, self.store.act), [e.down for e in experts], [e.down_bias for e in experts])  # [n, D]
        return y.to(x.dtype)

    def run_low(self, layer: int, groups: list[tuple[int, int]], x: torch.Tensor) -> torch.Tensor:
        """Row blocks of x [n, D] through the low-bit copies of groups' (expert, rows) -> [n, D] in x's dtype: each
        projection of every expert in one native call where the kernels read the layout, else one expert after
        another (QuantizedLinear; always through the disk tier, whose slots hold a few experts at a time)."""
        if self.disk is None:
            mods = [self.low(layer, e) for e, _ in groups]
            rows = [n for _, n in groups]
            h = quantized_linear_batch([gate_up for gate_up, _ in mods], x, rows)  # [n, 2F] float32
            if h is not None:
                y = quantized_linear_batch([down for _, down in mods], glu(h, self.store.act), rows)  # [n, D] fp32
                if y is not None:
                    return y.to(x.dtype)
        out, start = torch.empty_like(x), 0
        for e, n in groups:
            out[start:start + n] = self.run(layer, e, True, x[start:start + n])
            start += n
        return out
