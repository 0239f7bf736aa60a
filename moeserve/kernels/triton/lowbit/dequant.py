"""Packed 2/4/8-bit rows -> a float weight, for calls of many rows (jit code only; ops.lowbit_dequantize launches it).

Past the few rows the in-register kernels are made for, a tensor-core matmul over the whole dequantized weight is
faster than streaming the packed weight once per block of rows; this writes that weight in one pass (value j of a
word at bit j * BITS, pack.py's order for 2/4/8 bits).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, words_per_row, groups_per_row,
                   BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] = (q - z) * s, computed in float32; grid (N blocks, K blocks)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    mask = (rows < N)[:, None] & (cols < K)[None, :]  # [BN, BK]
    PER_WORD: tl.constexpr = 32 // BITS
    words = tl.load(w_ptr + rows[:, None] * words_per_row + (cols // PER_WORD)[None, :], mask=mask, other=0)
    q = (words >> ((cols % PER_WORD) * BITS)[None, :]) & ((1 << BITS) - 1)  # arithmetic shift: sign bits masked off
    at = rows[:, None] * groups_per_row + (cols // GROUP)[None, :]  # [BN, BK] group of each value
    s = tl.load(s_ptr + at, mask=mask, other=0).to(tl.float32)
    z = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32)
    w = (q.to(tl.float32) - z) * s
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
