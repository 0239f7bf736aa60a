"""What the low-bit kernels read, host side: the packed layout's facts (values per column, the exponent bits the
decode ORs in, the prepared x's slots), which weights and activations they accept (ValueError naming the problem
for the rest), and StackedLowbit, one projection of all experts as the MoE kernels take it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels.triton.skinny import low_rank_input

BITS = (2, 3, 4, 8)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def values_per_column(bits: int) -> int:
    """Values in a column of a packed row: a 32-value unit at 3 bits, a word's values otherwise."""
    return 32 if bits == 3 else 32 // bits


def exponent_bits(bits: int, half: bool = False, mantissa: int = 10) -> int:
    """The exponent field(s) the decode ORs in, so that values come out as 2^bits + q: float32 (codes.py's _code), or
    both halves of a 16-bit pair (_pair_code): fp16 (10 mantissa bits) or bf16 (7)."""
    if not half:
        return (127 + bits) << 23
    bias = 15 if mantissa == 10 else 127
    return ((bias + bits) << mantissa) * 0x10001


def pair_codes(bits: int, dtype: torch.dtype, use_dot: bool) -> bool:
    """Whether a tile runs on 16-bit pairs (every width's values pair up 16 bits apart, see slot_code): CUDA-core
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


@dataclass
class StackedLowbit:
    """One projection of all E experts: packed weights and (optional) compensator factors, zero-padded to the
    largest rank (exact): U stacked [E, N, r], and x V_all^T is one matmul against all experts' V [E * r, K]
    (skinny.low_rank_input), of which the kernels read each row's expert's r columns."""

    qweight: torch.Tensor  # [E, N, words] int32
    scale: torch.Tensor  # [E, N, K / group] fp16
    zero: torch.Tensor  # [E, N, K / group] fp16
    bits: int
    group: int
    in_features: int
    u: torch.Tensor | None = None  # [E, N, r] activation dtype
    v: torch.Tensor | None = None  # [E * r, K] activation dtype
    bias: torch.Tensor | None = None  # [E, N] the experts' biases (GPT-OSS), added to the sums

    def low_rank_inputs(self, x_sorted: torch.Tensor,
                        experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(U [E, N, r], x_sorted V_all^T [T*k, E * r]), or None: the kernels read each row's expert's r columns
        (one matmul, no gather launches); experts (ids, any shape): the kernels read only these experts' columns,
        the others may be left unwritten."""
        if self.u is None:
            return None
        groups = (experts.reshape(-1), self.u.shape[-1]) if experts is not None else None
        return self.u, low_rank_input(x_sorted, self.v, groups)  # [T*k, E * r]

    def planes(self) -> int:
        """Words between the planes of a 3-bit row (pack.py), 0 at other widths."""
        return self.qweight.shape[-1] // 3 if self.bits == 3 else 0
