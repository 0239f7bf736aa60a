"""The tensor-core tiles of the low-bit kernels, and tile_product, the one product every entry kernel calls (jit code
only).

Rows of x padded to BLOCK_M >= 16: each step decodes its [BLOCK_N, C] columns slot by slot, interleaves the slots in
registers into one [BLOCK_N, BLOCK_K] tile and runs one dot against x [BLOCK_K, BLOCK_M] (the tile is in input
order, so x loads as contiguous rows); the next step's words and scale/zero are loaded before this step's dot.
HALF (16-bit x, 2/3/4 bits, 8 with fp16): the tile holds the exact codes 2^bits + q in x's dtype, a step is one
group, and its scale/zero apply to the dot's result. Config PIPE (steps of whole groups, no HALF): the tile is
dequantized, Triton's pipeliner keeps PIPE steps in flight through shared memory, and the dots chain on one
accumulator. tile_product picks these or the CUDA-core GEMV (gemv.py) by the launch's USE_DOT; low_rank_tile is the
compensator term (x V^T) U^T.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.lowbit.codes import code_tile, column_words, dequant_tile, plane_stride
from moeserve.kernels.triton.lowbit.gemv import gemv, weight_rows


@triton.jit
def _load_words(row_ptr, n_mask, col, cols):
    """Words `col` [C] (< cols) of the packed rows (or of one 3-bit plane of them): [BLOCK_N, C] int32."""
    return tl.load(row_ptr[:, None] + col[None, :], mask=n_mask[:, None] & (col < cols)[None, :], other=0)


@triton.jit
def _column_loads(row_ptr, n_mask, col, words_per_row, BITS: tl.constexpr, CPG: tl.constexpr):
    """The stored words of columns `col` [C] of the packed rows (CPG columns a group): a tuple of [BLOCK_N, C] int32,
    one word a column, or a 3-bit unit's three (one per plane), masked past the row."""
    if BITS == 3:
        plane = plane_stride(words_per_row, CPG)
        stored = (_load_words(row_ptr, n_mask, col, plane), _load_words(row_ptr + plane, n_mask, col, plane),
                  _load_words(row_ptr + 2 * plane, n_mask, col, plane))
    else:
        stored = (_load_words(row_ptr, n_mask, col, words_per_row),)
    return stored


