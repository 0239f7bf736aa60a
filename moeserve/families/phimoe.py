"""Phi-3.5-MoE (PhimoeForCausalLM): LayerNorms with bias, attention and lm_head biases, LongRoPE, sparsemixer top-2
routing (which routes every token to 2 experts: other top-k are refused); classic checkpoints name the MoE block
block_sparse_moe and the experts w1/w3/w2, as Mixtral."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from dataclasses import replace

from moeserve.families.common import LONG_CONTEXT, Family, common_fields, heads
from moeserve.families.mixtral import MIXTRAL_NAMES
from moeserve.spec_parts import AttentionSpec, MoESpec


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "phimoe")
    L = c["num_layers"]
    if cfg.get("num_experts_per_tok", 2) != 2:
        raise MoeserveError(f"Phi-MoE's sparsemixer routes every token to 2 experts; num_experts_per_tok is "
                            f"{cfg['num_experts_per_tok']}")
    bias = bool(cfg.get("attention_bias", False))
    c["norm"] = replace(c["norm"], kind="layer")
    return dict(**c, lm_head_bias=bool(cfg.get("lm_head_bias", False)),
                attention=AttentionSpec(**heads(cfg), qkv_bias=bias, o_bias=bias,
                                        sliding_windows=(cfg.get("sliding_window"),) * L),
                moe=MoESpec(num_experts=cfg["num_local_experts"], top_k=2, expert_ffn=cfg["intermediate_size"],
                            router_weights_fp32=False, routing="sparsemixer",
                            router_jitter_eps=float(cfg.get("router_jitter_noise", 0.01)), layers=(True,) * L))


FAMILIES = (Family("phimoe", ("PhimoeForCausalLM",), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 1e6}, expert_names=MIXTRAL_NAMES),)
