"""The disk tier: a host RAM cache of experts over an expert store on disk, for a hybrid run whose CPU layers' experts
do not fit the RAM given to it (--cpu-memory).

The cache is one preallocated arena (page-locked when a GPU is present) cut into slots of one expert each (the
largest expert of the precisions the run reads); it holds at most `budget` bytes by construction. A miss reads the
expert's parts from its layer file with positional reads (os.preadv) straight into a slot: with O_DIRECT where the
filesystem takes it (through a small page-aligned bounce buffer: the tensors in a safetensors file are not aligned),
else buffered reads followed by posix_fadvise(DONTNEED), so neither the store's mapping nor the page cache grows past
the budget. Replacement is least recently used. A slot's tensors stay valid until the next miss: HostExperts computes
one expert at a time from them.

Low-bit experts are kept in the form the CPU kernels read (kernel_form): a miss reads the expert's parts into its
slot, repacks each projection for the kernel (pack_for_cpu) and writes the repacked words, scales and zeros over them
in the slot, so a hit computes at once, with no repack; a slot is sized for the larger of the two forms. Readers that
need the parts as stored (a prompt's dequantized matmul, mixed precision's float path reads the high copies as
stored anyway) get them back from the kernel form, a permutation (unpacked_for_cpu). Stores whose low-bit experts
the kernels do not read here (a layout or group they lack, no compiler, a quantized checkpoint's compensators) keep
the parts as stored, and each use goes through QuantizedLinear as it would in RAM.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from moeserve.checkpoint import SAFETENSORS_DTYPES, validate_safetensors
from moeserve.errors import MoeserveError
from moeserve.kernels.cpu.gemv import (CpuKernel, PackedForCpu, default_kernel, pack_for_cpu, packed_sizes, supports,
                                       unpacked_for_cpu)
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


@dataclass(frozen=True)
class KernelExpert:
    """A low-bit expert in a slot as the CPU kernels read it: (gate_up, down) repacked for the kernel, and the
    biases (gate_up [2F], down [D]) of biased experts."""

    gate_up: PackedForCpu
    down: PackedForCpu
    biases: tuple[torch.Tensor, torch.Tensor] | None

    def stored_parts(self) -> list[torch.Tensor]:
        """The expert's parts as the store holds them (ExpertStore.part_names order), unpacked from the kernel form
        (new tensors)."""
        return [*unpacked_for_cpu(self.gate_up), *unpacked_for_cpu(self.down), *(self.biases or ())]


def kernel_form(store: ExpertStore) -> CpuKernel | None:
    """The kernel the disk tier keeps the store's low-bit experts repacked for, or None: no low-bit copies, a layout
    or group the kernels do not read, no kernel builds here, or a quantized checkpoint's store (its compensators are
    added in torch from the parts as stored)."""
    bits, group = store.meta["low_bits"], store.meta["group"]
    if not bits or store.quantized or not all(supports(n, group, bits) for n in (store.meta["hidden"],
                                                                                 store.meta["ffn"])):
        return None
    parts = store.host_parts(store.meta["layers"][0], 0, True)
    if any(parts[i].dtype != torch.float16 for i in (1, 2, 4, 5)):  # the kernels' scales and zeros: float16
        return None
    return default_kernel(bits)


def _kernel_form_bytes(store: ExpertStore, kernel: CpuKernel, extents: dict[str, Extent]) -> int:
    """Bytes of a slot holding a low-bit expert in the kernel's form: each projection's words, scale and zero, then
    the biases, each part PART_ALIGN-aligned."""
    D, F, bits, group = store.meta["hidden"], store.meta["ffn"], store.meta["low_bits"], store.meta["group"]
    packed = [*packed_sizes(2 * F, D, bits, group, kernel), *packed_sizes(D, F, bits, group, kernel)]
    biases = [extents[n].nbytes for n in store.part_names(0, True)[6:]]
    return sum(_aligned(n, PART_ALIGN) for n in packed + biases)


def slot_bytes(store: ExpertStore, precisions: tuple[bool, ...]) -> int:
    """Bytes of one cache slot: the largest expert among `precisions` (False: high copy, True: low-bit copy), each
    part starting PART_ALIGN-aligned; a low-bit expert kept in the kernels' form (kernel_form) takes the larger of
    its parts as stored (read first) and that form."""
    layer = store.meta["layers"][0]
    extents = layer_extents(store.layer_file(layer))
    kernel = kernel_form(store) if True in precisions else None

    def size(low: bool) -> int:
        stored = sum(_aligned(extents[n].nbytes, PART_ALIGN) for n in store.part_names(0, low))
        return max(stored, _kernel_form_bytes(store, kernel, extents)) if low and kernel is not None else stored

    return max(size(low) for low in precisions)


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
        self.kernel = kernel_form(store) if True in precisions else None  # low-bit experts kept repacked for it
        self.slots = budget // self.slot_size
        self.arena = _arena(self.slots * self.slot_size, pin)  # [slots * slot_size <= budget] bytes
        self._arena_np = self.arena.numpy()
        self._free = list(range(self.slots - 1, -1, -1))
        # (layer, expert, low) -> (slot, its parts as stored or its KernelExpert, bytes held)
        self._where: OrderedDict[tuple[int, int, bool], tuple[int, list[torch.Tensor] | KernelExpert, int]] = \
            OrderedDict()
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
        next miss evicts the least recently used expert. A low-bit expert kept in the kernels' form: its parts
        unpacked from that form (new tensors)."""
        held = self._lookup(layer, expert, low)
        return held.stored_parts() if isinstance(held, KernelExpert) else held

    def kernel_expert(self, layer: int, expert: int) -> KernelExpert:
        """A low-bit expert as the CPU kernels read it, in its slot (repacked once, at the miss that read it); valid
        until the next miss. Only where the store has a kernel form (self.kernel)."""
        held = self._lookup(layer, expert, True)
        assert isinstance(held, KernelExpert), "kernel_expert needs a store with a kernel form (DiskCache.kernel)"
        return held

    def _lookup(self, layer: int, expert: int, low: bool) -> list[torch.Tensor] | KernelExpert:
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
        value = tensors
        if low and self.kernel is not None:
            value, held = self._repack(slot, tensors)
        self._where[key] = (slot, value, held)
        self.held_bytes += held
        return value

    def _repack(self, slot: int, parts: list[torch.Tensor]) -> tuple[KernelExpert, int]:
        """The low-bit expert whose stored parts are in `slot`, repacked for self.kernel and written over them in the
        slot: (its KernelExpert, the bytes it holds)."""
        bits, group = self.store.meta["low_bits"], self.store.meta["group"]
        packed = [pack_for_cpu(*parts[i:i + 3], bits, group, self.kernel, packed_words=True) for i in (0, 3)]
        biases = [b.clone() for b in parts[6:]]  # copied before the packed parts overwrite them
        start, held, views = slot * self.slot_size, 0, []
        for t in [t for p in packed for t in (p.words, p.scale, p.zero)] + biases:
            n = t.numel() * t.element_size()
            views.append(self.arena[start:start + n].view(t.dtype).view(t.shape))
            views[-1].copy_(t)
            start += _aligned(n, PART_ALIGN)
            held += n
        kept = [replace(p, words=views[3 * i], scale=views[3 * i + 1], zero=views[3 * i + 2])
                for i, p in enumerate(packed)]
        return KernelExpert(kept[0], kept[1], tuple(views[6:]) if biases else None), held

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
