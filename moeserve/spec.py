"""ModelSpec: one normalised description of every supported MoE architecture.

Each HF family spells the same ideas differently (`num_local_experts` vs `num_experts`,
`rope_scaling` vs `rope_parameters`, qk-norm per head vs over all heads). `from_hf_config`
reads a config.json dict once and the rest of moeserve only ever sees a ModelSpec.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeserve.errors import MoeserveError

# architectures value in config.json -> family name used inside moeserve
SUPPORTED_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "PRMoEForCausalLM": "prmoe",  # moeserve's own: PR-MoE (pyramid of expert counts, residual MoE layers)
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "PhimoeForCausalLM": "phimoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "DbrxForCausalLM": "dbrx",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",  # its text model (text_config, `language_model.` tensors) only
}
# What transformers' config class of each family puts in a field that config.json leaves out, where moeserve's reading
# would otherwise fall back to another value (checked against the classes in tests/model/test_family_defaults.py).
# with_family_defaults merges a family's table under the checkpoint's config before it is read, so a trimmed
# config.json means what it means to transformers. rope_theta is the rope's base where rope_parameters name none;
# rope_parameters is the family's rope when config.json gives neither rope_parameters nor rope_scaling.
LONG_CONTEXT = {"max_position_embeddings": 131072}
MIXTRAL_DEFAULTS = {**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 1e6}
QWEN2_MOE_DEFAULTS = {"max_position_embeddings": 32768, "shared_expert_intermediate_size": 5632}
QWEN3_MOE_DEFAULTS = {"max_position_embeddings": 32768}
OLMOE_DEFAULTS = {"rms_norm_eps": 1e-5}
DEEPSEEK_V2_DEFAULTS = {"max_position_embeddings": 2048, "q_lora_rank": 1536, "n_shared_experts": 2}
DEEPSEEK_V3_DEFAULTS = {"q_lora_rank": 1536, "n_shared_experts": 1, "first_k_dense_replace": 3,
                        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "norm_topk_prob": True}
GLM4_MOE_DEFAULTS = {**LONG_CONTEXT, "rms_norm_eps": 1e-5, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "norm_topk_prob": True}
PHIMOE_DEFAULTS = {**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 1e6}
GRANITEMOE_DEFAULTS = {"max_position_embeddings": 2048}
GPT_OSS_DEFAULTS = {**LONG_CONTEXT, "rms_norm_eps": 1e-5, "sliding_window": 128, "rope_theta": 150000.0,
                    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096}}
LLAMA4_DEFAULTS = {**LONG_CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_chunk_size": 8192}
FAMILY_DEFAULTS = {"mixtral": MIXTRAL_DEFAULTS, "qwen2_moe": QWEN2_MOE_DEFAULTS, "qwen3_moe": QWEN3_MOE_DEFAULTS,
                   "olmoe": OLMOE_DEFAULTS, "deepseek_v2": DEEPSEEK_V2_DEFAULTS, "deepseek_v3": DEEPSEEK_V3_DEFAULTS,
                   "glm4_moe": GLM4_MOE_DEFAULTS, "phimoe": PHIMOE_DEFAULTS, "granitemoe": GRANITEMOE_DEFAULTS,
                   "granitemoeshared": GRANITEMOE_DEFAULTS, "gpt_oss": GPT_OSS_DEFAULTS, "llama4": LLAMA4_DEFAULTS}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
NORMS = ("rms", "layer", "layer_no_bias")  # RMSNorm; LayerNorm with a bias (Phi-MoE) or without (DBRX)
ROUTINGS = ("softmax", "sparsemixer", "sigmoid")  # how the gate picks experts when ModelSpec.router is None
PARTIAL_ROTARY = ("glm4_moe",)  # families whose rope may turn only the start of a head
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    interleave: bool = False  # DeepSeek: rotated pairs are (x0, x1), (x2, x3).. instead of (x_i, x_i+Dh/2)
    # longrope (Phi-MoE): per-frequency divisors, short within original_max_position_embeddings, long past it; the
    # cos/sin scale of each (None: sqrt(1 + ln(max_position_embeddings / original) / ln(original)), LongRoPE's)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None
    long_mscale: float | None = None


@dataclass(frozen=True)
class MLASpec:
    """Multi-head Latent Attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck, keys and
    values from one compressed latent of kv_lora_rank per token, plus a rotary key of qk_rope_head_dim shared by
    every head. A head's query/key is [nope | rope] (qk_nope_head_dim + qk_rope_head_dim), its value v_head_dim."""

    q_lora_rank: int | None  # None: q_proj [H*(nope+rope), D]; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # (nope + rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2

    @property
    def latent_dim(self) -> int:
        """Values one token's cache entry holds per layer: the normed latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterSpec:
    """How a DeepSeek-style router picks experts. scoring: softmax or sigmoid of fp32 logits. topk_method: greedy
    (top-k of all), group_limited_greedy (top-k inside the topk_group of n_group groups with the highest best score)
    or noaux_tc (groups ranked by the sum of their two best scores; scores plus the correction bias decide the
    choice, the unbiased scores are the weights). Weights are renormalised (ModelSpec.norm_topk_prob), then
    multiplied by routed_scaling_factor."""

    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # the gate has e_score_correction_bias [E]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation on gate g and up u: (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
    g' = clamp(g, max=limit), instead of silu(g) * u."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class AttentionTemperature:
    """Llama-4's attention temperature on its NoPE layers: the query at position p is multiplied by
    1 + scale * log(1 + floor((p + 1) / floor_scale)), so attention stays sharp far into a long context."""

    floor_scale: float = 8192.0
    scale: float = 0.1


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

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = cfg.get("model_type")
            family = {v: v for v in SUPPORTED_ARCHITECTURES.values()}.get(model_type)
            if family is None or archs:
                raise MoeserveError(
                    f"unsupported architecture {archs or model_type!r}; supported: "
                    + ", ".join(SUPPORTED_ARCHITECTURES)
                )
        cfg = with_family_defaults(cfg, family)
        fp8_block_size(cfg)  # refuses quantized formats other than block-scaled FP8 (and GPT-OSS's MXFP4)
        if family not in PARTIAL_ROTARY and _partial_rotary(cfg, 1.0) != 1.0:
            raise MoeserveError(f"partial rotary embeddings (partial_rotary_factor != 1) are not supported for "
                                f"{family}")
        try:
            return _SPEC_READERS[family](cfg)
        except KeyError as e:
            raise MoeserveError(f"config.json for {family} lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        return cls.from_hf_config(read_config(path))


def fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """(rows, columns) of the FP8 scale blocks config.json's quantization_config names (quant_method "fp8",
    weight_block_size, 128 x 128 by default); None for a float checkpoint. Another quant_method is refused."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "mxfp4" and cfg.get("model_type") == "gpt_oss":
        return None  # GPT-OSS's MXFP4 experts (ModelSpec.experts_mxfp4), read as they are
    if method != "fp8":
        raise MoeserveError(f"quantization_config.quant_method {method!r} is not supported; moeserve reads float "
                            f"checkpoints, block-scaled 'fp8' ones and GPT-OSS's 'mxfp4' experts")
    block = quant.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise MoeserveError(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    return block[0], block[1]


def with_family_defaults(cfg: dict, family: str) -> dict:
    """cfg over its family's FAMILY_DEFAULTS. A rope that cfg gives (rope_parameters or rope_scaling) is taken whole,
    as transformers takes it: the family's default rope_parameters do not fill its gaps."""
    defaults = FAMILY_DEFAULTS.get(family, {})
    if _rope_params(cfg):
        defaults = {k: v for k, v in defaults.items() if k != "rope_parameters"}
    return {**defaults, **cfg}


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


# ---- per-family readers ------------------------------------------------------------------


def _rope_params(cfg: dict) -> dict:
    """rope_parameters (transformers 5) over rope_scaling (older configs): one dict."""
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def _rope(cfg: dict, interleave: bool = False) -> RopeSpec:
    """The rope of cfg; partial rotary is the GLM reader's business (_glm4_moe), refused for the others."""
    params = _rope_params(cfg)
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
        kw.update(_longrope(cfg, params))
    return RopeSpec(theta=float(theta), type=rope_type, interleave=interleave, **kw)


def _longrope(cfg: dict, params: dict) -> dict:
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


def _common(cfg: dict, family: str, rope: RopeSpec | None = None) -> dict:
    if cfg.get("hidden_act", "silu") != "silu":
        raise MoeserveError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    H = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=H,
        num_kv_heads=cfg.get("num_key_value_heads") or H,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // H,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=rope or _rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=cfg.get("pad_token_id"),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def _mixtral(cfg: dict) -> ModelSpec:
    c = _common(cfg, "mixtral")
    L = c["num_layers"]
    return ModelSpec(
        **c,
        sliding_windows=(cfg.get("sliding_window"),) * L,
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        expert_ffn=cfg["intermediate_size"],
        norm_topk_prob=True,
        router_weights_fp32=True,
        moe_layers=(True,) * L,
    )


def _num_experts(cfg: dict) -> int:
    """Qwen/OLMoE checkpoints say num_experts; transformers 5 may write num_local_experts instead."""
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n is None:
        raise KeyError("num_experts")
    return n


def _qwen_moe_layers(cfg: dict, L: int) -> tuple[bool, ...]:
    step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    n_exp = _num_experts(cfg)
    return tuple(i not in mlp_only and n_exp > 0 and (i + 1) % step == 0 for i in range(L))


def _qwen2_windows(cfg: dict, L: int) -> tuple[int | None, ...]:
    if not cfg.get("use_sliding_window", False):
        return (None,) * L
    types = cfg.get("layer_types")
    if types is None:
        mwl = cfg.get("max_window_layers", L)
        types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(L)]
    return tuple(cfg["sliding_window"] if t == "sliding_attention" else None for t in types)


