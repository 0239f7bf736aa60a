"""Experts computed on the CPU straight from their store copies: the high (float) copy through torch in the
model's dtype, the low-bit copy through QuantizedLinear (the generated CPU kernels for a few rows, else
dequantize + matmul), each with the store's biases and gated activation (GPT-OSS) as the resident experts apply
them. Shared by offload's cooperative mode and the hybrid backend.

A layer's CPU work is one call, `run_layer`. When every pair reads a low-bit copy, the generated kernels read its
layout and the experts are plain SwiGLU ones (no biases, silu(gate) * up), that is one native call for the whole
layer (kernels/cpu moe_layer: grouping, both projections, SwiGLU and the weighted sum in one parallel region).
Otherwise its (token, k) pairs are grouped per expert and precision in a routing table (kernels/routing.sorted_table),
each float group runs through its expert, the low-bit groups through one batched kernel call per projection (biases
added and the activation applied in torch between the two), and the weighted outputs are added back to their tokens
by the resident backend's combine (same order, so the result matches it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels.cpu.gemv import (LayerExperts, PendingLayer, applies, default_kernel, moe_layer, packed_weight,
                                       quantized_linear_batch)
from moeserve.kernels.routing import combine, sorted_table
from moeserve.model.experts import gated_ffn, glu
from moeserve.offload.store import ExpertStore, layer_experts


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
    def __init__(self, store: ExpertStore, dtype: torch.dtype | None = None):
        """dtype: the compute dtype of high-precision experts (the model's); store copies of another dtype are
        converted once, on first use, and kept."""
        self.store, self.dtype = store, dtype
        self._high: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._low: dict[int, tuple] = {}  # low experts as CPU QuantizedLinear pairs, by weight address
        self._layers: dict[int, LayerExperts | None] = {}  # a layer's low experts for moe_layer (None: not read)

    @property
    def fused(self) -> bool:
        """Whether the native whole-layer call (moe_layer) computes this store's experts: it fuses silu(gate) * up
        and adds no biases, so GPT-OSS's experts take the grouped path instead."""
        return self.store.act is None and not self.store.biased

    def high(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """(gate_up [2F, D], down [D, F], and the biases gate_up [2F], down [D] of biased experts) in the compute
        dtype (the store's tensors when it matches: no copy)."""
        key = (layer, expert)
        if key not in self._high:
            parts = self.store.host_parts(layer, expert, low=False)
            self._high[key] = tuple(p if self.dtype in (None, p.dtype) else p.to(self.dtype) for p in parts)
        return self._high[key]

    def low(self, layer: int, expert: int) -> tuple:
        """(gate_up, down) QuantizedLinear over the store's low-bit copy (the CPU kernels repack it once)."""
        parts = self.store.host_parts(layer, expert, low=True)
        key = parts[0].data_ptr()
        if key not in self._low:
            self._low[key] = self.store.quantized_modules(parts)
        return self._low[key]

    def warm(self, layers: list[int], low: bool) -> None:
        """Prepare every expert of these layers now rather than at its first token: a float copy converted to the
        compute dtype, a low-bit one repacked for the CPU kernels (where they read it); pages a mapped store in."""
        probe = torch.empty(1, self.store.meta["hidden"])  # [1, D]: a decode row
        for layer in layers:
            for e in range(layer_experts(self.store.meta, layer)):
                if not low:
                    self.high(layer, e)
                    continue
                for m in self.low(layer, e):
                    if applies(m, probe, 1):
                        packed_weight(m, default_kernel(m.bits))
            if low:
                self.native_layer(layer, probe)

    def run(self, layer: int, expert: int, low: bool, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] on the CPU -> expert output [n, D] in rows' dtype."""
        if not low:
            parts = self.high(layer, expert)
            x = rows if rows.dtype == parts[0].dtype else rows.to(parts[0].dtype)
            y = gated_ffn(x, *parts, act=self.store.act)
            return y if y.dtype == rows.dtype else y.to(rows.dtype)
        gate_up, down = self.low(layer, expert)
        return down(glu(gate_up(rows.float()), self.store.act)).to(rows.dtype)

    def native_layer(self, layer: int, x: torch.Tensor) -> LayerExperts | None:
        """Every low-bit expert of the layer repacked for the native MoE call (once per layer), or None where the
        generated kernels do not read them or the experts are not plain SwiGLU ones (fused)."""
        if layer not in self._layers:
            mods = [self.low(layer, e) for e in range(layer_experts(self.store.meta, layer))]
            kernel = default_kernel(mods[0][0].bits)
            ok = self.fused and kernel is not None and all(applies(m, x, None) and m.rank == 0 for m in mods[0])
            self._layers[layer] = LayerExperts.of([packed_weight(g, kernel) for g, _ in mods],
                                                  [packed_weight(d, kernel) for _, d in mods]) if ok else None
        return self._layers[layer]

    def start_layer(self, layer: int, x: torch.Tensor, pairs: CpuPairs, threads: int) -> PendingLayer | None:
        """run_layer on `threads` of the native pool's helpers, returning at once (the result, float32, from
        PendingLayer.result()), where the layer is one native call; else None."""
        experts = self.native_layer(layer, x) if pairs.low is True else None
        if experts is None:
            return None
        kernel = default_kernel(experts.gate_up[0].bits)
        return moe_layer(kernel, experts, x, pairs.expert_ids, pairs.weights, pairs.mask, threads, start=True)

    def run_layer(self, layer: int, x: torch.Tensor, pairs: CpuPairs) -> torch.Tensor:
        """x [T, D] on the CPU -> [T, D] in x's dtype: the sum over the pairs of weight * expert(x[token])."""
        if pairs.low is True:
            experts = self.native_layer(layer, x)
            if experts is not None:
                kernel = default_kernel(experts.gate_up[0].bits)
                return moe_layer(kernel, experts, x, pairs.expert_ids, pairs.weights, pairs.mask).to(x.dtype)
        E = self.store.meta["num_experts"]  # the most of any layer: unit ids stay apart
        low_copy = pairs.low.long() if isinstance(pairs.low, torch.Tensor) else int(pairs.low)
        units = pairs.expert_ids + low_copy * E  # [T, k]: expert, + E on a low-bit copy (float copies sort first)
        table = sorted_table(units, pairs.weights, 2 * E, mask=pairs.mask)  # the pairs in unit order
        x_sorted = x[table.token_ids]  # [n, D]
        y = torch.empty_like(x_sorted)  # [n, D]
        used = table.counts.nonzero().squeeze(1)  # units with pairs, ascending
        start, low = 0, []
        for u, n in zip(used.tolist(), table.counts[used].tolist()):
            if u >= E:
                low.append((u - E, n))
                continue
            y[start:start + n] = self.run(layer, u, False, x_sorted[start:start + n])
            start += n
        if low:
            y[start:] = self.run_low(layer, low, x_sorted[start:])
        return combine(y, table, x.shape[0], x.dtype)

    def run_low(self, layer: int, groups: list[tuple[int, int]], x: torch.Tensor) -> torch.Tensor:
        """Row blocks of x [n, D] through the low-bit copies of groups' (expert, rows) -> [n, D] in x's dtype: each
        projection of every expert in one native call where the kernels read the layout, else one expert after
        another (QuantizedLinear)."""
        mods = [self.low(layer, e) for e, _ in groups]
        rows = [n for _, n in groups]
        h = quantized_linear_batch([gate_up for gate_up, _ in mods], x, rows)  # [n, 2F] float32
        if h is not None:
            y = quantized_linear_batch([down for _, down in mods], glu(h, self.store.act), rows)  # [n, D] float32
            if y is not None:
                return y.to(x.dtype)
        out, start = torch.empty_like(x), 0
        for e, n in groups:
            out[start:start + n] = self.run(layer, e, True, x[start:start + n])
            start += n
        return out
