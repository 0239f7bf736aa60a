"""GPT-OSS (GptOssForCausalLM): attention sinks, sliding and full layers by layer_types, q/k/v/o biases, YaRN; a
biased router whose weights are the softmax of the top-k logits (= softmax, top-k, renormalised); biased experts
with the clamped SwiGLU; float32 RMSNorm; MXFP4 experts where quantization_config says so. Checkpoints name the
router mlp.router and store the experts fused with gate and up interleaved (checkpoint.from_interleaved)."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from dataclasses import replace

from moeserve.families.common import LONG_CONTEXT, Family, common_fields, heads
from moeserve.spec_parts import AttentionSpec, ClampedSwiGLU, MoESpec


def read(cfg: dict) -> dict:
    c = common_fields({**cfg, "hidden_act": "silu"}, "gpt_oss")  # hidden_act is unused: the experts' act is fixed
    L = c["num_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise MoeserveError(f"layer_types must list {L} of sliding_attention / full_attention, got {types!r}")
    bias = bool(cfg.get("attention_bias", True))
    quant = cfg.get("quantization_config") or {}
    c["norm"] = replace(c["norm"], fp32=True)
    return dict(
        **c,
        attention=AttentionSpec(
            **heads(cfg), qkv_bias=bias, o_bias=bias, sinks=True,
            sliding_windows=tuple(cfg.get("sliding_window") if t == "sliding_attention" else None for t in types)),
        moe=MoESpec(
            num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], expert_ffn=cfg["intermediate_size"],
            norm_topk_prob=True, router_weights_fp32=False, layers=(True,) * L, router_bias=True, expert_bias=True,
            expert_act=ClampedSwiGLU(alpha=float(cfg.get("swiglu_alpha", 1.702)),
                                     limit=float(cfg.get("swiglu_limit", 7.0))),
            experts_mxfp4=quant.get("quant_method") == "mxfp4"),
    )


FAMILIES = (Family("gpt_oss", ("GptOssForCausalLM",), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "sliding_window": 128, "rope_theta": 150000.0,
                             "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096}},
                   router_named=True, interleaved_experts=True, mxfp4_experts=True),)
