"""Prompts through the hybrid layers on the GPU: a layer's experts streamed from host RAM and computed there.

A decode step reads each of its experts for one row, which the CPU does at DRAM speed where the bytes lie. A prompt
of many tokens reads every expert of a layer for many rows: the CPU is then bound by its matmul rate, while the
GPU computes the rows almost for free once the expert's bytes are there. So at `stream_from` tokens or more
(measured by bench/hybrid.py's threshold sweep, llama.cpp's op-offload batch threshold plays the same part) the
layer's missed experts are copied over the link into a ring of GPU slots and computed in one routed pass: expert i's
copy overlaps expert i-1's compute, and a slot's next copy waits only for the compute that read it (offload's
SlotPool events on the Copier's stream). Nothing waits on the host: the whole layer is enqueued at once.

The ring holds the run's precision of an expert (the store's low-bit copies in a low-bit run, else the high ones:
floats, or MXFP4 as shipped, dequantized as each expert computes)
and is sized to keep the link busy (hybrid/memory.py ring_slots: STREAM_RING_BYTES, at least two experts, at most a
layer's experts).
"""

from __future__ import annotations

import torch

from moeserve.offload.slot_compute import after_loads, grouped_pass, mark_read, slot_ffn
from moeserve.offload.slots import SlotPool
from moeserve.offload.store import ExpertStore
from moeserve.offload.transfer import Copier


class ExpertStreamer:
    def __init__(self, store: ExpertStore, slots: int, device, dtype: torch.dtype, low: bool):
        """slots: the ring's size (ring_slots); low: stream the store's low-bit copies (else the high ones: float
        copies in `dtype`, or MXFP4 as stored)."""
        self.store, self.low = store, low
        self.pool = SlotPool(slots, store.slot_parts(low, dtype), device, store.slot_weights(low))
        self.copier = Copier(device)
        self.next = 0  # the ring slot the next expert goes to
        self.experts_streamed = 0
        self.bytes_copied = 0

    def compute(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, D] and expert_weights [T, k] on the GPU; expert_ids [T, k] and mask [T, k] bool on the host: the
        pairs to compute here (None: every pair) -> their weighted sum [T, D], every needed expert copied once."""
        E = self.store.meta["num_experts"]
        keys = expert_ids if mask is None else torch.where(mask, expert_ids, E)  # [T, k]: E = not in this pass
        return grouped_pass(x, expert_weights, keys, E, lambda e, rows: self._run(layer, e, x, rows))

    def _run(self, layer: int, expert: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One expert: copied into the next ring slot (after the pass that last read it), then computed."""
        slot, self.next = self.next, (self.next + 1) % self.pool.num_slots
        src = self.store.host_parts(layer, expert, self.low)
        self.copier.load(self.pool.load_parts(slot), src, self.pool.used[slot], self.pool.loaded[slot])
        self.experts_streamed += 1
        self.bytes_copied += self.store.expert_bytes(self.low)
        after_loads(x, [(self.pool, slot)])
        y = slot_ffn(self.pool.weights[slot], rows, self.store.act)  # [n, D]
        mark_read(x, [(self.pool, slot)])
        return y