@triton.jit
def _dot_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step, words_per_row, groups_per_row, BITS: tl.constexpr,
               GROUP: tl.constexpr, C: tl.constexpr, VPC: tl.constexpr, HALF: tl.constexpr):
    """What step `step` of the tensor-core path reads from HBM: the stored words of its C columns (a tuple of
    [BLOCK_N, C]: one word, or a 3-bit unit's three) and their scale/zero (fp16) per column [BLOCK_N, C], or
    (HALF: the step is one group) per row [BLOCK_N], masked past the row."""
    col = step * C + tl.arange(0, C)
    if HALF:
        g = tl.minimum(step, groups_per_row - 1)  # past the end (the prefetch after the last step): unused
        s = tl.load(s_ptr + grp_ptr + g, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + grp_ptr + g, mask=n_mask, other=0.0)
    else:
        g = col * VPC // GROUP
        mask = n_mask[:, None] & (g < groups_per_row)[None, :]
        s = tl.load(s_ptr + grp_ptr[:, None] + g[None, :], mask=mask, other=0.0)
        z = tl.load(z_ptr + grp_ptr[:, None] + g[None, :], mask=mask, other=0.0)
    return _column_loads(row_ptr, n_mask, col, words_per_row, BITS, GROUP // VPC), s, z


@triton.jit
def _dot16(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b (fp32). Triton 3.9's interpreter miscomputes bf16 dots, so there it runs in fp32: the same sums, as
    the products of 16-bit values are exact in fp32."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _dot_group_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step, words_per_row, groups_per_row, BITS: tl.constexpr,
                     C: tl.constexpr, G: tl.constexpr):
    """What a pipelined (PIPE) tensor-core step reads: the stored words of its C columns (_column_loads: vectors of
    whole groups, per plane at 3 bits) and the scale/zero of its G whole groups, [BLOCK_N, G] fp16 (one load per
    group, not per column: these go through the shared-memory stages)."""
    col = step * C + tl.arange(0, C)
    g = step * G + tl.arange(0, G)
    mask = n_mask[:, None] & (g < groups_per_row)[None, :]
    s = tl.load(s_ptr + grp_ptr[:, None] + g[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + grp_ptr[:, None] + g[None, :], mask=mask, other=0.0)
    return _column_loads(row_ptr, n_mask, col, words_per_row, BITS, C // G), s, z


@triton.jit
def _per_column(v, BLOCK_N: tl.constexpr, G: tl.constexpr, C: tl.constexpr):
    """[BLOCK_N, G] per-group values -> [BLOCK_N, C], each group's value for its C / G columns."""
    return tl.reshape(tl.broadcast_to(tl.reshape(v, (BLOCK_N, G, 1)), (BLOCK_N, G, C // G)), (BLOCK_N, C))


@triton.jit
def _x_tile(x_ptr, x_rows, r_mask, step, K, C: tl.constexpr, VPC: tl.constexpr):
    """x [C * VPC, BLOCK_M] of step `step` (the weight tiles are in input order: contiguous loads), zero past K."""
    off = step * (C * VPC) + tl.arange(0, C * VPC)  # [C * VPC]
    return tl.load(x_ptr + x_rows[None, :].to(tl.int64) * K + off[:, None], mask=(off < K)[:, None] & r_mask[None, :],
                   other=0.0)  # [C * VPC, BLOCK_M]


@triton.jit
def _dot(x_ptr, x_rows, r_mask, row_ptr, grp_ptr, s_ptr, z_ptr, n_mask, step0, step1, K, words_per_row,
         groups_per_row, exp, BITS: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_M: tl.constexpr, C: tl.constexpr, VPC: tl.constexpr, HALF: tl.constexpr, PIPE: tl.constexpr,
         INTERPRET: tl.constexpr):
    """Rows x_rows [BLOCK_M] of x (r_mask: the real ones) times steps [step0, step1): [BLOCK_N, BLOCK_M] fp32
    (weight as the A operand), one dot per step over the whole dequantized [BLOCK_N, C * VPC] tile, x gathered in the
    tile's value order.
    PIPE (whole groups per step, not HALF): Triton's pipeliner keeps PIPE steps of words, scale/zero and x in flight
    through shared memory, and the dots chain on one accumulator; otherwise the next step's words and scale/zero are
    loaded (into registers) before this step's dot.
    HALF (2/3/4 bits, 8 with fp16 x; a step is one group): the dot runs on the exact 16-bit codes 2^BITS + q, and
    s * (that - (z + 2^BITS) * sum x) scales it per group after: a shift + LOP3 per two weights instead of a decode,
    an FMA and a convert per weight, which bound the dequantizing loop."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PIPE:
        G: tl.constexpr = C * VPC // GROUP
        for step in tl.range(step0, step1, num_stages=PIPE):
            stored, s, z = _dot_group_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step, words_per_row,
                                            groups_per_row, BITS, C, G)
            s = s.to(tl.float32)
            zs = (z.to(tl.float32) + (1 << BITS)) * s  # _code's values carry 2^BITS
            w = dequant_tile(column_words(stored, BITS), _per_column(s, BLOCK_N, G, C),
                             _per_column(zs, BLOCK_N, G, C), exp, x_ptr.dtype.element_ty, BITS, VPC)
            acc = _dot16(w, _x_tile(x_ptr, x_rows, r_mask, step, K, C, VPC), acc, PRECISION, INTERPRET)
    else:
        nxt = _dot_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step0, words_per_row, groups_per_row, BITS, GROUP,
                         C, VPC, HALF)
        for step in range(step0, step1):
            stored, s, z = nxt
            nxt = _dot_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step + 1, words_per_row, groups_per_row, BITS,
                             GROUP, C, VPC, HALF)
            xt = _x_tile(x_ptr, x_rows, r_mask, step, K, C, VPC)
            s = s.to(tl.float32)
            if HALF:
                codes = code_tile(column_words(stored, BITS), exp, x_ptr.dtype.element_ty, BITS, VPC)  # [BLOCK_N, GROUP]
                part = _dot16(codes, xt, tl.zeros_like(acc), PRECISION, INTERPRET)  # [BLOCK_N, BLOCK_M] sum (2^BITS + q) x
                xs = tl.sum(xt.to(tl.float32), axis=0)  # [BLOCK_M] the group's sum of x
                acc += s[:, None] * (part - (z.to(tl.float32) + (1 << BITS))[:, None] * xs[None, :])
            else:
                zs = (z.to(tl.float32) + (1 << BITS)) * s  # _code's values carry 2^BITS
                w = dequant_tile(column_words(stored, BITS), s, zs, exp, x_ptr.dtype.element_ty, BITS, VPC)
                acc = _dot16(w, xt, acc, PRECISION, INTERPRET)  # w [BLOCK_N, C * VPC]
    return acc


@triton.jit
def low_rank_tile(u_ptr, xv_ptr, xv_stride, offs_n, n_mask, rows, r_mask, R, USE_DOT: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """(x V^T) U^T for these outputs and rows: U [N, R] (rows of u_ptr), xv [rows, R] (rows xv_stride apart: the MoE
    kernels read their expert's R columns of x V_all^T [rows, E * R]) -> [BLOCK_N, BLOCK_M] fp32."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        u = tl.load(u_ptr + offs_n[:, None].to(tl.int64) * R + offs_r[None, :], mask=n_mask[:, None] & r_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_R]
        xv = tl.load(xv_ptr + rows[None, :].to(tl.int64) * xv_stride + offs_r[:, None],
                     mask=r_ok[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_M]
        if USE_DOT:
            acc = _dot16(u, xv.to(u.dtype), acc, PRECISION, INTERPRET)
        else:
            acc += tl.sum(u.to(tl.float32)[:, :, None] * xv.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def tile_product(x_ptr, x_rows, r_mask, w_base, s_base, z_base, n0, n_end, step0, step1, K, words_per_row,
                 groups_per_row, exp, BITS: tl.constexpr, GROUP: tl.constexpr, USE_DOT: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, C: tl.constexpr,
                 VPC: tl.constexpr, AHEAD: tl.constexpr, SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr,
                 INTERPRET: tl.constexpr, PAIRED: tl.constexpr = False):
    """Rows x_rows [BLOCK_M] of x (tile_rows) times BLOCK_N weight rows from n0 (weight_rows: rows [n0, n_end), or
    PAIRED, BLOCK_N / 2 gate rows then their up rows): acc [BLOCK_N, BLOCK_M] fp32."""
    if USE_DOT:
        n, n_mask = weight_rows(n0, n_end, tl.arange(0, BLOCK_N), BLOCK_N, PAIRED)
        acc = _dot(x_ptr, x_rows, r_mask, w_base + n * words_per_row, n * groups_per_row, s_base, z_base, n_mask,
                   step0, step1, K, words_per_row, groups_per_row, exp, BITS, GROUP, PRECISION, BLOCK_N, BLOCK_M, C,
                   VPC, HALF, PIPE, INTERPRET)
    else:  # CUDA cores: x_ptr is the prepared x [rows, steps, VPC + 1, C] (prepare_x)
        acc = gemv(x_ptr, x_rows, w_base, s_base, z_base, n0, n_end, step0, step1, tl.cdiv(K, C * VPC),
                   words_per_row, groups_per_row, exp, BITS, BLOCK_N, C * VPC // GROUP, GROUP // VPC, VPC, AHEAD,
                   SUB, BLOCK_M, PIPE, HALF, INTERPRET, PAIRED)
    return acc
