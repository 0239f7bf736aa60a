"""Throughput planning: hardware profile, hierarchical roofline numbers, policy search, `moeserve plan/profile`."""

import json

import numpy as np
import pytest

from checks import GiB, H100
from moeserve.cli import main
from moeserve.errors import MoeserveError
from moeserve.plan.hardware import HardwareProfile, load_or_measure
from moeserve.plan.policy import ThroughputPolicy
from moeserve.plan.roofline import (Candidates, Rates, Workload, expected_experts, layer_ops, layer_time,
                                    operator_table, throughput, turning_points)
from moeserve.plan.search import candidates, evaluate, memory, search
from moeserve.spec import ModelSpec

# tiny spec for hand-worked numbers: D=8, 2 heads of 4, 1 KV head, 4 experts of FFN 16, top-2, 2 layers
TINY = ModelSpec.of(family="mixtral", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=4, max_position_embeddings=64, num_experts=4, top_k=2, expert_ffn=16,
                 moe_layers=(True, True), sliding_windows=(None, None))
WL = Workload(prompt_len=512, gen_len=128)


def test_tiny_layer_by_hand():
    # n=2 sequences, decode (1 token each), 8.5 positions attended (prompt 6, gen 4: 6 + 5/2)
    wl = Workload(prompt_len=6, gen_len=4)
    assert wl.decode_context == 8.5
    ops = layer_ops(TINY, wl, True, None, np.array([2.0]), 1, wl.decode_context, wl.decode_context)
    pre, attn, post = ops["pre_attention"], ops["attention"], ops["post_attention"]
    # pre: QKV 8 -> (2 + 2*1)*4 = 16 outputs: 2*2*8*16 = 512 FLOPs + norm 4*2*8 = 64; weights (8*16 + 8)*2 B
    assert pre.flops[0] == 576 and pre.weights == 272 and pre.mem[0] == 272 + 2 * 8 * 2 + 2 * 16 * 2
    # attention: 4 * tokens 2 * heads 2 * dim 4 * 8.5 = 544; KV: 2 seqs * 8.5 * (k, v) * 1 head * 4 * 2 B = 272
    assert attn.flops[0] == 544 and attn.kv[0] == 272 and attn.mem[0] == 272 + 64 + 32
    # post: O 2*2*8*8 = 256, router 2*2*8*4 = 128, experts 2*2*(2*3*8*16) = 3072, norm 64 -> 3520 FLOPs
    # weights: O 64 + norm 8 + router 32 + 4 experts * 384 = 1640 elements; 2 tokens touch 4(1 - 0.5^2) = 3 experts
    assert expected_experts(4, 2, 2) == 3.0
    assert post.flops[0] == 3520 and post.weights == 3280 and post.weights_read[0] == (104 + 3 * 384) * 2
    assert post.mem[0] == 2512 + 32 + 32

    # pipeline: N=4 in 2 micro-batches, CPU attention, GPU FFN, half the weights resident
    rates = Rates(gpu_flops=1000, hbm=100, cpu_flops=100, dram=10, link=100)
    c = Candidates.of([ThroughputPolicy(4, 2, False, True, 0.5, 0.0)])
    seconds, binding = layer_time(ops, c, rates, residual=2 * 8 * 2)
    g = 368 / 100 + 2576 / 100  # GPU: pre and post, both memory bound
    cpu = 368 / 10  # CPU attention, memory bound
    link = (0.25 * 272 + 64 + 0.25 * 3280 + 32) / 100  # streamed halves over 2 micro-batches + q/k/v + attention out
    assert seconds[0] == pytest.approx(max(2 * g, 2 * cpu, 2 * link, g + cpu)) and binding[0] == 1  # CPU
    # the executor's fixed cost per micro-batch comes on top, once per micro-batch
    slow = Rates(gpu_flops=1000, hbm=100, cpu_flops=100, dram=10, link=100, micro_batch_overhead=5.0)
    assert layer_time(ops, c, slow, residual=2 * 8 * 2)[0][0] == pytest.approx(seconds[0] + 2 * 5.0)


