"""Mixtral (MixtralForCausalLM): GQA, an optional sliding window, softmax top-k renormalised with the routing
weights kept in fp32; classic checkpoints name the MoE block block_sparse_moe and the experts w1/w3/w2."""

from __future__ import annotations

from moeserve.families.common import LONG_CONTEXT, ExpertNames, Family, common_fields, heads
from moeserve.spec_parts import AttentionSpec, MoESpec

MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "mixtral")
    L = c["num_layers"]
    return dict(
        **c,
        attention=AttentionSpec(**heads(cfg), sliding_windows=(cfg.get("sliding_window"),) * L),
        moe=MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                    expert_ffn=cfg["intermediate_size"], norm_topk_prob=True, router_weights_fp32=True,
                    layers=(True,) * L),
    )


FAMILIES = (Family("mixtral", ("MixtralForCausalLM",), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 1e6}, expert_names=MIXTRAL_NAMES),)
