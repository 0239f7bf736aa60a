"""The offloaded expert backend: experts come from an ExpertCache (fast memory) filled from an
ExpertStore (slow memory), each selected expert in high or low precision or skipped (HOBBIT)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moeserve.kernels.routing import build_routing_table, combine
from moeserve.model.experts import LoopedExperts, swiglu
from moeserve.offload.cache_state import CacheState
from moeserve.offload.policies import Policy
from moeserve.offload.precision import HIGH, LOW, SKIP, choose_precision
from moeserve.offload.simulate import SimResult
from moeserve.offload.store import ExpertStore
from moeserve.offload.trace import RoutingTrace


class ExpertCache:
    """Fast-memory copies of experts, two pools, decisions by CacheState (as the simulator makes them).

    It also logs every request as a routing trace (in request order) and counts hits and misses the
    way simulate() does, so the two can be compared."""

    def __init__(self, store: ExpertStore, policy: Policy, high_slots: int, low_slots: int, device, dtype,
                 mixed: bool = True, t1: float = 0.6, t2: float = 0.9, bits_high: int = 16):
        self.store, self.device, self.dtype = store, device, dtype
        self.state = CacheState(policy, high_slots, low_slots)
        self.resident = {HIGH: {}, LOW: {}}
        self.mixed, self.t1, self.t2, self.bits_high = mixed, t1, t2, bits_high
        self.stats = SimResult()
        self.sequence = 0
        self.prefetched = 0
        self._log: list[tuple] = []

    def new_sequence(self) -> None:
        self.sequence += 1

    def precision(self, weights: torch.Tensor) -> torch.Tensor:
        if not self.mixed:
            return torch.full(weights.shape, HIGH, dtype=torch.long)
        return choose_precision(weights.cpu(), self.t1, self.t2)

    def fetch_token(self, layer: int, ids: list[int], weights: list[float], precision: list[int]) -> dict:
        """One token at one layer: request its experts; returns (expert, requested tier) -> weights."""
        self.state.start_event(self.sequence)
        self._log.append((self.sequence, layer, ids, weights))
        needed = {(layer, e) for e in ids}
        out = {}
        for e, p in zip(ids, precision):
            if p == SKIP:
                self.stats.skipped += 1
                continue
            key = (layer, e)
            d = self.state.request(key, p, needed)
            self.stats.record(d, self.store.meta["low_bits"] / self.bits_high, self.store.expert_bytes(False),
                              self.store.expert_bytes(True))
            if d.hit:
                out[(e, p)] = self.resident[d.tier][key]
                continue
            w = self.store.load(layer, e, d.tier == LOW, self.device, self.dtype)
            self._place(key, d, w)
            out[(e, p)] = w
        return out

    def _place(self, key, decision, weights) -> None:
        if decision.evicted is not None:
            del self.resident[decision.tier][decision.evicted]
        if decision.keep:
            self.resident[decision.tier][key] = weights

    def prefetch(self, keys: list, needed: set) -> None:
        """Load predicted experts ahead of use, in low precision when there are low slots (a wrong guess
        then costs less), and keep them from eviction until used."""
        tier = LOW if self.state.capacity[LOW] > 0 else HIGH
        for key in keys:
            d = self.state.prefetch(key, tier, needed)
            if d is not None and d.keep:
                self._place(key, d, self.store.load(key[0], key[1], tier == LOW, self.device, self.dtype))
                self.prefetched += 1
                self.stats.bytes_moved += self.store.expert_bytes(tier == LOW)

    def trace(self, num_layers: int, num_experts: int) -> RoutingTrace:
        """The requests so far, as a routing trace (replayable by simulate())."""
        seq, layer, ids, w = zip(*self._log)
        return RoutingTrace(np.asarray(seq, np.int32), np.asarray(layer, np.int16), np.asarray(ids, np.int16),
                            np.asarray(w, np.float32), num_layers, num_experts)


class OffloadedExperts(LoopedExperts):
    def __init__(self, layer: int, num_experts: int, top_k: int, cache: ExpertCache,
                 next_layers: list[int] = (), next_gates: torch.Tensor | None = None):
        super().__init__()
        self.layer, self.num_experts, self.top_k, self.cache = layer, num_experts, top_k, cache
        self.next_layers = list(next_layers)
        self.next_gates = next_gates  # [n * E, D]: the routers of the next n MoE layers, stacked
        self._weights: dict = {}

    def predict_next(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """Experts the next layers' routers would pick for this layer's gate input (one stacked matmul)."""
        if not self.next_layers:
            return []
        logits = (x @ self.next_gates.T).reshape(x.shape[0], len(self.next_layers), self.num_experts)  # [T, n, E]
        picks = logits.topk(self.top_k, dim=-1).indices  # [T, n, k]
        return list(dict.fromkeys((self.next_layers[j], int(e)) for t in picks.tolist()
                                  for j, row in enumerate(t) for e in row))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        prec = self.cache.precision(expert_weights)  # [T, k]
        ids_l, w_l, p_l = expert_ids.tolist(), expert_weights.float().tolist(), prec.tolist()
        self._weights = {}
        for ids, w, p in zip(ids_l, w_l, p_l):  # token by token, as the simulator replays them
            self._weights.update(self.cache.fetch_token(self.layer, ids, w, p))
        if self.next_layers:
            self.cache.prefetch(self.predict_next(x), needed={(self.layer, e) for e in expert_ids.flatten().tolist()})
        E = self.num_experts
        prec = prec.to(expert_ids.device)
        virtual = torch.where(prec == SKIP, 2 * E, expert_ids * 2 + (prec == LOW))  # [T, k]: (expert, tier) ids
        weights = expert_weights.masked_fill(prec == SKIP, 0)
        table = build_routing_table(virtual, weights, 2 * E + 1)
        return combine(self.run_sorted(x[table.token_ids], table), table, x.shape[0], x.dtype)

    def expert_ffn(self, v: int, rows: torch.Tensor) -> torch.Tensor:
        if v == 2 * self.num_experts:  # skipped experts
            return torch.zeros_like(rows)
        gate_up, down = self._weights[(v // 2, LOW if v % 2 else HIGH)]
        if isinstance(gate_up, torch.Tensor):
            return F.linear(swiglu(F.linear(rows, gate_up)), down)
        return down(swiglu(gate_up(rows)))


def enable_offload(model, store: ExpertStore, *, high_slots: int, low_slots: int = 0, policy: str = "hobbit",
                   weights: tuple | None = None, mixed: bool = True, t1: float = 0.6, t2: float = 0.9,
                   prefetch_layers: int = 0) -> ExpertCache:
    """Replace every MoE layer's experts by OffloadedExperts sharing one cache; returns the cache.

    prefetch_layers = n > 0: each layer applies the next n MoE layers' routers (stacked) to its own gate
    input and prefetches the experts they would pick (HOBBIT's adaptive prefetch)."""
    cache = ExpertCache(store, Policy.named(policy, model.spec.num_layers, weights), high_slots, low_slots,
                        model.device, model.dtype, mixed, t1, t2)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    for n, i in enumerate(moe):
        following = moe[n + 1:n + 1 + prefetch_layers]
        gates = (torch.cat([model.model.layers[j].mlp.gate.weight for j in following]).detach()
                 if following else None)
        model.model.layers[i].mlp.experts = OffloadedExperts(i, model.spec.num_experts, model.spec.top_k, cache,
                                                             following, gates)
    return cache
