"""The placement planner (plan/placement.py): bytes and estimates by hand on a tiny shape, the choice rules on the
Mixtral-8x7B shape with an H100 profile, the checks; `moeserve plan --for decode`, and `--gpu-memory` planning the
run of generate / eval ppl on a CPU-only machine (everything on the CPU). GPU runs: tests/plan/test_gpu_placement.py."""

import dataclasses
import json

import pytest

from checks import GiB, H100, MIXTRAL_CONFIG, QWEN3_30B_CONFIG
from moeserve.cli import main
from moeserve.errors import MoeserveError
from moeserve.hybrid import memory
from moeserve.plan.footprint import (WORKSPACE_SHARE, Precision, activation_bytes, blas_workspace_bytes,
                                     checkpoint_precision, dense_bytes, expert_bytes, kv_cache_bytes, minimum_budget)
from moeserve.plan.hardware import HardwareProfile
from moeserve.plan.placement import (PRECISION_SPEEDUP, Costs, PlanRequest, candidates, choose, dense_minimum,
                                     plan_placement)
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes

# D 64, 2 heads of 32, 1 KV head, 4 experts of FFN 128, top-2, 2 MoE layers, vocabulary 100
TINY = ModelSpec.of(family="mixtral", vocab_size=100, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=32, max_position_embeddings=256, num_experts=4, top_k=2, expert_ffn=128,
                 moe_layers=(True, True), sliding_windows=(None, None))
# round rates for arithmetic by hand
HW = HardwareProfile(cpu_name="cpu", cpu_cores=4, cpu_fp32_flops=1e10, cpu_bf16_flops=1e10, dram_bandwidth=1e8,
                     ram_bytes=64 * GiB, gpu_name="gpu", gpu_flops=1e12, hbm_bandwidth=1e9, gpu_memory_bytes=GiB,
                     h2d_bandwidth=1e8)
COSTS = Costs(graph_layer_s=1e-4, eager_layer_s=1e-3, host_layer_s=1e-2, cpu_call_s=1e-4, cpu_dram_share=0.5,
              cpu_flops_share=0.5, gpu_flops_share=0.5)


def mixtral_request(budget_gib: float, **options) -> PlanRequest:
    return PlanRequest(int(budget_gib * GiB), 200 * GiB, 2, kv_tokens=640, **options)


