"""The MXFP4 MoE kernels (jit code only; launch.py launches them).

A weight row of K values is K/2 bytes (value 2i in the low nibble of byte i, 2i + 1 in the high one) and K/32 E8M0
scales. A tile decodes each byte's two codes by placing their bits in an fp16 (sign to bit 15, the 2 exponent bits
and the mantissa bit to bits 11..9): read as fp16 that is 2^-14 times the E2M1 value, normal or subnormal, so the
decode is a few integer ops and one multiply by the block's scale 2^(s - 127 + 14). The even values of x meet the low
nibbles and the odd ones the high nibbles: no interleaving in registers.

Grid (output block, expert); a program loops over its expert's expert-sorted rows BLOCK_M at a time (rows.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.rows import ROUTE_SORTED, expert_rows, tile_rows
from moeserve.kernels.triton.swiglu import silu_mul


@triton.jit
def e2m1_scaled(codes, scale):
    """E2M1 codes (int32, 0..15) -> float32 values times scale / 2^14 (the scale passed carries the 2^14)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale


@triton.jit
def _dot16(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b (fp32) on 16-bit a, b. Triton 3.9's interpreter miscomputes bf16 dots: there in fp32, the same sums
    (products of 16-bit values are exact in fp32)."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def mxfp4_tile(x_ptr, rows, r_mask, K, w_ptr, s_ptr, offs_n, n_mask, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 = x[rows, :K] W[offs_n, :K]^T; W's packed rows at w_ptr (K/2 bytes each), their
    scales at s_ptr (K/32 each). USE_DOT: tensor cores on x's 16-bit dtype (BLOCK_M >= 16), else CUDA-core sums."""
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.arange(0, HALF)
    kg = tl.arange(0, G)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2)  # [BLOCK_N, 1]
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * (K // 32)
    for k0 in range(0, K, BLOCK_K):
        b = k0 // 2 + kb  # [HALF] bytes of the step
        b_ok = b < K // 2
        byte = tl.load(w_rows + b[None, :], mask=n_mask[:, None] & b_ok[None, :], other=0).to(tl.int32)
        g = k0 // 32 + kg  # [G] scale blocks of the step
        s = tl.load(s_rows + g[None, :], mask=n_mask[:, None] & (g < K // 32)[None, :], other=0)  # [BLOCK_N, G]
        scale = tl.exp2(s.to(tl.float32) - 113.0)  # 2^(s - 127) times the decode's 2^14
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, HALF))
        lo = e2m1_scaled(byte & 15, scale)  # [BLOCK_N, HALF] values 2i
        hi = e2m1_scaled(byte >> 4, scale)  # values 2i + 1
        x_mask = r_mask[:, None] & b_ok[None, :]
        xe = tl.load(x_rows + 2 * b[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, HALF]
        xo = tl.load(x_rows + 2 * b[None, :] + 1, mask=x_mask, other=0.0)
        if USE_DOT:
            acc = _dot16(xe, tl.trans(lo.to(xe.dtype)), acc, INTERPRET)
            acc = _dot16(xo, tl.trans(hi.to(xo.dtype)), acc, INTERPRET)
        else:
            acc += tl.sum(xe.to(tl.float32)[:, None, :] * lo[None, :, :]
                          + xo.to(tl.float32)[:, None, :] * hi[None, :, :], axis=2)
    return acc


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, offsets_ptr, counts_ptr, F, K, alpha, limit,
                   HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """h[rows, n block] = act(x Wg[e]^T + bg[e], x Wu[e]^T + bu[e]) over (n block of F, expert e); weights [E, 2F, ..]
    (an expert's gate rows, then its up rows). act: CLAMPED (GPT-OSS) (clamp(u, -l, l) + 1) g' sigmoid(alpha g'),
    g' = min(g, l); else silu(g) u. Computed in float32, stored in h's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    start, end, e, match, rank = expert_rows(tl.program_id(1), offsets_ptr, counts_ptr, 0, ROUTE_SORTED, BLOCK_M, 1)
    gate_w = w_ptr + e * 2 * F * (K // 2)
    gate_s = s_ptr + e * 2 * F * (K // 32)
    for row0 in range(start, end, BLOCK_M):
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE_SORTED, BLOCK_M, 1)
        gate = mxfp4_tile(x_ptr, rows, r_mask, K, gate_w, gate_s, offs_n, n_mask, USE_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
                          INTERPRET)
        up = mxfp4_tile(x_ptr, rows, r_mask, K, gate_w + F * (K // 2), gate_s + F * (K // 32), offs_n, n_mask,
                        USE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + e * 2 * F + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + e * 2 * F + F + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            h = silu_mul(gate, up)
        out = h_ptr + rows[:, None].to(tl.int64) * F + offs_n[None, :]
        tl.store(out, h.to(h_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, offsets_ptr, counts_ptr, N, K,
                HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """y[rows, n block] = h[rows] Wd[e]^T + bd[e] (float32) over (n block of N, expert e); weights [E, N, ..]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    start, end, e, match, rank = expert_rows(tl.program_id(1), offsets_ptr, counts_ptr, 0, ROUTE_SORTED, BLOCK_M, 1)
    for row0 in range(start, end, BLOCK_M):
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE_SORTED, BLOCK_M, 1)
        y = mxfp4_tile(h_ptr, rows, r_mask, K, w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), offs_n, n_mask,
                       USE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        if HAS_BIAS:
            y += tl.load(bias_ptr + e * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, y, mask=r_mask[:, None] & n_mask[None, :])
