"""The typed parts of a ModelSpec: its attention (AttentionSpec, with its rope, latent attention and temperature),
its sparse part (MoESpec, with its router and expert activation) and its norms (NormSpec); and the names their fields
choose from. Pure data below both moeserve/spec.py and the family readers (moeserve/families/)."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
NORMS = ("rms", "layer", "layer_no_bias")  # RMSNorm; LayerNorm with a bias (Phi-MoE) or without (DBRX)
ROUTINGS = ("softmax", "sparsemixer", "sigmoid")  # how the gate picks experts when MoESpec.router is None
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
    choice, the unbiased scores are the weights). Weights are renormalised (MoESpec.norm_topk_prob), then
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
class AttentionSpec:
    """One decoder layer's attention: heads, rope, projections' biases, qk-norm, MLA, and the per-layer windows,
    chunks and NoPE layers."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec = field(default_factory=RopeSpec)
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
    chunks: tuple[int | None, ...] = ()
    nope_layers: tuple[bool, ...] = ()
    temperature: AttentionTemperature | None = None
    sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax row (dropped after)
    scale: float | None = None  # the softmax scale (None: head_dim^-0.5; Granite: attention_multiplier)

    @property
    def rotated_dims(self) -> int:
        """Dims of a head's query/key that the rope turns, from the head's start."""
        return self.rotary_dim or self.head_dim

    def kv_cache_entry(self) -> tuple[int, int, bool]:
        """(heads, values per head, values kept apart from keys) of one token's KV cache entry in one layer: GQA
        keeps keys and values of num_kv_heads heads; MLA one latent, from which keys and values are computed."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, False
        return self.num_kv_heads, self.head_dim, True

    def core(self) -> tuple[int, int]:
        """(query values, output values) per head of the attention core, the part that reads the KV cache
        (Attention.core_attention): GQA head_dim and head_dim; MLA, which attends in the latent space (absorbed),
        the latent entry's width and kv_lora_rank."""
        if self.mla is not None:
            return self.mla.latent_dim, self.mla.kv_lora_rank
        return self.head_dim, self.head_dim


@dataclass(frozen=True)
class MoESpec:
    """The sparse part: which layers route to experts, how the gate picks them, the experts' FFN (width, biases,
    activation, storage), the shared expert and the dense FFN of the other layers."""

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
    layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense FFN (False)
    dense_ffn: int = 0  # FFN width of dense layers
    shared_expert_ffn: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ g) scales the shared expert
    # PR-MoE (DeepSpeed-MoE): routed experts per layer where layers differ (the pyramid; 0 = a dense layer), and
    # the residual mix: the shared expert (PR-MoE's dense MLP) and the routed output weighted by softmax(Linear(D, 2))
    layer_experts: tuple[int, ...] = ()  # () = num_experts in every MoE layer
    residual_mix: bool = False

    def experts_at(self, layer: int) -> int:
        """Routed experts of layer `layer` (num_experts unless the layers differ)."""
        return self.layer_experts[layer] if self.layer_experts else self.num_experts

    def layer_indices(self) -> list[int]:
        """The layers with routed experts, in order (the others have a dense FFN)."""
        return [i for i, moe in enumerate(self.layers) if moe]


@dataclass(frozen=True)
class NormSpec:
    """The decoder's norms (input, post-attention, final; qk-norms and MLA's latent norms are RMSNorms of this eps)."""

    kind: str = "rms"  # one of NORMS
    eps: float = 1e-6  # the eps of every norm, RMSNorm or LayerNorm
    fp32: bool = False  # GPT-OSS: RMSNorm weights kept and applied in float32, the product cast after
