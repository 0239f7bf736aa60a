"""Dense building blocks: RMSNorm, LayerNorm, rotary embedding, GQA attention with a KV cache, SwiGLU MLP."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moeserve.kernels import needs_grad, triton_serves
from moeserve.model.sinks import sink_attention
from moeserve.spec import AttentionTemperature, ModelSpec, longrope_long_inv_freq, longrope_mscales, rope_inv_freq

# SDPA's cuDNN backend builds an execution plan per new shape, milliseconds of host time, and an eager decode step
# has a new key length every step (offload, hybrid): attention on CUDA runs on the other backends.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_serves(x, self.weight):  # one launch instead of eight, rounding where this code does
            from moeserve.kernels.triton.norm_rotary import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # normalise in fp32, scale in the input dtype (as HF does, so bf16 results agree)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def added(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + h), x + h): a residual add and the norm after it, one launch on CUDA (norm_rotary.py)."""
        if triton_serves(x, self.weight) and h.shape == x.shape and h.dtype == x.dtype:
            from moeserve.kernels.triton.norm_rotary import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=h)
        x = x + h
        return self(x), x


class Fp32RMSNorm(RMSNorm):
    """GPT-OSS's RMSNorm: the weight stays float32 (FP32_TENSORS, as transformers keeps it) and scales the float32
    normalised values before the cast to x's dtype (RMSNorm casts first, then scales)."""

    FP32_TENSORS = ("weight",)  # the loader keeps these in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def added(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + h
        return self(x), x


