"""The hybrid backend's dynamic expert cache: S slots on the model device holding experts of the CPU layers at the
run's precision, chosen by a policy as experts are used.

An expert whose copy is in a slot and loaded runs there; a missed one runs on the CPU this time (no copy waits on
the link) and may be copied into a slot in the background: at most one admission per layer call, only while no
other copy is in flight (an idle link; a copy also reads host DRAM, which the CPU experts need), for the CPU expert
with the most rows in the call, and only when the policy ranks it above the expert it would evict (offload's
CacheState.admit, which draws that victim from a sample of the cache). A slot becomes usable once its copy
has landed (its CUDA event has completed); until then its expert keeps running on the CPU.

The bookkeeping is offload's (CacheState, SlotPool, Copier), and the cached experts of a layer run through
offload's SlotExperts in one routed pass.
"""

from __future__ import annotations

from collections import Counter

import torch

from moeserve.offload.cache_state import CacheState
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH, SKIP
from moeserve.offload.slot_compute import SlotExperts
from moeserve.offload.slots import SlotPool
from moeserve.offload.store import ExpertStore
from moeserve.offload.transfer import Copier

NOT_CACHED = -1
VICTIM_SAMPLE = 32  # cached experts an admission compares itself with (CacheState.victim_sample)


class SlotCache:
    def __init__(self, store: ExpertStore, slots: int, policy: CachePolicy, layers: list[int], device,
                 dtype: torch.dtype, low: bool):
        """slots: experts the cache holds; layers: the CPU layers it serves; low: it holds the low-bit copies
        (else the float ones, in `dtype`)."""
        self.store, self.low = store, low
        # one tier: a cached copy serves every precision a request asks for
        self.state = CacheState(policy, slots, 0, victim_sample=VICTIM_SAMPLE)
        parts = store.part_shapes(low)
        parts = parts if low else [(shape, dtype) for shape, _ in parts]
        self.pool = SlotPool(slots, parts, device, store.quantized_modules if low else tuple)
        self.slots = SlotExperts([self.pool])
        self.copier = Copier(device)
        E = store.meta["num_experts"]
        self.ready = {layer: torch.full((E,), NOT_CACHED, dtype=torch.long) for layer in layers}  # [E] slot or -1
        self.pending: dict[tuple[int, int], int] = {}  # admitted, copy in flight: key -> slot
        self.admitted = 0
        self.bytes_copied = 0

    def where(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, k] (host) -> the slot holding each loaded expert, or NOT_CACHED."""
        self._poll()
        return self.ready[layer][expert_ids]  # [T, k]

    def _poll(self) -> None:
        """Copies that have landed make their slots usable."""
        for key, slot in list(self.pending.items()):
            event = self.pool.loaded[slot]
            if event is None or event.query():
                self.ready[key[0]][key[1]] = slot
                del self.pending[key]

    def account(self, layer: int, expert_ids: torch.Tensor, choice: torch.Tensor, on_cpu: torch.Tensor) -> None:
        """Count this call's uses with the policy, then maybe admit one of the experts the CPU ran.
        expert_ids, choice (HIGH / LOW / SKIP) and on_cpu [T, k], host. Plain Python over the few pairs of a decode
        step: cheaper than a chain of small torch ops on the host."""
        ids, choices, cpu = (t.reshape(-1).tolist() for t in (expert_ids, choice, on_cpu))
        self.state.start_event(0)
        precision: dict[int, int] = {}  # expert -> the highest precision asked of it (HIGH < LOW < SKIP)
        for e, c in zip(ids, choices):
            if c != SKIP:
                precision[e] = min(precision.get(e, c), c)
        needed = {(layer, e) for e in precision}
        for e in sorted(precision):
            self.state.request((layer, e), precision[e], needed, admit=False)
        if self.pending or not any(cpu):
            return  # the link is busy (or nothing missed)
        rows = Counter(e for e, on in zip(ids, cpu) if on)
        e = max(sorted(rows), key=rows.__getitem__)  # the CPU expert with the most rows (lowest id on ties)
        decision = self.state.admit((layer, e), HIGH, needed)
        if decision.keep:
            self._load((layer, e), decision.evicted)

    def _load(self, key: tuple[int, int], evicted: tuple[int, int] | None) -> None:
        if evicted is not None:
            self.ready[evicted[0]][evicted[1]] = NOT_CACHED
            self.pending.pop(evicted, None)
            self.pool.evict(evicted, deferred=False)  # the copy below waits for the last pass that read the slot
        slot = self.pool.take()
        self.pool.keep(key, slot)
        src = self.store.host_parts(key[0], key[1], self.low)
        self.copier.load(self.pool.load_parts(slot), src, self.pool.used[slot], self.pool.loaded[slot])
        self.pending[key] = slot
        self.admitted += 1
        self.bytes_copied += sum(t.nbytes for t in src)
