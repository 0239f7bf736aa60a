"""Bit packing of quantization codes into int32 words, with no wasted bits at any width.

2/4/8 bits: word w holds values w*n .. w*n+n-1 (n = 32/bits), value j of the word in bits [j*b, j*b+b).

3 bits: 32 values fill exactly 3 words (96 bits). Word k (k = 0, 1, 2) holds values 10k .. 10k+4 in bits
[0, 15) (value 10k+i at bit 3i) and values 10k+5 .. 10k+9 in bits [16, 31) (at bit 16+3i), so values i and
i+5 of a word sit 16 bits apart, like the values p and p + n/2 of a 2/4/8-bit word: a GPU kernel decodes
such a pair into two 16-bit floats with one shift and one mask. Bit k of value 30 is bit 15 of word k,
bit k of value 31 is bit 31 of word k (rebuilt into one more such pair).

Packing is along the last dimension, which must be a multiple of 32 values (every width packs whole
words then); callers pad rows (see QuantizedLinear).
"""

from __future__ import annotations

import torch

from moeserve.errors import MoeserveError

BITS = (2, 3, 4, 8)
LAYOUT = 3  # bumped when a width's layout changes (3: 3-bit rows word-planar; 2: unit after unit, values paired 16
# bits apart; 1 packed them in order)
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


def packed_words(values: range, n: int, bits: int) -> list[slice]:
    """The word ranges of a packed row of n values (padded to whole units) that hold `values`, a run of whole packing
    units (it starts on a multiple of GROUP_VALUES and ends on one or at n): one range at 2/4/8 bits, one per word
    plane at 3 bits. Joined in order they are the packed row of those values alone."""
    if values.start % GROUP_VALUES or (values.stop % GROUP_VALUES and values.stop != n):
        raise MoeserveError(f"values {values.start}..{values.stop - 1} cut a packing unit of {GROUP_VALUES} values")
    first, end = values.start // GROUP_VALUES, padded_length(values.stop) // GROUP_VALUES
    if bits == 3:  # word-planar: word k of every unit, for k = 0, 1, 2
        units = padded_length(n) // GROUP_VALUES
        return [slice(k * units + first, k * units + end) for k in range(3)]
    return [slice(first * bits, end * bits)]  # a unit of 32 values is `bits` words


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
        words = (body << _unit_shifts(c.device)).sum(-1)  # [..., units, 3]
        k = torch.arange(3, device=c.device)
        words = words | (((c[..., 30:31] >> k) & 1) << 15) | (((c[..., 31:32] >> k) & 1) << 31)
        words = words.transpose(-1, -2)  # [..., 3 words, units]: word-planar
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
        w = w.reshape(*lead, 3, n // 32).transpose(-1, -2)  # [..., units, 3]
        body = (w.unsqueeze(-1) >> _unit_shifts(w.device)) & 7  # [..., units, 3, 10]
        k = torch.arange(3, device=w.device)
        last = [(((w >> bit) & 1) << k).sum(-1, keepdim=True) for bit in (15, 31)]  # values 30, 31 [..., units, 1]
        codes = torch.cat([body.flatten(-2), *last], -1)
    else:
        per_word = 32 // bits
        codes = (w.unsqueeze(-1) >> (torch.arange(per_word, device=w.device) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, n).to(torch.uint8)


def planar_from_units(words: torch.Tensor) -> torch.Tensor:
    """3-bit words [..., 3U] stored unit after unit (LAYOUT 2: the three words of unit 0, then of unit 1, ...) ->
    the word-planar rows of LAYOUT 3. A permutation: reading older checkpoints costs no quantization."""
    return words.reshape(*words.shape[:-1], -1, 3).transpose(-1, -2).reshape(words.shape).contiguous()


def units_from_planar(words: torch.Tensor) -> torch.Tensor:
    """Word-planar 3-bit rows [..., 3U] -> the three words of each unit side by side (the CPU kernels' order)."""
    return words.reshape(*words.shape[:-1], 3, -1).transpose(-1, -2).reshape(words.shape).contiguous()


def _unit_shifts(device) -> torch.Tensor:
    """Bit offsets of values 10k .. 10k+9 within 3-bit word k: five in the low half, five in the high half."""
    i = torch.arange(5, device=device) * 3
    return torch.cat([i, i + 16])


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
