"""Fused MoE expert GEMMs in Triton over expert-sorted rows, for few tokens (decode).

Two launches, each over (expert, output block) with a fixed grid and no host sync: experts with no
rows return at once, the others read their weight tile once per block of input and multiply it with
all their rows (tl.dot, rows padded to BLOCK_M; more rows loop in chunks of BLOCK_M).

    gate_up: h[rows] = silu(x[rows] Wg[e]^T) * (x[rows] Wu[e]^T)       gate_up_proj [E, 2F, D]
    down:    y[rows] = h[rows] Wd[e]^T                                  down_proj    [E, D, F]

The gate-weight scaling and the scatter back to tokens stay in kernels/routing.combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.routing import RoutingTable
from moeserve.kernels.triton.configs import fused_moe_config, gpu_name
from moeserve.kernels.triton.swiglu import silu_mul


@triton.jit
def _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, N, BLOCK_N: tl.constexpr):
    """This program's expert e: its rows [start, end) in the sorted order, its block of N outputs, its weights."""
    e = tl.program_id(0)
    end = tl.load(offsets_ptr + e)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    return end - tl.load(counts_ptr + e), end, offs_n, offs_n < N, w_ptr + e.to(tl.int64) * stride_we


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, offsets_ptr, counts_ptr, D, F, stride_we,
                    PRECISION: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start, end, offs_n, n_mask, w_base = _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, F, BLOCK_N)
    for c in tl.static_range(CHUNKS):  # an expert has at most T rows: CHUNKS = cdiv(T, BLOCK_M), no host sync
      m0 = start + c * BLOCK_M
      if m0 < end:
        rows = m0 + tl.arange(0, BLOCK_M)
        r_mask = rows < end
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < D
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            wmask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(w_base + offs_n[None, :] * D + offs_k[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_base + (F + offs_n[None, :]) * D + offs_k[:, None], mask=wmask, other=0.0)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        h = silu_mul(acc_g, acc_u)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * F + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, y_ptr, offsets_ptr, counts_ptr, D, F, stride_we,
                 PRECISION: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start, end, offs_n, n_mask, w_base = _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, D, BLOCK_N)
    for c in tl.static_range(CHUNKS):
      m0 = start + c * BLOCK_M
      if m0 < end:
        rows = m0 + tl.arange(0, BLOCK_M)
        r_mask = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < F
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * F + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_base + offs_n[None, :] * F + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * D + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


def _precision(x: torch.Tensor) -> str:
    """fp32 inputs get exact (IEEE) dots, 16-bit ones tensor-core dots."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def launch_gate_up(x_sorted, gate_up_proj, h, table: RoutingTable, num_tokens: int, cfg: dict) -> None:
    E, two_f, D = gate_up_proj.shape
    F = two_f // 2
    _gate_up_kernel[(E, triton.cdiv(F, cfg["BLOCK_N"]))](
        x_sorted, gate_up_proj, h, table.offsets, table.counts, D, F, gate_up_proj.stride(0),
        PRECISION=_precision(x_sorted), CHUNKS=triton.cdiv(num_tokens, cfg["BLOCK_M"]), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])


def launch_down(h, down_proj, y, table: RoutingTable, num_tokens: int, cfg: dict) -> None:
    E, D, F = down_proj.shape
    _down_kernel[(E, triton.cdiv(D, cfg["BLOCK_N"]))](
        h, down_proj, y, table.offsets, table.counts, D, F, down_proj.stride(0),
        PRECISION=_precision(h), CHUNKS=triton.cdiv(num_tokens, cfg["BLOCK_M"]), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])


def fused_experts(x_sorted: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  table: RoutingTable, config: dict | None = None) -> torch.Tensor:
    """x_sorted [T*k, D] expert-sorted rows -> expert outputs [T*k, D] (before gate weighting).

    table.num_tokens bounds the rows of one expert, which fixes the kernels' loops without a sync."""
    num_tokens = table.num_tokens
    E, two_f, D = gate_up_proj.shape
    F = two_f // 2
    if config is None:
        name = gpu_name(x_sorted.device.index or 0) if x_sorted.is_cuda else "cpu"
        config = fused_moe_config(name, E, D, F, num_tokens)
    x_sorted = x_sorted.contiguous()
    h = torch.empty(x_sorted.shape[0], F, dtype=x_sorted.dtype, device=x_sorted.device)  # [T*k, F]
    y = torch.empty(x_sorted.shape[0], D, dtype=x_sorted.dtype, device=x_sorted.device)  # [T*k, D]
    launch_gate_up(x_sorted, gate_up_proj, h, table, num_tokens, config["gate_up"])
    launch_down(h, down_proj, y, table, num_tokens, config["down"])
    return y
