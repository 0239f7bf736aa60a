"""Replay a routing trace through a mixed-precision expert cache: hit rate, miss penalty, bytes moved.

The cache decisions are CacheState's (the real cache uses the same). Miss penalty counts a high miss
as 1 and a low miss as bits_low / bits_high (HOBBIT's measure). Pure Python, CPU only.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moeserve.offload.cache_state import CacheState, Decision
from moeserve.offload.policies import Policy
from moeserve.offload.precision import HIGH, SKIP, choose_precision
from moeserve.offload.trace import RoutingTrace


@dataclass
class SimResult:
    requests: int = 0
    hits: int = 0
    high_misses: int = 0
    low_misses: int = 0
    skipped: int = 0
    miss_penalty: float = 0.0
    bytes_moved: float = 0.0  # in units of `expert_bytes` (default 1: high-precision expert loads)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.requests, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}

    def record(self, decision: Decision, low_cost: float, high_bytes: float, low_bytes: float) -> None:
        """Count one served request: a hit, or a high / low load with its penalty and bytes."""
        self.requests += 1
        if decision.hit:
            self.hits += 1
        elif decision.tier == HIGH:
            self.high_misses += 1
            self.miss_penalty += 1
            self.bytes_moved += high_bytes
        else:
            self.low_misses += 1
            self.miss_penalty += low_cost
            self.bytes_moved += low_bytes


def simulate(trace: RoutingTrace, policy: Policy, high_slots: int, low_slots: int = 0, *, mixed: bool = True,
             t1: float = 0.6, t2: float = 0.9, bits_high: int = 16, bits_low: int = 4,
             expert_bytes: float = 1.0, per_layer: bool = False) -> SimResult:
    """Replay `trace`; mixed=False requests every selected expert in high precision (no skipping);
    per_layer: the slots are split evenly over the layers (see CacheState)."""
    precision = (choose_precision(torch.from_numpy(trace.weights), t1, t2).numpy() if mixed
                 else np.zeros(trace.weights.shape, dtype=np.int64))
    state = CacheState(policy, high_slots, low_slots, per_layer)
    r = SimResult()
    for seq, layer, ids, prec in zip(trace.sequence, trace.layer, trace.expert_ids, precision):
        state.start_event(int(seq))
        needed = {(int(layer), int(e)) for e in ids}
        for e, p in zip(ids, prec):
            if p == SKIP:
                r.skipped += 1
                continue
            d = state.request((int(layer), int(e)), int(p), needed)
            r.record(d, bits_low / bits_high, expert_bytes, expert_bytes * bits_low / bits_high)
    return r


def fit_policy_weights(trace: RoutingTrace, high_slots: int, low_slots: int = 0, step: float = 0.25,
                       **sim_kw) -> tuple[tuple[float, ...], float]:
    """Grid search over the weight simplex (step `step`) for the lowest miss penalty on `trace`."""
    n = round(1 / step)
    best = None
    for a, b, c in itertools.product(range(n + 1), repeat=3):
        if a + b + c > n:
            continue
        w = (a * step, b * step, c * step, (n - a - b - c) * step)
        penalty = simulate(trace, Policy.named("fit", trace.num_layers, w), high_slots, low_slots, **sim_kw).miss_penalty
        if best is None or penalty < best[1]:
            best = (w, penalty)
    return best
