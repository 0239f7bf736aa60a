"""The offloaded expert backend: experts come from an ExpertCache (fast memory) filled from an
ExpertStore (slow memory), each selected expert in high or low precision or skipped (HOBBIT)."""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
import torch

from moeserve.model.experts import ExpertBackend
from moeserve.offload.cache_state import CacheState
from moeserve.offload.cooperative import CpuExperts, choose_cpu
from moeserve.offload.host_compute import CpuPairs
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH, LOW, SKIP, choose_precision
from moeserve.offload.simulate import SimResult
from moeserve.offload.slot_compute import SlotExperts
from moeserve.offload.slots import SlotPool
from moeserve.offload.store import ExpertStore, layer_experts
from moeserve.offload.transfer import Copier, measure_h2d_bandwidth
from moeserve.offload.trace import RoutingTrace


PREFETCH_WINDOW = 32  # recent prefetch outcomes the adaptive gate looks at
PREFETCH_PROBE_EVERY = 8  # while gated off, still prefetch at every 8th layer to notice better predictions


class ExpertCache:
    """Fast-memory expert slots (two pools), decisions by CacheState (as the simulator makes them), loads
    on a copy stream, and optionally the CPU computing some misses instead (cooperative mode).

    It also logs every request as a routing trace (in request order) and counts hits and misses the
    way simulate() does, so the two can be compared."""

    def __init__(self, store: ExpertStore, policy: CachePolicy, high_slots: int, low_slots: int, device, dtype,
                 mixed: bool = True, t1: float = 0.6, t2: float = 0.9, bits_high: int = 16, reserve: int = 2,
                 cooperative: bool = False, bandwidth: float | None = None, prefetch_min_accuracy: float = 0.5,
                 per_layer: bool = False):
        self.store = store
        self.state = CacheState(policy, high_slots, low_slots if mixed else 0, per_layer)
        high_parts = [(shape, dtype) for shape, _ in store.part_shapes(low=False)]
        self.pools = {HIGH: SlotPool(high_slots + reserve, high_parts, device, tuple),
                      LOW: SlotPool(low_slots + reserve if mixed else 0, store.part_shapes(low=True), device,
                                    store.quantized_modules)}
        if cooperative and bandwidth is None and torch.device(device).type == "cuda":
            bandwidth = measure_h2d_bandwidth(device)  # the cooperative choice weighs copies against CPU runs
        self.copier = Copier(device, bandwidth)
        self.cpu = CpuExperts(store) if cooperative else None
        self.mixed, self.t1, self.t2, self.bits_high = mixed, t1, t2, bits_high
        self.stats = SimResult()
        self.sequence = 0
        self.prefetched = self.prefetch_used = self.cpu_experts = 0
        self._unused_prefetches: set = set()
        self._outcomes: deque = deque(maxlen=PREFETCH_WINDOW)  # recent prefetches: used (True) or not
        self.prefetch_min_accuracy, self._gated_calls = prefetch_min_accuracy, 0
        self._streamed: list[tuple[int, int]] = []  # (tier, slot) loaded for one use, freed after the chunk
        self._log: list[tuple] = []

    @property
    def resident(self) -> dict[int, dict]:
        return {tier: pool.slot_of for tier, pool in self.pools.items()}

    def new_sequence(self) -> None:
        self.sequence += 1

    def precision(self, weights: torch.Tensor) -> torch.Tensor:
        if not self.mixed:
            return torch.full(weights.shape, HIGH, dtype=torch.long)
        return choose_precision(weights.cpu(), self.t1, self.t2)

    # ---- one request -------------------------------------------------------------------------------
    def serve(self, layer: int, e: int, precision: int, needed: set, rows: int, cpu_busy: float, flush):
        """Decide and start serving one request: ("gpu", tier, slot) or ("cpu", tier); `flush()` computes
        the work planned so far when a slot must be freed first."""
        key = (layer, e)
        cached = self.state.cached_tier(key, precision) is not None
        if key in self._unused_prefetches and cached:
            self._unused_prefetches.discard(key)
            self.prefetch_used += 1
            self._outcomes.append(True)
        low = precision != HIGH
        on_cpu = self.cpu is not None and not cached and self._cpu_is_faster(low, rows, cpu_busy)
        d = self.state.request(key, precision, needed, admit=not on_cpu)
        if on_cpu:
            self.stats.record(d, self._low_cost, 0, 0)
            self.cpu_experts += 1
            return ("cpu", d.tier)
        self.stats.record(d, self._low_cost, self.store.expert_bytes(False), self.store.expert_bytes(True))
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
        return self.store.meta["low_bits"] / self.bits_high

    def _load(self, key, tier: int, keep: bool, flush=None) -> int:
        pool = self.pools[tier]
        if not pool.free and flush is not None:
            flush()
        slot = pool.take()
        self.copier.load(pool.load_parts(slot), self.store.host_parts(key[0], key[1], tier == LOW), pool.used[slot],
                         pool.loaded[slot])
        if keep:
            pool.keep(key, slot)
        else:
            self._streamed.append((tier, slot))
        return slot

    def chunk_done(self) -> None:
        """The planned work was enqueued: streamed slots and deferred frees can be reused."""
        for tier, slot in self._streamed:
            self.pools[tier].release(slot)
        self._streamed = []
        for pool in self.pools.values():
            pool.release(None)

    def settle_prefetches(self, layer: int) -> None:
        """After `layer` ran: the experts predicted for it that it did not use were wrong guesses; they
        count against the prediction accuracy and may be evicted from now on."""
        wrong = {k for k in self._unused_prefetches if k[0] == layer}
        self._unused_prefetches -= wrong
        self.state.pinned -= wrong
        self._outcomes.extend([False] * len(wrong))

    def prefetch_worthwhile(self) -> bool:
        """Adaptive prefetch: a wrong guess costs link time that demand loads need, so prefetch while at least
        `prefetch_min_accuracy` of the recent guesses were used; otherwise probe at every 8th layer only."""
        n = len(self._outcomes)
        if n < PREFETCH_PROBE_EVERY or sum(self._outcomes) >= self.prefetch_min_accuracy * n:
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
            self._unused_prefetches.add(key)
            self.stats.bytes_moved += self.store.expert_bytes(tier == LOW)

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


