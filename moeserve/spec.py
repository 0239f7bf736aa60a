"""ModelSpec: one normalised description of every supported MoE architecture.

Each HF family spells the same ideas differently (`num_local_experts` vs `num_experts`, `rope_scaling` vs
`rope_parameters`, qk-norm per head vs over all heads). `from_hf_config` reads a config.json dict once, through its
family's reader (moeserve/families/), and the rest of moeserve only ever sees a ModelSpec: sizes and tokens at the
top, `spec.attention`, `spec.moe` and `spec.norm` as typed parts (moeserve/spec_parts.py, named here too).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from moeserve.errors import MoeserveError
from moeserve.families import read_fields
from moeserve.spec_parts import (AttentionSpec, AttentionTemperature, ClampedSwiGLU, MLASpec, MoESpec, NormSpec,
                                  RopeSpec, RouterSpec)

__all__ = ["AttentionSpec", "AttentionTemperature", "ClampedSwiGLU", "MLASpec", "ModelSpec", "MoESpec", "NormSpec",
           "RopeSpec", "RouterSpec", "read_config", "longrope_long_inv_freq", "longrope_mscales", "rope_inv_freq"]


# ModelSpec's fields by the names of its flat form (config readers, JSON written before the parts, tests) -> (part,
# field): a part's field keeps its name there, except these
RENAMED = {"attention_chunks": ("attention", "chunks"), "attention_temperature": ("attention", "temperature"),
           "attention_sinks": ("attention", "sinks"), "attention_scale": ("attention", "scale"),
           "moe_layers": ("moe", "layers"), "norm": ("norm", "kind"), "rms_norm_eps": ("norm", "eps"),
           "norm_fp32": ("norm", "fp32")}
PARTS = {"attention": AttentionSpec, "moe": MoESpec, "norm": NormSpec}
FLAT_FIELDS = {**{f.name: (part, f.name) for part, cls in PARTS.items() for f in fields(cls)
                  if (part, f.name) not in RENAMED.values()}, **RENAMED}
NESTED = {"rope": RopeSpec, "mla": MLASpec, "router": RouterSpec, "expert_act": ClampedSwiGLU,
          "temperature": AttentionTemperature, "attention_temperature": AttentionTemperature}  # JSON dict -> part


@dataclass(frozen=True)
class ModelSpec:
    """A model: its sizes and tokens here, its attention, sparse part and norms in typed parts (spec_parts.py)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    attention: AttentionSpec
    moe: MoESpec = field(default_factory=MoESpec)
    norm: NormSpec = field(default_factory=NormSpec)
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    # Granite's scalars (muP): embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before its residual add, logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "float32"

    # ---- derived sizes -------------------------------------------------------------------
    def attention_projections(self) -> tuple[tuple[str, int, int, bool], ...]:
        """(name, out_features, in_features, bias) of one layer's attention linears, as `self_attn.<name>`."""
        a = self.attention
        D, H, m = self.hidden_size, a.num_heads, a.mla
        if m is None:
            Hkv, Dh, b = a.num_kv_heads, a.head_dim, a.qkv_bias
            return (("q_proj", H * Dh, D, b), ("k_proj", Hkv * Dh, D, b), ("v_proj", Hkv * Dh, D, b),
                    ("o_proj", D, H * Dh, a.o_bias))
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ((("q_proj", H * qk, D, False),) if m.q_lora_rank is None else
             (("q_a_proj", m.q_lora_rank, D, a.qkv_bias), ("q_b_proj", H * qk, m.q_lora_rank, False)))
        return q + (("kv_a_proj_with_mqa", m.latent_dim, D, a.qkv_bias),
                    ("kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False),
                    ("o_proj", D, H * m.v_head_dim, a.o_bias))

    def parameter_counts(self) -> dict[str, int]:
        """Parameters split into dense (always active) and sparse (routed experts)."""
        a, moe = self.attention, self.moe
        D, H, Hkv, Dh = self.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
        norm = D * (2 if self.norm.kind == "layer" else 1)  # one decoder norm's weights (and bias)
        attn = sum(o * i + (o if bias else 0) for _, o, i, bias in self.attention_projections()) + 2 * norm
        if a.mla is not None:
            attn += a.mla.kv_lora_rank + (a.mla.q_lora_rank or 0)  # the latent norms
        elif a.qk_norm == "head":
            attn += 2 * Dh
        elif a.qk_norm == "full":
            attn += H * Dh + Hkv * Dh
        attn += H if a.sinks else 0
        dense = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + norm
        dense += self.vocab_size if self.lm_head_bias else 0
        sparse = 0
        active_sparse = 0
        for i, is_moe in enumerate(moe.layers):
            dense += attn
            if is_moe:
                E = moe.experts_at(i)
                dense += E * D + (E if moe.router and moe.router.correction_bias or moe.router_bias else 0)
                dense += 3 * D * moe.shared_expert_ffn + (D if moe.shared_expert_gate else 0)
                dense += 2 * D + 2 if moe.residual_mix else 0  # the mix's Linear(D, 2) with bias
                per_expert = 3 * D * moe.expert_ffn + (2 * moe.expert_ffn + D if moe.expert_bias else 0)
                sparse += E * per_expert
                active_sparse += moe.top_k * per_expert
            else:
                dense += 3 * D * moe.dense_ffn
        return {"dense": dense, "experts": sparse, "total": dense + sparse, "active_per_token": dense + active_sparse}

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def of(cls, **values) -> "ModelSpec":
        """A ModelSpec from its fields by their flat names (FLAT_FIELDS: num_heads, top_k, rms_norm_eps, ...) and
        the top-level ones; a part may also be given whole (attention=AttentionSpec(...)), flat fields of it then
        replacing its own. How config readers, tests and JSON written before the parts name a spec."""
        top, parts = split_fields(values)
        for part, changes in parts.items():
            top[part] = replace(top[part], **changes) if part in top else PARTS[part](**changes)
        return cls(**top)

    def replace(self, **changes) -> "ModelSpec":
        """This spec with `changes` (flat names, as `of` takes them, or whole parts)."""
        top, parts = split_fields(changes)
        for part, values in parts.items():
            top[part] = replace(top.get(part, getattr(self, part)), **values)
        return replace(self, **top)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        """The spec to_json wrote: with its parts, or the flat form written before them (stores, manifests and
        results made then still read)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise MoeserveError("a ModelSpec JSON must hold an object")
        for part, part_cls in PARTS.items():
            if isinstance(data.get(part), dict):
                data[part] = part_cls(**{k: json_value(k, v) for k, v in data[part].items()})
        return cls.of(**{k: json_value(k, v) for k, v in data.items()})

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        return cls(**read_fields(cfg))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        return cls.from_hf_config(read_config(path))


def split_fields(values: dict) -> tuple[dict, dict[str, dict]]:
    """(top-level fields and whole parts, part -> {field: value}) of fields named as ModelSpec.of takes them."""
    top, parts = {}, {}
    for name, value in values.items():
        if name in PARTS and isinstance(value, PARTS[name]):
            top[name] = value
        elif name in FLAT_FIELDS:
            part, field_name = FLAT_FIELDS[name]
            parts.setdefault(part, {})[field_name] = value
        else:
            top[name] = value
    return top, parts


def json_value(name: str, value):
    """A field's value as JSON holds it -> as ModelSpec holds it: the nested dataclasses (NESTED) from their dicts,
    tuples from lists."""
    if isinstance(value, dict) and name in NESTED:
        return NESTED[name](**{k: json_value(k, v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(json_value(name, v) for v in value)
    return value


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise MoeserveError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise MoeserveError(f"model path {str(path)!r} is not a directory (expected config.json + *.safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise MoeserveError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoeserveError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise MoeserveError(f"{cfg_path} must hold a JSON object")
    return cfg





def rope_inv_freq(rope: RopeSpec, head_dim: int, max_position_embeddings: int):
    """Inverse frequencies [head_dim/2] and the cos/sin scale, as each rope type defines them."""
    import torch  # on use: spec.py is read by `import moeserve`, which stays torch-free (moeserve --help)

    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [Dh/2]
    inv_freq = 1.0 / base
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        old_ctx = rope.original_max_position_embeddings or max_position_embeddings
        low_wl, high_wl = old_ctx / rope.low_freq_factor, old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn(rope, head_dim, base)
    if rope.type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor) * base), longrope_mscales(rope, max_position_embeddings)[0]
    return inv_freq, 1.0


def longrope_long_inv_freq(rope: RopeSpec, head_dim: int):
    """LongRoPE's inverse frequencies [head_dim/2] past the original context (the long factors)."""
    import torch  # on use, as in rope_inv_freq

    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [Dh/2]
    return 1.0 / (torch.tensor(rope.long_factor) * base)


def longrope_mscales(rope: RopeSpec, max_position_embeddings: int) -> tuple[float, float]:
    """The cos/sin scales of LongRoPE's (short, long) factors: the config's, else LongRoPE's default for both."""
    orig = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor != 1.0 else max_position_embeddings / orig
    default = rope.attention_factor or (math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0)
    return (rope.short_mscale if rope.short_mscale is not None else default,
            rope.long_mscale if rope.long_mscale is not None else default)


def _yarn(rope: RopeSpec, dim: int, pos_freqs):
    import torch  # on use, as in rope_inv_freq

    factor, orig = rope.factor, rope.original_max_position_embeddings

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        attn = (mscale_of(factor, rope.mscale) / mscale_of(factor, rope.mscale_all_dim)
                if rope.mscale and rope.mscale_all_dim else mscale_of(factor))

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [Dh/2]
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)
