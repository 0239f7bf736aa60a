"""x W^T for a few rows of x and short, wide weights W, in one launch: the compensators' inputs x V^T
([rows, K] x [E * r, K]) and decode's dense projections (q, k and v of one token in one launch, o_proj, a dense
MLP's gate and up).

For one token cuBLAS runs each projection as a split-K GEMV plus a reduce kernel; here each program streams
BLOCK_N rows of one weight through Triton's software pipeline and keeps the few rows of x in registers: one launch
for up to three weights (their outputs side by side), no reduce. H100, CUDA graphs over rotating weights, one
token: x V^T of a Mixtral-shaped 3-bit MoE block with rank-32 compensators (2 and 7 MB of all experts' V) 8.5 us
instead of 13.5; Mixtral's q, k and v (4096 -> 4096 + 1024 + 1024) 20.5 us instead of 36.8 for three cuBLAS calls,
o_proj 15.3 instead of 18.0 (bench/results/partial/dense_gemv_probe-*.log).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # rows of x the kernel keeps in registers
PAYS_ROWS = 2  # rows up to which it beats cuBLAS at K 4096 and 14336 (H100: 8 rows of 14336 take 23 vs 13 us)
DENSE_ROWS = 1  # rows of x for which the dense projections were measured faster than cuBLAS (H100, one token)
PRODUCT = 4096  # BLOCK_N * BLOCK_M * BLOCK_K: the [BLOCK_N, BLOCK_M, BLOCK_K] products, 32 per thread at 4 warps
MAX_WEIGHTS = 3


@triton.jit
def _skinny_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, groups_ptr, M, N, N1, N2, K,
                   HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for this program's BLOCK_N outputs n of the weights side by side
    (w0 gives outputs [0, N1), w1 [N1, N2), w2 [N2, N); no block straddles two) and all M rows, fp32 sums. GROUP > 0:
    the programs cover only the groups of GROUP outputs listed in groups_ptr (an expert's r compensator rows)."""
    first = tl.program_id(0) * BLOCK_N
    if GROUP > 0:
        PER: tl.constexpr = GROUP // BLOCK_N  # programs per group
        first = tl.load(groups_ptr + tl.program_id(0) // PER).to(tl.int32) * GROUP + (tl.program_id(0) % PER) * BLOCK_N
    w_ptr, b_ptr, base = w0_ptr, b0_ptr, 0
    if first >= N2:
        w_ptr, b_ptr, base = w2_ptr, b2_ptr, N2
    elif first >= N1:
        w_ptr, b_ptr, base = w1_ptr, b1_ptr, N1
    n = first + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    row = n - base  # [BLOCK_N] rows of this weight
    m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = k < K
        w = tl.load(w_ptr + row[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + row, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def skinny_applies(x: torch.Tensor, rows: int = MAX_ROWS) -> bool:
    """Whether skinny_linear takes these rows (few enough to keep in registers; at most `rows`)."""
    return x.dim() == 2 and 0 < x.shape[0] <= min(rows, MAX_ROWS)


def skinny_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
                   out_dtype: torch.dtype = torch.float32, block_n: int = 1, stages: int = 3,
                   groups: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times up to three weights w_i [N_i, K] (+ biases [N_i]) in one launch ->
    [M, sum N_i] of out_dtype, the outputs of w_0, w_1, .. side by side (accumulated in float32); programs of
    block_n rows of one weight (a power of two; smaller where it does not divide every N_i). groups (ids [G], size):
    only the outputs [id * size, (id + 1) * size) of the listed ids are computed (one weight; the other outputs are
    left unwritten)."""
    K = x.shape[-1] if x.dim() == 2 else -1
    if not skinny_applies(x) or not 0 < len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"skinny_linear takes x [1..{MAX_ROWS}, K] and 1..{MAX_WEIGHTS} weights, got "
                         f"{tuple(x.shape)} and {len(weights)}")
    if any(w.dim() != 2 or w.shape[1] != K for w in weights):
        raise ValueError(f"skinny_linear takes weights w [N, K] with x's K = {K}, got "
                         f"{[tuple(w.shape) for w in weights]}")
    if not x.dtype.is_floating_point or any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"skinny_linear takes x and w of one float dtype, got {x.dtype} and "
                         f"{sorted({str(w.dtype) for w in weights})}")
    if biases is not None and [tuple(b.shape) for b in biases] != [(w.shape[0],) for w in weights]:
        raise ValueError("skinny_linear takes one bias [N_i] per weight, or none")
    sizes = [w.shape[0] for w in weights]
    ids, group = groups if groups is not None else (x, 0)  # x: unread without groups
    if groups is not None and (len(weights) != 1 or group <= 0 or sizes[0] % group or ids.dim() != 1):
        raise ValueError(f"skinny_linear computes groups of one weight's rows: ids [G] and a size dividing its "
                         f"{sizes[0]} rows, got ids {tuple(ids.shape)} and size {group} for {len(weights)} weights")
    while any(n % block_n for n in sizes + [group or block_n]):
        block_n //= 2
    x, weights = x.contiguous(), [w.contiguous() for w in weights]
    has_bias = biases is not None
    biases = [b.contiguous() for b in biases] if has_bias else weights  # unread without HAS_BIAS
    ends = list(accumulate(sizes))
    pad = MAX_WEIGHTS - len(weights)
    M, N = x.shape[0], ends[-1]
    block_m = triton.next_power_of_2(M)
    block_k = max(16, min(PRODUCT // (block_m * block_n), triton.next_power_of_2(K)))
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    bounds = (ends + [N] * pad)[:MAX_WEIGHTS - 1]  # where w1 and w2 start
    programs = ids.numel() * group // block_n if groups is not None else triton.cdiv(N, block_n)
    _skinny_kernel[(programs,)](
        x, *(weights + weights[-1:] * pad), *(biases + biases[-1:] * pad), y, ids, M, N, *bounds, K,
        HAS_BIAS=has_bias, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        num_warps=4)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 1,
                  groups: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times w [N, K]^T -> [M, N] float32; block_n rows of w per program (1 was the
    fastest on the H100 at N 32-2048, K 1408-14336); groups: as skinny_linears."""
    return skinny_linears(x, [w], block_n=block_n, groups=groups)


def low_rank_input(x: torch.Tensor, v: torch.Tensor,
                   groups: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """x V^T [M, E * r] for the low-rank kernels (V [E * r, K], all experts' r rows): skinny_linear where it pays
    (float32), else torch's GEMM. groups (expert ids [G], r): skinny computes only those experts' r columns (one
    token: 2 of Mixtral's 8 experts' V read instead of all)."""
    if not skinny_applies(x, PAYS_ROWS):
        return torch.nn.functional.linear(x, v)
    return skinny_linear(x, v, groups=groups)
