"""What every family module is made of: the Family record the registry holds, and the config reading the families
share (the rope, the fields every config names, expert counts, partial rotary).

A family reader takes config.json (its family's defaults merged under it) to the ModelSpec fields: the top-level
ones and its typed parts (attention, moe, norm), which moeserve/spec.py makes a ModelSpec of. Each HF family spells
the same ideas differently (`num_local_experts` vs `num_experts`, `rope_scaling` vs `rope_parameters`); the readers
normalise them once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from moeserve.errors import MoeserveError
from moeserve.spec_parts import SUPPORTED_ROPE_TYPES, NormSpec, RopeSpec

LONG_CONTEXT = {"max_position_embeddings": 131072}  # the context of the families that default to 128K


@dataclass(frozen=True)
class ExpertNames:
    """Classic HF names of one expert's weights: model.layers.{i}.<block>.experts.{j}.<gate|up|down>.weight."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class Family:
    """One family as the registry (moeserve/families/__init__.py) holds it.

    name: ModelSpec.family, and config.json's model_type for the family. architectures: config.json's
    `architectures` values that name it. read: config.json (defaults merged) -> ModelSpec fields; it raises
    MoeserveError, in one line, for what the family's config may say but moeserve cannot run. defaults: what
    transformers' config class of the family puts in a field config.json leaves out, where moeserve's reading would
    otherwise fall back to another value (rope_theta: the rope's base where rope_parameters name none;
    rope_parameters: the rope when config.json gives neither rope_parameters nor rope_scaling).

    Tensor layout: layout(spec) -> the rules (moeserve/layouts.py Rule) of a family that stores tensors under other
    names or shapes than moeserve's, None where it stores moeserve's own; expert_names: its classic per-expert names;
    shared_experts_plural: it stores mlp.shared_experts.* for moeserve's mlp.shared_expert.*; router_named: it
    stores mlp.router.* for mlp.gate.*; interleaved_experts: its experts are stored fused with gate and up
    interleaved (checkpoint.from_interleaved).

    Capabilities: partial_rotary (its rope may turn only the start of a head; refused for the others),
    mxfp4_experts (quantization_config's quant_method "mxfp4" is its experts' storage; refused for the others)."""

    name: str
    architectures: tuple[str, ...]
    read: Callable[[dict], dict]
    defaults: Mapping[str, object] = field(default_factory=dict)
    layout: Callable[..., list] | None = None
    expert_names: ExpertNames = ExpertNames()
    shared_experts_plural: bool = False
    router_named: bool = False
    interleaved_experts: bool = False
    partial_rotary: bool = False
    mxfp4_experts: bool = False


def rope_params(cfg: dict) -> dict:
    """rope_parameters (transformers 5) over rope_scaling (older configs): one dict."""
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def read_rope(cfg: dict, interleave: bool = False) -> RopeSpec:
    """The rope of cfg; partial rotary is the reader's business where the family has it (GLM), refused for the
    others (moeserve/families/__init__.py read_fields)."""
    params = rope_params(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise MoeserveError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    kw = {k: params[k] for k in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                                 "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
                                 "short_mscale", "long_mscale")
          if params.get(k) is not None}
    if rope_type == "yarn" and "original_max_position_embeddings" not in kw:
        kw["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    if rope_type == "longrope":
        kw.update(longrope_fields(cfg, params))
    return RopeSpec(theta=float(theta), type=rope_type, interleave=interleave, **kw)


def longrope_fields(cfg: dict, params: dict) -> dict:
    """LongRoPE's fields: both factor lists (one divisor per rotated frequency) and the original context, which
    older configs keep at the top level."""
    orig = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if orig is None:
        raise KeyError("original_max_position_embeddings")
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = {"original_max_position_embeddings": int(orig)}
    for name in ("short_factor", "long_factor"):
        factors = params.get(name)
        if not (isinstance(factors, list) and len(factors) == dim // 2):
            raise MoeserveError(f"longrope {name} must list {dim // 2} numbers (one per rotated frequency of a "
                                f"{dim}-dim head), got {factors!r}")
        out[name] = tuple(float(f) for f in factors)
    return out


def partial_rotary(cfg: dict, default: float) -> float:
    """The share of a head the rope turns (partial_rotary_factor, in the rope dict or at the top level)."""
    return float(rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def common_fields(cfg: dict, family: str) -> dict:
    """The top-level ModelSpec fields every family's config names alike (sizes, context, tokens, dtype), and the
    decoder's norms as RMSNorms of rms_norm_eps (NormSpec: a reader replaces it where its family differs)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise MoeserveError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        norm=NormSpec(eps=cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=cfg.get("pad_token_id"),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def heads(cfg: dict, rope: RopeSpec | None = None) -> dict:
    """The AttentionSpec fields every family's config names alike: heads, KV heads, head dim, and the rope (cfg's,
    where `rope` is None)."""
    H = cfg["num_attention_heads"]
    return dict(num_heads=H, num_kv_heads=cfg.get("num_key_value_heads") or H,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // H, rope=rope or read_rope(cfg))


def num_experts(cfg: dict) -> int:
    """Routed experts where a config says num_experts (Qwen, OLMoE) or, as transformers 5 writes, num_local_experts."""
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n is None:
        raise KeyError("num_experts")
    return n


def routed_experts_fields(cfg: dict, experts: int) -> dict:
    """The MoESpec sizes HF's DeepSeek, GLM and Qwen MoE configs name alike: `experts` routed experts,
    num_experts_per_tok of them per token, moe_intermediate_size wide, norm_topk_prob."""
    return dict(num_experts=experts, top_k=cfg["num_experts_per_tok"], expert_ffn=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
