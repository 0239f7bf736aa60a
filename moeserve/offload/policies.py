"""Expert-cache eviction policies as priorities (the lowest priority is evicted).

Each cached expert keeps statistics: last use (time), uses and high-precision uses since the sequence
began (reset per sequence), and its layer. HOBBIT's multi-dimensional priority is a weighted sum of
normalised components, each in [0, 1], higher = keep:

    p_lru = last_use / now          p_lfu = uses / max uses in the pool
    p_lhu = high uses / max          p_fld = 1 - d / L, d = layers until the expert's layer runs again

LRU, LFU, LHU and FLD are the single components; `hobbit` mixes them with fitted weights.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPONENTS = ("lru", "lfu", "lhu", "fld")
POLICIES = {"lru": (1, 0, 0, 0), "lfu": (0, 1, 0, 0), "lhu": (0, 0, 1, 0), "fld": (0, 0, 0, 1),
            "hobbit": (0.4, 0.2, 0.2, 0.2)}


@dataclass
class ExpertStats:
    layer: int
    last_use: int = 0
    uses: int = 0
    high_uses: int = 0


@dataclass
class CachePolicy:
    weights: tuple[float, float, float, float]  # w_lru, w_lfu, w_lhu, w_fld
    num_layers: int
    name: str = "custom"

    @classmethod
    def named(cls, name: str, num_layers: int, weights: tuple | None = None) -> "CachePolicy":
        if weights is None:
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
            weights = POLICIES[name]
        if len(weights) != 4 or any(w < 0 for w in weights):
            raise ValueError(f"policy weights must be four non-negative numbers (lru, lfu, lhu, fld), got {weights}")
        return cls(tuple(float(w) for w in weights), num_layers, name)

    def priorities(self, stats: dict, now: int, current_layer: int) -> dict:
        """key -> priority for every cached entry in `stats`."""
        max_uses = max((s.uses for s in stats.values()), default=0) or 1
        max_high = max((s.high_uses for s in stats.values()), default=0) or 1
        w_lru, w_lfu, w_lhu, w_fld = self.weights
        out = {}
        for key, s in stats.items():
            distance = (s.layer - current_layer) % self.num_layers
            out[key] = (w_lru * s.last_use / max(now, 1) + w_lfu * s.uses / max_uses
                        + w_lhu * s.high_uses / max_high + w_fld * (1 - distance / self.num_layers))
        return out

    def victim(self, stats: dict, now: int, current_layer: int, protected=frozenset()):
        """The entry to evict: lowest priority, ties broken by least recent use; never a protected key."""
        prio = self.priorities(stats, now, current_layer)
        candidates = [k for k in stats if k not in protected]
        if not candidates:
            return None
        return min(candidates, key=lambda k: (prio[k], stats[k].last_use))
