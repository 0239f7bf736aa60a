"""Llama-4's text model (Llama4ForCausalLM, and Llama4ForConditionalGeneration's: its text_config over the top
level, its `language_model.` tensors): MoE layers every interleave_moe_layer_step (or as moe_layers lists them) with
a shared expert, dense layers between them; a sigmoid top-1 router whose weight scales the expert's input (other
top-k are refused); chunked attention and L2 qk-norm on rotary layers, NoPE layers with the attention temperature;
interleaved rope pairs. Checkpoints name the MoE block feed_forward and store experts as x @ W."""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.families.common import LONG_CONTEXT, Family, common_fields, heads, read_rope
from moeserve.layouts import Rule, same, swap_last
from moeserve.spec_parts import AttentionSpec, AttentionTemperature, MoESpec


def read(cfg: dict) -> dict:
    text = {**cfg, **(cfg.get("text_config") or {}), "architectures": cfg.get("architectures")}
    c = common_fields(text, "llama4")
    L, k = c["num_layers"], text.get("num_experts_per_tok", 1)
    if k != 1:
        raise MoeserveError(f"Llama-4's router scales the expert's input by its weight; moeserve runs that for one "
                            f"expert per token (num_experts_per_tok 1, as every Llama-4 checkpoint), not {k}")
    step = text.get("interleave_moe_layer_step") or 1
    moe = text.get("moe_layers")
    moe = set(range(step - 1, L, step) if moe is None else moe)
    bias = bool(text.get("attention_bias", False))
    ffn = text["intermediate_size"]
    return dict(
        **c,
        attention=AttentionSpec(**heads(text, read_rope(text, interleave=True)), qkv_bias=bias, o_bias=bias,
                                **attention_fields(text, L)),
        moe=MoESpec(num_experts=text["num_local_experts"], top_k=1, expert_ffn=ffn, norm_topk_prob=False,
                    router_weights_fp32=False, routing="sigmoid", router_scales_input=True,
                    layers=tuple(i in moe for i in range(L)), dense_ffn=text.get("intermediate_size_mlp", 16384),
                    shared_expert_ffn=ffn),
    )


def attention_fields(text: dict, L: int) -> dict:
    """Llama-4's AttentionSpec fields past the heads: rotary layers (no_rope_layers 1; by default all but every
    no_rope_layer_interval-th) attend in chunks of attention_chunk_size (as layer_types says, where it does) and
    L2-norm q and k (use_qk_norm); the others are NoPE layers with the attention temperature
    (attn_temperature_tuning, floor_scale, attn_scale)."""
    rope_layers = layer_list(text, "no_rope_layers", L) or [
        int((i + 1) % (text.get("no_rope_layer_interval") or 4) != 0) for i in range(L)]
    chunk = text.get("attention_chunk_size")
    types = layer_list(text, "layer_types", L) or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope_layers]
    if not set(types) <= {"chunked_attention", "full_attention"}:
        raise MoeserveError(f"layer_types must list chunked_attention / full_attention, got {types!r}")
    temperature = (AttentionTemperature(float(text.get("floor_scale", 8192)), float(text.get("attn_scale", 0.1)))
                   if text.get("attn_temperature_tuning", True) else None)
    return dict(qk_norm="l2" if text.get("use_qk_norm", True) else None, sliding_windows=(None,) * L,
                chunks=tuple(chunk if t == "chunked_attention" else None for t in types),
                nope_layers=tuple(not r for r in rope_layers), temperature=temperature)


def layer_list(cfg: dict, name: str, L: int) -> list | None:
    """A per-layer list of Llama-4's config (no_rope_layers, layer_types), None where it names none."""
    values = cfg.get(name)
    if not values:
        return None
    if len(values) < L:
        raise MoeserveError(f"{name} must name each of the {L} layers, got {values!r}")
    return list(values[:L])


def layout(spec) -> list[Rule]:
    """Llama-4's feed_forward (experts [E, D, 2F] gate then up columns and [E, F, D], router, shared expert, dense
    MLP), with or without Llama4ForConditionalGeneration's `language_model.` prefix; its vision tensors match no
    rule and are never read."""
    ffn, layer = r"^(?:language_model\.)?model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."
    return [
        (ffn + r"experts\.(gate_up_proj|down_proj)$", [(layer + r"experts.\2", (), swap_last)]),
        (ffn + r"router\.weight$", [(layer + "gate.weight", (), same)]),
        (ffn + r"((?:shared_expert\.)?(?:gate|up|down)_proj\.weight)$", [(layer + r"\2", (), same)]),
        (r"^language_model\.((?:model\.|lm_head\.).+)$", [(r"\1", (), same)]),
    ]


FAMILIES = (Family("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), read,
                   defaults={**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                             "attention_chunk_size": 8192},
                   layout=layout),)
