"""Sizing rules of a hybrid run's expert memory: the precision of the store it builds, the experts the GPU ring
prompts stream through holds, and the check of host RAM against what the experts need (plan/footprint.py counts
the bytes)."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.hybrid.placement import HybridPlacement
from moeserve.offload.budget import available_ram
from moeserve.units import format_bytes

MIXED_LOW_BITS = 4  # the low-bit copies a store built for mixed precision holds
GROUPS = (64, 32, 16)  # quantization group of a store built on the fly: the largest dividing D and F
STREAM_RING_BYTES = 256 << 20  # GPU bytes of the ring prompts stream experts through (at least two experts)


def ring_slots(expert_bytes: int, num_experts: int) -> int:
    """Experts the streaming ring holds (hybrid/stream.py): STREAM_RING_BYTES worth, at least 2 (one copied while
    one computes), at most a layer's."""
    return max(2, min(STREAM_RING_BYTES // max(expert_bytes, 1), num_experts))


def read_precisions(placement: HybridPlacement) -> tuple[bool, ...]:
    """The copies the CPU layers' experts are read at (False: high, True: low-bit): the run's precision, and with
    mixed precision in a float run the low-bit copies too."""
    return tuple(sorted({placement.low, placement.mixed or placement.low}))


def store_precision(spec, placement: HybridPlacement) -> tuple[int, int]:
    """(low bits, group) of the store build_store makes for this placement (low bits 0: no low-bit copies)."""
    D, F = spec.hidden_size, spec.moe.expert_ffn
    group = next((g for g in GROUPS if D % g == 0 and F % g == 0), None)
    if group is None and placement.needs_low_copies:
        raise MoeserveError(f"low-bit experts need hidden size and expert FFN divisible by {GROUPS[-1]} "
                            f"(here {D} and {F})")
    return (placement.bits if placement.low else MIXED_LOW_BITS if placement.mixed else 0), group or GROUPS[0]


def check_host_ram(needed: int) -> None:
    """A MoeserveError naming what the experts need when the RAM available now (MemAvailable) is less."""
    have = available_ram()
    if needed > have:
        raise MoeserveError(f"not enough host RAM for the experts on the CPU: they need {format_bytes(needed)}, "
                            f"{format_bytes(have)} is available; put fewer MoE layers on the CPU (--n-cpu-moe), use "
                            f"fewer --experts-bits, or free memory")
