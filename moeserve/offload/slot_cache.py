"""The slot cache of the host-resident expert backends: fast-memory slots over an ExpertStore, in one or two
precisions, filled on the Copier, with admissions and evictions decided by CacheState.

Offload (`--offload`) and hybrid (`--cpu-moe`, `--n-cpu-moe`) are two miss policies of this one cache (Miss):
  COPY    a missed expert is copied into a slot and the computation waits for that copy on the device (offload;
          HOBBIT's high / low tiers, prefetch of predicted experts, every request in token order so that
          simulate() replays the same decisions);
  CHOOSE  a missed expert is copied in or computed on the CPU, whichever finishes first by a measured cost
          (offload's cooperative mode; choose_cpu);
  CPU     a missed expert runs on the CPU this time (no copy waits on the link) and may be copied in the
          background (hybrid): at most one admission per layer call, only while no other copy is in flight (an
          idle link; a copy also reads host DRAM, which the CPU experts need), for the CPU expert with the most rows
          in the call, and only when the policy ranks it above the expert it would evict (CacheState.admit, which
          draws that victim from a sample of the cache). A slot is used once its copy has landed (its CUDA event has
          completed: the landed map, `where`); until then its expert keeps running on the CPU.

Each tier (Tier) holds the store's float copies (in the model dtype) or its low-bit copies; the cached experts of a
call run over the tiers' slots in one routed pass (SlotExperts, `slots`).

Under hybrid's device link (hybrid/link.py; low-bit slots the Triton kernels read) the host sees no layer call of a
decode step, which is one CUDA graph. The cache then lives on the device too (DeviceView): each linked call looks its
experts up in a slot map [cached layers, E], counts their uses, sends the missed ones to the CPU and computes the hits
in one pass (SlotExperts.device_pass). Between steps (the model's step hook) the host reads the counts, keeps them
decayed (DECAY), and decides: while slots are free it queues copies of the most used uncached experts (FILL_BYTES a
step); when full, and no copy is in flight, it replaces the least used cached expert by the most used uncached one when
that one leads by SWAP_MARGIN uses (a frequency policy: the other policies rank by per-call Python the graph does not
run). A slot joins the map once its copy has landed; an evicted expert leaves the map before its slot is overwritten,
and the copy waits for every replay enqueued before. Prompts (the host path) add their uses too, so the slots fill
with the prompt's experts before the first decode step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from moeserve.offload.cache_state import CacheState, Key
from moeserve.offload.cooperative import CpuExperts, choose_cpu
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH, LOW, SKIP, choose_precision
from moeserve.offload.simulate import SimResult
from moeserve.offload.slot_compute import SlotExperts
from moeserve.offload.slots import SlotPool
from moeserve.offload.store import ExpertStore
from moeserve.offload.trace import RoutingTrace
from moeserve.offload.transfer import Copier, measure_h2d_bandwidth

NOT_CACHED = -1
PREFETCH_WINDOW = 32  # recent prefetch outcomes the adaptive gate looks at
PREFETCH_PROBE_EVERY = 8  # while gated off, still prefetch at every 8th layer to notice better predictions
DECAY = 0.95  # linked: the use counts keep 95% a step (about the last 20 steps weigh)
FILL_BYTES = 256 << 20  # linked: expert bytes a step queues while slots are free
SWAP_MARGIN = 1.0  # linked: decayed uses by which an uncached expert must lead the coldest cached one to replace it


class Miss(Enum):
    """What a request for an expert that is not in a slot does (the module docstring)."""

    COPY = "copy"
    CHOOSE = "choose"
    CPU = "cpu"


@dataclass(frozen=True)
class Tier:
    """One precision's slots: `slots` experts kept (CacheState's capacity), `reserve` more for experts used once
    (streamed) and frees deferred while a chunk is in flight; low: they hold the store's low-bit copies (else its
    float ones, in the model dtype)."""

    slots: int
    low: bool
    reserve: int = 0


@dataclass(frozen=True)
class CacheSettings:
    """tiers: HIGH's, then LOW's (a cached HIGH copy serves every precision); per_layer: each layer gets an even share
    of the slots (mixtral-offloading's per-layer caches); victim_sample: CacheState's; mixed, t1, t2: HOBBIT's
    precision rule for the requests (precision()); bits_high: a high miss's bits (the miss penalty's unit);
    prefetch_min_accuracy: the adaptive prefetch gate; bandwidth: host->device bytes/s for CHOOSE's cost (measured
    on a GPU when None); layers: the layers whose landed slots the map holds (Miss.CPU, and the device view)."""

    tiers: tuple[Tier, ...]
    miss: Miss = Miss.COPY
    per_layer: bool = False
    victim_sample: int | None = None
    mixed: bool = False
    t1: float = 0.6
    t2: float = 0.9
    bits_high: int = 16
    prefetch_min_accuracy: float = 0.5
    bandwidth: float | None = None
    layers: tuple[int, ...] = ()


class DeviceView:
    """The linked cache as the device reads it: the slot map and this step's use counts, [layers, E] each, and the
    decayed counts the host keeps."""

    def __init__(self, layers: int, experts: int, max_pairs: int, device):
        self.map = torch.full((layers, experts), NOT_CACHED, dtype=torch.long, device=device)
        self.uses = torch.zeros(layers, experts, device=device)  # float32: counted by the linked calls
        self.ones = torch.ones(max_pairs, device=device)  # [P] what each pair adds
        self.freq = torch.zeros(layers, experts)  # host float32: decayed uses


class SlotCache:
    def __init__(self, store: ExpertStore, policy: CachePolicy, settings: CacheSettings, device, dtype: torch.dtype):
        tiers = settings.tiers
        if settings.miss is Miss.CPU and len(tiers) != 1:
            raise ValueError(f"a slot cache whose misses run on the CPU has one tier, got {len(tiers)}")
        self.store, self.settings = store, settings
        self.state = CacheState(policy, tiers[HIGH].slots, tiers[LOW].slots if len(tiers) > LOW else 0,
                                settings.per_layer, settings.victim_sample)
        self.pools = [SlotPool(t.slots + t.reserve, store.slot_parts(t.low, dtype), device, store.slot_weights(t.low))
                      for t in tiers]
        self.slots = SlotExperts(self.pools, store.act)  # virtual ids: HIGH's slots, then LOW's
        self.tier_bytes = [store.expert_bytes(t.low) for t in tiers]
        self.device = torch.device(device)
        bandwidth = settings.bandwidth
        if settings.miss is Miss.CHOOSE and bandwidth is None and self.device.type == "cuda":
            bandwidth = measure_h2d_bandwidth(device)  # the choice weighs copies against CPU runs
        self.copier = Copier(device, bandwidth)
        self.cpu = CpuExperts(store) if settings.miss is Miss.CHOOSE else None
        self.stats = SimResult()
        self.sequence = 0
        self.admitted = self.bytes_copied = 0  # background admissions (Miss.CPU) and the bytes they copied
        self.prefetched = self.prefetch_used = self.cpu_experts = 0
        self.unused_prefetches: set[Key] = set()  # prefetched, not used yet
        self._outcomes: deque = deque(maxlen=PREFETCH_WINDOW)  # recent prefetches: used (True) or not
        self._gated_calls = 0
        self._streamed: list[tuple[int, int]] = []  # (tier, slot) loaded for one use, freed after the chunk
        self._log: list[tuple] = []
        # the landed map (Miss.CPU): [layers, E] the slot of each expert whose copy has landed, or NOT_CACHED
        self.layers = list(settings.layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.map = torch.full((len(self.layers), store.meta["num_experts"]), NOT_CACHED, dtype=torch.long)
        self.ready = {layer: self.map[i] for i, layer in enumerate(self.layers)}  # [E] views of the map
        self.pending: dict[Key, int] = {}  # admitted, copy in flight: key -> slot
        self.dev: DeviceView | None = None  # set by link(): the cache as the device reads it

    @property
    def pool(self) -> SlotPool:
        """HIGH's pool: the one pool of a one-tier cache."""
        return self.pools[HIGH]

    @property
    def resident(self) -> dict[int, dict]:
        return {tier: pool.slot_of for tier, pool in enumerate(self.pools)}

    def new_sequence(self) -> None:
        self.sequence += 1

    def precision(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [T, k] -> [T, k] the precision each request asks for: HOBBIT's rule with mixed, else HIGH."""
        if not self.settings.mixed:
            return torch.full(weights.shape, HIGH, dtype=torch.long)
        return choose_precision(weights.cpu(), self.settings.t1, self.settings.t2)

    # ---- requests in token order (Miss.COPY, Miss.CHOOSE) ---------------------------------------------------------
    def serve(self, layer: int, e: int, precision: int, needed: set, rows: int, cpu_busy: float, flush):
        """Decide and start serving one request: ("gpu", tier, slot) or ("cpu", tier); `flush()` computes
        the work planned so far when a slot must be freed first."""
        key = (layer, e)
        cached = self.state.cached_tier(key, precision) is not None
        if key in self.unused_prefetches and cached:
            self.unused_prefetches.discard(key)
            self.prefetch_used += 1
            self._outcomes.append(True)
        on_cpu = self.cpu is not None and not cached and self._cpu_is_faster(precision != HIGH, rows, cpu_busy)
        d = self.state.request(key, precision, needed, admit=not on_cpu)
        if on_cpu:
            self.stats.record(d, self._low_cost, 0, 0)
            self.cpu_experts += 1
            return ("cpu", d.tier)
        self.stats.record(d, self._low_cost, *self.tier_bytes)
        pool = self.pools[d.tier]
        if d.hit:
            return ("gpu", d.tier, pool.slot_of[key])
        if d.evicted is not None:
            pool.evict(d.evicted, deferred=True)
        return ("gpu", d.tier, self._load(key, d.tier, d.keep, flush))

    def _cpu_is_faster(self, low: bool, rows: int, cpu_busy: float) -> bool:
        """Only with a GPU fast tier: on a CPU machine a copy into RAM slots costs no more than a CPU run."""
        return self.copier.cuda and choose_cpu(self.cpu, low, rows, cpu_busy, self.copier.backlog(),
                                               self.store.expert_bytes(low), self.copier.bandwidth)

    @property
    def _low_cost(self) -> float:
        return self.store.meta["low_bits"] / self.settings.bits_high

    def _load(self, key: Key, tier: int, keep: bool, flush=None) -> int:
        """A slot of `tier` with key's copy on its way (the computation waits for it: SlotExperts)."""
        pool = self.pools[tier]
        if not pool.free and flush is not None:
            flush()
        slot = pool.take()
        self._copy_in(key, tier, slot, pool.used[slot])
        if keep:
            pool.keep(key, slot)
        else:
            self._streamed.append((tier, slot))
        return slot

    def _copy_in(self, key: Key, tier: int, slot: int, after) -> None:
        """Copy key's store copy at tier's precision into the slot, after event `after`."""
        pool = self.pools[tier]
        src = self.store.host_parts(key[0], key[1], self.settings.tiers[tier].low)
        self.copier.load(pool.load_parts(slot), src, after, pool.loaded[slot])

    def chunk_done(self) -> None:
        """The planned work was enqueued: streamed slots and deferred frees can be reused."""
        for tier, slot in self._streamed:
            self.pools[tier].release(slot)
        self._streamed = []
        for pool in self.pools:
            pool.release(None)

    def settle_prefetches(self, layer: int) -> None:
        """After `layer` ran: the experts predicted for it that it did not use were wrong guesses; they
        count against the prediction accuracy and may be evicted from now on."""
        wrong = {k for k in self.unused_prefetches if k[0] == layer}
        self.unused_prefetches -= wrong
        self.state.pinned -= wrong
        self._outcomes.extend([False] * len(wrong))

    def prefetch_worthwhile(self) -> bool:
        """Adaptive prefetch: a wrong guess costs link time that demand loads need, so prefetch while at least
        `prefetch_min_accuracy` of the recent guesses were used; otherwise probe at every 8th layer only."""
        n = len(self._outcomes)
        if n < PREFETCH_PROBE_EVERY or sum(self._outcomes) >= self.settings.prefetch_min_accuracy * n:
            return True
        self._gated_calls += 1
        return self._gated_calls % PREFETCH_PROBE_EVERY == 0

    def prefetch(self, keys: list, needed: set) -> None:
        """Load predicted experts ahead of use, in low precision when there are low slots (a wrong guess
        then costs less), and keep them from eviction until their layer has run."""
        if not keys or not self.prefetch_worthwhile():
            return
        tier = LOW if self.state.capacity[LOW] > 0 else HIGH
        for key in keys:  # after chunk_done, an admission always finds a free slot (the reserve)
            d = self.state.prefetch(key, tier, needed)
            if d is None or not d.keep:
                continue
            if d.evicted is not None:
                self.pools[tier].evict(d.evicted, deferred=False)
            self._load(key, tier, keep=True)
            self.prefetched += 1
            self.unused_prefetches.add(key)
            self.stats.bytes_moved += self.tier_bytes[tier]

    def log(self, layer: int, ids: list[int], weights: list[float]) -> None:
        self.state.start_event(self.sequence)
        self._log.append((self.sequence, layer, ids, weights))

    def trace(self, num_layers: int, num_experts: int) -> RoutingTrace:
        """The requests so far, as a routing trace (replayable by simulate())."""
        seq, layer, ids, w = zip(*self._log)
        return RoutingTrace(np.asarray(seq, np.int32), np.asarray(layer, np.int16), np.asarray(ids, np.int16),
                            np.asarray(w, np.float32), num_layers, num_experts)

    def summary(self) -> dict:
        st = self.stats
        return {**st.as_dict(), "high_slots": self.state.capacity[HIGH], "low_slots": self.state.capacity[LOW],
                "policy": self.state.policy.name, "prefetched": self.prefetched,
                "prefetch_accuracy": self.prefetch_used / max(self.prefetched, 1), "cpu_experts": self.cpu_experts}

    # ---- misses on the CPU, admissions in the background (Miss.CPU) -----------------------------------------------
    def where(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, k] (host) -> the slot holding each landed expert, or NOT_CACHED."""
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
            self._admit((layer, e), decision.evicted)

    def _admit(self, key: Key, evicted: Key | None) -> None:
        """A background copy of key into HIGH's pool (replacing `evicted`); its slot joins the map once landed."""
        pool = self.pool
        if evicted is not None:
            self.ready[evicted[0]][evicted[1]] = NOT_CACHED
            self.pending.pop(evicted, None)
            pool.evict(evicted, deferred=False)  # the copy below waits for the last pass that read the slot
        slot = pool.take()
        pool.keep(key, slot)
        after = pool.used[slot]
        if self.dev is not None:  # graphs read the slot through the device's map: drop it there first, and wait
            if evicted is not None:  # for every replay enqueued so far
                self._push()
            if self.device.type == "cuda":
                after = torch.cuda.Event()
                after.record()
        self._copy_in(key, HIGH, slot, after)
        self.pending[key] = slot
        self.admitted += 1
        self.bytes_copied += self.tier_bytes[HIGH]

    # ---- the linked cache (hybrid's device link): looked up and counted on the device, kept between steps ---------
    def device_serves(self, x: torch.Tensor, tokens: int) -> bool:
        """Whether linked_pass can compute the slots for `tokens` rows like x (low-bit or MXFP4 slots, Triton)."""
        return self.slots.triton_reads(HIGH, x, tokens)

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
        return self.slots.device_pass(HIGH, x, expert_weights, slots, kept)

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
        n = min(len(self.pool.free), max(1, FILL_BYTES // max(self.tier_bytes[HIGH], 1)))
        score = torch.where(self._held(), 0.0, self.dev.freq).reshape(-1)  # [L*E]
        values, flat = score.topk(min(n, score.numel()))
        for value, i in zip(values.tolist(), flat.tolist()):
            if value <= 0:
                break
            self._admit(self._key(i), None)

    def _swap(self) -> None:
        """Replace the least used cached expert by the most used uncached one if it leads by SWAP_MARGIN."""
        uncached = torch.where(self._held(), float("-inf"), self.dev.freq).reshape(-1)  # [L*E]
        cached = torch.where(self.map >= 0, self.dev.freq, float("inf")).reshape(-1)  # [L*E]
        best, coldest = int(uncached.argmax()), int(cached.argmin())
        if uncached[best] > cached[coldest] + SWAP_MARGIN:
            self._admit(self._key(best), self._key(coldest))

    def _held(self) -> torch.Tensor:
        """[L, E] bool: in a slot or on its way there."""
        held = self.map >= 0
        for layer, e in self.pending:
            held[self.row[layer], e] = True
        return held

    def _key(self, flat: int) -> Key:
        r, e = divmod(flat, self.map.shape[1])
        return self.layers[r], e

    def _push(self) -> None:
        """The host's map to the device, on the current stream (the next step reads it)."""
        self.dev.map.copy_(self.map)
