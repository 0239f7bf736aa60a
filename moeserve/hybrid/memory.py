"""Memory a hybrid run needs for its experts, from the model's shape, checked before anything is allocated: host RAM
(and the precision of the store it builds), and the GPU ring prompts stream experts through."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.hybrid.placement import HybridPlacement
from moeserve.offload.budget import available_ram
from moeserve.quant.dense import quantized_bytes
from moeserve.units import format_bytes

MIXED_LOW_BITS = 4  # the low-bit copies a store built for mixed precision holds
GROUPS = (64, 32, 16)  # quantization group of a store built on the fly: the largest dividing D and F
STREAM_RING_BYTES = 256 << 20  # GPU bytes of the ring prompts stream experts through (at least two experts)


def ring_slots(expert_bytes: int, num_experts: int) -> int:
    """Experts the streaming ring holds (hybrid/stream.py): STREAM_RING_BYTES worth, at least 2 (one copied while
    one computes), at most a layer's."""
    return max(2, min(STREAM_RING_BYTES // max(expert_bytes, 1), num_experts))


def store_precision(spec, placement: HybridPlacement) -> tuple[int, int]:
    """(low bits, group) of the store build_store makes for this placement (low bits 0: no low-bit copies)."""
    D, F = spec.hidden_size, spec.moe.expert_ffn
    group = next((g for g in GROUPS if D % g == 0 and F % g == 0), None)
    if group is None and placement.needs_low_copies:
        raise MoeserveError(f"low-bit experts need hidden size and expert FFN divisible by {GROUPS[-1]} "
                            f"(here {D} and {F})")
    return (placement.bits if placement.low else MIXED_LOW_BITS if placement.mixed else 0), group or GROUPS[0]


def expert_bytes(spec, bits: int, dtype_bytes: int = 2, group: int = 64) -> int:
    """Bytes of one expert as the store holds it: float (bits 16) at dtype_bytes per weight, or a low-bit copy
    (QuantizedLinear: packed int32 words, fp16 scale and zero per group) for gate_up [2F, D] and down [D, F]; and
    its biases [2F] and [D] at dtype_bytes where the family has them (GPT-OSS)."""
    D, F = spec.hidden_size, spec.moe.expert_ffn
    bias = (2 * F + D) * dtype_bytes if spec.moe.expert_bias else 0
    if bits == 16:
        return 3 * D * F * dtype_bytes + bias
    return sum(quantized_bytes(rows, cols, bits, group) for rows, cols in ((2 * F, D), (D, F))) + bias


def host_bytes(spec, placement: HybridPlacement, compute_bytes: int, low_bits: int, group: int,
               mapped_float_bytes: int | None = None) -> int:
    """RAM the experts take. A store built in RAM now (mapped_float_bytes None) holds every copy it is built with
    (float ones in the compute dtype); a mapped store on disk costs the pages the CPU reads (its float copies at
    mapped_float_bytes per weight) and a compute-dtype copy of those when the dtypes differ. Low-bit experts the CPU
    runs are also repacked once for its kernels (a second copy)."""
    high = 0 if placement.low else expert_bytes(spec, 16, compute_bytes)
    low = expert_bytes(spec, low_bits, group=group) if placement.needs_low_copies else 0
    cpu_experts = sum(spec.moe.experts_at(i) for i in placement.cpu_layers)
    if mapped_float_bytes is None:
        stored_layers = placement.moe_layers if placement.low else placement.cpu_layers
        total = sum(spec.moe.experts_at(i) for i in stored_layers) * (high + low)
    else:
        read_high = 0 if placement.low else expert_bytes(spec, 16, mapped_float_bytes)
        total = cpu_experts * (read_high + low + (high if mapped_float_bytes != compute_bytes else 0))
    return total + cpu_experts * low


def check_host_ram(needed: int) -> None:
    """A MoeserveError naming what the experts need when the RAM available now (MemAvailable) is less."""
    have = available_ram()
    if needed > have:
        raise MoeserveError(f"not enough host RAM for the experts on the CPU: they need {format_bytes(needed)}, "
                            f"{format_bytes(have)} is available; put fewer MoE layers on the CPU (--n-cpu-moe), use "
                            f"fewer --experts-bits, or free memory")
