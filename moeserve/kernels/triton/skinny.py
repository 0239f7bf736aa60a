"""x W^T for a few rows of x and a short, wide W: the compensators' inputs x V^T ([rows, K] x [E * r, K]).

For one token cuBLAS runs this as a split-K GEMV plus a reduce kernel; here each program streams BLOCK_N rows of W
through Triton's software pipeline and keeps the few rows of x in registers: one launch, no reduce, the output in
float32 (the low-rank kernels read it as is). H100, CUDA-graph replay, a Mixtral-shaped 3-bit MoE block with rank-32
compensators at one token: the two x V^T (2 and 7 MB of all experts' V) take 8.5 us instead of 13.5.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # rows of x the kernel keeps in registers
PAYS_ROWS = 2  # rows up to which it beats cuBLAS at K 4096 and 14336 (H100: 8 rows of 14336 take 23 vs 13 us)
PRODUCT = 4096  # BLOCK_N * BLOCK_M * BLOCK_K: the [BLOCK_N, BLOCK_M, BLOCK_K] products, 32 per thread at 4 warps


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] for this program's BLOCK_N columns n and all M rows, in float32."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + m[None, :] * N + n[:, None], acc, mask=n_ok[:, None] & m_ok[None, :])


def skinny_applies(x: torch.Tensor, rows: int = MAX_ROWS) -> bool:
    """Whether skinny_linear takes these rows (few enough to keep in registers; at most `rows`)."""
    return x.dim() == 2 and 0 < x.shape[0] <= min(rows, MAX_ROWS)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 1) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times w [N, K]^T -> [M, N] float32; block_n rows of w per program (1 was the
    fastest on the H100 at N 32-2048, K 1408-14336)."""
    if not skinny_applies(x) or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_linear takes x [1..{MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"skinny_linear takes x and w of one float dtype, got {x.dtype} and {w.dtype}")
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    block_m = triton.next_power_of_2(M)
    block_k = max(16, min(PRODUCT // (block_m * block_n), triton.next_power_of_2(K)))
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    _skinny_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                               STAGES=3, num_warps=4)
    return y


def low_rank_input(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x V^T [M, r] for the low-rank kernels: skinny_linear where it pays (float32), else torch's GEMM."""
    return skinny_linear(x, v) if skinny_applies(x, PAYS_ROWS) else torch.nn.functional.linear(x, v)
