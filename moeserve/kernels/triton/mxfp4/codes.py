"""E2M1 codes -> 16-bit floats by moving bits, and the arithmetic on pairs of 16-bit floats held in int32s (jit code
only).

A group of 32 values is 16 bytes, read as four int32 words: word w holds values 8w .. 8w + 7, value 8w + i in bits
4i .. 4i + 3 (sign, two exponent bits, one mantissa bit). Codes i and i + 4 of a word sit 16 bits apart, so one int32
becomes a pair of 16-bit floats with two shifts and two masks (e2m1_pairs): the sign goes to bit 15, the exponent and
mantissa bits to the top of the 16-bit exponent field and mantissa, which reads as E2M1 times 2^-14 in fp16 or
2^-126 in bf16 (0.5, the one subnormal E2M1 magnitude, lands on the 16-bit subnormal of the same value). No lookup,
no int -> float conversion.
"""

from __future__ import annotations

import triton
import triton.language as tl

SIGN_PAIR = tl.constexpr(-2147450880)  # 0x80008000 as an int32: the sign bits of a 16-bit pair
# 2^14 (fp16) / 2^126 (bf16) as a pair: times a decoded pair, the E2M1 values themselves
FP16_BIAS_PAIR, BF16_BIAS_PAIR = tl.constexpr(0x74007400), tl.constexpr(0x7E807E80)
DECODE_SCALE = tl.constexpr(16384.0)  # the fp16 decode's 2^14: a decoded code times this is its E2M1 value


@triton.jit
def shifted(v, SHIFT: tl.constexpr):
    """v << SHIFT, or (arithmetic) v >> -SHIFT for a negative SHIFT."""
    if SHIFT >= 0:
        out = v << SHIFT
    else:
        out = v >> -SHIFT
    return out


@triton.jit
def e2m1_pairs(words, J: tl.constexpr, BF16: tl.constexpr):
    """Codes J and J + 4 (J < 4) of int32 words [..] -> a pair of 16-bit floats per word (code J in the low half),
    int32 [..]: E2M1 times 2^-14 as fp16, or (BF16) times 2^-126 as bf16. Two shifts, two masks."""
    LOW: tl.constexpr = 6 if BF16 else 9  # where a half's exponent and mantissa bits start: mantissa bits - 1
    MAG: tl.constexpr = 0x01C001C0 if BF16 else 0x0E000E00  # those three bits of each half
    return (shifted(words, LOW - 4 * J) & MAG) | (shifted(words, 12 - 4 * J) & SIGN_PAIR)


@triton.jit
def split4(t):
    """t [A, B, 4] -> its four slices [A, B] along the last axis (in registers where a thread holds all four)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    even, odd = tl.split(tl.reshape(t, (A, B, 2, 2)))  # [A, B, 2] each: slices 0, 2 and 1, 3
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    return s0, s1, s2, s3


@triton.jit
def pair_halves(pair, dtype: tl.constexpr):
    """An int32 holding two 16-bit floats of dtype -> (low, high) in dtype, bits unchanged."""
    return pair.to(tl.int16).to(dtype, bitcast=True), (pair >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def pack_pair(lo, hi):
    """Two 16-bit float tensors -> one int32 tensor holding the pairs (lo in the low half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def bf16_pair_floats(pair):
    """An int32 holding two bf16 -> (low, high) float32, by moving bits (subnormals kept, as a GPU keeps them)."""
    return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def mul_pairs(a, b, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """a * b on pairs of 16-bit floats (dtype) held in int32s: one instruction for two values (bf16: an FMA with -0,
    sm_80 has no bf16 multiply). Subnormal inputs are kept."""
    if INTERPRET:  # no inline PTX there, and its bf16 conversions flush subnormals: through float32 by bits
        if dtype == tl.bfloat16:  # exact products (what the kernels multiply): the bits' truncation is the product
            a_lo, a_hi = bf16_pair_floats(a)
            b_lo, b_hi = bf16_pair_floats(b)
            lo = ((a_lo * b_lo).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            out = lo | ((a_hi * b_hi).to(tl.int32, bitcast=True) & -65536)
        else:
            a_lo, a_hi = pair_halves(a, dtype)
            b_lo, b_hi = pair_halves(b, dtype)
            out = pack_pair((a_lo.to(tl.float32) * b_lo.to(tl.float32)).to(dtype),
                            (a_hi.to(tl.float32) * b_hi.to(tl.float32)).to(dtype))
    elif dtype == tl.bfloat16:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }", "=r,r,r", [a, b],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                        pack=1)
    return out


@triton.jit
def group_scales(s, ok):
    """E8M0 scale bytes s [..] -> float32 2^(s - 127); zero where not ok (a group past a row's end, clamped onto a
    real one) and for s = 0 (2^-127, below float32's normal range: such a group counts as zero)."""
    return tl.where(ok, (s.to(tl.int32) << 23).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def pow2_range(m, LIMIT: tl.constexpr):
    """Maxima m >= 0 (float32) -> (r, 1 / r): the power of two with m r < 2^LIMIT (and m r >= 2^(LIMIT - 1) for a
    normal m), from m's exponent bits (exact; r = 2^126 for m = 0)."""
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # m < 2^e
    field = tl.minimum(tl.maximum(127 + LIMIT - e, 1), 253)
    return (field << 23).to(tl.float32, bitcast=True), ((254 - field) << 23).to(tl.float32, bitcast=True)
