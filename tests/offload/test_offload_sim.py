"""HOBBIT pieces that need no GPU: the precision rule, cache policies, the trace simulator, trace tools."""

import json

import numpy as np
import pytest
import torch

import moeserve
from moeserve.cli import DEMO_DIR, main
from moeserve.offload.policies import CachePolicy, ExpertStats
from moeserve.offload.precision import HIGH, LOW, SKIP, choose_precision
from moeserve.offload.simulate import fit_policy_weights, simulate
from moeserve.offload.trace import RoutingTrace, record_trace
from moeserve.tokenizer import load_tokenizer


def test_precision_rule_as_the_paper_states():
    w = torch.tensor([[0.5, 0.3, 0.15, 0.05],   # s = 0, .5, .8, .95 -> H H L S
                      [0.7, 0.2, 0.1, 0.0],     # s = 0, .7, .9, 1.0 -> H L L S
                      [0.25, 0.25, 0.25, 0.25]])  # s = 0, .25, .5, .75 -> H H H L
    assert choose_precision(w).tolist() == [[HIGH, HIGH, LOW, SKIP], [HIGH, LOW, LOW, SKIP], [HIGH, HIGH, HIGH, LOW]]
    perm = torch.tensor([2, 0, 3, 1])  # order of the inputs does not matter (ties aside)
    assert torch.equal(choose_precision(w[:2, perm]), choose_precision(w[:2])[:, perm])
    assert choose_precision(torch.tensor([[2.0, 1.0, 1.0]]), t1=0.0, t2=0.0).tolist() == [[HIGH, SKIP, SKIP]]  # top-1 high
    with pytest.raises(ValueError):
        choose_precision(w, t1=0.9, t2=0.6)


def test_policies_hand_worked():
    L = 4
    stats = {"a": ExpertStats(layer=0, last_use=5, uses=9, high_uses=1),
             "b": ExpertStats(layer=1, last_use=2, uses=5, high_uses=5),
             "c": ExpertStats(layer=2, last_use=8, uses=1, high_uses=0)}
    assert CachePolicy.named("lru", L).victim(stats, now=10, current_layer=1) == "b"  # oldest use
    assert CachePolicy.named("lfu", L).victim(stats, now=10, current_layer=1) == "c"  # fewest uses
    assert CachePolicy.named("lhu", L).victim(stats, now=10, current_layer=1) == "c"  # fewest high uses
    assert CachePolicy.named("fld", L).victim(stats, now=10, current_layer=1) == "a"  # layer 0 runs again last
    assert CachePolicy.named("lru", L).victim(stats, now=10, current_layer=1, protected={"b"}) == "a"
    p = CachePolicy.named("x", L, (0.5, 0.5, 0, 0)).priorities(stats, now=10, current_layer=1)
    assert p["a"] == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)
    with pytest.raises(ValueError, match="unknown policy"):
        CachePolicy.named("mru", L)


