"""What a rank's start-up read and how long it took: a checkpoint reader that counts the bytes it hands out, and the
one-line report each rank logs after loading (MOESERVE_LOG=info) so a launch shows that no rank read the whole
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.checkpoint import CheckpointReader
from moeserve.units import format_bytes


class CountingReader(CheckpointReader):
    """A CheckpointReader that counts the bytes of every tensor it returns, per stored (or viewed) name, read whole
    or in part: the bytes this rank took from the memory map (an FP8 weight's dequantized part counts at float32)."""

    def __init__(self, path):
        super().__init__(path)
        self.bytes_read: dict[str, int] = {}

    def _count(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        return t

    def get(self, name):
        return self._count(name, super().get(name))

    def get_slice(self, name, index):
        return self._count(name, super().get_slice(name, index))

    @property
    def total_read(self) -> int:
        return sum(self.bytes_read.values())


def checkpoint_bytes(path) -> int:
    """Size of the checkpoint's weight files (the safetensors files in its directory)."""
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


@dataclass(frozen=True)
class LoadReport:
    """One rank's start-up: bytes read of the checkpoint's total, and seconds from the call to a loaded part."""
    rank: int
    world: int
    bytes_read: int
    checkpoint_bytes: int
    seconds: float

    def line(self) -> str:
        share = self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 0.0
        return (f"rank {self.rank} of {self.world} read {format_bytes(self.bytes_read)} ({self.bytes_read} bytes, "
                f"{share:.0%} of the checkpoint's {format_bytes(self.checkpoint_bytes)}) in {self.seconds:.2f} s")
