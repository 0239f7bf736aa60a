"""GLM-4.5 (Glm4MoeForCausalLM): GQA with partial rotary (default half the head), q/k/v bias, an optional per-head
qk-norm; DeepSeek-V3's sparse part and router (deepseek.py). Checkpoints name the shared FFN mlp.shared_experts."""

from __future__ import annotations

from moeserve.families.common import LONG_CONTEXT, Family, common_fields, heads, partial_rotary
from moeserve.families.deepseek import deepseek_sparse, grouped_router
from moeserve.spec_parts import AttentionSpec


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "glm4_moe")
    L, a = c["num_layers"], heads(cfg)
    router = grouped_router(cfg, "sigmoid", "noaux_tc", correction_bias=True)
    return dict(**c, attention=AttentionSpec(**a, qkv_bias=bool(cfg.get("attention_bias", False)),
                                             qk_norm="head" if cfg.get("use_qk_norm") else None,
                                             rotary_dim=int(a["head_dim"] * partial_rotary(cfg, 0.5)),
                                             sliding_windows=(None,) * L),
                moe=deepseek_sparse(cfg, L, router))


FAMILIES = (Family("glm4_moe", ("Glm4MoeForCausalLM",), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "n_shared_experts": 1, "first_k_dense_replace": 1,
                             "norm_topk_prob": True},
                   shared_experts_plural=True, partial_rotary=True),)
