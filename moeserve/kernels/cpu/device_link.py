"""The CPU end of the device link: a native thread that computes MoE layers (the generated `moe_layer`) when a
device asks for them through host memory, and answers the same way.

Why: a hybrid decode step that hands each CPU layer to the host through Python pays, per layer, a device->host
copy and a wait for it, a Python call that starts the CPU experts, and a host->device copy after; on a model with
many small experts (Qwen3-30B-A3B: ~0.25 ms of DRAM reads a layer) that is as much time as the experts. With the
link the device drives: it writes a layer's inputs into page-locked buffers and one `ask` word, spins until the
thread's `answer` word arrives, then reads the output. No host thread sits between the two, nothing syncs, and the
whole decode step can be one CUDA graph (the device end: hybrid/link.py).

Words (int64): ask = seq << 20 | layer << 12 | T (T = 0: a ping, answered without work); answer = seq << 20.
Buffers (host): ids [R, k] int64 (negative: a pair computed elsewhere, skipped), wts [R, k] float32, x [R, D] float32 in; out [R, D] float32 back; R rows at most.
One layer is in flight at a time: the device needs its output before the next layer's input exists.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from moeserve.kernels.cpu import tuning
from moeserve.kernels.cpu.codegen import (LINK_LAYER_SHIFT as LAYER_SHIFT, LINK_MAX_LAYERS as MAX_LAYERS,  # the
                                          LINK_MAX_ROWS as MAX_ROWS, LINK_SEQ_SHIFT as SEQ_SHIFT)  # ask word's fields
from moeserve.kernels.cpu.gemv import CpuKernel, LayerExperts


class LinkLayer(ctypes.Structure):
    """One layer's entry of the thread's table (codegen.py link_layer): its experts' packed pointer arrays and
    what the thread did for it."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("k", "E", "D", "F", "gu_vectors", "kb_gu", "dn_vectors", "kb_dn",
                                                "group")]
                + [(n, ctypes.c_void_p) for n in ("gw", "gs", "gz", "dw", "ds", "dz", "gb", "db")]
                + [("clamped", ctypes.c_int64), ("alpha", ctypes.c_double), ("limit", ctypes.c_double)]
                + [(n, ctypes.c_int64) for n in ("calls", "rows", "errors", "pairs")])


@dataclass
class LinkBuffers:
    """The host memory both ends share (page-locked when a device reads and writes it)."""

    ask: torch.Tensor  # [8] int64: word 0 (a cache line of its own)
    answer: torch.Tensor  # [8] int64: word 0
    ids: torch.Tensor  # [R, k] int64
    wts: torch.Tensor  # [R, k] float32
    x: torch.Tensor  # [R, D] float32
    out: torch.Tensor  # [R, D] float32

    @classmethod
    def allocate(cls, rows: int, hidden: int, top_k: int, pin: bool) -> "LinkBuffers":
        def make(shape, dtype):
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        return cls(make(8, torch.int64), make(8, torch.int64), make((rows, top_k), torch.int64),
                   make((rows, top_k), torch.float32), make((rows, hidden), torch.float32),
                   make((rows, hidden), torch.float32))


def _form(bits: int, mxfp4: bool) -> str:
    return "MXFP4" if mxfp4 else f"{bits}-bit"


def ask_word(seq: int, layer: int, rows: int) -> int:
    return seq << SEQ_SHIFT | layer << LAYER_SHIFT | rows


class CpuLinkEnd:
    def __init__(self, kernel: CpuKernel, num_layers: int, rows: int, hidden: int, top_k: int, threads: int,
                 cpu: int, spin_us: int, pin: bool):
        """A running thread (pinned to `cpu`, -1: unpinned) that answers asks for up to `rows` tokens of the
        registered layers with `threads` threads (itself and the pool's helpers); spin_us: how long it spins
        after an answer before it polls every ~20 us."""
        if not 1 <= rows <= MAX_ROWS or not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"device link: {rows} rows / {num_layers} layers outside 1..{MAX_ROWS} / "
                             f"1..{MAX_LAYERS}")
        self.kernel, self.rows = kernel, rows
        self.buffers = b = LinkBuffers.allocate(rows, hidden, top_k, pin)
        self.table = (LinkLayer * num_layers)()
        self.experts: dict[int, LayerExperts] = {}  # kept alive: the table points into them
        self.handle = kernel.dll.link_start(b.ask.data_ptr(), b.answer.data_ptr(), b.ids.data_ptr(), b.wts.data_ptr(),
                                            b.x.data_ptr(), b.out.data_ptr(), self.table, num_layers, rows, hidden,
                                            max(threads, 1), cpu, spin_us)
        if not self.handle:
            raise RuntimeError("device link: the CPU thread could not start")
        # stopped before the buffers go, also at interpreter exit: the thread must not poll freed memory
        self._stop = weakref.finalize(self, kernel.dll.link_stop, self.handle)

    def register(self, layer: int, experts: LayerExperts, top_k: int) -> None:
        """Layer `layer`'s experts (repacked for this kernel) join the table: asks for it are answered from now."""
        gu, dn = experts.gate_up[0], experts.down[0]
        if (gu.bits, gu.mxfp4) != (self.kernel.bits, self.kernel.mxfp4):
            raise ValueError(f"device link: layer {layer} has {_form(gu.bits, gu.mxfp4)} experts, the link's kernel "
                             f"reads {_form(self.kernel.bits, self.kernel.mxfp4)} ones")
        entry = self.table[layer]
        entry.k, entry.E, entry.D, entry.F, entry.group = top_k, len(experts.gate_up), gu.in_features, \
            dn.in_features, gu.group
        entry.gu_vectors, entry.dn_vectors = gu.words.shape[0], dn.words.shape[0]
        entry.kb_gu = tuning.k_block(self.kernel.bits, self.kernel.tile_outputs, gu.group)
        entry.kb_dn = tuning.k_block(self.kernel.bits, self.kernel.tile_outputs, dn.group)
        entry.gs, entry.gz, entry.dw, entry.ds, entry.dz, entry.gb, entry.db = (
            None if a is None else ctypes.cast(a, ctypes.c_void_p).value for a in experts.arrays[1:])
        entry.clamped, entry.alpha, entry.limit = experts.activation
        self.experts[layer] = experts
        entry.gw = ctypes.cast(experts.arrays[0], ctypes.c_void_p).value  # last: the thread reads gw != NULL as ready

    def registered(self, layer: int) -> bool:
        return layer in self.experts

    def counts(self) -> tuple[int, int, int, int]:
        """(calls, token rows, calls answered with zeros for a bad entry, (token, expert) pairs computed: a pair
        with a negative expert id is not) over every layer so far."""
        return tuple(sum(getattr(e, f) for e in self.table) for f in ("calls", "rows", "errors", "pairs"))

    def close(self) -> None:
        self._stop()
