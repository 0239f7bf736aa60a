"""The bench scripts' --quick smoke runs: they finish on a CPU and write a complete result JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
COMMON_FIELDS = ("name", "date", "git", "device", "device_type", "threads", "torch", "triton", "transformers", "config")


def run_quick(tmp_path):
    """The scripts at once (each on one thread), so the test costs one Python+transformers start-up."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = {}
    for script in ("moe_block", "decode", "cpu_kernels", "parallel", "deepseek", "gptoss"):
        out = tmp_path / script
        cmd = [sys.executable, str(BENCH / f"{script}.py"), "--quick", "--threads", "1", "--out", str(out)]
        procs[script] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env),
                         out)
    results = {}
    for script, (proc, out) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{script} --quick failed:\n{log[-3000:]}"
        files = list(out.glob("*.json"))
        assert len(files) == 1, (files, log[-2000:])
        results[script] = json.loads(files[0].read_text())
    return results


def test_bench_quick_runs_write_json(tmp_path):
    results = run_quick(tmp_path)

    moe = results["moe_block"]
    for f in COMMON_FIELDS:
        assert f in moe, f
    assert moe["name"] == "moe_block" and moe["config"]["quick"] is True
    assert "commit" in moe["git"] and "dirty" in moe["git"]
    assert moe["floor_rates"]["copy_bandwidth"]["bytes_per_s"] > 0
    assert moe["floor_rates"]["matmul"]["flop_per_s"] > 0
    assert {s["shape"] for s in moe["shapes"]} == {"mixtral", "deepseek_like"}
    for shape in moe["shapes"]:
        assert shape["correctness"]["ours_vs_hf_eager_rel_err"] < 1e-4  # fp32 on the CPU
        assert shape["correctness"]["hf_grouped_vs_hf_eager_rel_err"] < 1e-4
        assert [r["tokens"] for r in shape["rows"]] == moe["config"]["tokens"]
        for r in shape["rows"]:
            for f in ("ours_ms", "hf_eager_ms", "hf_grouped_mm_ms", "floor_ms", "ours_over_floor",
                      "ours_over_hf_grouped_mm", "distinct_experts"):
                assert f in r, f
            assert r["ours_ms"] > 0 and r["floor_ms"] > 0
            assert all(1 <= d <= shape["num_experts"] for d in r["distinct_experts"])
        assert shape["rows"][0]["distinct_experts"] == [shape["top_k"]] * len(shape["rows"][0]["distinct_experts"])

    dec = results["decode"]
    for f in COMMON_FIELDS:
        assert f in dec, f
    assert dec["name"] == "decode" and dec["config"]["quick"] is True
    assert [r["batch"] for r in dec["results"]] == dec["config"]["batch_sizes"]
    for r in dec["results"]:
        for side in ("ours", "hf"):
            assert r[side]["prefill_ms"] > 0 and r[side]["decode_tok_s"] > 0
        assert r["floor"]["decode_tok_s"] > 0 and r["floor"]["weight_bytes"] > 0
        assert "ours_decode_over_hf_decode_speed" in r and "ours_step_over_floor" in r
        assert r["greedy_match_prefix"]["min"] == r["new_tokens"]  # fp32 greedy: identical to transformers

    cpu = results["cpu_kernels"]
    for f in COMMON_FIELDS:
        assert f in cpu, f
    assert cpu["floor_rates"]["dram_read"]["bytes_per_s"] > 0
    assert {(r["bits"], r["rows"]) for r in cpu["gemv"]} == {(b, m) for b in (2, 3, 4) for m in (1, 8)}
    for r in cpu["gemv"]:
        assert r["ours_ms"] > 0 and r["torch_bf16_ms"] > 0 and 0 < r["dram_share"]
    assert [r["experts"] for r in cpu["moe_layer"]] == ["fp32", "bf16", "4-bit", "3-bit"]
    assert all(r["tokens_per_s"] > 0 for r in cpu["demo_decode"])

    par = results["parallel"]
    for f in COMMON_FIELDS:
        assert f in par, f
    assert par["config"]["quick"] is True and par["config"]["backend"] == "gloo" and par["config"]["world"] == 2
    assert all(r["ms"] > 0 for r in par["all_to_all"])
    assert all(r["static_ms"] > 0 and r["dynamic_ms"] > 0 for r in par["dispatch"])
    assert {(r["shape"], r["ep"]) for r in par["moe_layer"]} == {(s, e) for s in ("mixtral", "deepseek_like") for e in (1, 2)}
    assert all(r["tokens_per_s_per_rank"] > 0 for r in par["moe_layer"])
    top8 = [r for r in par["bytes_sent"] if r["top_k"] == 8 and r["ep"] <= 4]
    assert top8 and all(r["per_expert_over_per_rank"] >= 2 for r in top8)  # the claim at top-8

    ds = results["deepseek"]
    for f in COMMON_FIELDS:
        assert f in ds, f
    kv = ds["decode"]["kv_bytes_per_token"]
    assert kv["moeserve_latent"] == kv["transformers_cache"] < kv["expanded_kv"]  # both cache MLA's latent
    (row,) = ds["decode"]["bf16"]
    assert row["eager"]["decode_tok_s"] > 0 and row["hf_decode_tok_s"] > 0
    assert row["greedy_match_prefix_vs_hf"]["min"] == row["new_tokens"]  # fp32: transformers' tokens
    assert [r["tokens"] for r in ds["moe_block"]["rows"]] == ds["config"]["tokens"]
    for r in ds["moe_block"]["rows"]:
        assert r["ours_ms"] > 0 and r["floor_ms"] > 0 and r["ours_vs_hf_rel_err"] < 1e-5

    oss = results["gptoss"]
    assert [r["tokens"] for r in oss["moe_block"]["rows"]] == oss["config"]["tokens"]
    for r in oss["moe_block"]["rows"]:  # MXFP4 experts vs transformers on the same (MXFP4-rounded) weights, fp32
        assert r["path"] == "mxfp4_loop" and r["ours_vs_hf_rel_err"] < 1e-5 and r["floor_fraction"] > 0
        assert r["expert_bytes_mxfp4"] < r["expert_bytes_bf16"] / 3


