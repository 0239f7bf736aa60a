"""DeepSeek-V2 and V3 (and the checkpoints built on V3's architecture, as Kimi-K2): Multi-head Latent Attention with
interleaved rotary pairs (V2 always; V3 unless rope_interleave is false), first_k_dense_replace dense layers, then
routed experts with n_shared_experts as one shared FFN; V2 softmax routing (greedy or group-limited), V3 sigmoid
noaux_tc with a correction bias. GLM-4.5 (glm.py) shares the sparse part and V3's router. Checkpoints name the
shared FFN mlp.shared_experts."""

from __future__ import annotations

import math

from moeserve.errors import MoeserveError
from moeserve.families.common import Family, common_fields, heads, read_rope, routed_experts_fields
from moeserve.spec_parts import SCORING_FUNCS, TOPK_METHODS, AttentionSpec, MLASpec, MoESpec, RopeSpec, RouterSpec


def routed_experts(cfg: dict) -> int:
    n = cfg.get("n_routed_experts", cfg.get("num_local_experts", cfg.get("num_experts")))
    if n is None:
        raise KeyError("n_routed_experts")
    return n


def grouped_router(cfg: dict, scoring: str, topk_method: str, correction_bias: bool) -> RouterSpec:
    """DeepSeek-style routing fields; scoring and topk_method: the family's defaults where cfg names none."""
    scoring = cfg.get("scoring_func") or scoring
    if scoring not in SCORING_FUNCS:
        raise MoeserveError(f"scoring_func {scoring!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
    method = cfg.get("topk_method") or topk_method
    if method not in TOPK_METHODS:
        raise MoeserveError(f"topk_method {method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
    E, k = routed_experts(cfg), cfg.get("num_experts_per_tok")
    if k is None:
        raise KeyError("num_experts_per_tok")
    n_group, topk_group = (cfg.get("n_group") or 1, cfg.get("topk_group") or 1) if method != "greedy" else (1, 1)
    if E % n_group or not 1 <= topk_group <= n_group or k > topk_group * (E // n_group):
        raise MoeserveError(f"{method} routing of {E} experts in n_group={n_group} groups, topk_group={topk_group}, "
                            f"top-{k}: the groups must split the experts evenly and the chosen groups hold k experts")
    if method == "noaux_tc" and E // n_group < 2:
        raise MoeserveError(f"noaux_tc routing ranks groups by their two best experts; n_group={n_group} leaves "
                            f"{E // n_group} per group")
    return RouterSpec(scoring=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                      correction_bias=correction_bias)


def deepseek_sparse(cfg: dict, L: int, router: RouterSpec) -> MoESpec:
    """The sparse part DeepSeek-V2/V3 and GLM-4.5 share: first_k_dense_replace dense layers, then an MoE layer every
    moe_layer_freq (DeepSeek's own rule; transformers reads 1), n_shared_experts as one shared FFN."""
    first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    return MoESpec(
        **routed_experts_fields(cfg, routed_experts(cfg)),
        router_weights_fp32=True,
        layers=tuple(i >= first and i % freq == 0 for i in range(L)),
        dense_ffn=cfg["intermediate_size"],
        shared_expert_ffn=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
        router=router,
    )


def read_mla(cfg: dict, rope: RopeSpec) -> MLASpec:
    nope, rot = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rot) ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:  # YaRN's attention temperature, on the softmax scale
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= m * m
    return MLASpec(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
                   qk_rope_head_dim=rot, v_head_dim=cfg["v_head_dim"], softmax_scale=scale)


def read_deepseek(cfg: dict, family: str) -> dict:
    """DeepSeek-V2 (softmax routing, greedy or group-limited) and V3 (sigmoid noaux_tc with a correction bias):
    MLA, whose rotary pairs are interleaved (V2 always; V3 unless rope_interleave is false)."""
    v3 = family == "deepseek_v3"
    rope = read_rope(cfg, interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)
    c = common_fields(cfg, family)
    L = c["num_layers"]
    mla = read_mla(cfg, rope)
    a = heads(cfg, rope)
    a.update(head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, num_kv_heads=a["num_heads"])
    bias = bool(cfg.get("attention_bias", False))
    router = grouped_router(cfg, "sigmoid" if v3 else "softmax", "noaux_tc" if v3 else "greedy", correction_bias=v3)
    return dict(**c, attention=AttentionSpec(**a, qkv_bias=bias, o_bias=bias, rotary_dim=mla.qk_rope_head_dim,
                                             mla=mla, sliding_windows=(None,) * L),
                moe=deepseek_sparse(cfg, L, router))


FAMILIES = (
    Family("deepseek_v2", ("DeepseekV2ForCausalLM",), lambda cfg: read_deepseek(cfg, "deepseek_v2"),
           defaults={"max_position_embeddings": 2048, "q_lora_rank": 1536, "n_shared_experts": 2},
           shared_experts_plural=True),
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), lambda cfg: read_deepseek(cfg, "deepseek_v3"),
           defaults={"q_lora_rank": 1536, "n_shared_experts": 1, "first_k_dense_replace": 3,
                     "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "norm_topk_prob": True},
           shared_experts_plural=True),
)
