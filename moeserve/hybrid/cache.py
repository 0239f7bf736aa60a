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

Under the device link (hybrid/link.py; low-bit slots the Triton kernels read) the host sees no layer call of a
decode step, which is one CUDA graph. The cache then lives on the device too (DeviceView): each linked call looks its
experts up in a slot map [CPU layers, E], counts their uses, sends the missed ones to the CPU and computes the hits
in one pass (SlotExperts.device_pass). Between steps (the model's step hook) the host reads the counts, keeps them
decayed (DECAY), and decides: while slots are free it queues copies of the most used uncached experts (FILL_BYTES a
step); when full, and no copy is in flight, it replaces the least used cached expert by the most used uncached one when
that one leads by SWAP_MARGIN uses (a frequency policy: the other policies rank by per-call Python the graph does
not run). A slot joins the map once its copy has landed; an evicted expert leaves the map before its slot is
overwritten, and the copy waits for every replay enqueued before. Prompts (the host path) add their uses too, so
the slots fill with the prompt's experts before the first decode step.
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
DECAY = 0.95  # linked: the use counts keep 95% a step (about the last 20 steps weigh)
FILL_BYTES = 256 << 20  # linked: expert bytes a step queues while slots are free
SWAP_MARGIN = 1.0  # linked: decayed uses by which an uncached expert must lead the coldest cached one to replace it


class DeviceView:
    """The linked cache as the device reads it: the slot map and this step's use counts, [CPU layers, E] each, and
    the decayed counts the host keeps."""

    def __init__(self, layers: int, experts: int, max_pairs: int, device):
        self.map = torch.full((layers, experts), NOT_CACHED, dtype=torch.long, device=device)
        self.uses = torch.zeros(layers, experts, device=device)  # float32: counted by the linked calls
        self.ones = torch.ones(max_pairs, device=device)  # [P] what each pair adds
        self.freq = torch.zeros(layers, experts)  # host float32: decayed uses


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
        self.slots = SlotExperts([self.pool], store.act)
        self.copier = Copier(device)
        E = store.meta["num_experts"]
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.map = torch.full((len(layers), E), NOT_CACHED, dtype=torch.long)  # [L, E] loaded slot, or -1
        self.ready = {layer: self.map[i] for i, layer in enumerate(layers)}  # [E] views of the map
        self.pending: dict[tuple[int, int], int] = {}  # admitted, copy in flight: key -> slot
        self.expert_bytes = store.expert_bytes(low)
        self.device = torch.device(device)
        self.dev: DeviceView | None = None  # set by link(): the cache as the device reads it
        self.admitted = 0
        self.bytes_copied = 0

    def where(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, k] (host) -> the slot holding each loaded expert, or NOT_CACHED."""
        if self._poll() and self.dev is not None:
            self._push()
        return self.ready[layer][expert_ids]  # [T, k]

    def _poll(self) -> bool:
        """Copies that have landed make their slots usable; whether any did."""
        landed = False
        for key, slot in list(self.pending.items()):
            event = self.pool.loaded[slot]
            if event is None or event.query():
                self.ready[key[0]][key[1]] = slot
                del self.pending[key]
                landed = True
        return landed

    # ---- the linked cache (device link): looked up and counted on the device, kept between steps -------------

    def device_serves(self, x: torch.Tensor, tokens: int) -> bool:
        """Whether linked_pass can compute the slots for `tokens` rows like x (low-bit slots, Triton)."""
        return self.slots.triton_reads(0, x, tokens)

    def link(self, max_pairs: int) -> None:
        """From now on the device looks the cache up (device_slots) and maintain() keeps it, between steps."""
        self.dev = DeviceView(len(self.layers), self.map.shape[1], max_pairs, self.device)
        self._push()

    def device_slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, k] on the device -> [T, k] the slot of each cached expert or NOT_CACHED, on the device;
        their uses are counted there. Capturable."""
        r = self.row[layer]
        flat = expert_ids.reshape(-1)  # [T*k]
        self.dev.uses[r].index_add_(0, flat, self.dev.ones[:flat.numel()])
        return self.dev.map[r][expert_ids]

    def linked_pass(self, x: torch.Tensor, expert_weights: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """x [T, D], expert_weights [T, k], slot [T, k] (device_slots) -> [T, D]: the cached pairs' weighted sum.
        A missed pair computes a hit's slot of its token (one token: read again from L2) with weight zero."""
        kept = slot >= 0  # [T, k]
        slots = torch.where(kept, slot, slot.amax(1, keepdim=True).clamp_min(0))  # [T, k] each in range
        return self.slots.device_pass(0, x, expert_weights, slots, kept)

    def maintain(self) -> None:
        """Between two steps: this step's counts into the decayed ones, landed copies into the map, then at most
        one round of admissions (none while a copy is in flight once the slots are full)."""
        uses = self.dev.uses.to("cpu", copy=True)  # [L, E]: waits for the step (the sampling waited already)
        self.dev.uses.zero_()
        self.dev.freq.mul_(DECAY).add_(uses)
        changed = self._poll()
        if self.pool.free:
            self._fill()
        elif not self.pending:
            self._swap()
        if changed:
            self._push()

    def _fill(self) -> None:
        """Queue copies of the most used uncached experts into the free slots (FILL_BYTES at most)."""
        n = min(len(self.pool.free), max(1, FILL_BYTES // max(self.expert_bytes, 1)))
        score = torch.where(self._held(), 0.0, self.dev.freq).reshape(-1)  # [L*E]
        values, flat = score.topk(min(n, score.numel()))
        for value, i in zip(values.tolist(), flat.tolist()):
            if value <= 0:
                break
            self._load(self._key(i), None)

    def _swap(self) -> None:
        """Replace the least used cached expert by the most used uncached one if it leads by SWAP_MARGIN."""
        uncached = torch.where(self._held(), float("-inf"), self.dev.freq).reshape(-1)  # [L*E]
        cached = torch.where(self.map >= 0, self.dev.freq, float("inf")).reshape(-1)  # [L*E]
        best, coldest = int(uncached.argmax()), int(cached.argmin())
        if uncached[best] > cached[coldest] + SWAP_MARGIN:
            self._load(self._key(best), self._key(coldest))

    def _held(self) -> torch.Tensor:
        """[L, E] bool: in a slot or on its way there."""
        held = self.map >= 0
        for layer, e in self.pending:
            held[self.row[layer], e] = True
        return held

    def _key(self, flat: int) -> tuple[int, int]:
        r, e = divmod(flat, self.map.shape[1])
        return self.layers[r], e

    def _push(self) -> None:
        """The host's map to the device, on the current stream (the next step reads it)."""
        self.dev.map.copy_(self.map)

    def account(self, layer: int, expert_ids: torch.Tensor, choice: torch.Tensor, on_cpu: torch.Tensor) -> None:
        """Count this call's uses with the policy, then maybe admit one of the experts the CPU ran.
        expert_ids, choice (HIGH / LOW / SKIP) and on_cpu [T, k], host. Plain Python over the few pairs of a decode
        step: cheaper than a chain of small torch ops on the host."""
        if self.dev is not None:  # linked: maintain() decides, between steps, from these uses too
            flat = expert_ids.reshape(-1)
            self.dev.freq[self.row[layer]].index_add_(0, flat, torch.ones(flat.numel()))
            return
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
        after = self.pool.used[slot]
        if self.dev is not None:  # graphs read the slot through the device's map: drop it there first, and wait
            if evicted is not None:  # for every replay enqueued so far
                self._push()
            if self.device.type == "cuda":
                after = torch.cuda.Event()
                after.record()
        src = self.store.host_parts(key[0], key[1], self.low)
        self.copier.load(self.pool.load_parts(slot), src, after, self.pool.loaded[slot])
        self.pending[key] = slot
        self.admitted += 1
        self.bytes_copied += sum(t.nbytes for t in src)
