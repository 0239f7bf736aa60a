"""HOBBIT's offload backend for a model whose routed experts were left unread: one SlotCache over the expert store,
every MoE layer's experts made by the factory as OffloadedExperts sharing it."""

from __future__ import annotations

from moeserve.factory import ExpertSources, place_experts
from moeserve.offload.policies import CachePolicy
from moeserve.offload.slot_cache import CacheSettings, Miss, SlotCache, Tier
from moeserve.offload.store import ExpertStore
from moeserve.plan.layers import offload_layers


def offload_cache(model, store: ExpertStore, *, high_slots: int, low_slots: int = 0, policy: str = "hobbit",
                  weights: tuple | None = None, mixed: bool = True, t1: float = 0.6, t2: float = 0.9,
                  cooperative: bool = False, pin: bool = True, bandwidth: float | None = None,
                  prefetch_min_accuracy: float = 0.5, per_layer: bool = False) -> SlotCache:
    """The one cache every MoE layer's OffloadedExperts share, on the model's device and dtype.

    high_slots / low_slots are the cache's capacities; each pool gets top_k more slots for experts used
    once and for frees deferred while a chunk is in flight (plan/footprint.py plan_slots counts them).
    Prefetching (the experts' prefetch_layers) goes on while at least prefetch_min_accuracy of the recent
    predictions are used (0: always). per_layer: each layer gets its own share of the slots
    (mixtral-offloading's per-layer caches) instead of one pool. cooperative: misses may run on the CPU when
    that is faster than copying them. pin: on a GPU, page-lock the store first."""
    if pin and model.device.type == "cuda":
        store.pin(progress=True)
    spec = model.spec
    reserve = spec.moe.top_k
    tiers = (Tier(high_slots, low=False, reserve=reserve),
             Tier(low_slots, low=True, reserve=reserve) if mixed else Tier(0, low=True))
    settings = CacheSettings(tiers, miss=Miss.CHOOSE if cooperative else Miss.COPY, per_layer=per_layer, mixed=mixed,
                             t1=t1, t2=t2, prefetch_min_accuracy=prefetch_min_accuracy, bandwidth=bandwidth)
    return SlotCache(store, CachePolicy.named(policy, spec.num_layers, weights), settings, model.device, model.dtype)


def enable_offload(model, store: ExpertStore, *, prefetch_layers: int = 0, **options) -> SlotCache:
    """offload_cache (returned; the options are its), and every MoE layer's OffloadedExperts over it
    (place_offloaded). For a model whose routed experts were left unread (tests and benchmarks; a run builds through
    moeserve.build)."""
    cache = offload_cache(model, store, **options)
    place_offloaded(model, cache, prefetch_layers)
    return cache


def place_offloaded(model, cache: SlotCache, prefetch_layers: int = 0) -> None:
    """Every MoE layer's experts made by the factory as OffloadedExperts sharing `cache`. prefetch_layers = n > 0:
    each layer applies the next n MoE layers' routers (stacked) to its own gate input and prefetches the experts they
    would pick (HOBBIT's adaptive prefetch)."""
    place_experts(model, offload_layers(model.spec, model.dtype.itemsize, cache.settings.mixed),
                  ExpertSources(model.spec, store=cache.store, cache=cache, model=model,
                                prefetch_layers=prefetch_layers))