def _qwen_sparse(cfg: dict, L: int) -> dict:
    """The sparse part both Qwen MoE generations share: dense layers interleaved by sparse step."""
    return dict(
        num_experts=_num_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_ffn=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_weights_fp32=False,
        moe_layers=_qwen_moe_layers(cfg, L),
        dense_ffn=cfg.get("intermediate_size", 0),
    )


def _qwen2_moe(cfg: dict) -> ModelSpec:
    c = _common(cfg, "qwen2_moe")
    L = c["num_layers"]
    return ModelSpec(
        **c,
        **_qwen_sparse(cfg, L),
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        sliding_windows=_qwen2_windows(cfg, L),
        shared_expert_ffn=cfg.get("shared_expert_intermediate_size", 0),
        shared_expert_gate=cfg.get("shared_expert_intermediate_size", 0) > 0,
    )


def _qwen3_moe(cfg: dict) -> ModelSpec:
    c = _common(cfg, "qwen3_moe")
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return ModelSpec(
        **c,
        qkv_bias=bias,
        o_bias=bias,
        **_qwen_sparse(cfg, L),
        qk_norm="head",
        sliding_windows=(window,) * L,
    )


def _olmoe(cfg: dict) -> ModelSpec:
    c = _common(cfg, "olmoe")
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        **c,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=cfg.get("clip_qkv"),
        sliding_windows=(None,) * L,
        num_experts=_num_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_ffn=cfg["intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_weights_fp32=False,
        moe_layers=(True,) * L,
    )


