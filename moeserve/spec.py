"""ModelSpec: one normalised description of every supported MoE architecture.

Each HF family spells the same ideas differently (`num_local_experts` vs `num_experts`, `rope_scaling` vs
`rope_parameters`, qk-norm per head vs over all heads). `from_hf_config` reads a config.json dict once, through its
family's reader (moeserve/families/), and the rest of moeserve only ever sees a ModelSpec. Its parts (RopeSpec,
MLASpec, RouterSpec, ClampedSwiGLU, AttentionTemperature) live in moeserve/spec_parts.py and are named here too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeserve.errors import MoeserveError
from moeserve.families import read_fields
from moeserve.spec_parts import AttentionTemperature, ClampedSwiGLU, MLASpec, RopeSpec, RouterSpec

__all__ = ["AttentionTemperature", "ClampedSwiGLU", "MLASpec", "ModelSpec", "RopeSpec", "RouterSpec", "read_config",
           "longrope_long_inv_freq", "longrope_mscales", "rope_inv_freq"]


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # the eps of every norm, RMSNorm or LayerNorm
    norm: str = "rms"  # one of NORMS: the decoder's norms (qk-norms and MLA's latent norms are RMSNorms)
    rope: RopeSpec = field(default_factory=RopeSpec)
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # None | "head" (Qwen3, GLM: per head) | "full" (OLMoE: over all heads) | "l2" (Llama-4: per head, no weight,
    # after the rotary, on rotary layers only)
    qk_norm: str | None = None
    rotary_dim: int = 0  # rotated dims of a head's query/key, from its start (0: all of head_dim; GLM: a part)
    mla: MLASpec | None = None  # DeepSeek's latent attention instead of GQA (head_dim = nope + rope dims)
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    # Llama-4, per layer: chunked attention (a query sees the keys of its own chunk of positions [c C, (c + 1) C)
    # only; None = not chunked), and NoPE layers (True: no rotary; the attention temperature instead, if any)
    attention_chunks: tuple[int | None, ...] = ()
    nope_layers: tuple[bool, ...] = ()
    attention_temperature: AttentionTemperature | None = None
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax row (dropped after)
    norm_fp32: bool = False  # GPT-OSS: RMSNorm weights kept and applied in float32, the product cast after
    # sparse part
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 14336
    norm_topk_prob: bool = True
    router_weights_fp32: bool = True  # Mixtral keeps routing weights in fp32, Qwen/OLMoE cast to the model dtype
    router: RouterSpec | None = None  # DeepSeek-style routing (fp32 gate); None: `routing` says
    # ROUTINGS: softmax top-k (TopKRouter) | Phi-MoE's sparsemixer top-2 (SparseMixerRouter) | sigmoid of the top-k
    # logits (SigmoidTopKRouter, Llama-4)
    routing: str = "softmax"
    router_jitter_eps: float = 0.0  # sparsemixer: experts whose logit is within 2 eps (relative) of the best compete
    router_bias: bool = False  # GPT-OSS: the gate linear has a bias
    expert_bias: bool = False  # GPT-OSS: gate_up and down projections of the experts have biases
    expert_act: ClampedSwiGLU | None = None  # None: silu(gate) * up
    router_scales_input: bool = False  # Llama-4 (top-1): the gate weight scales the expert's input, not its output
    experts_mxfp4: bool = False  # routed experts stored as MXFP4 blocks + scales (quant_method mxfp4), kept packed
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense FFN (False)
    dense_ffn: int = 0  # FFN width of dense layers
    shared_expert_ffn: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ g) scales the shared expert
    # PR-MoE (DeepSpeed-MoE): routed experts per layer where layers differ (the pyramid; 0 = a dense layer), and
    # the residual mix: the shared expert (PR-MoE's dense MLP) and the routed output weighted by softmax(Linear(D, 2))
    layer_experts: tuple[int, ...] = ()  # () = num_experts in every MoE layer
    residual_mix: bool = False
    # Granite's scalars (muP): embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before its residual add, logits divided by logits_scaling; attention_scale: the softmax
    # scale (None: head_dim^-0.5)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "float32"

    # ---- derived sizes -------------------------------------------------------------------
    def experts_at(self, layer: int) -> int:
        """Routed experts of layer `layer` (num_experts unless the layers differ)."""
        return self.layer_experts[layer] if self.layer_experts else self.num_experts

    def moe_layer_indices(self) -> list[int]:
        """The layers with routed experts, in order (the others have a dense FFN)."""
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    @property
    def rotated_dims(self) -> int:
        """Dims of a head's query/key that the rope turns, from the head's start."""
        return self.rotary_dim or self.head_dim

    def attention_projections(self) -> tuple[tuple[str, int, int, bool], ...]:
        """(name, out_features, in_features, bias) of one layer's attention linears, as `self_attn.<name>`."""
        D, H, m = self.hidden_size, self.num_heads, self.mla
        if m is None:
            Hkv, Dh, b = self.num_kv_heads, self.head_dim, self.qkv_bias
            return (("q_proj", H * Dh, D, b), ("k_proj", Hkv * Dh, D, b), ("v_proj", Hkv * Dh, D, b),
                    ("o_proj", D, H * Dh, self.o_bias))
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ((("q_proj", H * qk, D, False),) if m.q_lora_rank is None else
             (("q_a_proj", m.q_lora_rank, D, self.qkv_bias), ("q_b_proj", H * qk, m.q_lora_rank, False)))
        return q + (("kv_a_proj_with_mqa", m.latent_dim, D, self.qkv_bias),
                    ("kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False),
                    ("o_proj", D, H * m.v_head_dim, self.o_bias))

    def kv_cache_entry(self) -> tuple[int, int, bool]:
        """(heads, values per head, values kept apart from keys) of one token's KV cache entry in one layer: GQA
        keeps keys and values of num_kv_heads heads; MLA one latent, from which keys and values are computed."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, False
        return self.num_kv_heads, self.head_dim, True

    def attention_core(self) -> tuple[int, int]:
        """(query values, output values) per head of the attention core, the part that reads the KV cache
        (Attention.core_attention): GQA head_dim and head_dim; MLA, which attends in the latent space (absorbed),
        the latent entry's width and kv_lora_rank."""
        if self.mla is not None:
            return self.mla.latent_dim, self.mla.kv_lora_rank
        return self.head_dim, self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token takes over all layers at dtype_bytes per value."""
        heads, dim, separate = self.kv_cache_entry()
        return self.num_layers * heads * dim * (2 if separate else 1) * dtype_bytes

    def parameter_counts(self) -> dict[str, int]:
        """Parameters split into dense (always active) and sparse (routed experts)."""
        D, H, Hkv, Dh = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        norm = D * (2 if self.norm == "layer" else 1)  # one decoder norm's weights (and bias)
        attn = sum(o * i + (o if bias else 0) for _, o, i, bias in self.attention_projections()) + 2 * norm
        if self.mla is not None:
            attn += self.mla.kv_lora_rank + (self.mla.q_lora_rank or 0)  # the latent norms
        elif self.qk_norm == "head":
            attn += 2 * Dh
        elif self.qk_norm == "full":
            attn += H * Dh + Hkv * Dh
        attn += H if self.attention_sinks else 0
        dense = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + norm
        dense += self.vocab_size if self.lm_head_bias else 0
        sparse = 0
        active_sparse = 0
        for i, is_moe in enumerate(self.moe_layers):
            dense += attn
            if is_moe:
                E = self.experts_at(i)
                dense += E * D + (E if self.router and self.router.correction_bias or self.router_bias else 0)
                dense += 3 * D * self.shared_expert_ffn + (D if self.shared_expert_gate else 0)
                dense += 2 * D + 2 if self.residual_mix else 0  # the mix's Linear(D, 2) with bias
                per_expert = 3 * D * self.expert_ffn + (2 * self.expert_ffn + D if self.expert_bias else 0)
                sparse += E * per_expert
                active_sparse += self.top_k * per_expert
            else:
                dense += 3 * D * self.dense_ffn
        return {"dense": dense, "experts": sparse, "total": dense + sparse, "active_per_token": dense + active_sparse}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        return cls(**read_fields(cfg))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        return cls.from_hf_config(read_config(path))


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
