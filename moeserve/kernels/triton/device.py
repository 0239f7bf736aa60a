"""DeviceInfo: what the launch-config defaults and the tuner need to know of a GPU, read once from
torch.cuda.get_device_properties (no measurement): its name and compute capability (the keys of stored configs),
SM count (how many programs fill it), shared memory per block (how many pipeline stages fit), L2 size and the HBM
bandwidth the memory clock and bus width give."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

# Hopper's figures: the defaults assume them where a property is unknown (the interpreter, an old torch)
DEFAULT_SMS = 132
DEFAULT_SMEM = 227 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    sms: int = DEFAULT_SMS
    smem_per_block: int = DEFAULT_SMEM  # bytes a block may opt in to
    l2_bytes: int | None = None
    hbm_bytes_per_s: float | None = None  # from the memory clock and bus width, where torch reports them

    @property
    def slug(self) -> str:
        """The file name of this GPU's tables: its name, lower case, runs of other characters as '-'."""
        return device_slug(self.name)

    @property
    def hopper(self) -> bool:
        return self.capability[0] >= 9

    def as_dict(self) -> dict:
        """The "hardware" data section a config table records."""
        return {"capability": f"{self.capability[0]}.{self.capability[1]}", "sms": self.sms,
                "smem_per_block": self.smem_per_block, "l2_bytes": self.l2_bytes,
                "hbm_bytes_per_s": self.hbm_bytes_per_s}


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.cache
def device_info(index: int) -> DeviceInfo:
    """The properties of CUDA device `index` (cached: asking costs microseconds, too much per MoE layer)."""
    p = torch.cuda.get_device_properties(index)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    return DeviceInfo(name=p.name, capability=(p.major, p.minor), sms=p.multi_processor_count,
                      smem_per_block=getattr(p, "shared_memory_per_block_optin", None) or DEFAULT_SMEM,
                      l2_bytes=getattr(p, "L2_cache_size", None),
                      hbm_bytes_per_s=2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None)


def device_of(t: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of a CUDA tensor's GPU."""
    return device_info(t.device.index if t.device.index is not None else torch.cuda.current_device())
