"""How many expert-cache slots fit in a fast-memory budget, after what must stay resident."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.units import format_bytes

WORKSPACE_SHARE = 0.05  # activations, allocator slack
LOW_SHARE = 0.25  # of the expert memory, for low-precision slots


def kv_cache_bytes(spec, batch: int, tokens: int, dtype_bytes: int) -> int:
    return 2 * spec.num_layers * batch * tokens * spec.num_kv_heads * spec.head_dim * dtype_bytes


def plan_slots(budget: int, resident_bytes: int, kv_bytes: int, high_bytes: int, low_bytes: int,
               low_share: float = LOW_SHARE, reserve: int = 0) -> tuple[int, int]:
    """(high, low) cache capacities for `budget` bytes, after `reserve` extra slots per pool (the cache's
    room for experts used once); an error naming the minimum if not even the reserve fits."""
    fixed = resident_bytes + kv_bytes + reserve * (high_bytes + low_bytes)
    minimum = (fixed + (0 if reserve else high_bytes)) / (1 - WORKSPACE_SHARE)
    if budget < minimum:
        raise MoeserveError(f"memory budget {format_bytes(budget)} is too small: non-expert weights, KV cache and "
                            f"{max(reserve, 1)} expert(s) in flight need {format_bytes(minimum)}; give at least that")
    experts = budget * (1 - WORKSPACE_SHARE) - fixed
    low = int(experts * low_share // low_bytes) if low_bytes else 0
    high = int((experts - low * low_bytes) // high_bytes)
    return high, low
