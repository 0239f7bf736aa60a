"""Low-bit fused MoE for decode: the fused_moe.py schedule over stacked packed experts (lowbit_linear.py tiles).

    gate_up: h[rows] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u)   qweight [E, 2F, words], scale/zero [E, 2F, D/G]
    down:    y[rows] = h Wd[e]^T + lr_d                               qweight [E, D, words'], split-K, fp32 atomics

Grid (output block, K slice, expert); experts with no rows return at once, so there is no host sync.
Compensators (lr_*) of different ranks are zero-padded to the largest rank (exact): U stacked [E, N, r],
and x V_all^T is one matmul against all experts' V [E * r, K], of which the kernels read each row's expert's r
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.routing import RoutingTable
from moeserve.kernels.triton.lowbit_linear import (_low_rank, _row_range, _tile, check_activation,
                                                   check_weight, kernel_inputs, launch, tile_constexprs)
from moeserve.kernels.triton.swiglu import silu_mul


@dataclass
class StackedLowbit:
    """One projection of all E experts: packed weights and (optional) zero-padded compensator factors."""

    qweight: torch.Tensor  # [E, N, words] int32
    scale: torch.Tensor  # [E, N, K / group] fp16
    zero: torch.Tensor  # [E, N, K / group] fp16
    bits: int
    group: int
    in_features: int
    u: torch.Tensor | None = None  # [E, N, r] activation dtype
    v: torch.Tensor | None = None  # [E * r, K] activation dtype

    def low_rank_inputs(self, x_sorted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(U [E, N, r], x_sorted V_all^T [T*k, E * r]), or None: the kernels read each row's expert's r columns
        (one matmul, no gather launches)."""
        if self.u is None:
            return None
        return self.u, torch.nn.functional.linear(x_sorted, self.v)  # [T*k, E * r]


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, u_ptr, xv_ptr, offsets_ptr, counts_ptr,
                    F, K, R, words_per_row, groups_per_row, exp_bits,
                    BITS: tl.constexpr, GROUP: tl.constexpr, USE_DOT: tl.constexpr, HAS_LR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, AHEAD: tl.constexpr,
                    SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    C: tl.constexpr = BLOCK_K // VPC
    MOE: tl.constexpr = True
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    start, end, e = _row_range(offsets_ptr, counts_ptr, F, MOE, BLOCK_M)  # F: unused row count
    w_base = w_ptr + e * 2 * F * words_per_row  # expert e: [2F, words]
    s_base, z_base = s_ptr + e * 2 * F * groups_per_row, z_ptr + e * 2 * F * groups_per_row
    steps = tl.cdiv(K, BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        g, rows, r_mask = _tile(x_ptr, row0, end, w_base, s_base, z_base, n0, F, 0, steps, K, words_per_row,
                                groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M, C,
                                VPC, AHEAD, SUB, PIPE, HALF, INTERPRET)
        u, rows, r_mask = _tile(x_ptr, row0, end, w_base, s_base, z_base, F + n0, 2 * F, 0, steps, K,
                                words_per_row, groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N,
                                BLOCK_M, C, VPC, AHEAD, SUB, PIPE, HALF, INTERPRET)
        if HAS_LR:
            lr_base, xv_e, xv_stride = u_ptr + e * 2 * F * R, xv_ptr + e * R, R * tl.num_programs(2)
            g += _low_rank(lr_base, xv_e, xv_stride, offs_n, n_mask, rows, r_mask, R, USE_DOT, PRECISION, BLOCK_N,
                           BLOCK_M, BLOCK_R, INTERPRET)
            u += _low_rank(lr_base, xv_e, xv_stride, F + offs_n, n_mask, rows, r_mask, R, USE_DOT, PRECISION,
                           BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        h = silu_mul(g, u)  # [BLOCK_N, BLOCK_M]
        tl.store(h_ptr + rows[None, :].to(tl.int64) * F + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])


def launch_gate_up(x_sorted: torch.Tensor, p: StackedLowbit, h: torch.Tensor, table: RoutingTable, cfg: dict) -> None:
    E, two_f, _ = p.qweight.shape
    F = two_f // 2
    lr = p.low_rank_inputs(x_sorted)
    u, xv = lr if lr is not None else (h, h)
    tile = tile_constexprs(cfg, p.bits, p.group, table.num_tokens, x_sorted.dtype, lr is not None)
    xk, exp = kernel_inputs(x_sorted, tile)
    _gate_up_kernel[(triton.cdiv(F, cfg["BLOCK_N"]), 1, E)](
        xk, p.qweight, p.scale, p.zero, h, u, xv, table.offsets, table.counts, F, p.in_features,
        p.u.shape[-1] if lr is not None else 0, p.qweight.shape[-1], p.scale.shape[-1], exp, **tile)


def lowbit_experts(x_sorted: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, table: RoutingTable,
                   config: dict | None = None) -> torch.Tensor:
    """x_sorted [T*k, D] expert-sorted rows -> expert outputs [T*k, D] float32 (before gate weighting)."""
    check_activation(x_sorted, gate_up.in_features)
    for p in (gate_up, down):
        check_weight(p.qweight, p.scale, p.zero, p.bits, p.group, p.in_features)
    E, two_f, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1], gate_up.in_features
    F = two_f // 2
    if config is None:
        from moeserve.kernels.triton.configs import gpu_name, lowbit_moe_config

        name = gpu_name(x_sorted.device.index or 0) if x_sorted.is_cuda else "cpu"
        top_k = x_sorted.shape[0] // table.num_tokens
        config = lowbit_moe_config(name, gate_up.bits, E, D, F, table.num_tokens, top_k)
    x_sorted = x_sorted.contiguous()
    h = torch.empty(x_sorted.shape[0], F, dtype=x_sorted.dtype, device=x_sorted.device)  # [T*k, F]
    launch_gate_up(x_sorted, gate_up, h, table, config["gate_up"])
    y = torch.empty(x_sorted.shape[0], D, dtype=torch.float32, device=x_sorted.device)  # [T*k, D] launch zeroes it
    launch(h, down.qweight, down.scale, down.zero, y, down.bits, down.group, F, config["down"], table.num_tokens, E,
           lowrank=down.low_rank_inputs(h), routing=(table.offsets, table.counts))
    return y