def _prmoe(cfg: dict) -> ModelSpec:
    """moeserve's PR-MoE config: `num_experts_per_layer` (one count per layer, 0 = a dense MLP layer) and
    `residual` (each MoE layer adds a dense MLP of the experts' width, mixed as DeepSpeed-MoE's use_residual)."""
    c = _common(cfg, "prmoe")
    L, k = c["num_layers"], cfg["num_experts_per_tok"]
    experts = cfg["num_experts_per_layer"]
    if not (isinstance(experts, list) and len(experts) == L and all(isinstance(e, int) and e >= 0 for e in experts)):
        raise MoeserveError(f"num_experts_per_layer must list {L} expert counts (0 = a dense layer), got {experts!r}")
    if any(0 < e < k for e in experts) or not any(experts):
        raise MoeserveError(f"num_experts_per_layer {experts} needs an MoE layer and at least top-{k} experts in each")
    residual = bool(cfg.get("residual", False))
    ffn = cfg["intermediate_size"]
    return ModelSpec(
        **c,
        sliding_windows=(None,) * L,
        num_experts=max(experts),
        layer_experts=tuple(experts),
        top_k=k,
        expert_ffn=ffn,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", k > 1)),
        router_weights_fp32=True,
        moe_layers=tuple(e > 0 for e in experts),
        dense_ffn=ffn,
        shared_expert_ffn=ffn if residual else 0,
        residual_mix=residual,
    )


