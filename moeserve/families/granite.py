"""Granite-MoE (and -Shared: a shared MLP beside the experts, added unweighted): softmax over the top-k logits
(= softmax top-k renormalised), muP multipliers on embeddings, residual branches, attention scale and logits.
Checkpoints name the router block_sparse_moe.router.layer, the fused experts input_linear [E, 2F, D] and
output_linear [E, D, F], the shared MLP shared_mlp.input_linear [2F, D] (gate rows, then up rows)."""

from __future__ import annotations

from moeserve.families.common import Family, common_fields, heads
from moeserve.layouts import Rule, rows, same
from moeserve.spec_parts import AttentionSpec, MoESpec


def read(cfg: dict, family: str) -> dict:
    c = common_fields(cfg, family)
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    return dict(**c, embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)),
                attention=AttentionSpec(**heads(cfg), qkv_bias=bias, o_bias=bias, sliding_windows=(None,) * L,
                                        scale=float(cfg.get("attention_multiplier", 1.0))),
                moe=MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                            expert_ffn=cfg["intermediate_size"], norm_topk_prob=True, router_weights_fp32=False,
                            layers=(True,) * L, shared_expert_ffn=cfg.get("shared_intermediate_size") or 0))


def layout(spec) -> list[Rule]:
    """The stored tensors of a Granite checkpoint (spec: its ModelSpec) as moeserve's."""
    F = spec.moe.shared_expert_ffn
    moe = r"^model\.layers\.(\d+)\.block_sparse_moe\."
    return [
        (moe + r"router\.layer\.weight$", [(r"model.layers.\1.mlp.gate.weight", (), same)]),
        (moe + r"input_linear\.weight$", [(r"model.layers.\1.mlp.experts.gate_up_proj", (), same)]),  # [E, 2F, D]
        (moe + r"output_linear\.weight$", [(r"model.layers.\1.mlp.experts.down_proj", (), same)]),  # [E, D, F]
        (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$",  # [2F, D]: gate rows, then up rows
         [(r"model.layers.\1.mlp.shared_expert.gate_proj.weight", (), rows(0, F)),
          (r"model.layers.\1.mlp.shared_expert.up_proj.weight", (), rows(F, 2 * F))]),
        (r"^model\.layers\.(\d+)\.shared_mlp\.output_linear\.weight$",
         [(r"model.layers.\1.mlp.shared_expert.down_proj.weight", (), same)]),
    ]


DEFAULTS = {"max_position_embeddings": 2048}
FAMILIES = (
    Family("granitemoe", ("GraniteMoeForCausalLM",), lambda cfg: read(cfg, "granitemoe"), defaults=DEFAULTS,
           layout=layout),
    Family("granitemoeshared", ("GraniteMoeSharedForCausalLM",), lambda cfg: read(cfg, "granitemoeshared"),
           defaults=DEFAULTS, layout=layout),
)
