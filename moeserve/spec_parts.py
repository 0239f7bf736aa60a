"""The typed parts of a ModelSpec (rope, latent attention, router, expert activation, attention temperature) and
the names each part's fields choose from. Pure data below both moeserve/spec.py and the family readers
(moeserve/families/), which build these parts from a config.json."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
NORMS = ("rms", "layer", "layer_no_bias")  # RMSNorm; LayerNorm with a bias (Phi-MoE) or without (DBRX)
ROUTINGS = ("softmax", "sparsemixer", "sigmoid")  # how the gate picks experts when ModelSpec.router is None
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
