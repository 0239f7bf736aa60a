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


def moe_block_outputs(spec: ModelSpec, store, n_cpu: int, tokens: torch.Tensor) -> dict:
    """MoE layer -> (its block's output, the shared experts' part of it) [B, S, D] for `tokens` through the bench's
    random model with the first n_cpu MoE layers' 4-bit experts on the CPU, the others' resident."""
    model = dense_model(spec, torch.device("cpu"), torch.float32)
    placement = HybridPlacement.choose(spec.moe.layer_indices(), n_cpu_moe=n_cpu, bits=hybrid.BITS)
    runtime = enable_hybrid(model, store, placement)
    blocks = {i: model.model.layers[i].mlp for i in spec.moe.layer_indices()}
    captured = {}
    hooks = [b.register_forward_hook(lambda _, args, out, i=i: captured.__setitem__(i, (args[0], out)))
             for i, b in blocks.items()]
    with torch.no_grad():
        model(tokens)
        out = {i: (y, blocks[i].shared_expert(x)) for i, (x, y) in captured.items()}
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