def test_micro_batch_overhead_favours_fewer_micro_batches(mixtral):
    """Charged per micro-batch, the overhead makes the search take larger micro-batches, and the profile's
    measurement of it (the demo model through the executor, here on the CPU) is a positive time."""
    from moeserve.plan.hardware import micro_batch_overhead

    spec = ModelSpec.from_dir(mixtral)
    free = search(spec, HardwareProfile.from_dict(H100), WL, 16 * GiB, 200 * GiB, max_batch=256)
    costly = search(spec, HardwareProfile.from_dict({**H100, "micro_batch_overhead": 2e-3}), WL, 16 * GiB, 200 * GiB,
                    max_batch=256)
    assert costly.policy.batch_size // costly.policy.micro_batch < free.policy.batch_size // free.policy.micro_batch
    assert 0 < micro_batch_overhead("cpu", steps=1, micro_batches=2) < 1.0


def test_turning_points_and_operator_bounds(mixtral):
    hw = HardwareProfile.from_dict(H100)
    tp = turning_points(hw)
    assert tp["gpu_ridge"] == pytest.approx(774e12 / 2.94e12) and tp["balance"] == pytest.approx(3.4e12 / 54.4e9)
    spec = ModelSpec.from_dir(mixtral)
    rows = operator_table(spec, WL, hw, ThroughputPolicy(64, 64, False, True, 0.0, 0.0))
    bounds = {r["operator"]: (r["device"], r["bound"]) for r in rows}
    # CPU attention reads the KV cache at ~4 FLOP/B: memory bound; streamed expert weights: link bound
    assert bounds["attention"] == ("CPU", "memory") and bounds["post_attention"] == ("GPU", "link")
    attn = next(r for r in rows if r["operator"] == "attention")
    assert attn["flop_per_s"] == pytest.approx(attn["intensity"] * 79e9)


def _brute_force(spec, hw, wl, gpu_budget, host_budget, max_batch, step):
    """Every candidate evaluated one ThroughputPolicy at a time: (throughput, policy) of those that fit."""
    c = candidates(max_batch, step)
    out = []
    for i in range(len(c)):
        p = c.policy(i)
        gpu, host = memory(spec, wl, Candidates.of([p]))
        if sum(gpu.values())[0] <= gpu_budget and sum(host.values())[0] <= host_budget:
            out.append((evaluate(spec, hw, wl, p).tokens_per_s, p))
    return out


@pytest.mark.parametrize("gpu_gib", [3, 12, 200])
def test_search_matches_brute_force(mixtral, gpu_gib):
    spec, hw = ModelSpec.from_dir(mixtral), HardwareProfile.from_dict(H100)
    plan = search(spec, hw, WL, gpu_gib * GiB, 100 * GiB, max_batch=64, step=0.25)
    feasible = _brute_force(spec, hw, WL, gpu_gib * GiB, 100 * GiB, 64, 0.25)
    assert plan.feasible == len(feasible)
    best = max(t for t, _ in feasible)
    assert plan.tokens_per_s == pytest.approx(best, rel=1e-3)
    for attr in ("attention_on_gpu", "ffn_on_gpu"):  # placement follows the model wherever it is decisive
        best_on = max((t for t, p in feasible if getattr(p, attr)), default=0)
        best_off = max((t for t, p in feasible if not getattr(p, attr)), default=0)
        if max(best_on, best_off) > 1.01 * min(best_on, best_off):
            assert getattr(plan.policy, attr) == (best_on > best_off)
    assert sum(plan.gpu_bytes.values()) <= gpu_gib * GiB and sum(plan.host_bytes.values()) <= 100 * GiB


def test_search_respects_memory(mixtral):
    spec, hw = ModelSpec.from_dir(mixtral), HardwareProfile.from_dict(H100)
    weights = spec.parameter_counts()["total"] * 2
    # 16 GiB: the weights (87 GiB) must be streamed; CPU attention keeps the KV cache in host memory
    plan = search(spec, hw, WL, 16 * GiB, 200 * GiB)
    assert plan.policy.ffn_on_gpu and plan.policy.weights_gpu_fraction < 1 and not plan.policy.attention_on_gpu
    assert plan.bottleneck == "CPU-GPU link" and plan.seconds < 1.0
    # the host holds every layer's weights, resident ones too (the executor keeps their host copies): with
    # 100 GiB of host memory only ~13 GiB are left for host KV, and an exact pinned figure replaces the estimate
    tight = search(spec, hw, WL, 16 * GiB, 100 * GiB)
    assert tight.host_bytes["weights"] == pytest.approx(weights, rel=0.01)
    assert sum(tight.host_bytes.values()) <= 100 * GiB and tight.policy.batch_size < plan.policy.batch_size
    pinned = search(spec, hw, WL, 16 * GiB, 100 * GiB, host_weights=95 * GiB)
    assert pinned.host_bytes["weights"] == 95 * GiB and sum(pinned.host_bytes.values()) <= 100 * GiB
    # a GPU that holds everything: all weights resident, no link traffic for weights
    big = search(spec, hw, WL, 400 * GiB, 100 * GiB)
    assert big.policy.weights_gpu_fraction == 1.0 and big.tokens_per_s > plan.tokens_per_s
    assert sum(big.gpu_bytes.values()) <= 400 * GiB and big.gpu_bytes["resident weights"] > 0.95 * weights


