"""OLMoE: a qk-norm over all heads (not per head), optional clip_qkv, softmax top-k renormalised where
norm_topk_prob says."""

from __future__ import annotations

from moeserve.families.common import Family, common_fields, heads, num_experts
from moeserve.spec_parts import AttentionSpec, MoESpec


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "olmoe")
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        **c,
        attention=AttentionSpec(**heads(cfg), qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=cfg.get("clip_qkv"),
                                sliding_windows=(None,) * L),
        moe=MoESpec(num_experts=num_experts(cfg), top_k=cfg["num_experts_per_tok"], expert_ffn=cfg["intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), router_weights_fp32=False,
                    layers=(True,) * L),
    )


FAMILIES = (Family("olmoe", ("OlmoeForCausalLM",), read, defaults={"rms_norm_eps": 1e-5}),)
