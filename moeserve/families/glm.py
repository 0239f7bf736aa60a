"""GLM-4.5 (Glm4MoeForCausalLM): GQA with partial rotary (default half the head), q/k/v bias, an optional per-head
qk-norm; DeepSeek-V3's sparse part and router (deepseek.py). Checkpoints name the shared FFN mlp.shared_experts."""

from __future__ import annotations

from moeserve.families.common import LONG_CONTEXT, Family, common_fields, partial_rotary
from moeserve.families.deepseek import deepseek_sparse, grouped_router


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "glm4_moe")
    router = grouped_router(cfg, "sigmoid", "noaux_tc", correction_bias=True)
    return dict(**c, qkv_bias=bool(cfg.get("attention_bias", False)),
                qk_norm="head" if cfg.get("use_qk_norm") else None,
                rotary_dim=int(c["head_dim"] * partial_rotary(cfg, 0.5)),
                **deepseek_sparse(cfg, c["num_layers"], router))


FAMILIES = (Family("glm4_moe", ("Glm4MoeForCausalLM",), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "n_shared_experts": 1, "first_k_dense_replace": 1,
                             "norm_topk_prob": True},
                   shared_experts_plural=True, partial_rotary=True),)