def test_only_cpu_attention_fits(mixtral):
    """A GPU budget between the smallest CPU-attention and the smallest GPU-attention footprint."""
    spec, hw = ModelSpec.from_dir(mixtral), HardwareProfile.from_dict(H100)
    wl = Workload(prompt_len=30000, gen_len=128)  # long contexts: one layer's KV staging is large
    c = candidates(4096)
    gpu, _ = memory(spec, wl, c)
    need = sum(gpu.values())
    budget = need[~c.attention_on_gpu].min() + 1
    assert need[c.attention_on_gpu].min() > budget
    plan = search(spec, hw, wl, budget, 100 * GiB)
    assert not plan.policy.attention_on_gpu and plan.policy.kv_gpu_fraction == 0


def test_impossible_budgets_say_what_is_short(mixtral):
    spec, hw = ModelSpec.from_dir(mixtral), HardwareProfile.from_dict(H100)
    with pytest.raises(MoeserveError, match=r"GPU memory short by .*embedding \+ LM head .* > 512\.0 MiB budget"):
        search(spec, hw, WL, 0.5 * GiB, 100 * GiB)
    with pytest.raises(MoeserveError, match=r"host memory short by"):
        search(spec, hw, WL, 16 * GiB, 20 * GiB)


def test_profile_json_round_trip_and_errors(tmp_path):
    hw = HardwareProfile.from_dict(H100)
    assert hw.h2d_chunk_bandwidth[4] == 44.4e9 and hw.cpu_flops == 3.4e12
    hw.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == hw
    with pytest.raises(MoeserveError, match="unknown hardware profile field"):
        HardwareProfile.from_dict({**H100, "gpu_tflops": 1})
    with pytest.raises(MoeserveError, match="lacks the field"):
        HardwareProfile.from_dict({"cpu_name": "x"})
    cpu_only = HardwareProfile.from_dict({k: v for k, v in H100.items() if not k.startswith(("gpu", "h2d", "d2h",
                                                                                             "hbm"))})
    with pytest.raises(MoeserveError, match="no GPU figures"):
        throughput(TINY, WL, Candidates.of([ThroughputPolicy(1, 1, False, False, 0, 0)]), Rates.of(cpu_only))


def test_cli_plan_demo_and_mixtral(capsys, tmp_path, mixtral, h100_json):
    assert main(["plan", "--for", "batch", "--profile", str(h100_json), "--gpu-memory", "16GiB", "--cpu-memory", "100GiB"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "tokens/s" in out and "post_attention" in out
    assert main(["plan", "--for", "batch", "--model", str(mixtral), "--profile", str(h100_json), "--gpu-memory", "24GiB",
                 "--cpu-memory", "100GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert ThroughputPolicy(**result["policy"]).batch_size >= 1 and result["bottleneck"] and result["tokens_per_s"] > 0
    assert main(["plan", "--for", "batch", "--model", str(mixtral), "--profile", str(h100_json), "--gpu-memory", "512MiB"]) == 2
    assert "GPU memory short by" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    png = tmp_path / "roofline.png"
    assert main(["plan", "--for", "batch", "--model", str(mixtral), "--profile", str(h100_json), "--gpu-memory", "16GiB",
                 "--cpu-memory", "100GiB", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_profile_measures_once_and_caches(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOESERVE_PROFILE_QUICK", "1")
    assert main(["profile", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["cpu_fp32_flops"] > 0 and measured["dram_bandwidth"] > 0 and measured["ram_bytes"] > 0
    assert list(tmp_path.glob("hardware/*.json"))
    assert load_or_measure().as_dict() == HardwareProfile.from_dict(measured).as_dict()  # from the cache
    assert main(["profile"]) == 0 and "DRAM copy" in capsys.readouterr().out