class LayerNorm(nn.LayerNorm):
    """LayerNorm with (Phi-MoE) or without (DBRX) a bias, with RMSNorm's `added`: the decoder's norms are either."""

    def added(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + h), x + h)."""
        x = x + h
        return self(x), x


def decoder_norm(spec: ModelSpec, dim: int) -> RMSNorm | LayerNorm:
    """A norm of the decoder stack (input, post-attention, final) of the kind spec.norm names (GPT-OSS's RMSNorm
    keeps its weight in float32: spec.norm.fp32)."""
    if spec.norm.kind == "rms":
        return (Fp32RMSNorm if spec.norm.fp32 else RMSNorm)(dim, spec.norm.eps)
    return LayerNorm(dim, eps=spec.norm.eps, bias=spec.norm.kind == "layer")


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly from integer positions (any length, any rope type).

    LongRoPE has two sets of frequencies: a pass whose last position reaches past original_max_position_embeddings
    rotates all its tokens with the long factors (and their scale), else with the short ones, as Phi-3.5-MoE's own
    code does (keys already cached keep theirs). Chosen on the device: no host sync, the same in a CUDA graph."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        rope, R = spec.attention.rope, spec.attention.rotated_dims
        with torch.device("cpu"):  # also in a model built on the meta device: torch's meta arange imports its compiler
            inv_freq, self.scale = rope_inv_freq(rope, R, spec.max_position_embeddings)
            long_inv_freq = longrope_long_inv_freq(rope, R) if rope.type == "longrope" else None
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [R/2], R = spec.attention.rotated_dims
        self.long_from = None  # longrope: the first position (counting from 1) that takes the long factors
        if rope.type == "longrope":
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)  # [R/2]
            self.long_from = rope.original_max_position_embeddings + 1
            self.long_scale = longrope_mscales(rope, spec.max_position_embeddings)[1]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = self.inv_freq.float(), self.scale
        if self.long_from is not None:
            long = positions.max() + 1 >= self.long_from  # [] bool, on the device
            inv_freq = torch.where(long, self.long_inv_freq.float(), inv_freq)  # [R/2]
            scale = torch.where(long, self.long_scale, self.scale)  # [] float32
        freqs = positions[..., None].float() * inv_freq  # [B, S, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, R]
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, Dh]; cos/sin [B, S, R], R <= Dh; rotate-half convention (HF/Llama) on the first R dims of each
    head, the rest (partial rotary: GLM) as they are."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    if triton_serves(x):
        from moeserve.kernels.triton.norm_rotary import rotary, rotary_fits

        if rotary_fits(x, cos, sin):
            return rotary(x, cos, sin)  # one launch instead of five, the same roundings
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """x [.., R] with rotary pairs interleaved, (x0, x1), (x2, x3).. (DeepSeek's, Llama-4's) -> the even dims then
    the odd ones, the halves apply_rotary turns as pairs. Queries and keys take the same order, so q.k is as it was."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-4's qk-norm: x [.., Dh] over its root mean square, no weight (float32, cast back)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scale(t: AttentionTemperature, positions: torch.Tensor) -> torch.Tensor:
    """Llama-4's query scale at positions [B, S] -> [B, S] float32 (AttentionTemperature's formula)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / t.floor_scale)) * t.scale + 1.0


def linears_path(x: torch.Tensor, mods) -> str:
    """How linears() runs x through mods: "skinny" (CUDA, decode rows: one launch for all of them, where cuBLAS runs
    each as a split-K GEMV plus a reduce) or "torch" (each module). Names in model/paths.py LINEAR_PATHS."""
    return "skinny" if triton_serves(x) and skinny_serves(x, mods) else "torch"


def linears(x: torch.Tensor, *mods: nn.Linear) -> tuple[torch.Tensor, ...]:
    """x [.., K] through each of the linear layers mods, as linears_path says."""
    if linears_path(x, mods) == "skinny":
        return side_by_side(x, mods).split([m.out_features for m in mods], dim=-1)
    return tuple(m(x) for m in mods)


def side_by_side(x: torch.Tensor, mods) -> torch.Tensor:
    """x [.., K] through the linear layers mods (skinny_serves said yes) in one launch: their outputs side by side,
    [.., sum of out_features]."""
    from moeserve.kernels.triton.skinny import skinny_linears

    biases = [m.bias for m in mods] if mods[0].bias is not None else None
    y = skinny_linears(x.reshape(-1, x.shape[-1]), [m.weight for m in mods], biases, out_dtype=x.dtype, block_n=2,
                       stages=4)  # [M, N]
    return y.view(*x.shape[:-1], y.shape[-1])


def skinny_serves(x: torch.Tensor, mods) -> bool:
    """Whether linears() may run mods as one skinny launch: at most DENSE_ROWS rows of x (where it was measured
    faster), plain nn.Linear layers (no subclass, no hooks: a tensor-parallel or quantized layer does more than
    x W^T + b) with weights of x's dtype and device, all with biases or none, no autograd."""
    from moeserve.kernels.triton.skinny import DENSE_ROWS, MAX_WEIGHTS

    return (0 < x.numel() // x.shape[-1] <= DENSE_ROWS and 0 < len(mods) <= MAX_WEIGHTS
            and all(type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in mods)
            and all(m.weight.dtype == x.dtype and m.weight.device == x.device for m in mods)
            and len({m.bias is None for m in mods}) == 1
            and not any(needs_grad(x, m.weight, m.bias) for m in mods))


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        D, H, Hkv, Dh = spec.hidden_size, spec.attention.num_heads, spec.attention.num_kv_heads, spec.attention.head_dim
        self.layer_idx, self.H, self.Hkv, self.Dh = layer_idx, H, Hkv, Dh
        self.q_proj = nn.Linear(D, H * Dh, bias=spec.attention.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=spec.attention.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=spec.attention.qkv_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=spec.attention.o_bias)
        nope = bool(spec.attention.nope_layers) and spec.attention.nope_layers[layer_idx]
        self.rotary, self.interleaved = not nope, spec.attention.rope.interleave  # Llama-4's NoPE layers turn nothing
        self.tempered = nope and spec.attention.temperature is not None  # q times temperature_scale (q_scale)
        # Llama-4's qk-norm: on rotary layers only
        self.qk_norm = None if spec.attention.qk_norm == "l2" and nope else spec.attention.qk_norm
        self.eps = spec.norm.eps
        if spec.attention.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(Dh, spec.norm.eps), RMSNorm(Dh, spec.norm.eps)
        elif spec.attention.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * Dh, spec.norm.eps), RMSNorm(Hkv * Dh, spec.norm.eps)
        self.clip_qkv = spec.attention.clip_qkv
        self.scale = spec.attention.scale  # the softmax scale; None: head_dim^-0.5 (SDPA's default)
        self.sinks = nn.Parameter(torch.empty(H)) if spec.attention.sinks else None  # GPT-OSS: model/sinks.py

    def forward(self, x, cos, sin, mask, kv=None, q_scale=None):
        """x [B, S, D]; mask [B, 1, S, S_total] bool (True = attend) or additive (0 / -inf, static decode); kv:
        KVCache or None (static decode: S_total = all of kv.max_len); q_scale [B, S]: the attention temperature of
        each query (temperature_scale), applied on NoPE layers, or None."""
        qkv = self.qkv_into_cache(x, cos, sin, kv) if kv is not None else None
        if qkv is not None:
            q, k, v, rows = qkv  # k/v: the whole caches, sequence b's at row rows[b]
            if not self.decode_kernel(q, v, mask):  # SDPA (sinks) reads the rows' own keys and values
                k, v, rows = k.index_select(0, rows), v.index_select(0, rows), None
            out = self.attend(q, k, v, mask, rows)
        else:
            q, k, v = self.qkv(x, cos, sin, q_scale)
            rows = None
            if kv is not None and self.decode_kernel(q, v, mask):
                k, v, rows = kv.update_in_place(self.layer_idx, k, v)  # the caches, read in place
            elif kv is not None:
                k, v = kv.update(self.layer_idx, k, v)  # [B, Hkv, S_total, Dh]
            out = self.attend(q, k, v, mask, rows)
        return self.project_out(out)

    def decode_kernel(self, q, v, mask) -> bool:
        """Whether attention of this call runs the decode kernel (kernels/triton/decode_attention.py): one token,
        on a GPU, with a mask, where it applies; otherwise SDPA."""
        if not q.is_cuda or mask is None:
            return False
        from moeserve.kernels.triton.decode_attention import decode_attention_serves

        return decode_attention_serves(q, v, self.sinks)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """The projections that read the layer input, run side by side (linears)."""
        return self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x, cos, sin, q_scale=None):
        """Pre-attention: x [B, S, D] -> q [B, H, S, Dh], k and v [B, Hkv, S, Dh] (normed, clipped, rotated, q
        tempered): the query attend() takes and the new cache entry KVCache.update() takes. A step of its own, as
        are attend() and project_out(), so a pipeline can place the cache and the attention (plan/pipeline.py)."""
        B, S, _ = x.shape
        q, k, v = linears(x, *self.input_projections())  # [B, S, H*Dh], [B, S, Hkv*Dh] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, S, self.H, self.Dh)
        k = k.view(B, S, self.Hkv, self.Dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, Dh], [B, Hkv, S, Dh]
        if self.rotary:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.qk_norm == "l2":
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.tempered:
            q = (q * q_scale[:, None, :, None]).to(q.dtype)
        return q, k, v.view(B, S, self.Hkv, self.Dh).transpose(1, 2)  # v [B, Hkv, S, Dh]

    def rotate(self, x, cos, sin):
        """x [B, h, S, Dh] rotated (its pairs deinterleaved first where the family interleaves them: Llama-4)."""
        return apply_rotary(deinterleaved(x) if self.interleaved else x, cos, sin)

    def qkv_into_cache(self, x, cos, sin, kv):
        """A static decode step's (q, the caches' keys and values, each sequence's row [B]) with the new entries
        written, in two launches: the three projections (side_by_side), then the rotary of q and k and the cache
        writes of k and v (rotary_into_cache) instead of seven. None where that does not apply: a dynamic pass,
        several tokens, qk norms or clipping, partial, interleaved or no rotary, the attention temperature, layers
        skinny does not take, dtypes that differ."""
        cache = kv.static_slot(self.layer_idx)
        mods = self.input_projections()
        if (cache is None or x.shape[1] != 1 or self.qk_norm or self.clip_qkv is not None or self.Dh & (self.Dh - 1)
                or not self.rotary or self.interleaved or self.tempered
                or cos.shape[-1] != self.Dh
                or linears_path(x, mods) != "skinny"
                or not x.dtype == cos.dtype == sin.dtype == cache[0].dtype):
            return None
        from moeserve.kernels.triton.norm_rotary import rotary_into_cache

        keys, values, slots, rows = cache
        return rotary_into_cache(side_by_side(x, mods), cos, sin, self.H, keys, values, slots, rows), keys, values, rows

    def attend(self, q, k, v, mask, rows=None):
        """q [B, H, S, Dh], k/v [B, Hkv, S_total, Dh] -> attention output [B, S, H*Dh] (before o_proj). rows [B]: k/v
        are whole caches [R, Hkv, >= S_total, Dh] and sequence b reads row rows[b] (the decode kernel)."""
        if rows is not None or (q.shape[2] == 1 and self.decode_kernel(q, v, mask)):
            from moeserve.kernels.triton.decode_attention import decode_attention

            return decode_attention(q, k, v, rows, mask, self.scale)
        return self.core_attention(q, k, v, mask)

    # attention in three steps around the part that reads the cache (the core), which needs no weights but the
    # sinks, so that it can run on the device the cache lies on (plan/pipeline.py's CPU attention):
    # attend = core_output(core_attention(core_query(q), keys, values, mask)); here the outer two are identities
    def core_query(self, q: torch.Tensor) -> torch.Tensor:
        """The query the core reads the cache with: q [B, H, S, Dh] itself."""
        return q

    def core_attention(self, q, k, v, mask) -> torch.Tensor:
        """q [B, H, S, Dh], k/v [B, Hkv, S_total, Dh], mask [B, 1, S, S_total] bool or additive -> [B, S, H*Dh]:
        softmax attention, with the sinks where the family has them (model/sinks.py), on q's device."""
        B, _, S, _ = q.shape
        if self.sinks is not None:
            return sink_attention(q, k, v, mask, self.sinks).transpose(1, 2).reshape(B, S, self.H * self.Dh)
        with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.H != self.Hkv,
                                                 scale=self.scale)
        return out.transpose(1, 2).reshape(B, S, self.H * self.Dh)

    def core_output(self, out: torch.Tensor) -> torch.Tensor:
        """The core's output [B, S, H*Dh] as attend() gives it: itself."""
        return out

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, S, H*Dh] -> [B, S, D] (o_proj)."""
        return linears(out, self.o_proj)[0]


class MLP(nn.Module):
    """SwiGLU FFN: dense layers and shared experts."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = linears(x, self.gate_proj, self.up_proj)
        return linears(F.silu(gate) * up, self.down_proj)[0]
