"""Bit packing of quantization codes into int32 words, with no wasted bits at any width.

2/4/8 bits: word w holds values w*n .. w*n+n-1 (n = 32/bits), value j of the word in bits [j*b, j*b+b).

3 bits: 32 values fill exactly 3 words (96 bits). Word k (k = 0, 1, 2) holds values 10k .. 10k+9 in its
low 30 bits; the last two values (30 and 31) form a 6-bit remainder r = v30 | v31 << 3 whose 2-bit
pieces go to the top two bits of the three words (bits [2k, 2k+2) of r in word k). A kernel reads
30 values with a shift and a mask and rebuilds the last two from the three top bit pairs.

Packing is along the last dimension, which must be a multiple of 32 values (every width packs whole
words then); callers pad rows (see QuantizedLinear).
"""

from __future__ import annotations

import torch

from moeserve.errors import MoeserveError

BITS = (2, 3, 4, 8)
GROUP_VALUES = 32  # values per packing unit: 32 * bits / 32 = `bits` words


def _check(bits: int, n: int) -> None:
    if bits not in BITS:
        raise MoeserveError(f"cannot pack {bits}-bit codes; supported widths are {', '.join(map(str, BITS))}")
    if n % GROUP_VALUES:
        raise MoeserveError(f"packing needs the last dimension to be a multiple of {GROUP_VALUES}, got {n}")


def padded_length(n: int) -> int:
    """n codes rounded up to whole packing units (rows of any length are padded to this to be packed)."""
    return -(-n // GROUP_VALUES) * GROUP_VALUES


def packed_length(n: int, bits: int) -> int:
    """Number of int32 words for n codes."""
    _check(bits, n)
    return n * bits // 32


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] integers in [0, 2^bits) -> int32 [..., n * bits / 32]."""
    n = codes.shape[-1]
    _check(bits, n)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise MoeserveError(f"codes out of range for {bits} bits (must be in [0, {(1 << bits) - 1}])")
    c = codes.to(torch.int64)
    if bits == 3:
        c = c.reshape(*codes.shape[:-1], n // 32, 32)  # [..., units, 32]
        body = c[..., :30].reshape(*c.shape[:-1], 3, 10)  # [..., units, 3 words, 10 values]
        shifts = torch.arange(10, device=c.device) * 3
        words = (body << shifts).sum(-1)  # [..., units, 3]
        rest = c[..., 30] | (c[..., 31] << 3)  # [..., units] 6-bit remainder
        words = words | (((rest.unsqueeze(-1) >> (torch.arange(3, device=c.device) * 2)) & 3) << 30)
    else:
        per_word = 32 // bits
        c = c.reshape(*codes.shape[:-1], n // per_word, per_word)
        words = (c << (torch.arange(per_word, device=c.device) * bits)).sum(-1)
    return _to_int32(words.reshape(*codes.shape[:-1], n * bits // 32))


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [..., n * bits / 32] -> uint8 codes [..., n]."""
    _check(bits, n)
    if words.shape[-1] != n * bits // 32:
        raise MoeserveError(f"{words.shape[-1]} packed words cannot hold {n} {bits}-bit codes")
    w = words.to(torch.int64) & 0xFFFFFFFF  # [..., W] as unsigned
    lead = words.shape[:-1]
    if bits == 3:
        w = w.reshape(*lead, n // 32, 3)  # [..., units, 3]
        body = (w.unsqueeze(-1) >> (torch.arange(10, device=w.device) * 3)) & 7  # [..., units, 3, 10]
        rest = ((w >> 30) << (torch.arange(3, device=w.device) * 2)).sum(-1)  # [..., units]
        codes = torch.cat([body.flatten(-2), (rest & 7).unsqueeze(-1), (rest >> 3).unsqueeze(-1)], -1)
    else:
        per_word = 32 // bits
        codes = (w.unsqueeze(-1) >> (torch.arange(per_word, device=w.device) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, n).to(torch.uint8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
