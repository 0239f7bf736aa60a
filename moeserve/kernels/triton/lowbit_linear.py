"""W{2,3,4,8}A16 matmul in Triton for decode (1..64 rows), dense or over expert-sorted rows, on the pack.py layout.

Each program owns BLOCK_N outputs and one of SPLIT_K slices of the input dimension (so that a 4096-output
matrix still fills every SM). A *column* of a packed row is one word (2/4/8 bits) or one 32-value 3-bit unit,
read as its three stored words plus a fourth rebuilt from their bits 15 and 31 (values 30 and 31). 3-bit rows are
word-planar (pack.py: word t of unit u at t * units + u), so a run of columns is three runs of words, each loaded as
2/4/8-bit words are. A column's
values are taken in *slot* order: slot p < VPC / 2 and slot p + VPC / 2 are the two values of pair p, 16 bits
apart in one word (pack.py: values p and p + VPC / 2 of a 2/4/8-bit word; at 3 bits, values 10t + i and
10t + i + 5 of word t for pair 5t + i, values 30 and 31 for pair 15). A value becomes the float 2^bits + q with
one shift (its bits onto the top of the mantissa) and one LOP3 (mask, exponent), a pair the two halves of a
16-bit float pair the same way: no subtract and no quarter-rate int->float conversion; the 2^bits per value
comes off with the zero (z + 2^bits). A column never spans two groups.

    GEMV (one row, or BLOCK_M <= 8 rows by config; CUDA cores): the weight rows are SUB interleaved sub-tiles,
        each [BLOCK_N / SUB, groups, columns per group], so words load as vectors of a group's columns (16 bytes at
        4 bits, 8 per plane at 3 bits, group 64) and scale/zero once per (row, group),
        in the tile's layout (keep a sub-tile's rows * groups per step below the thread count, or Triton converts
        the tile through shared memory); x comes prepared per step
        (prepare_x: the inputs of each value slot side by side, plus each column's sum of x), so its loads are
        vectors at constant offsets, one per thread for all SUB sub-tiles (L1 bandwidth bounds this loop), and
        acc += s * (sum_i f_i x_i - (z + 2^bits) * sum x) needs no per-value zero term. Each code is decoded
        once for all rows of x. Nothing in the loop is masked (rows and groups clamped, x zero-padded); the
        next AHEAD steps' words and scale/zero are loaded before this step's arithmetic, or (config PIPE) the
        words go through PIPE shared-memory stages (cp.async) and only scale/zero are loaded ahead.
        HALF (16-bit x): the same sums on fp16 pairs, two codes per shift + LOP3 and one HFMA2 per two values,
        x scaled per step by a power of two so the fp16 sums cannot overflow.
    DOT  (more rows, padded to BLOCK_M >= 16, tensor cores): each step decodes its [BLOCK_N, C] columns slot by
        slot, interleaves the slots in registers into one [BLOCK_N, BLOCK_K] tile and runs one dot against x
        [BLOCK_K, BLOCK_M] gathered in the tile's slot order; the next step's words and scale/zero are loaded
        before this step's dot. HALF (16-bit x, 2/3/4 bits, 8 with fp16): the tile holds the exact codes
        2^bits + q in x's dtype, a step is one group, and its scale/zero apply to the dot's result. Config PIPE
        (steps of whole groups, no HALF): the tile is dequantized, Triton's pipeliner keeps PIPE steps in flight
        through shared memory, and the dots chain on one accumulator.

SPLIT_K > 1 accumulates with fp32 atomics into an output that launch() zeroes (with prepare_x on CUDA cores).
An optional low-rank compensator adds (x V^T) U^T in the first K slice, computed before the weight stream (after
it, its live values crowd the stream's registers: a 3-bit down kernel went from 95 to 128 registers and twice the
time): the caller passes xv = x V^T [rows, r] (skinny.low_rank_input) and U [N, r]; the kernel reads U once per
output block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels import triton_interpreting
from moeserve.kernels.triton.configs import gpu_name, lowbit_config
from moeserve.kernels.triton.pdl import after_previous, dependent_launch
from moeserve.kernels.triton.skinny import low_rank_input

BITS = (2, 3, 4, 8)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _code(word, exp, POS: tl.constexpr, BITS: tl.constexpr):
    """The value at bit POS of each word as the float 2^BITS + q: one shift puts its bits on top of the mantissa, one
    LOP3 masks them and sets the exponent (no subtract, no int->float conversion; callers take off 2^BITS per value).
    exp = (127 + BITS) << 23 comes as a run-time argument: as a second immediate beside the mask, Triton 3.6's ptxas
    splits the LOP3 in two (one more instruction per value)."""
    SHIFT: tl.constexpr = 23 - BITS - POS  # the value's lowest bit lands on mantissa bit 23 - BITS
    if SHIFT >= 0:
        w = word << SHIFT
    else:
        w = word >> -SHIFT  # arithmetic: the sign bits land above the mask
    q = (w & (((1 << BITS) - 1) << (23 - BITS))) | exp
    return q.to(tl.float32, bitcast=True)


@triton.jit
def _pair_code(word, exp2, POS: tl.constexpr, BITS: tl.constexpr, MANT: tl.constexpr = 10):
    """The values at bits POS and POS + 16 of each word as the 16-bit float pair (2^BITS + q_lo, 2^BITS + q_hi) in an
    int32, fp16 (MANT = 10 mantissa bits) or bf16 (7): one shift puts both fields on top of their halves' mantissas,
    one LOP3 masks them and sets both exponents (exp2 = exponent_bits(BITS, True, MANT), a run-time argument as in
    _code)."""
    SHIFT: tl.constexpr = MANT - BITS - POS
    if SHIFT >= 0:
        w = word << SHIFT
    else:
        w = word >> -SHIFT
    FIELD: tl.constexpr = ((1 << BITS) - 1) << (MANT - BITS)
    return (w & (FIELD | (FIELD << 16))) | exp2


@triton.jit
def _slot_code(words, exp, S: tl.constexpr, BITS: tl.constexpr):
    """Slot S of each column (words: the column's decode words, _column_words) as the float 2^BITS + q (_code). Pair
    p = S % (VPC / 2) sits in word p // 5 at bit 3 (p % 5) at 3 bits (word 3, the rebuilt one, for p = 15), in the
    column's word at bit p * BITS otherwise; slots past VPC / 2 are the pairs' high values, 16 bits up."""
    if BITS == 3:
        code = _code(words[(S % 16) // 5], exp, 3 * ((S % 16) % 5) + 16 * (S // 16), BITS)
    else:
        code = _code(words[0], exp, S * BITS, BITS)
    return code


@triton.jit
def _slot_pair(words, exp2, P: tl.constexpr, BITS: tl.constexpr, MANT: tl.constexpr = 10):
    """Pair P of each column (slots P and P + VPC / 2, see _slot_code) as a 16-bit float pair (_pair_code)."""
    if BITS == 3:
        pair = _pair_code(words[P // 5], exp2, 3 * (P % 5), BITS, MANT)
    else:
        pair = _pair_code(words[0], exp2, P * BITS, BITS, MANT)
    return pair


@triton.jit
def _split_pair(h, dtype: tl.constexpr):
    """An int32 holding a pair of 16-bit floats -> (low, high) in dtype (fp16 or bf16), bits unchanged."""
    return (h & 0xFFFF).to(tl.int16).to(dtype, bitcast=True), (h >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _halves(h):
    """An int32 holding an fp16 pair -> (low, high) as float32 (the interpreter's path: no inline PTX there)."""
    lo, hi = _split_pair(h, tl.float16)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _hfma2(a, b, c, INTERPRET: tl.constexpr):
    """a * b + c on fp16 pairs held in int32s: one HFMA2 for two values."""
    if INTERPRET:
        a_lo, a_hi = _halves(a)
        b_lo, b_hi = _halves(b)
        c_lo, c_hi = _halves(c)
        lo = (a_lo * b_lo + c_lo).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = (a_hi * b_hi + c_hi).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        out = lo | (hi << 16)
    else:
        out = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def _pair_sum(h, INTERPRET: tl.constexpr):
    """low + high of an fp16 pair held in an int32, in float32."""
    if INTERPRET:
        lo, hi = _halves(h)
        out = lo + hi
    else:
        out = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
            "add.f32 $0, a, b; }", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1)
    return out


@triton.jit
def _load_words(row_ptr, n_mask, col, cols):
    """Words `col` [C] (< cols) of the packed rows (or of one 3-bit plane of them): [BLOCK_N, C] int32."""
    return tl.load(row_ptr[:, None] + col[None, :], mask=n_mask[:, None] & (col < cols)[None, :], other=0)


@triton.jit
def _plane(words_per_row, CPG: tl.constexpr):
    """Words between the planes of a 3-bit row (its units, pack.py); a multiple of the CPG columns of a group (the
    input dimension holds whole groups), which lets a group's words of one plane load as one vector."""
    return tl.multiple_of(words_per_row // 3, CPG)


@triton.jit
def _top_word(w0, w1, w2):
    """A 3-bit unit's fourth word, values 30 and 31 at bits 0 and 16, rebuilt from bit k (15 and 31) of word k."""
    return ((w0 >> 15) & 0x10001) | ((w1 >> 14) & 0x20002) | ((w2 >> 13) & 0x40004)


@triton.jit
def _column_words(stored, BITS: tl.constexpr):
    """The stored words of a column (a tuple: one word, or a 3-bit unit's three) -> the words its values are decoded
    from: the word itself, or the unit's three plus the fourth rebuilt from their bits 15 and 31 (_slot_code)."""
    if BITS == 3:
        words = (stored[0], stored[1], stored[2], _top_word(stored[0], stored[1], stored[2]))
    else:
        words = stored
    return words


@triton.jit
def _slot_offsets(j, BITS: tl.constexpr):
    """Input offset within its column of value slot j [..] (_slot_code; at 3 bits slot j of pair p = j % 16 is value
    10 (p // 5) + p % 5 + 5 (j // 16), and value 30 + j // 16 for p = 15)."""
    if BITS == 3:
        p, high = j % 16, j // 16
        off = tl.where(p < 15, 10 * (p // 5) + p % 5 + 5 * high, 30 + high)
    else:
        off = j
    return off


@triton.jit
def _in_value_order(slots, BITS: tl.constexpr, VPC: tl.constexpr):
    """A column's VPC decoded slots (_slot_code's order) -> the same tensors in input order, a permutation at compile
    time: at 3 bits value v sits in slot 5 (v // 10) + v % 5 + 16 ((v // 5) % 2) (_slot_offsets), 15 and 31 for values
    30 and 31; at 2/4/8 bits slot j is value j. In input order the tensor-core tiles load x as contiguous rows."""
    vals = ()
    for v in tl.static_range(VPC):
        if BITS == 3:
            vals = vals + (slots[5 * (v // 10) + (v % 5) * (1 - v // 30) + 16 * ((v // 5) % 2) + 16 * (v // 31)],)
        else:
            vals = vals + (slots[v],)
    return vals


@triton.jit
def _dequant_tile(words, s, zs, exp, dtype: tl.constexpr, BITS: tl.constexpr, VPC: tl.constexpr):
    """Column words [BLOCK_N, C] (a tuple: one word, or a 3-bit unit's four) -> dequantized [BLOCK_N, C * VPC] in
    dtype, in input order (value i of column c at c * VPC + i): the slots are decoded apart and interleaved in
    registers."""
    vals = ()
    for j in tl.static_range(VPC):
        vals = vals + ((_slot_code(words, exp, j, BITS) * s - zs).to(dtype),)
    return _interleave(_in_value_order(vals, BITS, VPC), VPC)


@triton.jit
def _code_tile(words, exp2, dtype: tl.constexpr, BITS: tl.constexpr, VPC: tl.constexpr):
    """Column words [BLOCK_N, C] (_column_words) -> the exact codes 2^BITS + q [BLOCK_N, C * VPC] in dtype (fp16 or
    bf16), in input order: a shift + LOP3 per two values (_slot_pair), no scale/zero arithmetic (_dot applies them
    per group, after the dot)."""
    MANT: tl.constexpr = 7 if dtype == tl.bfloat16 else 10
    lo = ()
    hi = ()
    for p in tl.static_range(VPC // 2):
        lo_p, hi_p = _split_pair(_slot_pair(words, exp2, p, BITS, MANT), dtype)
        lo = lo + (lo_p,)
        hi = hi + (hi_p,)
    return _interleave(_in_value_order(lo + hi, BITS, VPC), VPC)


@triton.jit
def group_cols(g, CPG: tl.constexpr):
    """The columns of groups g [G]: [G, CPG]."""
    return g[:, None] * CPG + tl.arange(0, CPG)[None, :]


@triton.jit
def _step_groups(step, last, G: tl.constexpr):
    """The G groups of step `step`, clamped to the last (`last`): [G]."""
    return tl.minimum(step * G + tl.arange(0, G), last)


@triton.jit
def _word_loads(tiles, plane, step, last, G: tl.constexpr, CPG: tl.constexpr, BITS: tl.constexpr,
                SUB: tl.constexpr):
    """The packed words step `step` reads from HBM, per sub-tile: one [ROWS, G, CPG] tile of words (vector loads),
    three at 3 bits (a unit's stored words, one per plane, `plane` words apart). A tuple of SUB stored-word tuples.
    No mask: rows come clamped."""
    groups = _step_groups(step, last, G)  # [G]
    out = ()
    for j in tl.static_range(SUB):
        ptr = tiles[j][0][:, None, None] + group_cols(groups, CPG)[None, :, :]  # [ROWS, G, CPG]
        if BITS == 3:
            out = out + ((tl.load(ptr), tl.load(ptr + plane), tl.load(ptr + 2 * plane)),)
        else:
            out = out + ((tl.load(ptr),),)
    return out


@triton.jit
def _scale_loads(tiles, s_ptr, z_ptr, step, last, G: tl.constexpr, SUB: tl.constexpr):
    """Scale/zero of step `step`'s groups, per sub-tile: a tuple of SUB (scale, zero) [ROWS, G, 1] fp16, loaded in
    the word tile's layout."""
    g = _step_groups(step, last, G)[None, :, None]
    out = ()
    for j in tl.static_range(SUB):
        sz = tiles[j][1][:, None, None] + g
        out = out + ((tl.load(s_ptr + sz), tl.load(z_ptr + sz)),)
    return out


@triton.jit
def _step_loads(tiles, plane, s_ptr, z_ptr, step, last, G: tl.constexpr, CPG: tl.constexpr, BITS: tl.constexpr,
                SUB: tl.constexpr):
    """Everything step `step` reads from HBM: (_word_loads, _scale_loads)."""
    return (_word_loads(tiles, plane, step, last, G, CPG, BITS, SUB),
            _scale_loads(tiles, s_ptr, z_ptr, step, last, G, SUB))


@triton.jit
def _weight_rows(n0, n_end, v, TILE_N: tl.constexpr, PAIRED: tl.constexpr):
    """The weight rows of tile rows v [..]: n0 + v, or (PAIRED: a stacked gate/up weight [2 n_end, K], one pipeline
    for both) n0 + v of the gate half for v < TILE_N / 2 and n0 + v - TILE_N / 2 of the up half after. Returns
    (rows clamped in range [..] int64, in-range mask): the clamped rows' sums are never stored."""
    if PAIRED:
        local = n0 + v % (TILE_N // 2)
        second = (v >= TILE_N // 2).to(tl.int64) * n_end
    else:
        local = n0 + v
        second = 0
    return tl.minimum(local, n_end - 1).to(tl.int64) + second, local < n_end


@triton.jit
def _sub_tiles(w_base, n0, n_end, words_per_row, groups_per_row, ROWS: tl.constexpr, SUB: tl.constexpr,
               PAIRED: tl.constexpr):
    """Sub-tile j holds tile rows j + SUB * i (i < ROWS), weight rows by _weight_rows: a tuple of SUB (word pointers
    [ROWS], group offsets [ROWS])."""
    tiles = ()
    for j in tl.static_range(SUB):
        n, _ = _weight_rows(n0, n_end, j + SUB * tl.arange(0, ROWS), ROWS * SUB, PAIRED)
        tiles = tiles + ((w_base + n * words_per_row, n * groups_per_row),)
    return tiles


@triton.jit
def _step_sums(acc, units, scales, x_steps, col, exp, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
               SUB: tl.constexpr, M: tl.constexpr):
    """acc (tuple M * SUB of [ROWS, G, CPG]) + one step: s * (sum (2^BITS + q) x - (z + 2^BITS) * sum x) per column,
    units[j] the decode words (_column_words) of sub-tile j.
    Each code is decoded once for all M rows of x, each x load serves all SUB sub-tiles: x of slot i of column c is
    x_steps[m][i * CPS + c] of this step's prepared x, a constant offset from one address."""
    qx = ()
    for _ in tl.static_range(M * SUB):
        qx = qx + (tl.zeros(acc[0].shape, dtype=tl.float32),)
    for i in tl.static_range(VPC):
        codes = ()
        for j in tl.static_range(SUB):
            codes = codes + (_slot_code(units[j], exp, i, BITS),)
        new = ()
        for m in tl.static_range(M):
            x = tl.load(x_steps[m] + i * CPS + col)[None, :, :]  # [1, G, CPG] fp32
            for j in tl.static_range(SUB):
                new = new + (qx[m * SUB + j] + codes[j] * x,)
        qx = new
    new = ()
    for m in tl.static_range(M):
        xs = tl.load(x_steps[m] + VPC * CPS + col)[None, :, :]  # [1, G, CPG] sum of each column's x
        for j in tl.static_range(SUB):
            s, z = scales[j][0].to(tl.float32), scales[j][1].to(tl.float32)
            new = new + (acc[m * SUB + j] + s * (qx[m * SUB + j] - (z + (1 << BITS)) * xs),)  # 2^BITS extra per value
    return new


@triton.jit
def _half_step_sums(acc, units, scales, x_steps, col, exp2, BITS: tl.constexpr, VPC: tl.constexpr,
                    CPS: tl.constexpr, SUB: tl.constexpr, M: tl.constexpr, INTERPRET: tl.constexpr):
    """_step_sums on fp16 pairs: per column, sum (2^BITS + q) x over its VPC / 2 value pairs with one HFMA2 per
    pair into an fp16 pair (the prepared x is scaled per step so that it cannot overflow), then in fp32
    s / r * (that pair's two halves - (z + 2^BITS) * sum x), r the step's x scale. Half the FMAs of _step_sums
    and one shift + LOP3 per two values."""
    PAIRS: tl.constexpr = VPC // 2
    qx = ()
    for _ in tl.static_range(M * SUB):
        qx = qx + (tl.zeros(acc[0].shape, dtype=tl.int32),)  # fp16 pair (0, 0)
    for p in tl.static_range(PAIRS):
        codes = ()
        for j in tl.static_range(SUB):
            codes = codes + (_slot_pair(units[j], exp2, p, BITS),)
        new = ()
        for m in tl.static_range(M):
            x = tl.load(x_steps[m] + p * CPS + col)[None, :, :]  # [1, G, CPG] fp16 pairs
            for j in tl.static_range(SUB):
                new = new + (_hfma2(codes[j], x, qx[m * SUB + j], INTERPRET),)
        qx = new
    new = ()
    for m in tl.static_range(M):
        xs = tl.load(x_steps[m] + PAIRS * CPS + col).to(tl.float32, bitcast=True)[None, :, :]  # [1, G, CPG] sum x
        inv_r = tl.load(x_steps[m] + (PAIRS + 1) * CPS).to(tl.float32, bitcast=True)  # the step's 1 / scale
        for j in tl.static_range(SUB):
            s, z = scales[j][0].to(tl.float32) * inv_r, scales[j][1].to(tl.float32)
            new = new + (acc[m * SUB + j] + s * (_pair_sum(qx[m * SUB + j], INTERPRET) - (z + (1 << BITS)) * xs),)
    return new


@triton.jit
def x_step_ptrs(x_rows, step, XSLOTS: tl.constexpr, CPS: tl.constexpr, M: tl.constexpr):
    """This step's prepared x of each of the M rows: a tuple of M pointers."""
    x_steps = ()
    for m in tl.static_range(M):
        x_steps = x_steps + (x_rows[m] + step * XSLOTS * CPS,)
    return x_steps


@triton.jit
def gemv_step(acc, words, scales, x_steps, col, exp, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
              SUB: tl.constexpr, M: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """One step of the GEMV (words: each sub-tile's stored words): on fp16 pairs (HALF) or in fp32."""
    units = ()
    for j in tl.static_range(SUB):
        units = units + (_column_words(words[j], BITS),)
    if HALF:
        acc = _half_step_sums(acc, units, scales, x_steps, col, exp, BITS, VPC, CPS, SUB, M, INTERPRET)
    else:
        acc = _step_sums(acc, units, scales, x_steps, col, exp, BITS, VPC, CPS, SUB, M)
    return acc


@triton.jit
def _interleave(parts, N: tl.constexpr):
    """N (a power of two <= 32) tensors [L] or [R, L] -> [N * L] or [R, N * L], out[.., N * i + j] = parts[j][.., i]:
    pairs j, j + half joined along a new last axis, level by level (in registers: each thread keeps its pairs)."""
    for level in tl.static_range(5):
        if (N >> (level + 1)) >= 1:
            new = ()
            for j in tl.static_range(N >> (level + 1)):
                pair = tl.join(parts[j], parts[j + (N >> (level + 1))])  # [.., L', 2]
                if len(pair.shape) == 2:
                    new = new + (tl.reshape(pair, (2 * parts[j].shape[0],)),)
                else:
                    new = new + (tl.reshape(pair, (parts[j].shape[0], 2 * parts[j].shape[1])),)
            parts = new
    return parts[0]


@triton.jit
def _gemv(xw_ptr, x_rows, w_base, s_ptr, z_ptr, n0, n_end, step0, step1, steps, words_per_row, groups_per_row,
          exp, BITS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, CPG: tl.constexpr, VPC: tl.constexpr,
          AHEAD: tl.constexpr, SUB: tl.constexpr, M: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr,
          INTERPRET: tl.constexpr, PAIRED: tl.constexpr):
    """Rows x_rows [M] of x (all in range: masked rows repeat a real one) times steps [step0, step1) of BLOCK_N weight
    rows from n0 (_weight_rows), on CUDA cores, a step = G whole groups of CPG columns: [BLOCK_N, M] fp32.

    xw_ptr: the prepared x [rows, steps, XSLOTS, G * CPG] (prepare_x, zero past the last column). Per column
    s * (sum (2^BITS + q) x - (z + 2^BITS) * sum x), scale/zero loaded once per (row, group). Nothing is masked:
    weight rows, x rows and groups are clamped in range and the zero x past the end cancels what they read.
    The weight rows are SUB interleaved sub-tiles of BLOCK_N / SUB: each thread works on one row of every sub-tile, so
    x, which every row reads, is loaded once per SUB rows (L1 bandwidth, not HBM, bounds this loop), while each
    sub-tile keeps the layout in which its scale/zero load needs no shared-memory conversion. Each code is decoded
    once for the M rows of x.
    Loads in flight: PIPE = 0 loads the next AHEAD steps' words and scale/zero into registers before this step's
    arithmetic (AHEAD + 1 steps in flight per thread: without it every step would wait a full HBM latency for its
    scales); PIPE > 1 leaves the words to Triton's pipeliner, PIPE stages through shared memory (cp.async, fewer
    registers), and loads the 2-byte scale/zero, too small for cp.async, one step ahead into registers."""
    ROWS: tl.constexpr = BLOCK_N // SUB
    CPS: tl.constexpr = G * CPG  # columns per step
    XSLOTS: tl.constexpr = VPC // 2 + 2 if HALF else VPC + 1  # prepared x per column and step (x_slots)
    col = group_cols(tl.arange(0, G), CPG)  # [G, CPG] columns within a step
    last = groups_per_row - 1
    tiles = _sub_tiles(w_base, n0, n_end, words_per_row, groups_per_row, ROWS, SUB, PAIRED)
    plane = _plane(words_per_row, CPG)  # 3 bits
    x_row_ptrs = ()
    acc = ()
    for m in tl.static_range(M):
        row = tl.sum(tl.where(tl.arange(0, M) == m, x_rows, 0), axis=0).to(tl.int64)  # x_rows[m]
        x_row_ptrs = x_row_ptrs + (xw_ptr + row * steps * XSLOTS * CPS,)
        for j in tl.static_range(SUB):
            acc = acc + (tl.zeros((ROWS, G, CPG), dtype=tl.float32),)
    if PIPE > 1:
        scales = _scale_loads(tiles, s_ptr, z_ptr, step0, last, G, SUB)
        for step in tl.range(step0, step1, num_stages=PIPE):
            words = _word_loads(tiles, plane, step, last, G, CPG, BITS, SUB)
            cur = scales
            scales = _scale_loads(tiles, s_ptr, z_ptr, step + 1, last, G, SUB)
            acc = gemv_step(acc, words, cur, x_step_ptrs(x_row_ptrs, step, XSLOTS, CPS, M), col, exp, BITS, VPC, CPS,
                            SUB, M, HALF, INTERPRET)
    else:
        nxt = _step_loads(tiles, plane, s_ptr, z_ptr, step0, last, G, CPG, BITS, SUB)
        if AHEAD == 2:
            nxt2 = _step_loads(tiles, plane, s_ptr, z_ptr, step0 + 1, last, G, CPG, BITS, SUB)
        for step in range(step0, step1):
            cur = nxt
            fresh = _step_loads(tiles, plane, s_ptr, z_ptr, step + AHEAD, last, G, CPG, BITS, SUB)  # in flight from now
            if AHEAD == 2:
                nxt, nxt2 = nxt2, fresh
            else:
                nxt = fresh
            acc = gemv_step(acc, cur[0], cur[1], x_step_ptrs(x_row_ptrs, step, XSLOTS, CPS, M), col, exp, BITS, VPC,
                            CPS, SUB, M, HALF, INTERPRET)
    outs = ()
    for m in tl.static_range(M):
        parts = ()
        for j in tl.static_range(SUB):
            parts = parts + (tl.sum(tl.sum(acc[m * SUB + j], axis=2), axis=1),)  # [ROWS]
        outs = outs + (_interleave(parts, SUB),)  # [BLOCK_N]: row n0 + j + SUB * i
    return tl.reshape(_interleave(outs, M), (BLOCK_N, M))


@triton.jit
def _column_loads(row_ptr, n_mask, col, words_per_row, BITS: tl.constexpr, CPG: tl.constexpr):
    """The stored words of columns `col` [C] of the packed rows (CPG columns a group): a tuple of [BLOCK_N, C] int32,
    one word a column, or a 3-bit unit's three (one per plane), masked past the row."""
    if BITS == 3:
        plane = _plane(words_per_row, CPG)
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
    through shared memory, and the dots chain on one accumulator (H100, 4-bit, 16 rows of 14336 x 4096: 46 -> 31 us;
    64 rows 72 -> 48 us); otherwise the next step's words and scale/zero are loaded (into registers) before this step's
    dot.
    HALF (2/3/4 bits, 8 with fp16 x; a step is one group): the dot runs on the exact 16-bit codes 2^BITS + q, and
    s * (that - (z + 2^BITS) * sum x) scales it per group after: a shift + LOP3 per two weights instead of a decode,
    an FMA and a convert per weight, which bound this loop (0.8 TB/s at 16 rows of a 4-bit 14336x4096 on an H100)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PIPE:
        G: tl.constexpr = C * VPC // GROUP
        for step in tl.range(step0, step1, num_stages=PIPE):
            stored, s, z = _dot_group_loads(row_ptr, s_ptr, z_ptr, grp_ptr, n_mask, step, words_per_row,
                                            groups_per_row, BITS, C, G)
            s = s.to(tl.float32)
            zs = (z.to(tl.float32) + (1 << BITS)) * s  # _code's values carry 2^BITS
            w = _dequant_tile(_column_words(stored, BITS), _per_column(s, BLOCK_N, G, C),
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
                codes = _code_tile(_column_words(stored, BITS), exp, x_ptr.dtype.element_ty, BITS, VPC)  # [BLOCK_N, GROUP]
                part = _dot16(codes, xt, tl.zeros_like(acc), PRECISION, INTERPRET)  # [BLOCK_N, BLOCK_M] sum (2^BITS + q) x
                xs = tl.sum(xt.to(tl.float32), axis=0)  # [BLOCK_M] the group's sum of x
                acc += s[:, None] * (part - (z.to(tl.float32) + (1 << BITS))[:, None] * xs[None, :])
            else:
                zs = (z.to(tl.float32) + (1 << BITS)) * s  # _code's values carry 2^BITS
                w = _dequant_tile(_column_words(stored, BITS), s, zs, exp, x_ptr.dtype.element_ty, BITS, VPC)
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
    """Rows x_rows [BLOCK_M] of x (tile_rows) times BLOCK_N weight rows from n0 (_weight_rows: rows [n0, n_end), or
    PAIRED, BLOCK_N / 2 gate rows then their up rows): acc [BLOCK_N, BLOCK_M] fp32."""
    if USE_DOT:
        n, n_mask = _weight_rows(n0, n_end, tl.arange(0, BLOCK_N), BLOCK_N, PAIRED)
        acc = _dot(x_ptr, x_rows, r_mask, w_base + n * words_per_row, n * groups_per_row, s_base, z_base, n_mask,
                   step0, step1, K, words_per_row, groups_per_row, exp, BITS, GROUP, PRECISION, BLOCK_N, BLOCK_M, C,
                   VPC, HALF, PIPE, INTERPRET)
    else:  # CUDA cores: x_ptr is the prepared x [rows, steps, VPC + 1, C] (prepare_x)
        acc = _gemv(x_ptr, x_rows, w_base, s_base, z_base, n0, n_end, step0, step1, tl.cdiv(K, C * VPC),
                    words_per_row, groups_per_row, exp, BITS, BLOCK_N, C * VPC // GROUP, GROUP // VPC, VPC, AHEAD,
                    SUB, BLOCK_M, PIPE, HALF, INTERPRET, PAIRED)
    return acc


DENSE, SORTED, SLOTS, SLOT_PROGRAMS = 0, 1, 2, 3  # how a kernel finds its rows (ROUTE): see expert_rows
ROUTE_DENSE, ROUTE_SORTED, ROUTE_SLOTS, ROUTE_SLOT_PROGRAMS = (  # the same, for kernels
    tl.constexpr(DENSE), tl.constexpr(SORTED), tl.constexpr(SLOTS), tl.constexpr(SLOT_PROGRAMS))


@triton.jit
def expert_rows(route_a, route_b, M, ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, NSLOTS: tl.constexpr):
    """This program's rows (grid axis 2) as (start, end, expert, match, rank); its tiles are rows [start, end) in
    BLOCK_M steps (tile_rows).
    DENSE: block pid of the M rows of x. SORTED: expert pid's rows of expert-sorted x (route_a/b = the routing table's
    end offsets and counts). Slot order (ROUTE >= SLOTS; slot t * k + j: token t's j-th expert), route_a = the M flat
    expert ids [T*k] (NSLOTS >= M): match/rank [NSLOTS] say which slots are the program's expert's and their order
    among them (no routing table, no gather). SLOTS: program pid serves expert pid. SLOT_PROGRAMS (M <= experts):
    program pid serves slot pid's expert if pid is that expert's first slot, else nothing; so no program waits on an
    expert no token chose (at one token, 6 of Mixtral's 8 and 58 of a 64-expert model's)."""
    pid = tl.program_id(2)
    s = tl.arange(0, NSLOTS)
    match, rank = s < 0, s
    e = pid.to(tl.int64)
    if ROUTE >= ROUTE_SLOTS:
        ids = tl.load(route_a + s, mask=s < M, other=-1)  # [NSLOTS]
        if ROUTE == ROUTE_SLOT_PROGRAMS:
            e = tl.load(route_a + pid).to(tl.int64)
            match = ids == e
            match = match & (tl.min(tl.where(match, s, NSLOTS), axis=0) == pid)  # the expert's first slot only
        else:
            match = ids == e
        hit = match.to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit  # [NSLOTS] place among the expert's slots
        start, end = 0, tl.sum(hit, axis=0)
    if ROUTE == ROUTE_SORTED:
        end = tl.load(route_a + pid)
        start = end - tl.load(route_b + pid)
    if ROUTE == ROUTE_DENSE:
        start = pid * BLOCK_M
        end = tl.minimum(start + BLOCK_M, M)
        e = e * 0
    return start, end, e, match, rank


@triton.jit
def tile_rows(row0, end, match, rank, ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, NSLOTS: tl.constexpr):
    """Tile rows [row0, row0 + BLOCK_M) of expert_rows -> (their rows [BLOCK_M], in range [BLOCK_M]); rows past the
    end repeat a real one. SLOTS: the slots of ranks row0 .. row0 + BLOCK_M - 1."""
    r = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    r_mask = r < end
    if ROUTE >= ROUTE_SLOTS:
        hit = match[None, :] & (rank[None, :] == tl.minimum(r, end - 1)[:, None])  # [BLOCK_M, NSLOTS]
        rows = tl.sum(tl.where(hit, tl.arange(0, NSLOTS)[None, :], 0), axis=1)
    else:
        rows = tl.minimum(r, end - 1)
    return rows, r_mask


@triton.jit
def _lowbit_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, u_ptr, xv_ptr, route_a, route_b,
                   M, N, K, R, xv_stride, words_per_row, groups_per_row, steps_per_split, exp_bits,
                   BITS: tl.constexpr, GROUP: tl.constexpr, ROUTE: tl.constexpr, NSLOTS: tl.constexpr,
                   USE_DOT: tl.constexpr, HAS_LR: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   AHEAD: tl.constexpr, SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr,
                   INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """y[rows, N] (+)= x[rows, K] dequant(W[e])^T (+ low rank), over (N block, K slice, row block | expert)."""
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # values per column: a 3-bit unit or a word
    C: tl.constexpr = BLOCK_K // VPC
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    start, end, e, match, rank = expert_rows(route_a, route_b, M, ROUTE, BLOCK_M, NSLOTS)
    step0 = tl.program_id(1) * steps_per_split
    step1 = tl.minimum(step0 + steps_per_split, tl.cdiv(K, BLOCK_K))
    for row0 in range(start, end, BLOCK_M):  # an expert's rows, BLOCK_M at a time (a loop: no host sync)
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE, BLOCK_M, NSLOTS)
        lr = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if HAS_LR:  # before the weight stream (see the module docstring)
            if tl.program_id(1) == 0:
                lr = low_rank_tile(u_ptr + e * N * R, xv_ptr + e * R, xv_stride, offs_n, n_mask, rows, r_mask, R,
                                   USE_DOT, PRECISION, BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        acc = tile_product(x_ptr, rows, r_mask, w_ptr + e * N * words_per_row, s_ptr + e * N * groups_per_row,
                           z_ptr + e * N * groups_per_row, tl.program_id(0) * BLOCK_N, N, step0, step1, K,
                           words_per_row, groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M,
                           C, VPC, AHEAD, SUB, PIPE, HALF, INTERPRET) + lr
        y = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
        mask = n_mask[:, None] & r_mask[None, :]
        if ATOMIC:
            tl.atomic_add(y, acc, mask=mask, sem="relaxed")
        else:
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- launch ----------------------------------------------------------------------------------------------


def exponent_bits(bits: int, half: bool = False, mantissa: int = 10) -> int:
    """The exponent field(s) the decode ORs in, so that values come out as 2^bits + q: float32 (_code), or both
    halves of a 16-bit pair (_pair_code): fp16 (10 mantissa bits) or bf16 (7)."""
    if not half:
        return (127 + bits) << 23
    bias = 15 if mantissa == 10 else 127
    return ((bias + bits) << mantissa) * 0x10001


def pair_codes(bits: int, dtype: torch.dtype, use_dot: bool) -> bool:
    """Whether a tile runs on 16-bit pairs (every width's values pair up 16 bits apart, see _slot_code): CUDA-core
    tiles on fp16 pairs for 16-bit x (prepare_x converts it); tensor-core tiles on codes in x's own dtype, which holds
    2^bits + q exactly only while bits fit its mantissa (bf16: 7 bits)."""
    if dtype == torch.float32:
        return False
    return not use_dot or bits < 8 or dtype == torch.float16


def x_slots(per_column: int, half: bool) -> int:
    """Prepared-x rows per step: the VPC value slots (fp32) or VPC / 2 fp16 pairs, the column sums, (half) 1 / r."""
    return per_column // 2 + 2 if half else per_column + 1


def half_x_limit(bits: int) -> int:
    """log2 of the bound prepare_x scales each step's |x| under, on the fp16-pair path: a word's pair sum,
    VPC / 2 * (2^(bits+1) - 1) * |x|, stays under 2^15 (half fp16's range)."""
    pairs = values_per_column(bits) // 2
    return (2 ** 15 // (pairs * ((2 << bits) - 1))).bit_length() - 1


def supported(bits: int, group: int) -> bool:
    """Power-of-two groups of >= 16 values (>= 32 at 3 bits: a group must hold whole 32-value units)."""
    return bits in BITS and group >= (32 if bits == 3 else 16) and group & (group - 1) == 0


def check_activation(x: torch.Tensor, in_features: int) -> None:
    """Raise ValueError naming the problem for activations the kernels cannot take."""
    if x.dtype not in DTYPES:
        raise ValueError(f"low-bit kernels take float16/bfloat16/float32 activations, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {in_features}")


def check_weight(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                 in_features: int) -> None:
    """Raise ValueError naming the problem for a packed weight ([..., N, words]) the kernels cannot read."""
    if bits not in BITS:
        raise ValueError(f"low-bit kernels support {BITS} bits, got {bits}")
    if not supported(bits, group):
        raise ValueError(f"low-bit kernels need a power-of-two group >= {32 if bits == 3 else 16} at {bits} bits, "
                         f"got {group}")
    if in_features % group:
        raise ValueError(f"group {group} does not divide the input dimension {in_features}")
    words = -(-in_features // 32) * bits  # padded to whole 32-value units
    if qweight.dtype != torch.int32 or qweight.shape[-1] != words or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [..., {words}] for {in_features} {bits}-bit inputs, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    groups = (*qweight.shape[:-1], in_features // group)
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != torch.float16 or tuple(t.shape) != groups or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float16 {groups}, got {t.dtype} {tuple(t.shape)}")


GEMV_MAX_ROWS = 8


def values_per_column(bits: int) -> int:
    """Values in a column of a packed row: a 32-value unit at 3 bits, a word's values otherwise."""
    return 32 if bits == 3 else 32 // bits


def blocks(bits: int, group: int, rows: int, cfg: dict) -> tuple[bool, int, int]:
    """(use tensor cores, BLOCK_M, BLOCK_K) for up to `rows` rows per program. One row, or a config with BLOCK_M
    (rows of x per CUDA-core tile, a power of two <= 8), runs on CUDA cores; more rows on tensor cores, padded to
    >= 16. BLOCK_K holds whole words and units (a dot's K = columns is >= 16) and, on CUDA cores, whole groups."""
    gemv_m = cfg.get("BLOCK_M", 1)
    if gemv_m not in (1, 2, 4, GEMV_MAX_ROWS):
        raise ValueError(f"a CUDA-core config's BLOCK_M must be 1, 2, 4 or {GEMV_MAX_ROWS}, got {gemv_m}")
    use_dot = rows > 1 and "BLOCK_M" not in cfg
    per_column = values_per_column(bits)
    if use_dot:
        return True, max(16, triton.next_power_of_2(rows)), max(cfg["BLOCK_K"], per_column, 16)
    return False, min(gemv_m, triton.next_power_of_2(rows)), max(cfg["BLOCK_K"], group, per_column)


@triton.jit
def _pack_pair(lo, hi):
    """Two fp16 tensors -> one int32 tensor holding the pairs (lo in the low half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _pow2_scale(m, LOG2_LIMIT: tl.constexpr):
    """(r, 1 / r): the power of two that brings m (> 0) just under 2^LOG2_LIMIT, from the exponent bits (exact)."""
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # m < 2^e
    field = tl.minimum(tl.maximum(127 + LOG2_LIMIT - e, 1), 253)
    return (field << 23).to(tl.float32, bitcast=True), ((254 - field) << 23).to(tl.float32, bitcast=True)


@triton.jit
def prepare_step(x_row, xw_ptr, m, steps, t, cols, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
                 HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr):
    """Step t of row m (x_row: its inputs, `cols` columns; xw_ptr: the prepared x [rows, steps, XSLOTS, CPS]), zero
    past the last column, fp32: xw[t, j, c] = x[input index of value slot j of column t * CPS + c] and
    xw[t, VPC, c] = that column's sum of x. HALF: the step's x is scaled by a power of two r (max |x r| <
    2^LOG2_LIMIT), xw[t, p, c] = the fp16 pair (x r of slots p, p + VPC / 2), xw[t, VPC / 2, c] = the column's sum of
    those fp16 values (fp32 bits), xw[t, VPC / 2 + 1, :] = 1 / r (fp32 bits)."""
    c = t * CPS + tl.arange(0, CPS)
    c_ok = c < cols
    XSLOTS: tl.constexpr = VPC // 2 + 2 if HALF else VPC + 1  # x_slots
    out = xw_ptr + (m.to(tl.int64) * steps + t) * XSLOTS * CPS + tl.arange(0, CPS)
    vals = ()
    for j in tl.static_range(VPC):
        off = c * VPC + _slot_offsets(tl.full((CPS,), j, tl.int32), BITS)
        vals = vals + (tl.load(x_row + off, mask=c_ok, other=0.0).to(tl.float32),)
    total = tl.zeros((CPS,), dtype=tl.float32)
    if HALF:
        big = tl.zeros((CPS,), dtype=tl.float32)
        for j in tl.static_range(VPC):
            big = tl.maximum(big, tl.abs(vals[j]))
        r, inv_r = _pow2_scale(tl.max(big, axis=0), LOG2_LIMIT)
        for p in tl.static_range(VPC // 2):
            lo, hi = (vals[p] * r).to(tl.float16), (vals[p + VPC // 2] * r).to(tl.float16)
            tl.store(out + p * CPS, _pack_pair(lo, hi))
            total += lo.to(tl.float32) + hi.to(tl.float32)
        tl.store(out + (VPC // 2) * CPS, total.to(tl.int32, bitcast=True))
        tl.store(out + (VPC // 2 + 1) * CPS, tl.full((CPS,), inv_r, tl.float32).to(tl.int32, bitcast=True))
    else:
        for j in tl.static_range(VPC):
            tl.store(out + j * CPS, vals[j])
            total += vals[j]
        tl.store(out + VPC * CPS, total)


@triton.jit
def _prepare_x_kernel(x_ptr, xw_ptr, K, cols, fill_ptr, fill_n, BITS: tl.constexpr, VPC: tl.constexpr,
                      CPS: tl.constexpr, HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr, FILL: tl.constexpr,
                      PDL: tl.constexpr):
    """Step pid 0 of row pid 1 (prepare_step). FILL: each program also zeroes its share of fill_ptr's fill_n fp32
    values (the GEMV's split-K target), which saves the separate fill launch: at one row that launch costs as much
    as a tenth of the GEMV."""
    after_previous(PDL)
    if FILL:
        FILL_BLOCK: tl.constexpr = 256
        programs = tl.num_programs(0) * tl.num_programs(1)
        share = tl.cdiv(tl.cdiv(fill_n, programs), FILL_BLOCK) * FILL_BLOCK
        first = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * share
        for i0 in range(first, tl.minimum(first + share, fill_n), FILL_BLOCK):
            i = i0 + tl.arange(0, FILL_BLOCK)  # [FILL_BLOCK]
            tl.store(fill_ptr + i, tl.zeros((FILL_BLOCK,), dtype=tl.float32), mask=i < fill_n)
    m = tl.program_id(1)
    prepare_step(x_ptr + m.to(tl.int64) * K, xw_ptr, m, tl.num_programs(0), tl.program_id(0), cols, BITS, VPC, CPS,
                 HALF, LOG2_LIMIT)


def kernel_inputs(x: torch.Tensor, tile: dict, fill: torch.Tensor | None = None,
                  prepared: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(what the kernels read as x, the exponent bits their decode ORs in) for tile_constexprs `tile`: x itself for
    tensor-core tiles, prepare_x(x) for the CUDA-core path (or `prepared`, x prepared already as
    Preparation.of(tile) says). fill (fp32): zeroed on the way (by prepare_x)."""
    bits = tile["BITS"]
    if not tile["USE_DOT"] and prepared is None:
        return prepare_x(x, bits, tile["BLOCK_K"], tile["HALF"], fill), exponent_bits(bits, tile["HALF"])
    if fill is not None:
        fill.zero_()
    if tile["USE_DOT"]:
        return x, exponent_bits(bits, tile["HALF"], 7 if x.dtype == torch.bfloat16 else 10)
    want = Preparation.of(tile)
    if tuple(prepared.shape) != want.shape(*x.shape) or prepared.dtype != want.dtype:
        raise ValueError(f"x prepared as {tuple(prepared.shape)} {prepared.dtype}, this tile reads "
                         f"{want.shape(*x.shape)} {want.dtype} ({want})")
    return prepared, exponent_bits(bits, tile["HALF"])


@dataclass(frozen=True)
class Preparation:
    """How the CUDA-core kernels want x prepared (prepare_x's layout): packed width, inputs per step, fp16 pairs.
    Another kernel that reads x anyway can write it (kernels/triton/topk_router.py), one launch fewer."""

    bits: int
    block_k: int
    half: bool

    @staticmethod
    def of(tile: dict) -> "Preparation | None":
        """What a tile (tile_constexprs) reads as x, or None for tensor-core tiles (they read x itself)."""
        return None if tile["USE_DOT"] else Preparation(tile["BITS"], tile["BLOCK_K"], tile["HALF"])

    @property
    def dtype(self) -> torch.dtype:
        return torch.int32 if self.half else torch.float32  # fp16 pairs, or fp32 values

    def shape(self, rows: int, K: int) -> tuple[int, int, int, int]:
        """[rows, steps, x_slots, CPS] of rows of K inputs."""
        per_column = values_per_column(self.bits)
        cps = self.block_k // per_column
        return rows, triton.cdiv(K // per_column, cps), x_slots(per_column, self.half), cps

    def buffer(self, rows: int, K: int, device) -> torch.Tensor:
        """An empty prepared x for rows of K inputs."""
        return torch.empty(self.shape(rows, K), dtype=self.dtype, device=device)

    def constexprs(self) -> dict:
        """prepare_step's compile-time arguments."""
        per_column = values_per_column(self.bits)
        return dict(BITS=self.bits, VPC=per_column, CPS=self.block_k // per_column, HALF=self.half,
                    LOG2_LIMIT=half_x_limit(self.bits) if self.half else 0)


def prepare_x(x: torch.Tensor, bits: int, block_k: int, half: bool = False,
              fill: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, steps, x_slots, CPS] for the CUDA-core kernel, a step = block_k inputs = CPS columns: per step,
    the inputs of value slot j of its columns side by side (slot j of a 3-bit unit = value i of its word T,
    j = 8T + i; half: fp16 pairs of slots p and p + VPC / 2, scaled per step), then each column's sum of x (and,
    half, the step's 1 / scale). The kernel finds each slot at a constant offset from the step."""
    M, K = x.shape
    prep = Preparation(bits, block_k, half)
    xw = prep.buffer(M, K, x.device)
    constexprs = prep.constexprs()
    _prepare_x_kernel[(xw.shape[1], M)](x, xw, K, K // values_per_column(bits), xw if fill is None else fill,
                                        0 if fill is None else fill.numel(), FILL=fill is not None, **constexprs,
                                        num_warps=prepare_warps(constexprs["CPS"]), **dependent_launch(x.device))
    return xw


def prepare_warps(columns: int) -> int:
    """Warps of a prepare_x program: a thread per column of the step, at most 4 (more threads only repeat the work;
    H100, Mixtral 3-bit one-token block, h for down in steps of 64 columns: 2 warps instead of 4, 80.6 -> 80.2 us)."""
    return min(4, max(1, columns // 32))


def tile_constexprs(cfg: dict, bits: int, group: int, rows: int, dtype: torch.dtype, has_lr: bool) -> dict:
    """The compile-time arguments tile_product takes (and the launch options) for a config and up to `rows` rows per
    program: shared by the dense/down kernel and the MoE gate/up kernel."""
    use_dot, block_m, block_k = blocks(bits, group, rows, cfg)
    pipelined_dot = use_dot and cfg.get("PIPE", 0) > 0  # _dot's PIPE: dequantized tiles of whole groups
    if pipelined_dot and block_k % group:
        raise ValueError(f"a pipelined tensor-core config (PIPE) needs BLOCK_K a multiple of the group {group}, got "
                         f"{block_k}")
    # 16-bit pairs for 16-bit activations (relative error ~2e-3, bf16's own output rounding) unless a config says no
    half = pair_codes(bits, dtype, use_dot) and bool(cfg.get("HALF", 1)) and not pipelined_dot
    if use_dot and half:
        block_k = group  # a step is one group: its scale/zero apply to the step's dot
    return dict(BITS=bits, GROUP=group, USE_DOT=use_dot, HAS_LR=has_lr, HALF=half,
                INTERPRET=triton_interpreting(),
                PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_N=cfg["BLOCK_N"], BLOCK_M=block_m,
                BLOCK_K=block_k, BLOCK_R=cfg.get("BLOCK_R", 32), AHEAD=cfg.get("AHEAD", 1), SUB=cfg.get("SUB", 1),
                PIPE=cfg.get("PIPE", 0), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3))


def routed_tokens(routing) -> int:
    """The tokens T behind a routing (expert ids [T, k] or a RoutingTable): the most rows one expert can get."""
    return routing.shape[0] if isinstance(routing, torch.Tensor) else routing.num_tokens


def route_args(routing, rows: int, placeholder: torch.Tensor, programs: int) -> dict:
    """The kernels' row arguments (expert_rows) and grid axis 2 (`programs`: the experts, or the row blocks of a
    dense matmul) for a routing: None (dense, `rows` rows), a RoutingTable (sorted rows: its end offsets and counts) or
    expert ids [T, k] (slot order: the T*k flat ids; a program per slot where there are no more slots than
    experts)."""
    if routing is None:
        return dict(a=placeholder, b=placeholder, rows=rows, programs=programs, ROUTE=DENSE, NSLOTS=1)
    if isinstance(routing, torch.Tensor):
        ids = routing.reshape(-1)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        n = ids.numel()
        by_slot = n <= programs
        return dict(a=ids, b=ids, rows=n, programs=n if by_slot else programs,
                    ROUTE=SLOT_PROGRAMS if by_slot else SLOTS, NSLOTS=max(16, triton.next_power_of_2(n)))
    return dict(a=routing.offsets, b=routing.counts, rows=rows, programs=programs, ROUTE=SORTED, NSLOTS=1)


def low_rank_args(lowrank: tuple[torch.Tensor, torch.Tensor] | None, placeholder: torch.Tensor) -> tuple:
    """The kernels' compensator arguments (U [(E,) N, r], x V^T, r) for lowrank = (U, x V^T), or placeholders and
    rank 0 without one (HAS_LR off: never read)."""
    if lowrank is None:
        return placeholder, placeholder, 0
    u, xv = lowrank
    return u, xv, u.shape[-1]


def launch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, y: torch.Tensor,
           bits: int, group: int, K: int, cfg: dict, rows_per_block: int, grid_z: int, *,
           lowrank: tuple[torch.Tensor, torch.Tensor] | None = None, routing=None) -> None:
    """Run the kernel: x [rows, K] -> y [rows, N] (fp32 when cfg SPLIT_K > 1: then zeroed here, with prepare_x).

    routing (grid_z = the experts, weights stacked [E, N, ...]): a RoutingTable (x and y expert-sorted) or the
    expert ids [T, k] (x and y in slot order, [T*k, ...]; see route_args). Without it, grid axis 2 walks
    blocks of rows_per_block rows of a dense matmul."""
    N = qweight.shape[-2]
    tile = tile_constexprs(cfg, bits, group, rows_per_block, x.dtype, lowrank is not None)
    steps = triton.cdiv(K, tile["BLOCK_K"])
    split = min(cfg["SPLIT_K"], steps)
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)
    if split > 1 and y.dtype != torch.float32:
        raise ValueError("split-K accumulates with fp32 atomics: the output must be float32")
    u, xv, R = low_rank_args(lowrank, y)
    route = route_args(routing, x.shape[0], y, grid_z)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, route.pop("programs"))
    xk, exp = kernel_inputs(x, tile, y if split > 1 else None)
    _lowbit_kernel[grid](
        xk, qweight, scale, zero, y, u, xv, route.pop("a"), route.pop("b"), route.pop("rows"), N, K, R,
        xv.stride(0), qweight.shape[-1], scale.shape[-1], per_split, exp, ATOMIC=split > 1, **route, **tile,
        **dependent_launch(x.device))


def lowbit_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  group: int, in_features: int, lowrank: tuple[torch.Tensor, torch.Tensor] | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T (+ (x V^T) U^T) -> [..., N] in x's dtype.

    qweight [N, padded K * bits / 32] int32, scale/zero [N, K / group] fp16; lowrank = (U [N, r], V [r, K])
    in x's dtype (x V^T is a tiny matmul here, U^T is applied in the kernel's epilogue)."""
    check_activation(x, in_features)
    check_weight(qweight, scale, zero, bits, group, in_features)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [M, K]
    M, N = x2.shape[0], qweight.shape[0]
    if config is None:
        config = lowbit_config(gpu_name(x.device.index or 0) if x.is_cuda else "cpu", bits, M, N, in_features)
    lr = None
    if lowrank is not None:
        u, v = lowrank
        lr = (u.contiguous(), low_rank_input(x2, v).contiguous())  # U [N, r], xv [M, r]
    split = config["SPLIT_K"] > 1
    y = torch.empty(M, N, dtype=torch.float32 if split else x.dtype, device=x.device)  # split-K: launch zeroes it
    rows_per_block = M if M == 1 else min(M, config.get("BLOCK_M", 64))  # CUDA-core tiles: a program per BLOCK_M rows
    launch(x2, qweight, scale, zero, y, bits, group, in_features, config, rows_per_block,
           triton.cdiv(M, rows_per_block), lowrank=lr)
    return y.to(x.dtype).reshape(*lead, N)
