"""Qwen2-MoE and Qwen3-MoE: experts every decoder_sparse_step (dense FFN layers in mlp_only_layers and between),
top-k renormalised only where norm_topk_prob says; Qwen2 a sigmoid-gated shared expert, q/k/v biases and sliding
windows by layer; Qwen3 a per-head qk-norm."""

from __future__ import annotations

from moeserve.families.common import Family, common_fields, heads, num_experts, routed_experts_fields
from moeserve.spec_parts import AttentionSpec, MoESpec


def moe_layers(cfg: dict, L: int) -> tuple[bool, ...]:
    step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    n_exp = num_experts(cfg)
    return tuple(i not in mlp_only and n_exp > 0 and (i + 1) % step == 0 for i in range(L))


def qwen2_windows(cfg: dict, L: int) -> tuple[int | None, ...]:
    if not cfg.get("use_sliding_window", False):
        return (None,) * L
    types = cfg.get("layer_types")
    if types is None:
        mwl = cfg.get("max_window_layers", L)
        types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(L)]
    return tuple(cfg["sliding_window"] if t == "sliding_attention" else None for t in types)


def qwen_sparse(cfg: dict, L: int) -> dict:
    """The MoESpec fields both Qwen MoE generations share: dense layers interleaved by sparse step."""
    return dict(
        **routed_experts_fields(cfg, num_experts(cfg)),
        router_weights_fp32=False,
        layers=moe_layers(cfg, L),
        dense_ffn=cfg.get("intermediate_size", 0),
    )


def read_qwen2_moe(cfg: dict) -> dict:
    c = common_fields(cfg, "qwen2_moe")
    L = c["num_layers"]
    shared = cfg.get("shared_expert_intermediate_size", 0)
    return dict(
        **c,
        attention=AttentionSpec(**heads(cfg), qkv_bias=bool(cfg.get("qkv_bias", True)),
                                sliding_windows=qwen2_windows(cfg, L)),
        moe=MoESpec(**qwen_sparse(cfg, L), shared_expert_ffn=shared, shared_expert_gate=shared > 0),
    )


def read_qwen3_moe(cfg: dict) -> dict:
    c = common_fields(cfg, "qwen3_moe")
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return dict(
        **c,
        attention=AttentionSpec(**heads(cfg), qkv_bias=bias, o_bias=bias, qk_norm="head",
                                sliding_windows=(window,) * L),
        moe=MoESpec(**qwen_sparse(cfg, L)),
    )


FAMILIES = (
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), read_qwen2_moe,
           defaults={"max_position_embeddings": 32768, "shared_expert_intermediate_size": 5632}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), read_qwen3_moe, defaults={"max_position_embeddings": 32768}),
)