def hand_trace(ids, weights=None, sequence=None):
    ids = np.asarray(ids, np.int16).reshape(len(ids), -1)
    w = np.ones(ids.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
    seq = np.zeros(len(ids), np.int32) if sequence is None else np.asarray(sequence, np.int32)
    return RoutingTrace(seq, np.zeros(len(ids), np.int16), ids, w, num_layers=1, num_experts=4)


def test_simulator_counts_hand_worked():
    lru = CachePolicy.named("lru", 1)
    r = simulate(hand_trace([0, 0, 1, 0]), lru, high_slots=1, mixed=False)
    assert (r.requests, r.hits, r.high_misses) == (4, 1, 3)
    r = simulate(hand_trace([0, 0, 1, 0]), lru, high_slots=2, mixed=False)
    assert (r.hits, r.high_misses, r.bytes_moved) == (2, 2, 2)
    # mixed precision, k=2: weights .9/.1 -> expert 0 high, expert 1 low (s = .9 <= T2)
    tr = hand_trace([[0, 1], [0, 1], [1, 0]], [[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]])
    r = simulate(tr, lru, high_slots=1, low_slots=1)
    # t0: 0 high miss, 1 low miss; t1: both hit; t2: 1 high miss (a low copy does not serve high); the only
    # high slot holds 0, which this token still needs, so 1 streams through uncached; 0 (low) hits the high copy
    assert (r.high_misses, r.low_misses, r.hits) == (2, 1, 3)
    assert r.miss_penalty == pytest.approx(2.25)
    assert simulate(tr, lru, high_slots=1, low_slots=1, mixed=False).low_misses == 0


def test_per_layer_cache_hand_worked():
    """Two layers, 3 slots: one pool keeps the 3 most recent experts of either layer; per layer, layer 0 gets
    2 slots (the remainder goes to the first layers) and layer 1 one, each evicting only its own."""
    layers, ids = [0, 1, 0, 1, 0, 1, 0, 1], [0, 5, 1, 6, 0, 5, 1, 6]
    trace = RoutingTrace(np.zeros(8, np.int32), np.asarray(layers, np.int16), np.asarray(ids, np.int16)[:, None],
                         np.ones((8, 1), np.float32), num_layers=2, num_experts=8)
    lru = CachePolicy.named("lru", 2)
    assert simulate(trace, lru, high_slots=3, mixed=False).hits == 0  # a cycle of 4 through 3 LRU slots
    r = simulate(trace, lru, high_slots=3, mixed=False, per_layer=True)
    assert (r.hits, r.high_misses) == (2, 6)  # layer 0's experts 0 and 1 stay; layer 1 thrashes its one slot


def test_frequency_counters_reset_per_sequence():
    lfu = CachePolicy.named("lfu", 1)
    # sequence 0 uses expert 0 often; sequence 1 alternates 1 and 2 with one slot left after expert 3
    ids = [0, 0, 0, 0, 1, 2, 1, 2]
    r = simulate(hand_trace(ids, sequence=[0, 0, 0, 0, 1, 1, 1, 1]), lfu, high_slots=2, mixed=False)
    assert r.hits == 3 + 2  # without the reset, expert 0 would keep its slot and 1/2 would thrash


@pytest.fixture(scope="module")
def demo_trace():
    model = moeserve.load_model(DEMO_DIR, device="cpu", dtype=torch.float32)
    ids = load_tokenizer(DEMO_DIR).encode((DEMO_DIR / "heldout.txt").read_text())
    return record_trace(model, [ids[s:s + 128] for s in range(0, 128 * 24, 128)])


def test_recorded_trace_matches_the_router(demo_trace, tmp_path):
    tr = demo_trace
    assert len(tr) == 24 * 128 * 6 and tr.expert_ids.shape[1] == 2
    assert np.allclose(tr.weights.sum(1), 1, atol=1e-5)  # Mixtral renormalises the top-2
    tr.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert np.array_equal(back.expert_ids, tr.expert_ids) and back.num_layers == 6


def test_multi_dimensional_policy_beats_lru_and_lfu_on_demo_trace(demo_trace):
    fit, held_out = demo_trace.split(0.5)
    weights, _ = fit_policy_weights(fit, 12, 12, step=0.5)
    penalty = {name: simulate(held_out, CachePolicy.named(name, 6, w), 12, 12).miss_penalty
               for name, w in (("lru", None), ("lfu", None), ("hobbit", None), ("fitted", weights))}
    assert penalty["hobbit"] < penalty["lru"] and penalty["hobbit"] < penalty["lfu"]
    assert penalty["fitted"] < penalty["lru"] and penalty["fitted"] < penalty["lfu"]


def test_cli_trace_record_simulate_fit(capsys, byte_model_dir, tmp_path):
    out = tmp_path / "t.npz"
    assert main(["trace", "record", "--model", str(byte_model_dir), "--out", str(out), "--seq-len", "32",
                 "--max-tokens", "96"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 96 * 2
    assert main(["trace", "simulate", "--trace", str(out), "--high-slots", "2", "--policy", "lru", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["policy"] == "lru" and r["requests"] + r["skipped"] == 96 * 2 * 2
    assert main(["trace", "fit", "--trace", str(out), "--high-slots", "2", "--low-slots", "1", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["weights"]) == {"lru", "lfu", "lhu", "fld"}
    assert main(["trace", "simulate", "--trace", str(out), "--high-slots", "2", "--weights", "1,2"]) == 2
    assert "four" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_text("not a trace")
    assert main(["trace", "simulate", "--trace", str(bad), "--high-slots", "2"]) == 2
    assert "not a routing trace" in capsys.readouterr().err
