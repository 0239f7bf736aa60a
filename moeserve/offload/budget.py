"""How many expert-cache slots fit in a fast-memory budget, after what must stay resident; and whether the
budget exists at all on the device that holds the cache."""

from __future__ import annotations

import os

from moeserve.errors import MoeserveError
from moeserve.units import format_bytes

WORKSPACE_SHARE = 0.05  # activations, allocator slack
LOW_SHARE = 0.25  # of the expert memory, for low-precision slots


def kv_cache_bytes(spec, batch: int, tokens: int, dtype_bytes: int) -> int:
    return batch * tokens * spec.kv_bytes_per_token(dtype_bytes)


def available_ram() -> int:
    """RAM the kernel can give now without swapping (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def fast_memory(device) -> tuple[int, str]:
    """(bytes, what they are) of the memory that holds the cache on `device` (a torch.device): a GPU's total
    memory, or with the CPU as the fast tier the RAM available now."""
    if device.type == "cuda":
        import torch  # on use: the budget arithmetic stays importable without torch

        return torch.cuda.get_device_properties(device).total_memory, f"memory of GPU {device}"
    return available_ram(), "RAM available (on the CPU the expert cache lives in RAM)"


def check_budget(budget: int, device) -> None:
    """A budget larger than the memory that exists fails here, in one line, not in the allocator."""
    have, what = fast_memory(device)
    if budget > have:
        raise MoeserveError(f"memory budget {format_bytes(budget)} is more than the {format_bytes(have)} of {what}; "
                            f"give at most that")


def plan_slots(budget: int, resident_bytes: int, kv_bytes: int, high_bytes: int, low_bytes: int,
               low_share: float = LOW_SHARE, reserve: int = 0, max_slots: int | None = None) -> tuple[int, int]:
    """(high, low) cache capacities for `budget` bytes, after `reserve` extra slots per pool (the cache's
    room for experts used once); an error naming the minimum if not even the reserve fits. max_slots (the
    model's number of experts): no pool gets more slots than there are experts to hold."""
    fixed = resident_bytes + kv_bytes + reserve * (high_bytes + low_bytes)
    minimum = (fixed + (0 if reserve else high_bytes)) / (1 - WORKSPACE_SHARE)
    if budget < minimum:
        raise MoeserveError(f"memory budget {format_bytes(budget)} is too small: non-expert weights, KV cache and "
                            f"{max(reserve, 1)} expert(s) in flight need {format_bytes(minimum)}; give at least that")
    experts = budget * (1 - WORKSPACE_SHARE) - fixed
    low = int(experts * low_share // low_bytes) if low_bytes else 0
    high = int((experts - low * low_bytes) // high_bytes)
    if max_slots is not None:
        high, low = min(high, max_slots), min(low, max_slots)
    return high, low
