"""bench/hybrid.py's shapes as bench/offload.py's model_spec builds them: plain data whose JSON (the results record it)
builds the same spec; the deepseek shape is DeepSeek-V2-Lite as moeserve reads its config.json, and its budget
leaves a third of its MoE layers' experts on the GPU; the random model of the DeepSeek-like quick shape (MLA, a dense
first layer, shared experts) runs its MoE layers' 4-bit experts on the CPU as it runs them resident."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench")]
import hybrid  # noqa: E402
from offload import dense_model, model_spec, random_store  # noqa: E402

from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.plan.footprint import WORKSPACE_SHARE, Precision, dense_bytes, expert_bytes, kv_cache_bytes  # noqa: E402
from moeserve.quant.mxfp4 import stored_experts  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

# deepseek-ai/DeepSeek-V2-Lite's config.json (the fields moeserve reads)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 102400,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
# what a step reads and computes does not depend on these: the context length, YaRN's frequencies and softmax
# scale (the bench shape keeps the default rope, interleaved as DeepSeek's), the token ids
UNTIMED = ("max_position_embeddings", "rope", "sliding_windows", "bos_token_id", "eos_token_ids", "torch_dtype")


@pytest.mark.parametrize("name", [*hybrid.SHAPES, *hybrid.QUICK])
def test_a_shape_read_back_from_json_builds_the_same_spec(name):
    shape = {**hybrid.SHAPES, **hybrid.QUICK}[name][0]
    assert model_spec(json.loads(json.dumps(shape, allow_nan=False))) == model_spec(shape)


def test_deepseek_shape_is_deepseek_v2_lite():
    ours, theirs = model_spec(hybrid.SHAPES["deepseek"][0]), ModelSpec.from_hf_config(DEEPSEEK_V2_LITE)

    def timed(spec: ModelSpec) -> ModelSpec:
        return spec.replace(mla=dataclasses.replace(spec.attention.mla, softmax_scale=0.0), **dict.fromkeys(UNTIMED))

    assert timed(ours) == timed(theirs) and ours.attention.rope.interleave
    assert ours.moe.layer_indices() == list(range(1, 27))
    assert ours.parameter_counts()["total"] == pytest.approx(15.7e9, rel=0.005)  # DeepSeek-V2-Lite's 15.7B
    assert kv_cache_bytes(ours, 1, 1, 2) == 27 * (512 + 64) * 2  # the latent cache


def test_deepseek_budget_leaves_a_third_of_the_moe_layers_resident():
    """The hybrid column at the deepseek shape's budget, in bf16 with a default run's KV cache (16 + 8 + 128 + 512
    tokens): 8 of the 26 MoE layers' 4-bit experts on the GPU, 18 on the CPU; every layer's on the CPU in the cpu
    column."""
    shape, budget, _ = hybrid.SHAPES["deepseek"]
    spec = model_spec(shape)
    room = int(budget * (1 - WORKSPACE_SHARE)) - dense_bytes(spec, 2) - kv_cache_bytes(spec, 1, 664, 2)
    experts = expert_bytes(spec, Precision.hqq(hybrid.BITS, hybrid.GROUP))
    placement = hybrid.placement_of("hybrid", spec, room, experts, 1)
    assert placement.moe_layers == tuple(range(1, 27)) and placement.cpu_layers == tuple(range(1, 19))
    assert hybrid.placement_of("cpu", spec, room, experts, 1).cpu_layers == placement.moe_layers


def moe_block_outputs(spec: ModelSpec, store, n_cpu: int, tokens: torch.Tensor, bits: int = hybrid.BITS,
                      fill=None) -> dict:
    """MoE layer -> (its block's output, the shared experts' part of it) [B, S, D] for `tokens` through the bench's
    random model with the first n_cpu MoE layers' experts (at `bits`) on the CPU, the others' resident (fill(model)
    gives them their experts first, where the store does not)."""
    model = dense_model(spec, torch.device("cpu"), torch.float32)
    if fill is not None:
        fill(model)
    placement = HybridPlacement.choose(spec.moe.layer_indices(), n_cpu_moe=n_cpu, bits=bits)
    runtime = enable_hybrid(model, store, placement)
    blocks = {i: model.model.layers[i].mlp for i in spec.moe.layer_indices()}
    captured = {}
    hooks = [b.register_forward_hook(lambda _, args, out, i=i: captured.__setitem__(i, (args[0], out)))
             for i, b in blocks.items()]
    with torch.no_grad():
        model(tokens)
        out = {i: (y, blocks[i].shared_expert(x) if blocks[i].shared_expert is not None else None)
               for i, (x, y) in captured.items()}
    for h in hooks:
        h.remove()
    runtime.close()
    return out


def test_mla_quick_model_runs_its_experts_on_the_cpu_as_resident():
    """The store holds the MoE layers only, the dense part counts MLA, the dense FFN and the shared experts, and each
    MoE block's output (routed experts + shared ones) is the same with every MoE layer's 4-bit experts on the CPU as
    with them resident."""
    spec = model_spec(hybrid.QUICK["quick-mla"][0])
    store = random_store(spec, 1, torch.device("cpu"), torch.float32, hybrid.BITS, 32)
    assert store.meta["layers"] == spec.moe.layer_indices() == [1, 2, 3] and spec.attention.mla is not None
    assert dense_bytes(spec, 4) == 4 * spec.parameter_counts()["dense"]
    tokens = torch.randint(0, spec.vocab_size, (2, 9))
    on_cpu, resident = (moe_block_outputs(spec, store, n, tokens) for n in (3, 0))
    for i in spec.moe.layer_indices():
        (got, shared), (want, _) = on_cpu[i], resident[i]
        assert (got - shared).abs().mean() > 0.1 * got.abs().mean()  # the routed experts count
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


# the real configs' fields moeserve reads (deepseek-ai/DeepSeek-V3, Qwen/Qwen3-235B-A22B, openai/gpt-oss-120b)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 129280,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "max_position_embeddings": 40960, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "attention_bias": False}
BIG_CONFIGS = {"deepseek-v3": (DEEPSEEK_V3, 671.0e9), "qwen3-235b": (QWEN3_235B, 235.1e9),
               "gpt-oss-120b": (None, 116.8e9)}


def real_config(name: str) -> dict:
    if name == "gpt-oss-120b":
        from random_checkpoint import GPT_OSS_20B
        return {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
    return BIG_CONFIGS[name][0]


def timed(spec: ModelSpec) -> ModelSpec:
    """What a step reads and computes (UNTIMED left out; GPT-OSS's sliding windows kept: they are timed)."""
    untimed = [k for k in UNTIMED if k != "sliding_windows" or spec.family != "gpt_oss"]
    if spec.attention.mla is not None:
        spec = spec.replace(mla=dataclasses.replace(spec.attention.mla, softmax_scale=0.0))
    return spec.replace(norm_fp32=False, **dict.fromkeys(untimed))


@pytest.mark.parametrize("name", hybrid.BIG)
def test_big_shapes_are_the_real_configs(name):
    """Each big shape is its model's config.json as moeserve reads it (the untimed fields aside), at its parameter
    count; GPT-OSS's experts MXFP4 as shipped, with sinks and the window on even layers."""
    ours, theirs = model_spec(hybrid.SHAPES[name][0]), ModelSpec.from_hf_config(real_config(name))
    assert timed(ours) == timed(theirs)
    assert ours.parameter_counts()["total"] == pytest.approx(BIG_CONFIGS[name][1], rel=0.001)
    assert hybrid.expert_precision_of(ours).kind == ("mxfp4" if name == "gpt-oss-120b" else "hqq")


@pytest.mark.parametrize("name", hybrid.BIG)
def test_stand_in_keeps_the_structure_at_tiny_sizes(name):
    big, tiny = (model_spec(s) for s in (hybrid.SHAPES[name][0], hybrid.stand_in(hybrid.SHAPES[name][0])))
    assert (tiny.family, tiny.num_layers, tiny.moe.layers, tiny.moe.experts_mxfp4, tiny.attention.sinks,
            tiny.attention.mla is None, bool(tiny.moe.shared_expert_ffn), tiny.moe.router is None) == (
        big.family, big.num_layers, big.moe.layers, big.moe.experts_mxfp4, big.attention.sinks,
        big.attention.mla is None, bool(big.moe.shared_expert_ffn), big.moe.router is None)
    assert [w is None for w in tiny.attention.sliding_windows] == [w is None for w in big.attention.sliding_windows]
    assert tiny.parameter_counts()["total"] < 3e5 * tiny.num_layers


def test_fewer_layers_keep_the_dense_share_and_the_resident_share():
    """--layers N: DeepSeek-V3's dense layers in the full depth's share; the GPU budget keeps the same share of MoE
    layers resident (15 of 58 at full depth); the full budget back at full depth."""
    shape, budget, _ = hybrid.SHAPES["deepseek-v3"]
    assert hybrid.shape_at(shape, None) is shape and hybrid.shape_at(shape, 61) is shape
    assert hybrid.shape_at(shape, 20)["dense_layers"] == 1 and hybrid.shape_at(shape, 8)["dense_layers"] == 0
    with pytest.raises(SystemExit, match="outside 1..61"):
        hybrid.shape_at(shape, 62)
    full = model_spec(shape)
    assert hybrid.budget_at(full, full, budget, 664, 2) == pytest.approx(budget, abs=2)
    experts = expert_bytes(full, hybrid.expert_precision_of(full))

    def resident(spec) -> int:
        b = hybrid.budget_at(full, spec, budget, 664, 2)
        room = int(b * (1 - WORKSPACE_SHARE)) - dense_bytes(spec, 2) - kv_cache_bytes(spec, 1, 664, 2)
        p = hybrid.placement_of("hybrid", spec, room, experts, 1)
        return len(p.moe_layers) - len(p.cpu_layers)

    assert resident(full) == 15
    part = model_spec(hybrid.shape_at(shape, 29))  # 28 MoE layers: 15 x 28/58 = 7.2
    assert resident(part) == 7


def test_scaled_rows_say_so():
    row = {"column": "cpu", "tg_tokens_per_s": 40.0, "pp_tokens_per_s": 500.0, "floor_tokens_per_s": 80.0,
           "pp_floor_tokens_per_s": None}
    assert hybrid.scale_row(row, 61, 61) is row
    scaled = hybrid.scale_row(row, 8, 61)
    assert scaled["depth"] == hybrid.depth_label(8, 61) == "scaled from 8 of 61 layers"
    assert scaled["tg_tokens_per_s_full_depth"] == pytest.approx(40 * 8 / 61)
    assert scaled["pp_tokens_per_s_full_depth"] == pytest.approx(500 * 8 / 61)
    assert scaled["tg_tokens_per_s"] == 40.0 and "pp_floor_tokens_per_s_full_depth" not in scaled
    assert scaled["tg_ms_per_layer"] == pytest.approx(1e3 / 40 / 8)


def test_preflight_on_the_h200_host():
    """The H200 host (128 GiB RAM, 64 GiB disk): Qwen3-235B's full-depth Q4_0 GGUF (127 GiB) does not fit the disk,
    46 layers do; GPT-OSS-120B's MXFP4 one (59 GiB) does; DeepSeek-V3's 4 distinct layers of 256 4-bit experts fit
    the RAM, not beside their float copies (hobbit-offload), where 3 distinct layers do."""
    host = hybrid.H200_HOST
    qwen = hybrid.SHAPES["qwen3-235b"][0]
    line = hybrid.preflight("qwen3-235b", qwen, 94, 4, False, host)
    assert line.startswith("hybrid.py: qwen3-235b at 94 layers needs 127.0 GiB of disk") and "--layers 46 fits" in line
    assert "\n" not in line
    assert hybrid.needs("qwen3-235b", qwen, 46, 4, False).refusal(host) is None
    assert hybrid.needs("qwen3-235b", qwen, 47, 4, False).refusal(host) is not None
    assert hybrid.preflight("gpt-oss-120b", hybrid.SHAPES["gpt-oss-120b"][0], 36, 4, True, host) is None
    v3 = hybrid.SHAPES["deepseek-v3"][0]
    assert hybrid.preflight("deepseek-v3", v3, 61, 4, False, host) is None
    line = hybrid.preflight("deepseek-v3", v3, 61, 4, True, host)
    assert "GiB of RAM" in line and "--distinct-layers 3 fits" in line
    assert hybrid.needs("deepseek-v3", v3, 61, 4, True).disk == 0  # no deepseek2 GGUF writer


def test_mxfp4_stand_in_runs_its_experts_on_the_cpu_as_resident():
    """The GPT-OSS stand-in's store keeps MXFP4 experts as shipped (no low-bit copies), and each MoE block's output
    with every layer's experts on the CPU equals the resident Mxfp4Experts' over the same blocks and scales."""
    spec = model_spec(hybrid.shape_at(hybrid.stand_in(hybrid.SHAPES["gpt-oss-120b"][0]), 2))
    store = random_store(spec, 2, torch.device("cpu"), torch.float32, hybrid.BITS, 32, high=False)
    assert store.mxfp4 and store.meta["low_bits"] == 0 and store.biased
    tokens = torch.randint(0, spec.vocab_size, (2, 9))
    on_cpu = moe_block_outputs(spec, store, 2, tokens, bits=16)

    def resident(model):
        for i in spec.moe.layer_indices():
            experts = stored_experts(spec, spec.moe.num_experts)
            for e in range(spec.moe.num_experts):
                parts = store.host_parts(i, e, low=False)
                for name, t in zip(("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                    "down_proj_scales", "gate_up_proj_bias", "down_proj_bias"), parts):
                    getattr(experts, name).data[e] = t
            model.model.layers[i].mlp.experts = experts

    want = moe_block_outputs(spec, store, 0, tokens, bits=16, fill=resident)
    for i in spec.moe.layer_indices():
        assert want[i][0].abs().mean() > 0
        torch.testing.assert_close(on_cpu[i][0], want[i][0], atol=1e-5, rtol=1e-4)
