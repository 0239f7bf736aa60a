"""Experts computed on the CPU straight from their store copies: the high (float) copy through torch in the
model's dtype, the low-bit copy through QuantizedLinear (the generated CPU kernels for a few rows, else
dequantize + matmul). Shared by offload's cooperative mode and the hybrid backend.

A layer's CPU work is one call, `run_layer`: the (token, expert, precision, gate weight) rows are grouped per
expert and precision with one sort, each group runs through its expert once, and the weighted outputs are added
back to their tokens as the resident backend's combine does (so the result matches it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.model.experts import swiglu
from moeserve.offload.store import ExpertStore


@dataclass
class ExpertRows:
    """One layer's rows for the CPU: row i is token tokens[i] through expert experts[i] (low[i]: its low-bit copy),
    scaled by weights[i]. Host tensors, all [n]."""

    tokens: torch.Tensor  # [n] long
    experts: torch.Tensor  # [n] long
    low: torch.Tensor  # [n] bool
    weights: torch.Tensor  # [n] gate weights, in the router's dtype

    def __len__(self) -> int:
        return self.tokens.numel()


class HostExperts:
    def __init__(self, store: ExpertStore, dtype: torch.dtype | None = None):
        """dtype: the compute dtype of high-precision experts (the model's); store copies of another dtype are
        converted once, on first use, and kept."""
        self.store, self.dtype = store, dtype
        self._high: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._low: dict[int, tuple] = {}  # low experts as CPU QuantizedLinear pairs, by weight address

    def high(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2F, D], down [D, F]) in the compute dtype (the store's tensors when it matches: no copy)."""
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

    def run(self, layer: int, expert: int, low: bool, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] on the CPU -> expert output [n, D] in rows' dtype."""
        if not low:
            gate_up, down = self.high(layer, expert)
            return F.linear(swiglu(F.linear(rows.to(gate_up.dtype), gate_up)), down).to(rows.dtype)
        gate_up, down = self.low(layer, expert)
        return down(swiglu(gate_up(rows.float()))).to(rows.dtype)

    def run_layer(self, layer: int, x: torch.Tensor, work: ExpertRows) -> torch.Tensor:
        """x [T, D] on the CPU -> [T, D] in x's dtype: the sum over work's rows of weight * expert(x[token])."""
        out = torch.zeros_like(x)  # [T, D]
        if not len(work):
            return out
        unit = work.experts * 2 + work.low  # [n]: expert and precision
        order = torch.argsort(unit, stable=True)  # [n]
        units, counts = torch.unique_consecutive(unit[order], return_counts=True)
        tokens, weights = work.tokens[order], work.weights[order]  # [n] each, grouped
        start = 0
        for u, n in zip(units.tolist(), counts.tolist()):
            t = tokens[start:start + n]  # [n_u]
            y = self.run(layer, u >> 1, bool(u & 1), x[t])  # [n_u, D]
            out.index_add_(0, t, (y * weights[start:start + n, None]).to(x.dtype))  # as routing.combine scales
            start += n
        return out
