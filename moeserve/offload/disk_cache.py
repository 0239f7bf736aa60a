"""The disk tier: a host RAM cache of experts over an expert store on disk, for a hybrid run whose CPU layers' experts
do not fit the RAM given to it (--cpu-memory).

The cache is one preallocated arena (page-locked when a GPU is present) cut into slots of one expert each (the
largest expert of the precisions the run reads); it holds at most `budget` bytes by construction. A miss reads the
expert's parts from its layer file with positional reads (os.preadv) straight into a slot: with O_DIRECT where the
filesystem takes it (through a small page-aligned bounce buffer: the tensors in a safetensors file are not aligned),
else buffered reads followed by posix_fadvise(DONTNEED), so neither the store's mapping nor the page cache grows past
the budget. Replacement is least recently used. A slot's tensors stay valid until the next miss: HostExperts computes
one expert at a time from them.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeserve.checkpoint import SAFETENSORS_DTYPES, validate_safetensors
from moeserve.errors import MoeserveError
from moeserve.offload.store import UNITS_LAYOUT, ExpertStore, read_provenance
from moeserve.units import format_bytes

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page: any block size divides it)
PART_ALIGN = 64  # start of each part within a slot (any dtype's view, cache lines)


@dataclass(frozen=True)
class Extent:
    """One tensor of a layer file: where its bytes lie (absolute file offset, length) and what they are."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class DiskStats:
    """What the disk tier did: expert lookups served from RAM (hits) or read from disk (misses), the bytes read
    (O_DIRECT: whole aligned blocks) and whether the reads bypass the page cache."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    direct: bool = False

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def layer_extents(path: Path) -> dict[str, Extent]:
    """Every tensor of a safetensors file by name, from its header."""
    header = validate_safetensors(path)
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")  # the data follow the length and the JSON header
    return {name: Extent(start + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0],
                         SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]))
            for name, v in header.items() if name != "__metadata__"}


def slot_bytes(store: ExpertStore, precisions: tuple[bool, ...]) -> int:
    """Bytes of one cache slot: the largest expert among `precisions` (False: high copy, True: low-bit copy), each
    part starting PART_ALIGN-aligned."""
    layer = store.meta["layers"][0]
    extents = layer_extents(store.layer_file(layer))
    return max(sum(_aligned(extents[n].nbytes, PART_ALIGN) for n in store.part_names(0, low)) for low in precisions)


def minimum_budget(store: ExpertStore, precisions: tuple[bool, ...], top_k: int) -> int:
    """The smallest --cpu-memory the disk tier runs with: one layer's top_k experts (one token's)."""
    return top_k * slot_bytes(store, precisions)


def check_disk_budget(store: ExpertStore, precisions: tuple[bool, ...], top_k: int, budget: int) -> None:
    """A MoeserveError naming the minimum when `budget` cannot hold one token's experts of a layer."""
    need = minimum_budget(store, precisions, top_k)
    if budget < need:
        raise MoeserveError(f"--cpu-memory {format_bytes(budget)} is below the disk tier's minimum of "
                            f"{format_bytes(need)} ({top_k} experts, one layer's top-k); give at least that")


