"""The footprint ledger (plan/footprint.py) against the bytes of the tensors a run really allocates: tiny models of
several families loaded through moeserve.runtime in each placement (resident float, a 4-bit checkpoint, --cpu-moe,
--n-cpu-moe 1 with cache slots, --offload), on the CPU in fp32; the precisions against real modules; the slot
sizing. GPU totals against torch's peak: tests/test_gpu.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import moeserve
from hf_models import write_mxfp4_pair
from moeserve.compress import QuantConfig, quantize_checkpoint
from moeserve.errors import MoeserveError
from moeserve.loader import is_routed_expert
from moeserve.model.kv_cache import KVCache, SlotKVCache
from moeserve.offload.store import ExpertStore
from moeserve.plan.footprint import (WORKSPACE_SHARE, Footprint, Precision, activation_bytes, engine_kv_rows,
                                     expert_bytes, footprint, hybrid_layout, kv_cache_bytes, offload_layout,
                                     plan_slots, resident_layout)
from moeserve.quant.mxfp4 import quantize as mxfp4_quantize
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.quant import hqq
from moeserve.spec import ModelSpec

# GQA; shared experts and a dense layer; MLA latents; expert biases and sliding windows; dense and NoPE layers
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v2_lite", "gpt_oss", "llama4"]
BATCH, TOKENS = 2, 24


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors` (tied weights count once), meta tensors left out."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def model_bytes(model) -> tuple[int, int]:
    """(dense, routed experts) bytes a loaded model holds: its parameters and buffers (packed weights of quantized
    layers are buffers) but the rotary tables, which are computed, not weights."""
    named = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if not n.startswith("rotary.")]
    routed = [is_routed_expert(n) or ".mlp.experts." in n for n, _ in named]  # float, packed or quantized
    return (tensor_bytes(t for (_, t), r in zip(named, routed) if not r),
            tensor_bytes(t for (_, t), r in zip(named, routed) if r))


def store_bytes(store: ExpertStore, low: bool) -> int:
    return sum(p.nbytes for i in store.meta["layers"] for e in range(store.meta["num_experts"])
               for p in store.host_parts(i, e, low))


def llm(path, **options) -> moeserve.LLM:
    return moeserve.LLM(path, max_batch=BATCH, context=TOKENS, device="cpu", dtype="float32", **options)


def check_kv(spec: ModelSpec, need: Footprint) -> None:
    """The engine's KV cache for BATCH sequences of TOKENS is the ledger's KV part."""
    kv = SlotKVCache(spec, BATCH, TOKENS, "cpu", torch.float32)
    assert tensor_bytes([kv.k, kv.v]) == need.host["KV cache"]


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_float_counts_the_loaded_model(hf_checkpoints, family):
    path = hf_checkpoints[family][1]
    run = llm(path)
    spec = run.model.spec
    need = footprint(spec, resident_layout(spec, "cpu", 4, engine_kv_rows(BATCH), TOKENS))
    assert model_bytes(run.model) == (need.host["dense weights"], need.host["resident experts"])
    assert need.gpu == {} and need.host["expert store"] == 0
    check_kv(spec, need)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_resident_dense_bits_8(hf_checkpoints, family):
    path = hf_checkpoints[family][1]
    run = llm(path, dense_bits=8)
    spec = run.model.spec
    need = footprint(spec, resident_layout(spec, "cpu", 4, engine_kv_rows(BATCH), TOKENS, dense_bits=8))
    assert model_bytes(run.model) == (need.host["dense weights"], need.host["resident experts"])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_4bit_checkpoint_counts_its_packed_experts(hf_checkpoints, tmp_path, family):
    """A 4-bit HQQ checkpoint (experts only, no ranks): QuantizedExperts' codes, scales and zeros (and biases)."""
    out = tmp_path / "q4"
    quantize_checkpoint(hf_checkpoints[family][1], out, QuantConfig(
        bits=4, group=16, method="hqq", ranks="uniform:0", skip=("attention", "dense_ffn", "shared_expert")),
        progress=False)
    run = llm(out)
    spec = run.model.spec
    need = footprint(spec, resident_layout(spec, "cpu", 4, engine_kv_rows(BATCH), TOKENS,
                                           precision=Precision.hqq(4, 16, 4)))
    assert model_bytes(run.model) == (need.host["dense weights"], need.host["resident experts"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options", [{"cpu_moe": True}, {"n_cpu_moe": 1, "gpu_cache_experts": 2}])
def test_hybrid_counts_resident_layers_store_and_slots(hf_checkpoints, family, options):
    """--cpu-moe / --n-cpu-moe 1 with 2 cache slots: the model's resident experts, the store built in RAM (float
    copies in fp32 of the CPU layers) and the slot pool."""
    path = hf_checkpoints[family][1]
    run = llm(path, **options)
    spec, placement = run.model.spec, run.plan.hybrid
    need = footprint(spec, hybrid_layout(spec, placement, "cpu", 4, engine_kv_rows(BATCH), TOKENS, 0, 64))
    assert model_bytes(run.model) == (need.host["dense weights"], need.host["resident experts"])
    store = run.runtime.hybrid.host.store
    assert store_bytes(store, low=False) == need.host["expert store"] > 0
    cache = run.runtime.hybrid.cache
    slots = 0 if cache is None else tensor_bytes(cache.pool.buffers)
    assert slots == need.host["cache slots"] == placement.cache_slots * expert_bytes(spec, Precision.float(4))
    check_kv(spec, need)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_hybrid_low_bit_counts_the_store_and_the_cpu_copy(hf_checkpoints, family):
    """--cpu-moe --experts-bits 4: the store's 4-bit copies of every MoE layer, and the ledger's second copy the
    CPU kernels repack (counted, not measured here)."""
    path = hf_checkpoints[family][1]
    run = llm(path, cpu_moe=True, experts_bits=4)
    spec, placement = run.model.spec, run.plan.hybrid
    store = run.runtime.hybrid.host.store
    low_bits, group = store.meta["low_bits"], store.meta["group"]
    need = footprint(spec, hybrid_layout(spec, placement, "cpu", 4, engine_kv_rows(BATCH), TOKENS, low_bits, group))
    low = store_bytes(store, low=True)
    assert need.host["expert store"] == 2 * low and low == sum(spec.moe.experts_at(i) for i in placement.cpu_layers) \
        * store.expert_bytes(True)
    assert model_bytes(run.model) == (need.host["dense weights"], 0)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2_lite", "gpt_oss"])
def test_offload_counts_the_store_and_the_slot_pools(hf_checkpoints, tmp_path, family):
    """--offload STORE --high-slots 4 --all-high: no routed expert in the model; the store's float and 4-bit copies
    in host RAM; 4 + top_k float slots (the reserve for experts in flight)."""
    path = hf_checkpoints[family][1]
    ExpertStore.build(path, tmp_path / "s", low_bits=4, group=8)
    run = llm(path, offload=str(tmp_path / "s"), high_slots=4, all_high=True)
    spec = run.model.spec
    need = footprint(spec, offload_layout(spec, 4, engine_kv_rows(BATCH), TOKENS, 4 + spec.moe.top_k, 0,
                                          Precision.hqq(4, 8, 4)))
    dense, experts = model_bytes(run.model)
    assert (dense, experts) == (need.gpu["dense weights"], 0)
    store = run.runtime.cache.store
    assert store_bytes(store, False) + store_bytes(store, True) == need.host["expert store"]
    pools = run.runtime.cache.pools
    assert sum(tensor_bytes(p.buffers) for p in pools) == need.gpu["cache slots"]


def test_precisions_against_real_tensors():
    """HQQ: a QuantizedLinear's codes, scales and zeros, for a width the packing pads; MXFP4: blocks and scales."""
    for bits, rows, cols, group in ((4, 24, 64, 16), (3, 40, 96, 32), (8, 16, 80, 16)):
        q = QuantizedLinear.from_quantized(hqq.quantize_hqq(torch.randn(rows, cols), bits, group))
        assert tensor_bytes(q.buffers()) == Precision.hqq(bits, group).matrix_bytes(rows, cols)
    blocks, scales = mxfp4_quantize(torch.randn(3, 64, 96))
    assert blocks.nbytes + scales.nbytes == 3 * Precision.mxfp4(2).matrix_bytes(64, 96)
    assert Precision.float(4).matrix_bytes(3, 5) == 60
    with pytest.raises(MoeserveError, match="unknown weight precision"):
        Precision("fp7").matrix_bytes(1, 1)


def test_mxfp4_checkpoint_keeps_its_experts_packed(hf_checkpoints, tmp_path):
    src = hf_checkpoints["gpt_oss"][1]
    packed, twin = tmp_path / "packed", tmp_path / "twin"
    packed.mkdir(), twin.mkdir()
    write_mxfp4_pair(src, packed, twin)
    run = llm(packed)
    spec = run.model.spec
    need = footprint(spec, resident_layout(spec, "cpu", 4, engine_kv_rows(BATCH), TOKENS))
    assert spec.moe.experts_mxfp4 and model_bytes(run.model) == (need.host["dense weights"],
                                                              need.host["resident experts"])


def test_kv_cache_of_the_prompt_cache_and_mla(hf_checkpoints):
    """KVCache (prompt passes, pipeline): keys and values, or MLA's latents alone."""
    for family in ("mixtral_sliding", "deepseek_v2"):
        spec = ModelSpec.from_dir(hf_checkpoints[family][1])
        kv = KVCache(spec, 3, 10, "cpu", torch.bfloat16)
        assert tensor_bytes([kv.k, kv.v]) == kv_cache_bytes(spec, 3, 10, 2)
        assert (kv.v is None) == (spec.attention.mla is not None)


def test_workspace_is_the_activations_or_the_budget_share():
    spec = ModelSpec.from_dir(moeserve.DEMO_MODEL)
    run = resident_layout(spec, "cuda", 2, 2, 64)
    act = activation_bytes(spec, 1, 1, 2)
    assert footprint(spec, run).gpu["workspace"] == act
    big = footprint(spec, resident_layout(spec, "cuda", 2, 2, 64, budget=10 * 2**30))
    assert big.gpu["workspace"] == int(10 * 2**30 * WORKSPACE_SHARE)
    assert big.gpu_total == sum(big.gpu.values()) and big.table()[-1] == ("gpu", "total", big.gpu_total)


def test_plan_slots_fill_the_budget_after_the_dense_part():
    spec = ModelSpec.from_dir(moeserve.DEMO_MODEL)
    high, low = expert_bytes(spec, Precision.float(2)), expert_bytes(spec, Precision.hqq(4, 64))
    base = resident_layout(spec, "cuda", 2, 2, 64, budget=192 << 20, experts=False)
    fixed = footprint(spec, base).gpu_total
    h, lo = plan_slots(spec, base, high, low, reserve=2)
    left = (192 << 20) - fixed - 2 * (high + low)
    assert h * high + lo * low <= left < (h + 1) * high + lo * low and lo == int(left * 0.25 // low)
    assert plan_slots(spec, base, high, low, reserve=2, max_slots=5) == (5, 5)
    with pytest.raises(MoeserveError, match="too small: .* need .*; give at least that"):
        dense = footprint(spec, base).gpu["dense weights"]
        plan_slots(spec, resident_layout(spec, "cuda", 2, 2, 64, budget=dense, experts=False), high, low, reserve=2)


def test_cli_plan_prints_the_chosen_footprint(capsys, mixtral, h100_json):
    """`moeserve plan`: the chosen candidate's bytes per device and part after the table (they add up to its GPU
    and host columns), and each candidate's footprint in --json."""
    from moeserve.cli import main
    from moeserve.units import format_bytes

    base = ["plan", "--model", mixtral, "--profile", h100_json, "--cpu-memory", "200GiB", "--gpu-memory", "12GiB"]
    assert main([str(a) for a in base + ["--json"]]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = report["candidates"][report["chosen"]]
    parts = chosen["footprint"]
    assert sum(parts["gpu"].values()) == chosen["gpu_bytes"] and sum(parts["host"].values()) == chosen["host_bytes"]
    assert parts["gpu"]["resident experts"] > 0 and parts["host"]["expert store"] > 0
    assert main([str(a) for a in base]) == 0
    table = capsys.readouterr().out.split("\nmemory of *:\n")[1].splitlines()
    assert table[0].split() == ["gpu", "dense", "weights", *format_bytes(parts["gpu"]["dense weights"]).split()]
    totals = [line.split() for line in table if " total " in line]
    assert totals == [["gpu", "total", *format_bytes(chosen["gpu_bytes"]).split()],
                      ["host", "total", *format_bytes(chosen["host_bytes"]).split()]]


def test_cublas_workspaces_one_per_stream(monkeypatch):
    """A GPU run holds the default stream's cuBLAS workspace, and the capture stream's when it decodes in CUDA
    graphs; CUBLAS_WORKSPACE_CONFIG sets their size."""
    spec = ModelSpec.from_dir(moeserve.DEMO_MODEL)
    graphs = footprint(spec, resident_layout(spec, "cuda", 2, 2, 64))
    eager = footprint(spec, replace(resident_layout(spec, "cuda", 2, 2, 64), blas_workspaces=1))
    assert graphs.gpu["cuBLAS workspaces"] == 2 * eager.gpu["cuBLAS workspaces"] == 2 * 32 * 2**20
    assert "cuBLAS workspaces" not in footprint(spec, resident_layout(spec, "cpu", 4, 2, 64)).host
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert footprint(spec, replace(resident_layout(spec, "cuda", 2, 2, 64), blas_workspaces=1)).gpu[
        "cuBLAS workspaces"] == 4096 * 1024 * 2 + 16 * 1024 * 8
