"""Replay a routing trace through a mixed-precision expert cache: hit rate, miss penalty, bytes moved.

The cache decisions are CacheState's (the real cache uses the same). Miss penalty counts a high miss
as 1 and a low miss as bits_low / bits_high (HOBBIT's measure). Bytes moved count each miss at the size of
the copy it loads (`expert_bytes`, `low_expert_bytes`: real sizes from an expert store, or by default the
penalty's units). Pure Python, CPU only.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moeserve.offload.cache_state import CacheState, Decision
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH, SKIP, choose_precision
from moeserve.offload.trace import RoutingTrace
from moeserve.progress import Progress


@dataclass
class SimResult:
    requests: int = 0
    hits: int = 0
    high_misses: int = 0
    low_misses: int = 0
    skipped: int = 0
    miss_penalty: float = 0.0
    bytes_moved: float = 0.0  # bytes at simulate's expert_bytes / low_expert_bytes (default: penalty units)

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


def simulate(trace: RoutingTrace, policy: CachePolicy, high_slots: int, low_slots: int = 0, *, mixed: bool = True,
             t1: float = 0.6, t2: float = 0.9, bits_high: int = 16, bits_low: int = 4,
             expert_bytes: float = 1.0, low_expert_bytes: float | None = None, per_layer: bool = False) -> SimResult:
    """Replay `trace`; mixed=False requests every selected expert in high precision (no skipping);
    expert_bytes / low_expert_bytes: size of a high / low copy (default low: expert_bytes * bits_low / bits_high);
    per_layer: the slots are split evenly over the layers (see CacheState)."""
    if low_expert_bytes is None:
        low_expert_bytes = expert_bytes * bits_low / bits_high
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
            r.record(d, bits_low / bits_high, expert_bytes, low_expert_bytes)
    return r


def weight_grid(step: float) -> list[tuple[float, float, float, float]]:
    """Every point of the weight simplex (w_lru, w_lfu, w_lhu, w_fld summing to 1) on a grid of `step`."""
    n = round(1 / step)
    return [(a * step, b * step, c * step, (n - a - b - c) * step)
            for a, b, c in itertools.product(range(n + 1), repeat=3) if a + b + c <= n]


def fit_policy_weights(trace: RoutingTrace, high_slots: int, low_slots: int = 0, step: float = 0.25,
                       progress: bool = False, **sim_kw) -> tuple[tuple[float, ...], float]:
    """Grid search over the weight simplex (step `step`) for the lowest miss penalty on `trace`; progress: show
    the candidates replayed on stderr (each is a full replay of the trace)."""
    best = None
    grid = weight_grid(step)
    with Progress(len(grid), "trace fit", "candidates", enabled=progress) as bar:
        for w in grid:
            penalty = simulate(trace, CachePolicy.named("fit", trace.num_layers, w), high_slots, low_slots,
                               **sim_kw).miss_penalty
            if best is None or penalty < best[1]:
                best = (w, penalty)
            bar.update(note=f"best miss penalty {best[1]:g}")
    return best
