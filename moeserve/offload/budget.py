"""Whether a memory budget exists at all on the device that holds the cache, and the host RAM available now (the
bytes a run needs are counted by plan/footprint.py)."""

from __future__ import annotations

import os

from moeserve.errors import MoeserveError
from moeserve.units import format_bytes

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