def quick_json(script: str, tmp_path, *args: str, stdout: list | None = None) -> dict:
    """Run one bench script with --quick on one thread (and `args`); its result JSON, with the common fields
    checked; stdout: a list the printed output is appended to."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / f"{script}.py"), "--quick", "--threads", "1", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    (path,) = tmp_path.glob(f"{script}-*.json")
    result = json.loads(path.read_text())
    for f in COMMON_FIELDS:
        assert f in result, f
    return result


def test_offload_bench_quick(tmp_path):
    result = quick_json("offload", tmp_path)
    methods = {r["method"] for r in result["results"]}
    assert methods == {"naive", "lru", "lru-per-layer", "hobbit", "hobbit+cpu"}
    for r in result["results"]:
        assert r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1
        if r["method"] == "naive":
            assert r["hit_rate"] == 0 and r["high_slots"] == 0


def test_throughput_bench_quick(tmp_path):
    result = quick_json("throughput", tmp_path)
    runs = [r for r in result["results"] if "schedule" in r]
    assert {r["schedule"] for r in runs} == {"cgopipe", "zero", "flexgen", "planned"}
    assert all(r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["setup_s"] >= 0 for r in runs)
    assert all(r["batch_size"] == r["policy"]["batch_size"] and r["host_bytes_needed"] > 0 for r in runs)
    assert {r["ratio"] for r in result["results"] if "ratio" in r} == {
        "cgopipe_over_zero", "cgopipe_over_flexgen", "cgopipe_over_best_baseline"}


def test_lowbit_decode_bench_quick(tmp_path):
    result = quick_json("lowbit_decode", tmp_path)
    assert result["config"]["bits"] == 3 and result["weight_bytes_per_token"] > 0
    assert result["results"]["eager"]["tokens_per_s"] > 0 and result["floor_tokens_per_s"] > 0


def test_hybrid_bench_quick(tmp_path):
    """Every column on both tiny shapes: the Mixtral-like one (4 MoE layers) and the DeepSeek-like one (MLA, a dense
    first layer and shared experts: 3 MoE layers, whose KV cache is the latent)."""
    result = quick_json("hybrid", tmp_path)
    assert list(result["shapes"]) == ["quick", "quick-mla"]
    for name, moe_layers in (("quick", 4), ("quick-mla", 3)):
        rows = result["shapes"][name]["rows"]
        assert [r["column"] for r in rows] == ["cpu", "hybrid", "hybrid+cache", "hybrid+mixed", "hobbit-offload"]
        assert all(r["tg_tokens_per_s"] > 0 for r in rows)
        for r in rows[:4]:
            assert r["pp_tokens_per_s"] > 0 and r["floor_tokens_per_s"] > 0 and r["cpu_pairs_per_token"] > 0
        assert rows[0]["cpu_layers"] == moe_layers and 0 < rows[1]["cpu_layers"] < moe_layers
        assert rows[2]["cache_slots"] > 0 and rows[3]["skipped_per_token"] >= 0
    mla, c = result["shapes"]["quick-mla"], result["config"]
    tokens = c["prefill"] + c["new_tokens"] + c["warmup"] + c["prompt"]
    latent = mla["shape"]["mla"]["kv_lora_rank"] + mla["shape"]["mla"]["qk_rope_head_dim"]
    assert mla["kv_bytes"] == tokens * mla["shape"]["num_layers"] * latent * 4  # fp32 on the CPU
    assert result["demo_mixed_precision"]["4bit"] > 1 and result["rates"]["dram_read_bytes_per_s"] > 0


def test_hybrid_bench_big_shape_stand_ins(tmp_path):
    """The big shapes' tiny stand-ins, 2 of their layers: figures measured and scaled to full depth, labelled so in
    the JSON and the printed table; GPT-OSS's MXFP4 experts skip the low-bit columns."""
    printed = []
    result = quick_json("hybrid", tmp_path, "--shapes", "deepseek-v3,qwen3-235b,gpt-oss-120b", "--layers", "2",
                        "--columns", "cpu,hybrid,hybrid+mixed", "--ppl-tokens", "64", stdout=printed)
    for name, full in (("deepseek-v3", 61), ("qwen3-235b", 94), ("gpt-oss-120b", 36)):
        shape = result["shapes"][name]
        assert (shape["layers"], shape["full_layers"]) == (2, full)
        assert shape["depth"] == f"scaled from 2 of {full} layers"
        assert f"{name}: batch 1, {shape['expert_precision']} experts; full-depth columns scaled from 2 of {full} " \
               "layers" in printed[0]
        rows = shape["rows"]
        assert [r["column"] for r in rows] == (["cpu", "hybrid"] if name == "gpt-oss-120b" else
                                               ["cpu", "hybrid", "hybrid+mixed"])
        for r in rows:
            assert r["depth"] == shape["depth"]
            assert r["tg_tokens_per_s_full_depth"] == pytest.approx(r["tg_tokens_per_s"] * 2 / full)
    assert result["shapes"]["gpt-oss-120b"]["expert_precision"] == "MXFP4"
    assert "hybrid+mixed: skipped (MXFP4" in printed[0]


def test_gptoss_sweep_quick(tmp_path):
    """bench/gptoss.py --quick --sweep in Triton's interpreter: each candidate Mxfp4Config timed with its error
    against the per-expert loop, then the block with the fastest one (the H200 sweep's code path, minus the GPU)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, str(BENCH / "gptoss.py"), "--quick", "--sweep", "--threads", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = tmp_path.glob("gptoss-*.json")
    sweep = json.loads(path.read_text())["sweep"]
    assert [t["tokens"] for t in sweep["tokens"]] == [1, 4]
    for entry in sweep["tokens"]:
        assert len(entry["candidates"]) == 2 and entry["experts_floor_ms"] > 0
        for c in entry["candidates"]:
            assert c["ms"] > 0 and c["rel_err"] < 1e-5 and c["path"] == "gemv", c  # fp32 x: CUDA cores
        assert entry["best"] in [c["config"] for c in entry["candidates"]] and entry["block_graph_ms"] > 0
