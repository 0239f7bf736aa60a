"""Packed words -> values, in Triton: the decode every low-bit kernel shares (jit code only).

A *column* of a packed row is one word (2/4/8 bits) or one 32-value 3-bit unit, read as its three stored words plus a
fourth rebuilt from their bits 15 and 31 (values 30 and 31). 3-bit rows are word-planar (pack.py: word t of unit u at
t * units + u), so a run of columns is three runs of words, each loaded as 2/4/8-bit words are. A column's values are
taken in *slot* order: slot p < VPC / 2 and slot p + VPC / 2 are the two values of pair p, 16 bits apart in one word
(pack.py: values p and p + VPC / 2 of a 2/4/8-bit word; at 3 bits, values 10t + i and 10t + i + 5 of word t for
pair 5t + i, values 30 and 31 for pair 15). A value becomes the float 2^bits + q with one shift (its bits onto the top
of the mantissa) and one LOP3 (mask, exponent), a pair the two halves of a 16-bit float pair the same way: no
subtract and no quarter-rate int->float conversion; the 2^bits per value comes off with the zero (z + 2^bits). A
column never spans two groups. The fp16-pair arithmetic (hfma2, pair_sum) works on such pairs held in int32s.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def slot_code(words, exp, S: tl.constexpr, BITS: tl.constexpr):
    """Slot S of each column (words: the column's decode words, column_words) as the float 2^BITS + q (_code). Pair
    p = S % (VPC / 2) sits in word p // 5 at bit 3 (p % 5) at 3 bits (word 3, the rebuilt one, for p = 15), in the
    column's word at bit p * BITS otherwise; slots past VPC / 2 are the pairs' high values, 16 bits up."""
    if BITS == 3:
        code = _code(words[(S % 16) // 5], exp, 3 * ((S % 16) % 5) + 16 * (S // 16), BITS)
    else:
        code = _code(words[0], exp, S * BITS, BITS)
    return code


@triton.jit
def slot_pair(words, exp2, P: tl.constexpr, BITS: tl.constexpr, MANT: tl.constexpr = 10):
    """Pair P of each column (slots P and P + VPC / 2, see slot_code) as a 16-bit float pair (_pair_code)."""
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
def hfma2(a, b, c, INTERPRET: tl.constexpr):
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
def pair_sum(h, INTERPRET: tl.constexpr):
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
def plane_stride(words_per_row, CPG: tl.constexpr):
    """Words between the planes of a 3-bit row (its units, pack.py); a multiple of the CPG columns of a group (the
    input dimension holds whole groups), which lets a group's words of one plane load as one vector."""
    return tl.multiple_of(words_per_row // 3, CPG)


@triton.jit
def _top_word(w0, w1, w2):
    """A 3-bit unit's fourth word, values 30 and 31 at bits 0 and 16, rebuilt from bit k (15 and 31) of word k."""
    return ((w0 >> 15) & 0x10001) | ((w1 >> 14) & 0x20002) | ((w2 >> 13) & 0x40004)


@triton.jit
def column_words(stored, BITS: tl.constexpr):
    """The stored words of a column (a tuple: one word, or a 3-bit unit's three) -> the words its values are decoded
    from: the word itself, or the unit's three plus the fourth rebuilt from their bits 15 and 31 (slot_code)."""
    if BITS == 3:
        words = (stored[0], stored[1], stored[2], _top_word(stored[0], stored[1], stored[2]))
    else:
        words = stored
    return words


@triton.jit
def slot_offsets(j, BITS: tl.constexpr):
    """Input offset within its column of value slot j [..] (slot_code; at 3 bits slot j of pair p = j % 16 is value
    10 (p // 5) + p % 5 + 5 (j // 16), and value 30 + j // 16 for p = 15)."""
    if BITS == 3:
        p, high = j % 16, j // 16
        off = tl.where(p < 15, 10 * (p // 5) + p % 5 + 5 * high, 30 + high)
    else:
        off = j
    return off


@triton.jit
def _in_value_order(slots, BITS: tl.constexpr, VPC: tl.constexpr):
    """A column's VPC decoded slots (slot_code's order) -> the same tensors in input order, a permutation at compile
    time: at 3 bits value v sits in slot 5 (v // 10) + v % 5 + 16 ((v // 5) % 2) (slot_offsets), 15 and 31 for values
    30 and 31; at 2/4/8 bits slot j is value j. In input order the tensor-core tiles load x as contiguous rows."""
    vals = ()
    for v in tl.static_range(VPC):
        if BITS == 3:
            vals = vals + (slots[5 * (v // 10) + (v % 5) * (1 - v // 30) + 16 * ((v // 5) % 2) + 16 * (v // 31)],)
        else:
            vals = vals + (slots[v],)
    return vals


@triton.jit
def interleave(parts, N: tl.constexpr):
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
def dequant_tile(words, s, zs, exp, dtype: tl.constexpr, BITS: tl.constexpr, VPC: tl.constexpr):
    """Column words [BLOCK_N, C] (a tuple: one word, or a 3-bit unit's four) -> dequantized [BLOCK_N, C * VPC] in
    dtype, in input order (value i of column c at c * VPC + i): the slots are decoded apart and interleaved in
    registers."""
    vals = ()
    for j in tl.static_range(VPC):
        vals = vals + ((slot_code(words, exp, j, BITS) * s - zs).to(dtype),)
    return interleave(_in_value_order(vals, BITS, VPC), VPC)


@triton.jit
def code_tile(words, exp2, dtype: tl.constexpr, BITS: tl.constexpr, VPC: tl.constexpr):
    """Column words [BLOCK_N, C] (column_words) -> the exact codes 2^BITS + q [BLOCK_N, C * VPC] in dtype (fp16 or
    bf16), in input order: a shift + LOP3 per two values (slot_pair), no scale/zero arithmetic (_dot applies them
    per group, after the dot)."""
    MANT: tl.constexpr = 7 if dtype == tl.bfloat16 else 10
    lo = ()
    hi = ()
    for p in tl.static_range(VPC // 2):
        lo_p, hi_p = _split_pair(slot_pair(words, exp2, p, BITS, MANT), dtype)
        lo = lo + (lo_p,)
        hi = hi + (hi_p,)
    return interleave(_in_value_order(lo + hi, BITS, VPC), VPC)
