"""The one slot cache under its miss policies (offload/slot_cache.py), driven directly on the CPU as the fast tier:
what lands in a slot is the store's copy, and the slots' routed pass equals a float64 reference of the same experts."""

import pytest
import torch

from moeserve.model.experts import gated_ffn
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH, LOW
from moeserve.offload.slot_cache import NOT_CACHED, CacheSettings, Miss, SlotCache, Tier
from moeserve.offload.store import ExpertStore


@pytest.fixture(scope="module")
def store(hf_checkpoints, tmp_path_factory):
    _, path = hf_checkpoints["mixtral"]
    out = tmp_path_factory.mktemp("slot_cache_store")
    ExpertStore.build(path, out, low_bits=4, group=16, progress=False)
    return ExpertStore.open(out)


def reference(store: ExpertStore, layer: int, pairs, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, D] float64: sum over pairs (token, k-slot, expert, low) of weight * the expert's store copy on x's row."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j, e, low in pairs:
        row = x[t:t + 1].double()
        if low:  # the low-bit copy, dequantized by its own modules, in float64 from there on
            gate_up, down = store.quantized_modules(store.host_parts(layer, e, low=True))
            eye_in, eye_mid = torch.eye(gate_up.in_features), torch.eye(down.in_features)
            y = gated_ffn(row, gate_up(eye_in).T.double(), down(eye_mid).T.double(), act=store.act)
        else:
            y = gated_ffn(row, *(p.double() for p in store.host_parts(layer, e, low=False)), act=store.act)
        out[t] += weights[t, j].double() * y[0]
    return out


def test_copy_policy_loads_the_store_copies_and_computes_them(store):
    layer = store.meta["layers"][0]
    E = store.meta["num_experts"]
    settings = CacheSettings((Tier(2, low=False, reserve=2), Tier(2, low=True, reserve=2)), miss=Miss.COPY, mixed=True)
    cache = SlotCache(store, CachePolicy.named("lru", len(store.meta["layers"])), settings, "cpu", torch.float32)
    # (token, k-slot, expert, precision)
    asked = [(0, 0, 1, HIGH), (0, 1, 3, LOW), (1, 0, 3, HIGH), (1, 1, 1, LOW), (2, 0, E - 1, LOW)]
    cache.log(layer, [1, 3], [0.7, 0.3])
    virtual = torch.full((3, 2), cache.slots.none, dtype=torch.long)  # [T, k]
    served = []
    for t, j, e, p in asked:
        source = cache.serve(layer, e, p, {(layer, e) for _, _, e, _ in asked}, 1, 0.0, flush=None)
        assert source[0] == "gpu"
        _, tier, slot = source
        parts = store.host_parts(layer, e, low=tier == LOW)
        assert all(torch.equal(buf[slot], part.to(buf.dtype)) for buf, part in zip(cache.pools[tier].buffers, parts))
        virtual[t, j] = cache.slots.virtual(tier, slot)
        served.append((t, j, e, tier == LOW))
    x, weights = torch.randn(3, store.meta["hidden"]), torch.rand(3, 2)
    out = cache.slots.compute(x, weights, virtual)  # [T, D]
    torch.testing.assert_close(out.double(), reference(store, layer, served, x, weights), atol=1e-4, rtol=1e-4)
    cache.chunk_done()
    st = cache.stats
    assert (st.requests, st.hits, st.high_misses, st.low_misses) == (5, 1, 2, 2)  # expert 1's high copy serves LOW
    assert st.bytes_moved == 2 * store.expert_bytes(False) + 2 * store.expert_bytes(True)


def test_cpu_policy_admits_in_the_background_and_maps_landed_slots(store):
    layers = tuple(store.meta["layers"][:2])
    settings = CacheSettings((Tier(2, low=True),), miss=Miss.CPU, victim_sample=32, layers=layers)
    cache = SlotCache(store, CachePolicy.named("lru", len(store.meta["layers"])), settings, "cpu", torch.float32)
    ids = torch.tensor([[2, 5], [5, 0]])  # [T, k]: expert 5 has the most rows
    assert torch.equal(cache.where(layers[1], ids), torch.full((2, 2), NOT_CACHED))
    cache.account(layers[1], ids, torch.zeros_like(ids), torch.ones(2, 2, dtype=torch.bool))
    assert set(cache.pending) == {(layers[1], 5)} and cache.admitted == 1
    cache.account(layers[1], ids, torch.zeros_like(ids), torch.ones(2, 2, dtype=torch.bool))  # a copy in flight
    assert cache.admitted == 1
    slot = cache.pool.slot_of[(layers[1], 5)]
    assert torch.equal(cache.where(layers[1], ids), torch.tensor([[NOT_CACHED, slot], [slot, NOT_CACHED]]))
    assert cache.bytes_copied == store.expert_bytes(True) and not cache.pending
    x, weights = torch.randn(2, store.meta["hidden"]), torch.rand(2, 2)
    virtual = torch.tensor([[cache.slots.none, slot], [slot, cache.slots.none]])  # [T, k]
    out = cache.slots.compute(x, weights, virtual)
    expected = reference(store, layers[1], [(0, 1, 5, True), (1, 0, 5, True)], x, weights)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