class OffloadedExperts(ExpertBackend):
    """Serves each token's experts through the cache, in token order (as the simulator replays them),
    then computes them: GPU experts over their slots in one routed pass, CPU ones on the host meanwhile."""

    def __init__(self, layer: int, num_experts: int, top_k: int, cache: ExpertCache,
                 next_layers: list[int] = (), next_gates: torch.Tensor | None = None):
        super().__init__()
        self.layer, self.num_experts, self.top_k, self.cache = layer, num_experts, top_k, cache
        self.slots = SlotExperts([cache.pools[HIGH], cache.pools[LOW]], cache.store.act)  # virtual ids: high, then low
        self.next_layers = list(next_layers)
        self.next_gates = next_gates  # [sum of their E, D]: the routers of the next n MoE layers, stacked
        self.next_counts = [layer_experts(cache.store.meta, j) for j in self.next_layers]

    def predict_next(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """Experts the next layers' routers would pick for this layer's gate input (one stacked matmul)."""
        if not self.next_layers:
            return []
        logits = (x @ self.next_gates.T).split(self.next_counts, dim=-1)  # n x [T, E of that layer]
        picks = [part.topk(self.top_k, dim=-1).indices.tolist() for part in logits]  # n x [T, k]
        return list(dict.fromkeys((self.next_layers[j], e) for t in range(x.shape[0])
                                  for j in range(len(picks)) for e in picks[j][t]))

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "offload"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        prec = cache.precision(expert_weights)  # [T, k]
        ids_l, w_l, p_l = expert_ids.tolist(), expert_weights.float().tolist(), prec.tolist()
        rows = Counter(e for ids in ids_l for e in ids)  # tokens per expert, for the CPU cost
        out = torch.zeros_like(x)  # [T, D]
        planned: list[tuple] = []  # (token, k-slot, expert, gate weight, source)
        cpu_busy = 0.0

        def flush():
            nonlocal planned, cpu_busy
            self._compute(x, expert_weights, planned, out)
            planned, cpu_busy = [], 0.0
            cache.chunk_done()

        for t, (ids, w, p) in enumerate(zip(ids_l, w_l, p_l)):
            cache.log(self.layer, ids, w)
            needed = {(self.layer, e) for e in ids}
            for j, (e, pj) in enumerate(zip(ids, p)):
                if pj == SKIP:
                    cache.stats.skipped += 1
                    continue
                source = cache.serve(self.layer, e, pj, needed, rows[e], cpu_busy, flush)
                if source[0] == "cpu":
                    cpu_busy += cache.cpu.cost(source[1] == LOW, rows[e])
                planned.append((t, j, e, w[j], source))
        flush()
        cache.settle_prefetches(self.layer)
        if self.next_layers:
            cache.prefetch(self.predict_next(x), needed={(self.layer, e) for e in expert_ids.flatten().tolist()})
        return out

    def _compute(self, x, expert_weights, planned, out) -> None:
        """Add the planned (token, k-slot) contributions to out [T, D]: the CPU's rows as one layer call
        (HostExperts.run_layer), the slots' in one routed pass (SlotExperts)."""
        on_cpu = [p for p in planned if p[4][0] == "cpu"]
        on_gpu = [p for p in planned if p[4][0] == "gpu"]
        if on_cpu:  # read the rows before queueing GPU work behind the copies
            x_host = x.cpu()  # [T, D]
            ids, mask, low = (torch.zeros(expert_weights.shape, dtype=dt) for dt in (torch.long, torch.bool, torch.bool))
            for t, j, e, _, (_, tier) in on_cpu:
                ids[t, j], mask[t, j], low[t, j] = e, True, tier == LOW
            work = CpuPairs(ids, expert_weights.cpu(), mask, low)  # [T, k] each
        if on_gpu:
            virtual = torch.full(expert_weights.shape, self.slots.none, dtype=torch.long)  # [T, k]
            for t, j, _, _, (_, tier, slot) in on_gpu:
                virtual[t, j] = self.slots.virtual(tier, slot)
            out += self.slots.compute(x, expert_weights, virtual)
        if on_cpu:
            out += self.cache.cpu.run_layer(self.layer, x_host, work).to(x.device)


def enable_offload(model, store: ExpertStore, *, high_slots: int, low_slots: int = 0, policy: str = "hobbit",
                   weights: tuple | None = None, mixed: bool = True, t1: float = 0.6, t2: float = 0.9,
                   prefetch_layers: int = 0, cooperative: bool = False, pin: bool = True,
                   bandwidth: float | None = None, prefetch_min_accuracy: float = 0.5,
                   per_layer: bool = False) -> ExpertCache:
    """Replace every MoE layer's experts by OffloadedExperts sharing one cache; returns the cache.

    high_slots / low_slots are the cache's capacities; each pool gets top_k more slots for experts used
    once and for frees deferred while a chunk is in flight (budget.plan_slots counts them).
    prefetch_layers = n > 0: each layer applies the next n MoE layers' routers (stacked) to its own gate
    input and prefetches the experts they would pick (HOBBIT's adaptive prefetch), while at least
    prefetch_min_accuracy of the recent predictions are used (0: always). per_layer: each layer gets its own
    share of the slots (mixtral-offloading's per-layer caches) instead of one pool. cooperative: misses
    may run on the CPU when that is faster than copying them. pin: on a GPU, page-lock the store first."""
    if pin and model.device.type == "cuda":
        store.pin(progress=True)
    cache = ExpertCache(store, CachePolicy.named(policy, model.spec.num_layers, weights), high_slots, low_slots,
                        model.device, model.dtype, mixed, t1, t2, reserve=model.spec.moe.top_k,
                        cooperative=cooperative, bandwidth=bandwidth, prefetch_min_accuracy=prefetch_min_accuracy,
                        per_layer=per_layer)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    for n, i in enumerate(moe):
        following = moe[n + 1:n + 1 + prefetch_layers]
        gates = (torch.cat([model.model.layers[j].mlp.gate.weight for j in following]).detach()
                 if following else None)
        model.model.layers[i].mlp.experts = OffloadedExperts(i, model.spec.moe.experts_at(i), model.spec.moe.top_k,
                                                             cache, following, gates)
    return cache
