"""The bookkeeping of a two-pool (high / low precision) expert cache, shared by the simulator and the
real cache so that both make the same decisions for the same request sequence.

A high request hits only a high copy; a low request hits a low or a high copy. A miss loads into the
request's pool, evicting the policy's lowest-priority entry that the current token does not need; with
no such entry (or no slots) the expert is used once and not kept ("streamed").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moeserve.offload.policies import CachePolicy, ExpertStats
from moeserve.offload.precision import HIGH

Key = tuple[int, int]  # (layer, expert)


@dataclass
class Decision:
    hit: bool
    tier: int  # pool the request is served from or loaded into: HIGH or LOW (1)
    keep: bool  # a miss: whether the loaded expert stays cached
    evicted: Key | None  # a miss: the entry it replaced


class CacheState:
    def __init__(self, policy: CachePolicy, high_slots: int, low_slots: int, per_layer: bool = False,
                 victim_sample: int | None = None):
        """per_layer: each layer gets an even share of each pool's slots and evicts only its own experts (the
        per-layer caches of mixtral-offloading); otherwise one pool serves all layers. victim_sample: admit()
        looks for its victim among that many cached experts drawn at random (seeded), not all of them: the
        policy's priorities are Python, and a pool of thousands of small experts would cost milliseconds a call."""
        self.policy, self.per_layer = policy, per_layer
        self.victim_sample, self._rng = victim_sample, random.Random(0)
        self.capacity = {HIGH: high_slots, 1: low_slots}
        self.pools: dict[int, dict[Key, None]] = {HIGH: {}, 1: {}}  # dicts: deterministic order
        self.stats: dict[Key, ExpertStats] = {}
        self.now = 0
        self.sequence = None
        self.pinned: set[Key] = set()  # prefetched, not used yet: not evicted (HOBBIT masks predictions)

    def start_event(self, sequence) -> None:
        """One token at one layer; a new sequence resets the frequency counters (HOBBIT)."""
        self.now += 1
        if sequence != self.sequence:
            self.sequence = sequence
            for s in self.stats.values():
                s.uses = s.high_uses = 0

    def cached_tier(self, key: Key, precision: int) -> int | None:
        """The pool a request would hit (a high copy serves both precisions), or None for a miss."""
        if key in self.pools[HIGH]:
            return HIGH
        return 1 if precision != HIGH and key in self.pools[1] else None

    def request(self, key: Key, precision: int, needed: set[Key], admit: bool = True) -> Decision:
        """Count a use; a miss is admitted to the request's pool unless admit=False (computed elsewhere)."""
        self.pinned.discard(key)
        s = self.stats.setdefault(key, ExpertStats(key[0]))
        s.last_use, s.uses, s.high_uses = self.now, s.uses + 1, s.high_uses + (precision == HIGH)
        tier = self.cached_tier(key, precision)
        if tier is not None:
            return Decision(True, tier, True, None)
        tier = HIGH if precision == HIGH else 1
        return self._admit(key, tier, needed) if admit else Decision(False, tier, False, None)

    def prefetch(self, key: Key, tier: int, needed: set[Key]) -> Decision | None:
        """Admit a predicted expert ahead of use (no use counted); None if a copy is already cached."""
        if key in self.pools[HIGH] or key in self.pools[tier]:
            return None
        self.stats.setdefault(key, ExpertStats(key[0]))
        decision = self._admit(key, tier, needed)
        if decision.keep:
            self.pinned.add(key)
        return decision

    def admit(self, key: Key, tier: int, needed: set[Key]) -> Decision:
        """Admit a missed expert served elsewhere this time (the hybrid backend computed it on the CPU) when the
        policy ranks it above the entry it would evict (LRU always does: it was just used); its uses were
        counted by request(admit=False)."""
        return self._admit(key, tier, needed, only_if_hotter=True)

    def _admit(self, key: Key, tier: int, needed: set[Key], only_if_hotter: bool = False) -> Decision:
        pool = self.pools[tier]
        capacity, rivals = self.capacity[tier], list(pool)
        if self.per_layer:  # slots spread evenly, the first layers taking the remainder
            L = self.policy.num_layers
            capacity = capacity // L + (key[0] % L < capacity % L)
            rivals = [k for k in pool if k[0] == key[0]]
        if capacity <= 0:
            return Decision(False, tier, False, None)
        evicted = None
        if len(rivals) >= capacity:
            evicted = (self._colder_victim(key, rivals, needed | self.pinned) if only_if_hotter else
                       self.policy.victim({k: self.stats[k] for k in rivals}, self.now, key[0],
                                          protected=needed | self.pinned))
            if evicted is None:
                return Decision(False, tier, False, None)
            del pool[evicted]
        pool[key] = None
        return Decision(False, tier, True, evicted)

    def _colder_victim(self, key: Key, rivals: list[Key], protected: set[Key]) -> Key | None:
        """The policy's victim among the rivals (or victim_sample of them) when it ranks key above it, else None."""
        if self.victim_sample is not None and len(rivals) > self.victim_sample:
            rivals = self._rng.sample(rivals, self.victim_sample)
        candidates = [k for k in rivals if k not in protected]
        if not candidates:
            return None
        stats = {k: self.stats[k] for k in [*candidates, key]}
        prio = self.policy.priorities(stats, self.now, key[0])
        victim = min(candidates, key=lambda k: (prio[k], stats[k].last_use))
        return victim if prio[key] > prio[victim] else None