def _arena(nbytes: int, pin: bool) -> torch.Tensor:
    """The cache's bytes, page-locked when asked and the OS allows it (else pageable, with a note)."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            print(f"moeserve: note: could not pin the disk tier's {format_bytes(nbytes)} RAM cache "
                  f"({str(e).splitlines()[0]}); it stays pageable", file=sys.stderr)
    return torch.empty(nbytes, dtype=torch.uint8)


class DiskCache:
    def __init__(self, store: ExpertStore, layers: tuple[int, ...], budget: int, precisions: tuple[bool, ...],
                 top_k: int, pin: bool = False, direct: bool = True):
        """The RAM cache of `layers`' experts (precisions: False high copy, True low-bit copy) within `budget` bytes
        (at least minimum_budget); pin: page-lock the arena (a GPU copies from it); direct: try O_DIRECT."""
        if store.path is None:
            raise MoeserveError("--cpu-memory needs an expert store on disk (--offload STORE from "
                                "`moeserve offload-prepare`)")
        check_disk_budget(store, precisions, top_k, budget)
        self.store, self.budget = store, budget
        self.extents = {}  # layer -> name -> Extent
        for layer in layers:
            f = store.layer_file(layer)
            if store.meta["low_bits"] == 3 and True in precisions and \
                    (read_provenance(f) or {}).get("pack_layout") == UNITS_LAYOUT:
                raise MoeserveError(f"{store.path} holds 3-bit experts in pack layout {UNITS_LAYOUT}, which the disk "
                                    f"tier does not convert; build the store again with `moeserve offload-prepare`")
            self.extents[layer] = layer_extents(f)
        self.slot_size = slot_bytes(store, precisions)
        self.slots = budget // self.slot_size
        self.arena = _arena(self.slots * self.slot_size, pin)  # [slots * slot_size <= budget] bytes
        self._arena_np = self.arena.numpy()
        self._free = list(range(self.slots - 1, -1, -1))
        self._where: OrderedDict[tuple[int, int, bool], tuple[int, list[torch.Tensor], int]] = OrderedDict()
        self.held_bytes = 0  # bytes of the experts the slots hold now
        self.stats = DiskStats()
        largest = max(e.nbytes for extents in self.extents.values() for e in extents.values())
        self._bounce = mmap.mmap(-1, _aligned(largest, ALIGN) + 2 * ALIGN)  # page-aligned
        self._fds: dict[int, int] = {}
        if direct and hasattr(os, "O_DIRECT"):
            self.stats.direct = self._open_direct(layers)
            if not self.stats.direct:
                print(f"moeserve: note: {store.path}'s filesystem refuses O_DIRECT; the disk tier reads through the "
                      f"page cache and drops what it read (posix_fadvise DONTNEED)", file=sys.stderr)
        if not self.stats.direct:
            self._fds = {layer: os.open(store.layer_file(layer), os.O_RDONLY) for layer in layers}

    def _open_direct(self, layers: tuple[int, ...]) -> bool:
        """Open the layer files with O_DIRECT and read a block of the first; False (nothing left open) where the
        filesystem refuses either."""
        try:
            for layer in layers:
                self._fds[layer] = os.open(self.store.layer_file(layer), os.O_RDONLY | os.O_DIRECT)
            os.preadv(self._fds[layers[0]], [memoryview(self._bounce)[:ALIGN]], 0)
            return True
        except OSError:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            return False

    # ---- lookups ---------------------------------------------------------------------------------------
    def parts(self, layer: int, expert: int, low: bool) -> list[torch.Tensor]:
        """One expert's parts (ExpertStore.part_names order) in a RAM slot, read from disk on a miss; valid until the
        next miss evicts the least recently used expert."""
        key = (layer, expert, low)
        if key in self._where:
            self._where.move_to_end(key)
            self.stats.hits += 1
            return self._where[key][1]
        self.stats.misses += 1
        if self._free:
            slot = self._free.pop()
        else:
            _, (slot, _, held) = self._where.popitem(last=False)
            self.held_bytes -= held
        tensors, start, held = [], slot * self.slot_size, 0
        for name in self.store.part_names(expert, low):
            e = self.extents[layer][name]
            self._read(self._fds[layer], e.offset, self._arena_np[start:start + e.nbytes])
            tensors.append(self.arena[start:start + e.nbytes].view(e.dtype).view(e.shape))
            start += _aligned(e.nbytes, PART_ALIGN)
            held += e.nbytes
        self._where[key] = (slot, tensors, held)
        self.held_bytes += held
        return tensors

    def _read(self, fd: int, offset: int, out: np.ndarray) -> None:
        """out[:] = the file's bytes at offset (out: a uint8 view of a slot)."""
        n = out.nbytes
        if self.stats.direct:
            first = offset // ALIGN * ALIGN
            end = _aligned(offset + n, ALIGN)
            self._fill(fd, memoryview(self._bounce)[:end - first], first, offset + n - first)
            out[:] = np.frombuffer(self._bounce, np.uint8, n, offset - first)
        else:
            self._fill(fd, memoryview(out), offset, n)
            if hasattr(os, "posix_fadvise"):  # Linux: drop the pages just read
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def _fill(self, fd: int, buf: memoryview, offset: int, need: int) -> None:
        """Read into buf from offset until `need` bytes are in (a read past the file's end comes back short)."""
        done = 0
        while done < need:
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got <= 0:
                raise MoeserveError(f"expert store {self.store.path} ended early (a layer file was truncated); "
                                    f"build it again with `moeserve offload-prepare`")
            done += got
            self.stats.bytes_read += got

    def summary(self) -> dict:
        """The disk tier's counts for a run's stats (hybrid/runtime.py summary)."""
        s = self.stats
        return {"disk_budget": self.budget, "disk_slots": self.slots, "disk_held_bytes": self.held_bytes,
                "disk_hits": s.hits, "disk_misses": s.misses, "disk_hit_rate": s.hit_rate,
                "disk_bytes_read": s.bytes_read, "disk_direct": s.direct}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._bounce.close()