@pytest.mark.parametrize("prompt", [32, 16])
def test_tiny_hybrid_candidate_by_hand(monkeypatch, prompt):
    """Budget for the dense part, the KV cache, one layer's experts, the 2-expert streaming ring and one slot: 1 CPU
    layer, 1 slot over its 4 experts (hit rate 1/4); bytes and both rates worked out from the roofline and the
    costs. A prompt of STREAM_FROM (32) tokens streams the CPU layer's experts to the GPU, one of 16 runs them on
    the CPU."""
    monkeypatch.setattr(memory, "STREAM_RING_BYTES", 1)  # the smallest ring: 2 experts
    eb = 3 * 64 * 128 * 2  # one bf16 expert
    assert expert_bytes(TINY, Precision.float(2)) == eb
    dense = TINY.parameter_counts()["dense"] * 2
    assert dense_bytes(TINY, 2) == dense
    kv = 2 * 2 * 2 * 40 * 32 * 2  # k and v, 2 layers, 1 sequence and the spare row of 40 tokens, 1 head of 32, bf16
    assert kv_cache_bytes(TINY, 2, 40, 2) == kv
    # the prompt's activations: per token 4 D, queries and the new k and v (2 x 32 + 2 x 32), gate and up of the
    # 2 experts (2 x 2 x 128), bf16; fp32 logits of one row; the budget's WORKSPACE_SHARE when that is more (the two
    # cuBLAS workspaces make this tiny model's budget large beside its activations)
    activations = prompt * (4 * 64 + 128 + 2 * 256) * 2 + 100 * 4
    blas = 2 * blas_workspace_bytes()  # the default stream's and the graph capture stream's
    budget = int((dense + kv + blas + 7.5 * eb) / (1 - WORKSPACE_SHARE))
    workspace = max(activations, int(budget * WORKSPACE_SHARE))
    fixed = dense + kv + workspace + blas
    req = PlanRequest(budget, GiB, 2, kv_tokens=40, prompt_len=prompt, gen_len=8, bits=16)
    resident, hybrid = candidates(TINY, HW, req, COSTS)
    assert resident.kind == "resident" and not resident.fits and "GPU memory" in resident.problem
    assert (hybrid.kind, hybrid.cpu_layers, hybrid.cache_slots, hybrid.fits) == ("hybrid", 1, 1, True)
    assert hybrid.gpu_bytes == fixed + 7 * eb  # 4 resident experts, 1 slot, the ring's 2
    assert hybrid.footprint.gpu == {"dense weights": dense, "resident experts": 4 * eb, "KV cache": kv,
                                    "cache slots": eb, "stream ring": 2 * eb if prompt >= 32 else 0,
                                    "workspace": workspace, "cuBLAS workspaces": blas} or prompt < 32

    # decode: dense weights but the embedding table, KV of prompt + 4 positions; 1.25 layers' experts on the GPU (a
    # resident layer and a quarter of the CPU layer's picks hit the cache), 0.75 on the CPU
    D, V = 64, 100
    dense_read = dense - V * D * 2 + kv_cache_bytes(TINY, 1, prompt + 4, 2)  # the LM head is read, no embedding row
    gpu_s, cpu_s = (dense_read + 1.25 * 2 * eb) / 1e9, 0.75 * 2 * eb / (0.5 * 1e8)
    decode_s = max(gpu_s, cpu_s) + 2 * 1e-3 + 1 * 1e-2 + 0.75 * 2 * 1e-4  # 2 eager layers, 1 host layer, CPU calls
    assert hybrid.decode_tok_s == pytest.approx(1 / decode_s, rel=1e-9)

    # prefill of T tokens: the experts of a layer it touches (top-2 of 4: 4 (1 - (1/2)^T)); dense FLOPs per token 2 x
    # layer weights, attention 4 x T tokens x (T + 1) / 2 positions x 64 x 2 layers, the head on the last token
    touched = 4 * (1 - 0.5 ** prompt)
    layers = dense // 2 - 2 * V * D - D
    expert_flops = 2 * prompt * 2 * 3 * 64 * 128
    on_gpu = 2 if prompt >= 32 else 1.25  # streamed: the CPU layer's share too
    gpu_flops = 2 * prompt * layers + 2 * V * D + 4 * prompt * (prompt + 1) / 2 * 64 * 2 + on_gpu * expert_flops
    gpu_bytes = (layers + V * D) * 2 + kv_cache_bytes(TINY, 1, (prompt + 1) // 2, 2) + on_gpu * touched * eb
    pre_gpu = max(gpu_flops / (0.5 * 1e12), gpu_bytes / 1e9)
    if prompt >= 32:  # the CPU layer's missed share copied over the link (1e8 B/s), no CPU work
        rest = 0.75 * touched * eb / 1e8
    else:
        rest = max(0.75 * expert_flops / (0.5 * 1e10), 0.75 * touched * eb / (0.5 * 1e8)) + 0.75 * touched * 1e-4
    prefill_s = pre_gpu + rest + 2 * 1e-3 + 1e-2
    assert hybrid.prefill_tok_s == pytest.approx(prompt / prefill_s, rel=1e-9)


def test_choice_on_the_mixtral_shape():
    spec = ModelSpec.from_hf_config(MIXTRAL_CONFIG)
    hw = HardwareProfile.from_dict(H100)
    # everything fits in bf16: the exact resident placement, though 4-bit would be faster
    plan = plan_placement(spec, hw, mixtral_request(100))
    assert (plan.chosen.kind, plan.chosen.bits) == ("resident", 16) and plan.chosen.flags() == []
    # 24 GiB: no float placement comes close; 3-bit resident is more than twice as fast as 4-bit hybrid
    plan = plan_placement(spec, hw, mixtral_request(24))
    by = {(c.kind, c.bits): c for c in plan.candidates}
    assert (plan.chosen.kind, plan.chosen.bits) == ("resident", 3)
    assert by["hybrid", 4].decode_tok_s > PRECISION_SPEEDUP * by["hybrid", 16].decode_tok_s
    assert by["resident", 3].decode_tok_s > PRECISION_SPEEDUP * by["hybrid", 4].decode_tok_s
    assert by["offload", 16].fits and plan.chosen.flags() == ["--n-cpu-moe", "0", "--experts-bits", "3"]
    # 12 GiB: 4-bit hybrid, the fewest CPU layers whose complement (and the streaming ring) fits, the rest of the
    # budget as cache slots; the dense part 8-bit (it leaves fewer layers' experts on the CPU: test_dense_bits_*)
    plan = plan_placement(spec, hw, mixtral_request(12))
    c = plan.chosen
    assert (c.kind, c.bits, c.dense_bits) == ("hybrid", 4, 8) and c.gpu_bytes <= 12 * GiB  # the workspace in it
    eb = expert_bytes(spec, Precision.hqq(4, 64))
    assert c.footprint.gpu["workspace"] == int(12 * GiB * WORKSPACE_SHARE) and c.gpu_bytes + eb > 12 * GiB  # no more
    assert c.cache_slots < spec.moe.num_experts  # else one layer fewer on the CPU
    slots = ["--gpu-cache-experts", str(c.cache_slots)] if c.cache_slots else []
    assert c.flags() == ["--n-cpu-moe", str(c.cpu_layers), "--experts-bits", "4", *slots, "--dense-bits", "8"]
    line = plan.describe()
    assert line.startswith("[plan: ") and f"{c.cpu_layers}/32 MoE layers' experts on the CPU (4-bit)" in line
    assert "; dense part 8-bit (auto: " in line and "estimated tg" in line and "\n" not in line
    # no store: offload is rated, never chosen
    only_offload = [dataclasses.replace(c, decode_tok_s=1e6) if c.kind == "offload" else c for c in plan.candidates]
    assert choose(only_offload) is c


def test_explicit_flags_narrow_the_candidates():
    spec = ModelSpec.from_hf_config(MIXTRAL_CONFIG)
    hw = HardwareProfile.from_dict(H100)
    cands = candidates(spec, hw, mixtral_request(24, bits=4))
    assert {c.bits for c in cands} == {4} and not any(c.kind == "offload" for c in cands)
    plan = plan_placement(spec, hw, mixtral_request(24, cpu_layers=32, cache_slots=7))
    assert all(c.cpu_layers == 32 and c.cache_slots == 7 for c in plan.candidates)
    assert plan.chosen.flags()[:1] == ["--cpu-moe"]
    with pytest.raises(MoeserveError, match="--experts-bits 5 is not one of"):
        candidates(spec, hw, mixtral_request(24, bits=5))


def test_budget_and_host_ram_errors_name_what_is_needed():
    spec = ModelSpec.from_hf_config(MIXTRAL_CONFIG)
    hw = HardwareProfile.from_dict(H100)
    need = dense_minimum(spec, mixtral_request(0))
    assert need > (dense_bytes(spec, 2) + kv_cache_bytes(spec, 1, 640, 2)) / (1 - WORKSPACE_SHARE)
    with pytest.raises(MoeserveError, match=r"cannot hold the dense part of the model: .* need 3\.\d GiB; give at "):
        plan_placement(spec, hw, mixtral_request(2, dense_bits=16))
    plan_placement(spec, hw, mixtral_request(need / GiB, dense_bits=16))  # the minimum itself runs
    with pytest.raises(MoeserveError, match="not enough host RAM for the experts: .* needs .* GiB, 1.0 GiB is avail"):
        plan_placement(spec, hw, dataclasses.replace(mixtral_request(12), host_ram=GiB))


def qwen3_request(budget_gib: float = 8, **options) -> PlanRequest:
    """Qwen3-30B-A3B with 4-bit experts in budget_gib of GPU memory (the shape llama.cpp fits 18 layers' experts of
    on the GPU at 8 GiB with its dense part in Q8_0)."""
    return PlanRequest(int(budget_gib * GiB), 200 * GiB, 2, kv_tokens=640, bits=4, **options)


def test_dense_bits_8_counts_its_bytes_and_puts_fewer_layers_on_the_cpu():
    """The dense part's linear layers of Qwen3-30B-A3B: per layer q [4096, 2048], k and v [512, 2048], o [2048, 4096],
    and the LM head [151936, 2048]; at 8 bits a weight takes a byte and its group of 64 an fp16 scale and zero:
    1.0625 bytes instead of 2. The bytes saved hold that many more layers' experts on the GPU at the same budget."""
    spec = ModelSpec.from_hf_config(QWEN3_30B_CONFIG)
    hw = HardwareProfile.from_dict(H100)
    weights = 48 * (2 * 4096 * 2048 + 2 * 512 * 2048) + 151936 * 2048
    saved = weights * 2 - weights * 17 // 16
    assert dense_bytes(spec, 2, 8) == dense_bytes(spec, 2) - saved
    bf16 = plan_placement(spec, hw, qwen3_request(dense_bits=16))
    q8 = plan_placement(spec, hw, qwen3_request(dense_bits=8))
    a, b = bf16.chosen, q8.chosen
    assert (a.kind, a.bits, a.dense_bits, b.kind, b.bits, b.dense_bits) == ("hybrid", 4, 16, "hybrid", 4, 8)
    layer = spec.moe.num_experts * expert_bytes(spec, Precision.hqq(4, 64))
    assert b.cpu_layers <= a.cpu_layers - saved // layer and b.decode_tok_s > a.decode_tok_s
    assert b.flags()[-2:] == ["--dense-bits", "8"] and "--dense-bits" not in a.flags()
    assert "; dense part bfloat16; GPU " in bf16.describe() and "; dense part 8-bit; GPU " in q8.describe()
    # not given: the 8-bit dense candidate, since it puts fewer layers' experts on the CPU; the plan line says why
    auto = plan_placement(spec, hw, qwen3_request())
    assert auto.chosen == b and auto.candidates[-1] is auto.chosen and a in auto.candidates
    assert (f"; dense part 8-bit (auto: {a.cpu_layers - b.cpu_layers} fewer MoE layers' experts on the CPU than with "
            f"it in bfloat16; --dense-bits 16 keeps bfloat16); GPU ") in auto.describe()
    # where 8 bits cannot put fewer layers on the CPU (their number given, or every expert resident) it stays float
    fixed = plan_placement(spec, hw, qwen3_request(cpu_layers=a.cpu_layers))
    assert fixed.chosen.dense_bits == 16 and fixed.dense_reason is None
    assert plan_placement(spec, hw, qwen3_request(100)).chosen.dense_bits == 16


def test_minimum_budget_names_the_dense_bits_in_force():
    """Below the float dense part's minimum: refused with --dense-bits 16, the 8-bit dense part when not given; below
    the 8-bit minimum refused, naming it."""
    spec = ModelSpec.from_hf_config(QWEN3_30B_CONFIG)
    hw = HardwareProfile.from_dict(H100)
    least16, least8 = dense_minimum(spec, qwen3_request(0)), dense_minimum(spec, qwen3_request(0), 8)
    assert least8 < least16
    between = (least8 + least16) / 2 / GiB
    with pytest.raises(MoeserveError, match=rf"model: attention, .* need {format_bytes(least16)}; give at least"):
        plan_placement(spec, hw, qwen3_request(between, dense_bits=16))
    plan = plan_placement(spec, hw, qwen3_request(between))
    assert plan.chosen.dense_bits == 8 and "(auto: no placement fits with it in bfloat16)" in plan.describe()
    for dense_bits in (8, None):
        with pytest.raises(MoeserveError, match=rf"cannot hold the dense part of the model with 8-bit linear layers "
                                                rf"\(--dense-bits 8\): .* need {format_bytes(least8)}; give at least"):
            plan_placement(spec, hw, qwen3_request((least8 - 1) / GiB, dense_bits=dense_bits))


def test_cpu_only_plans_everything_on_the_cpu():
    spec = ModelSpec.from_hf_config(MIXTRAL_CONFIG)
    hw = dataclasses.replace(HardwareProfile.from_dict(H100), gpu_name=None, gpu_flops=None, hbm_bandwidth=None)
    req = PlanRequest(None, 200 * GiB, 4, "float32")
    plan = plan_placement(spec, hw, req)
    assert {c.kind for c in plan.candidates} == {"cpu"} and (plan.chosen.bits, plan.chosen.gpu_bytes) == (16, 0)
    assert plan.chosen.flags() == ["--device", "cpu"] and "no GPU" in plan.describe()
    small = plan_placement(spec, hw, dataclasses.replace(req, host_ram=60 * GiB))  # fp32 experts do not fit RAM
    assert small.chosen.bits in (4, 3) and small.chosen.flags()[:3] == ["--device", "cpu", "--cpu-moe"]
    with pytest.raises(MoeserveError, match="the hardware profile has no GPU figures"):
        candidates(spec, hw, mixtral_request(12))  # a GPU budget with a profile of a machine without one


def test_host_bytes_are_those_of_the_moe_layers_on_the_cpu():
    """A first dense layer (PR-MoE's pyramid of 0, 4 and 8 experts): the CPU layers are the first MoE layers, so the
    store of one CPU layer holds 4 experts and of two 4 + 8."""
    from prmoe_models import tiny_arch

    spec = ModelSpec.from_hf_config(tiny_arch(experts=(0, 4, 8)).hf_config(64))
    for n, experts in ((1, 4), (2, 12)):
        (c,) = candidates(spec, HW, PlanRequest(GiB, 64 * GiB, 2, bits=16, cpu_layers=n), COSTS)
        assert (c.kind, c.cpu_layers, c.moe_layers) == ("hybrid", n, 2)
        assert c.host_bytes == experts * expert_bytes(spec, Precision.float(2))


def test_cli_plan_for_decode_of_an_mla_model(capsys, hf_checkpoints, h100_json):
    """DeepSeek-V2-Lite (MLA, a dense first layer, two shared experts): the plan's GPU bytes are the dense part
    (every tensor of the checkpoint but the routed experts), MLA's latent KV cache (kv_lora_rank + qk_rope_head_dim
    values per token and layer, not keys and values per head) and the two MoE layers' experts; a budget with room
    for 1.5 layers' experts puts both MoE layers on the CPU, the streaming ring and cache slots in the rest."""
    hf, path = hf_checkpoints["deepseek_v2_lite"]
    spec = ModelSpec.from_dir(path)
    m, tokens = spec.attention.mla, spec.max_position_embeddings  # prompt 128 + 128 generated
    dense = 2 * sum(p.numel() for name, p in hf.named_parameters() if ".mlp.experts." not in name)
    kv = 2 * tokens * spec.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2  # a sequence and the spare row
    expert = 3 * spec.hidden_size * spec.moe.expert_ffn * 2
    layer = spec.moe.num_experts * expert
    activations = activation_bytes(spec, 128, 1, 2)
    blas = 2 * blas_workspace_bytes()
    budget = minimum_budget(dense + kv + blas + int(1.5 * layer), activations)
    workspace = max(activations, int(budget * WORKSPACE_SHARE))
    base = ["plan", "--model", path, "--profile", h100_json, "--cpu-memory", "1GiB", "--json", "--dense-bits", "16"]
    assert main([str(a) for a in base + ["--gpu-memory", f"{budget}B"]]) == 0
    report = json.loads(capsys.readouterr().out)
    resident, hybrid, offload = report["candidates"]  # float experts only: no group divides expert FFN 24
    assert (resident["kind"], resident["fits"], resident["gpu_bytes"]) == ("resident", False,
                                                                        dense + kv + 2 * layer + workspace + blas)
    slots = int(0.5 * layer) // expert  # 1.5 layers' room less the ring of a layer's experts
    assert hybrid["where"] == f"2/2 MoE layers' experts on the CPU (bfloat16), {slots} GPU cache slots"
    assert hybrid["gpu_bytes"] == dense + kv + workspace + blas + (spec.moe.num_experts + slots) * expert
    assert hybrid["streams"]
    assert hybrid["host_bytes"] == 2 * layer and report["chosen"] == 1
    assert hybrid["flags"] == ["--cpu-moe", "--gpu-cache-experts", str(slots)] and offload["kind"] == "offload"


def test_cli_plan_for_decode_table_and_json(capsys, mixtral, h100_json):
    base = ["plan", "--model", mixtral, "--profile", h100_json, "--cpu-memory", "200GiB"]
    assert main([str(a) for a in base + ["--gpu-memory", "12GiB"]]) == 0
    out = capsys.readouterr().out
    chosen = [ln for ln in out.splitlines() if ln.startswith("*  ")]
    assert len(chosen) == 1 and "MoE layers' experts on the CPU (4-bit)" in chosen[0] and "8-bit" in chosen[0]
    assert "tg128 t/s" in out and "pp512 t/s" in out and "needs --offload STORE" in out and "dense" in out
    assert "(dense part 8-bit, auto: " in out and "by hand: --n-cpu-moe" in out
    assert main([str(a) for a in base + ["--gpu-memory", "12GiB", "--json", "--experts-bits", "16"]]) == 0
    report = json.loads(capsys.readouterr().out)
    cands = report["candidates"]  # the float dense ones, then the 8-bit dense one the planner takes
    rows = [(c["kind"], c["bits"], c["fits"], c["dense_bits"]) for c in cands]
    assert rows == [("resident", 16, False, 16), ("hybrid", 16, True, 16), ("hybrid", 16, True, 8)]
    assert report["chosen"] == 2 and cands[2]["flags"][:1] == ["--n-cpu-moe"] and report["gpu_budget"] == 12 * GiB
    assert cands[2]["cpu_layers"] < cands[1]["cpu_layers"] and report["dense_reason"].startswith("auto: ")


def test_cli_plan_errors(expect_cli_error, mixtral, h100_json, tmp_path):
    base = ["plan", "--model", mixtral, "--profile", h100_json]
    expect_cli_error(base + ["--gpu-memory", "2GiB", "--dense-bits", "16"], "cannot hold the dense part")
    expect_cli_error(base + ["--plot", tmp_path / "r.png"], "--plot belongs to the throughput plan")
    expect_cli_error(base + ["--for", "batch", "--experts-bits", "4"], "give it with --for decode")
    expect_cli_error(base + ["--for", "batch", "--dense-bits", "8"], "--dense-bits rates placements: give it with")
    expect_cli_error(base + ["--dense-bits", "4"], "argument --dense-bits: invalid choice: 4")
    expect_cli_error(base + ["--dense-bits", "eight"], "argument --dense-bits: invalid int value")
    line = expect_cli_error(base + ["--gpu-memory", "1GiB"], "the dense part of the model with 8-bit linear layers")
    least = dense_minimum(ModelSpec.from_hf_config(MIXTRAL_CONFIG), mixtral_request(0), 8)
    assert f"need {format_bytes(least)}" in line


@pytest.fixture
def quick_profile(monkeypatch):
    """This machine's profile, measured quickly into the test's cache (the first call measures)."""
    monkeypatch.setenv("MOESERVE_PROFILE_QUICK", "1")


def test_gpu_memory_on_a_cpu_machine_runs_the_plan(capsys, byte_model_dir, quick_profile):
    """Without a GPU the plan is everything on the CPU: the same tokens as without --gpu-memory, one plan line;
    --experts-bits 4 plans 4-bit experts on the CPU (the hybrid backend, inline)."""
    base = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "6", "--ignore-eos",
            "--device", "cpu", "HAM"]
    assert main(base) == 0
    resident = capsys.readouterr().out
    assert main(base + ["--gpu-memory", "1GiB"]) == 0
    captured = capsys.readouterr()
    assert captured.out == resident
    plans = [ln for ln in captured.err.splitlines() if ln.startswith("[plan:")]
    assert len(plans) == 1 and "everything on the CPU (float32)" in plans[0] and "no GPU" in plans[0]
    assert main(base + ["--gpu-memory", "1GiB", "--experts-bits", "4"]) == 0
    err = capsys.readouterr().err
    assert "everything on the CPU (experts 4-bit)" in err and "[hybrid experts:" in err and "[placement:" not in err
    ppl = ["eval", "ppl", "--model", str(byte_model_dir), "--device", "cpu", "--max-tokens", "64"]
    assert main(ppl) == 0
    expected = json.loads(capsys.readouterr().out)["perplexity"]
    assert main(ppl + ["--gpu-memory", "1GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == expected


def test_gpu_memory_errors_before_loading(expect_cli_error, byte_model_dir, quick_profile, monkeypatch, tmp_path):
    gen = ["generate", "--model", byte_model_dir, "--max-new-tokens", "2", "--device", "cpu", "--gpu-memory", "1GiB"]
    expect_cli_error(gen + ["--n-cpu-moe", "3"], "--n-cpu-moe 3 is outside the model's 2 MoE layers")
    expect_cli_error(gen + ["--mixed-precision"], "--mixed-precision applies to experts on the CPU")
    expect_cli_error(gen + ["--experts-bits", "16", "--cpu-threads", "2"], "--cpu-threads applies to experts on")
    expect_cli_error(gen + ["--experts-bits", "5"], "--experts-bits 5 is not one of")
    monkeypatch.setattr("moeserve.runtime.available_ram", lambda: 1000)
    line = expect_cli_error(gen, "not enough host RAM for the experts")
    assert "needs" in line and "1000 B is available" in line
    monkeypatch.undo()
    from moeserve.offload.store import ExpertStore

    store = tmp_path / "s"
    ExpertStore.build(byte_model_dir, store, low_bits=4, group=32, progress=False)
    offload = ["generate", "--model", byte_model_dir, "--device", "cpu", "--offload", store]
    expect_cli_error(offload + ["--gpu-memory", "64KiB", "x"], "cannot hold the dense part", watch=store)


def test_help_explains_planning_and_bench(capsys):
    for argv, phrases in ((["generate", "--help"], ("placement planner", "--gpu-memory SIZE")),
                          (["eval", "ppl", "--help"], ("placement planner",)),
                          (["plan", "--help"], ("--for {decode,batch}", "--experts-bits B", "--dense-bits {16,8}")),
                          (["bench", "--help"], ("-p P", "-n N", "-r R", "peak host RSS"))):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert all(p in text for p in phrases), (argv, phrases)


def test_serve_checks_the_plan_and_host_ram_before_listening(expect_cli_error, byte_model_dir, quick_profile,
                                                             monkeypatch):
    pytest.importorskip("fastapi")

    def listen(*_args, **_kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr("moeserve.serve.server.run", listen)
    serve = ["serve", "--model", byte_model_dir, "--device", "cpu", "--port", "0"]
    expect_cli_error(serve + ["--gpu-memory", "1GiB", "--n-cpu-moe", "3"], "outside the model's 2 MoE layers")
    monkeypatch.setattr("moeserve.hybrid.memory.available_ram", lambda: 1000)
    expect_cli_error(serve + ["--cpu-moe"], "not enough host RAM for the experts on the CPU")


def test_mxfp4_experts_count_packed_where_they_stay_resident():
    """GPT-OSS-20B as shipped (MXFP4 experts, 9.5 GiB packed, 36 GiB as bf16): a 16 GiB budget holds every expert
    packed on the GPU, so the plan keeps them resident rather than putting layers' experts on the CPU; the layers it
    does put on the CPU (a smaller budget) are counted as the store's float copies."""
    import transformers

    cfg = transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32).to_dict()
    spec = ModelSpec.from_hf_config({**cfg, "quantization_config": {"quant_method": "mxfp4"}})
    assert spec.moe.experts_mxfp4
    packed = expert_bytes(spec, checkpoint_precision(spec, 2))
    assert packed == 3 * 2880 * 2880 * 17 // 32 + (3 * 2880) * 2
    assert packed < expert_bytes(spec, Precision.float(2)) / 3.5
    hw = HardwareProfile.from_dict(H100)
    plan = plan_placement(spec, hw, mixtral_request(16, bits=16))
    assert (plan.chosen.kind, plan.chosen.bits) == ("resident", 16)
    assert plan.chosen.gpu_bytes > 24 * 32 * packed  # the experts, packed, and the dense part
    small = plan_placement(spec, hw, mixtral_request(8, bits=16)).chosen
    assert small.kind == "hybrid" and 0 < small.cpu_layers < 24
    assert small.gpu_bytes <= 8 * GiB  # the workspace included
    float_slot = expert_bytes(spec, Precision.float(2))
    assert small.gpu_bytes >= (24 - small.cpu_layers) * 32 * packed + small.cache_slots * float_slot
