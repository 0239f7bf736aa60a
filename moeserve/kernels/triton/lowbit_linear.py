"""W{2,3,4,8}A16 linear in Triton: y = x dequant(W)^T with W in the pack.py layout, dequantized in registers.

One program per (row block of x, block of BLOCK_N outputs); it walks the input dimension in BLOCK_K
steps, loads the packed words of its outputs once, unpacks them with shifts (3-bit: the 10+10+10 and
top-bit-pairs layout), applies the group's scale and zero and multiplies on tensor cores. Each weight
byte is read once per row block, so for decode (M <= BLOCK_M) once in total.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _codes(w_ptr, row_base, offs_k, k_mask, BITS: tl.constexpr):
    """Codes [BLOCK_N, BLOCK_K] (int32) of inputs offs_k for the rows at row_base (word pointers)."""
    if BITS == 3:
        unit, j = offs_k // 32, offs_k % 32
        word = unit * 3 + tl.minimum(j // 10, 2)
        body = (tl.load(row_base[:, None] + word[None, :], mask=k_mask[None, :], other=0)
                >> ((j % 10) * 3)[None, :]) & 7
        # values 30, 31: the 6-bit remainder spread over the top bit pairs of the unit's three words
        top = tl.zeros(body.shape, dtype=tl.int32)
        for t in tl.static_range(3):
            wt = tl.load(row_base[:, None] + (unit * 3 + t)[None, :], mask=k_mask[None, :] & (j >= 30)[None, :],
                         other=0)
            top |= ((wt >> 30) & 3) << (2 * t)
        rest = tl.where((j == 30)[None, :], top & 7, (top >> 3) & 7)
        return tl.where((j >= 30)[None, :], rest, body)
    PER_WORD: tl.constexpr = 32 // BITS
    words = tl.load(row_base[:, None] + (offs_k // PER_WORD)[None, :], mask=k_mask[None, :], other=0)
    return (words >> ((offs_k % PER_WORD) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _lowbit_linear_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, words_per_row, groups_per_row,
                          BITS: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
    row_base = w_ptr + rows * words_per_row  # [BLOCK_N] pointers to each output's packed row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP: one scale and zero per output per step
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = _codes(w_ptr, row_base, offs_k, k_mask, BITS).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        g = rows * groups_per_row + k0 // GROUP  # [BLOCK_N]
        s = tl.load(s_ptr + g).to(tl.float32)
        z = tl.load(z_ptr + g).to(tl.float32)
        w = ((q - z[:, None]) * s[:, None]).to(x_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def supported(group: int) -> bool:
    """Input steps divide the group, so the group must be a power of two of at least 16 (tl.dot's K)."""
    return group >= 16 and group & (group - 1) == 0


def lowbit_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  group: int, in_features: int, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                  num_stages: int = 2) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T -> [..., N]; qweight [N, padded K * bits / 32] int32, scale/zero [N, K / group]."""
    if not supported(group):
        raise ValueError(f"the Triton low-bit linear needs a power-of-two group >= 16, got {group}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    M, N = x2.shape[0], qweight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _lowbit_linear_kernel[grid](x2, qweight, scale, zero, y, M, N, in_features, qweight.shape[1], scale.shape[1],
                                BITS=bits, GROUP=group, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, group), num_warps=num_warps,
                                num_stages=num_stages)
    return y.reshape(*lead, N)