def _partial_rotary(cfg: dict, default: float) -> float:
    return float(_rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def _router(cfg: dict, scoring: str, topk_method: str, correction_bias: bool) -> RouterSpec:
    """DeepSeek-style routing fields; scoring and topk_method: the family's defaults where cfg names none."""
    scoring = cfg.get("scoring_func") or scoring
    if scoring not in SCORING_FUNCS:
        raise MoeserveError(f"scoring_func {scoring!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
    method = cfg.get("topk_method") or topk_method
    if method not in TOPK_METHODS:
        raise MoeserveError(f"topk_method {method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
    E, k = _deepseek_experts(cfg), cfg.get("num_experts_per_tok")
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


def _deepseek_experts(cfg: dict) -> int:
    n = cfg.get("n_routed_experts", cfg.get("num_local_experts", cfg.get("num_experts")))
    if n is None:
        raise KeyError("n_routed_experts")
    return n


def _deepseek_sparse(cfg: dict, L: int, router: RouterSpec) -> dict:
    """The sparse part DeepSeek-V2/V3 and GLM-4.5 share: first_k_dense_replace dense layers, then an MoE layer every
    moe_layer_freq (DeepSeek's own rule; transformers reads 1), n_shared_experts as one shared FFN."""
    first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    return dict(
        num_experts=_deepseek_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_ffn=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_weights_fp32=True,
        moe_layers=tuple(i >= first and i % freq == 0 for i in range(L)),
        dense_ffn=cfg["intermediate_size"],
        shared_expert_ffn=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
        router=router,
        sliding_windows=(None,) * L,
    )


def _mla(cfg: dict, rope: RopeSpec) -> MLASpec:
    nope, rot = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rot) ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:  # YaRN's attention temperature, on the softmax scale
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= m * m
    return MLASpec(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
                   qk_rope_head_dim=rot, v_head_dim=cfg["v_head_dim"], softmax_scale=scale)


def _deepseek(cfg: dict, family: str) -> ModelSpec:
    """DeepSeek-V2 (softmax routing, greedy or group-limited) and V3 (sigmoid noaux_tc with a correction bias):
    MLA, whose rotary pairs are interleaved (V2 always; V3 unless rope_interleave is false)."""
    v3 = family == "deepseek_v3"
    rope = _rope(cfg, interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)
    c = _common(cfg, family, rope)
    mla = _mla(cfg, rope)
    c.update(head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, num_kv_heads=c["num_heads"])
    bias = bool(cfg.get("attention_bias", False))
    router = _router(cfg, "sigmoid" if v3 else "softmax", "noaux_tc" if v3 else "greedy", correction_bias=v3)
    return ModelSpec(**c, qkv_bias=bias, o_bias=bias, rotary_dim=mla.qk_rope_head_dim, mla=mla,
                     **_deepseek_sparse(cfg, c["num_layers"], router))


def _glm4_moe(cfg: dict) -> ModelSpec:
    """GLM-4.5: GQA with partial rotary (default half the head), q/k/v bias, optional per-head qk-norm; V3's router."""
    c = _common(cfg, "glm4_moe")
    router = _router(cfg, "sigmoid", "noaux_tc", correction_bias=True)
    return ModelSpec(**c, qkv_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm="head" if cfg.get("use_qk_norm") else None,
                     rotary_dim=int(c["head_dim"] * _partial_rotary(cfg, 0.5)),
                     **_deepseek_sparse(cfg, c["num_layers"], router))


def _phimoe(cfg: dict) -> ModelSpec:
    """Phi-3.5-MoE: LayerNorms with bias, attention and lm_head biases, LongRoPE, sparsemixer top-2 routing."""
    c = _common(cfg, "phimoe")
    L = c["num_layers"]
    if cfg.get("num_experts_per_tok", 2) != 2:
        raise MoeserveError(f"Phi-MoE's sparsemixer routes every token to 2 experts; num_experts_per_tok is "
                            f"{cfg['num_experts_per_tok']}")
    bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(**c, norm="layer", lm_head_bias=bool(cfg.get("lm_head_bias", False)), qkv_bias=bias,
                     o_bias=bias, sliding_windows=(cfg.get("sliding_window"),) * L,
                     num_experts=cfg["num_local_experts"], top_k=2, expert_ffn=cfg["intermediate_size"],
                     router_weights_fp32=False, routing="sparsemixer",
                     router_jitter_eps=float(cfg.get("router_jitter_noise", 0.01)), moe_layers=(True,) * L)


def _granitemoe(cfg: dict, family: str) -> ModelSpec:
    """Granite-MoE (and -Shared: a shared MLP beside the experts, added unweighted): softmax over the top-k logits
    (= softmax top-k renormalised), muP multipliers on embeddings, residual branches, attention scale, logits."""
    c = _common(cfg, family)
    L = c["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(**c, qkv_bias=bias, o_bias=bias, sliding_windows=(None,) * L,
                     num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                     expert_ffn=cfg["intermediate_size"], norm_topk_prob=True, router_weights_fp32=False,
                     moe_layers=(True,) * L, shared_expert_ffn=cfg.get("shared_intermediate_size") or 0,
                     embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                     residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                     logits_scaling=float(cfg.get("logits_scaling", 1.0)),
                     attention_scale=float(cfg.get("attention_multiplier", 1.0)))


def _dbrx(cfg: dict) -> ModelSpec:
    """DBRX: its own config names (d_model, attn_config, ffn_config), LayerNorms without bias (eps 1e-5), clip_qkv
    on the fused qkv, softmax top-k with the top weights divided by their p-norm (p = 1: renormalised; None: as
    they are). Its fused Wqkv and expert tensors are split on reading (moeserve/layouts.py)."""
    attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    p = ffn.get("moe_normalize_expert_weights", 1)
    if p not in (None, 1):
        raise MoeserveError(f"DBRX ffn_config.moe_normalize_expert_weights {p!r} is not supported (1 or null)")
    flat = dict(cfg, hidden_size=cfg["d_model"], num_attention_heads=cfg["n_heads"], num_hidden_layers=cfg["n_layers"],
                num_key_value_heads=attn.get("kv_n_heads", 1), max_position_embeddings=cfg.get("max_seq_len", 2048),
                hidden_act=(ffn.get("ffn_act_fn") or {}).get("name", "silu"), rms_norm_eps=1e-5,
                rope_theta=attn.get("rope_theta", 10000.0))
    c = _common(flat, "dbrx")
    L = c["num_layers"]
    return ModelSpec(**c, norm="layer_no_bias", clip_qkv=attn.get("clip_qkv"), sliding_windows=(None,) * L,
                     num_experts=ffn["moe_num_experts"], top_k=ffn["moe_top_k"], expert_ffn=ffn["ffn_hidden_size"],
                     norm_topk_prob=p is not None, router_weights_fp32=False, moe_layers=(True,) * L)


def _gpt_oss(cfg: dict) -> ModelSpec:
    """GPT-OSS: attention sinks, sliding and full layers by layer_types, q/k/v/o biases, YaRN; a biased router whose
    weights are the softmax of the top-k logits (= softmax, top-k, renormalised); biased experts with the clamped
    SwiGLU; float32 RMSNorm; MXFP4 experts where quantization_config says so."""
    c = _common({**cfg, "hidden_act": "silu"}, "gpt_oss")  # hidden_act is unused: the experts' activation is fixed
    L = c["num_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise MoeserveError(f"layer_types must list {L} of sliding_attention / full_attention, got {types!r}")
    bias = bool(cfg.get("attention_bias", True))
    quant = cfg.get("quantization_config") or {}
    return ModelSpec(
        **c, qkv_bias=bias, o_bias=bias, attention_sinks=True, norm_fp32=True,
        sliding_windows=tuple(cfg.get("sliding_window") if t == "sliding_attention" else None for t in types),
        num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], expert_ffn=cfg["intermediate_size"],
        norm_topk_prob=True, router_weights_fp32=False, moe_layers=(True,) * L, router_bias=True, expert_bias=True,
        expert_act=ClampedSwiGLU(alpha=float(cfg.get("swiglu_alpha", 1.702)),
                                 limit=float(cfg.get("swiglu_limit", 7.0))),
        experts_mxfp4=quant.get("quant_method") == "mxfp4",
    )


def _llama4(cfg: dict) -> ModelSpec:
    """Llama-4's text model (Llama4ForConditionalGeneration's: its text_config over the top level): MoE layers every
    interleave_moe_layer_step (or as moe_layers lists them) with a shared expert, dense layers between them; a
    sigmoid top-1 router whose weight scales the expert's input; attention as _llama4_attention reads it."""
    text = {**cfg, **(cfg.get("text_config") or {}), "architectures": cfg.get("architectures")}
    c = _common(text, "llama4", _rope(text, interleave=True))
    L, k = c["num_layers"], text.get("num_experts_per_tok", 1)
    if k != 1:
        raise MoeserveError(f"Llama-4's router scales the expert's input by its weight; moeserve runs that for one "
                            f"expert per token (num_experts_per_tok 1, as every Llama-4 checkpoint), not {k}")
    step = text.get("interleave_moe_layer_step") or 1
    moe = text.get("moe_layers")
    moe = set(range(step - 1, L, step) if moe is None else moe)
    bias = bool(text.get("attention_bias", False))
    ffn = text["intermediate_size"]
    return ModelSpec(
        **c, qkv_bias=bias, o_bias=bias, **_llama4_attention(text, L), num_experts=text["num_local_experts"],
        top_k=1, expert_ffn=ffn, norm_topk_prob=False, router_weights_fp32=False, routing="sigmoid",
        router_scales_input=True, moe_layers=tuple(i in moe for i in range(L)),
        dense_ffn=text.get("intermediate_size_mlp", 16384), shared_expert_ffn=ffn,
    )


def _llama4_attention(text: dict, L: int) -> dict:
    """Llama-4's attention fields: rotary layers (no_rope_layers 1; by default all but every
    no_rope_layer_interval-th) attend in chunks of attention_chunk_size (as layer_types says, where it does) and
    L2-norm q and k (use_qk_norm); the others are NoPE layers with the attention temperature
    (attn_temperature_tuning, floor_scale, attn_scale)."""
    rope_layers = _llama4_list(text, "no_rope_layers", L) or [
        int((i + 1) % (text.get("no_rope_layer_interval") or 4) != 0) for i in range(L)]
    chunk = text.get("attention_chunk_size")
    types = _llama4_list(text, "layer_types", L) or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope_layers]
    if not set(types) <= {"chunked_attention", "full_attention"}:
        raise MoeserveError(f"layer_types must list chunked_attention / full_attention, got {types!r}")
    temperature = (AttentionTemperature(float(text.get("floor_scale", 8192)), float(text.get("attn_scale", 0.1)))
                   if text.get("attn_temperature_tuning", True) else None)
    return dict(qk_norm="l2" if text.get("use_qk_norm", True) else None, sliding_windows=(None,) * L,
                attention_chunks=tuple(chunk if t == "chunked_attention" else None for t in types),
                nope_layers=tuple(not r for r in rope_layers), attention_temperature=temperature)


def _llama4_list(cfg: dict, name: str, L: int) -> list | None:
    """A per-layer list of Llama-4's config (no_rope_layers, layer_types), None where it names none."""
    values = cfg.get(name)
    if not values:
        return None
    if len(values) < L:
        raise MoeserveError(f"{name} must name each of the {L} layers, got {values!r}")
    return list(values[:L])


_SPEC_READERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
                 "prmoe": _prmoe, "deepseek_v2": lambda cfg: _deepseek(cfg, "deepseek_v2"),
                 "deepseek_v3": lambda cfg: _deepseek(cfg, "deepseek_v3"), "glm4_moe": _glm4_moe,
                 "phimoe": _phimoe, "granitemoe": lambda cfg: _granitemoe(cfg, "granitemoe"),
                 "granitemoeshared": lambda cfg: _granitemoe(cfg, "granitemoeshared"), "dbrx": _dbrx,
                 "gpt_oss": _gpt_oss, "llama4": _llama4}


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
