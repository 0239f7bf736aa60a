"""Expert backends: how routed experts are computed. The MoE block calls one of these and nothing else.

The interface is one call, `experts(x [T, D], expert_ids [T, k], expert_weights [T, k]) -> [T, D]`
(already combined with the gate weights), so quantized, offloaded or expert-parallel backends plug in
by replacing `MoEBlock.experts` without touching the model code.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.routing import RoutingTable, build_routing_table, combine


@functools.cache
def _sm90_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def grouped_mm_available(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm runs on CUDA (sm90+) in bf16 with 16-byte aligned rows."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(d % 8 == 0 for d in dims) and _sm90_or_newer(x.device))


class ResidentExperts(nn.Module):
    """All experts of a layer in device memory, stacked: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts, self.ffn = num_experts, ffn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        table = build_routing_table(expert_ids, expert_weights, self.num_experts)
        x_sorted = x[table.token_ids]  # [T*k, D]
        if grouped_mm_available(x, x.shape[1], self.ffn):
            y = self._grouped(x_sorted, table)
        else:
            y = self._looped(x_sorted, table)
        return combine(y, table, x.shape[0], x.dtype)

    def _grouped(self, x_sorted: torch.Tensor, table: RoutingTable) -> torch.Tensor:
        """One grouped GEMM per projection over the expert-sorted rows (no host sync)."""
        h = torch._grouped_mm(x_sorted, self.gate_up_proj.transpose(1, 2), offs=table.offsets)  # [T*k, 2F]
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=table.offsets)  # [T*k, D]

    def _looped(self, x_sorted: torch.Tensor, table: RoutingTable) -> torch.Tensor:
        """One matmul pair per active expert (the CPU path and the reference)."""
        y = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(table.counts.tolist()):
            if n:
                rows = x_sorted[start:start + n]  # [n, D]
                gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, F] x2
                y[start:start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        return y
