"""moeserve's own PR-MoE (PRMoEForCausalLM, DeepSpeed-MoE's pyramid-residual MoE): `num_experts_per_layer` (one
count per layer, 0 = a dense MLP layer) and `residual` (each MoE layer adds a dense MLP of the experts' width,
mixed as DeepSpeed-MoE's use_residual)."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.families.common import Family, common_fields, heads
from moeserve.spec_parts import AttentionSpec, MoESpec


def read(cfg: dict) -> dict:
    c = common_fields(cfg, "prmoe")
    L, k = c["num_layers"], cfg["num_experts_per_tok"]
    experts = cfg["num_experts_per_layer"]
    if not (isinstance(experts, list) and len(experts) == L and all(isinstance(e, int) and e >= 0 for e in experts)):
        raise MoeserveError(f"num_experts_per_layer must list {L} expert counts (0 = a dense layer), got {experts!r}")
    if any(0 < e < k for e in experts) or not any(experts):
        raise MoeserveError(f"num_experts_per_layer {experts} needs an MoE layer and at least top-{k} experts in each")
    residual = bool(cfg.get("residual", False))
    ffn = cfg["intermediate_size"]
    return dict(
        **c,
        attention=AttentionSpec(**heads(cfg), sliding_windows=(None,) * L),
        moe=MoESpec(num_experts=max(experts), layer_experts=tuple(experts), top_k=k, expert_ffn=ffn,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", k > 1)), router_weights_fp32=True,
                    layers=tuple(e > 0 for e in experts), dense_ffn=ffn, shared_expert_ffn=ffn if residual else 0,
                    residual_mix=residual),
    )


FAMILIES = (Family("prmoe", ("PRMoEForCausalLM",), read),)
