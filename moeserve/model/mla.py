"""Multi-head Latent Attention (DeepSeek-V2/V3), computed for inference.

Per token the layer makes one latent c = RMSNorm(x W_DKV) of kv_lora_rank values and one rotary key k_r of
qk_rope_head_dim values shared by all heads; head h's key is [c W_UK_h^T | k_r] and its value c W_UV_h^T
(W_UK_h [nope, r] and W_UV_h [v, r] are head h's rows of kv_b_proj). The KV cache holds only [c | k_r] per token
and layer (ModelSpec.attention.kv_cache_entry): kv_lora_rank + qk_rope_head_dim values instead of 2 H head_dim.

Two ways to attend over the cached latents, equal up to rounding:
  absorbed: W_UK folds into the query (q_nope_h W_UK_h is a query over c), W_UV into the output (softmax(..) c
            W_UV_h^T): attention runs in the latent space, one key [c | k_r] for every head (MQA-like), and K/V are
            never expanded. Cost per query token ~ S_total H (2 r + rope).
  expanded: keys and values of every head from kv_b_proj over all S_total latents, then plain attention. Cost
            ~ S_total H r (nope + v) for the expansion, shared by all S query tokens.
`absorbs(S)` picks the cheaper for a pass of S query tokens: decode (and short chunks) absorb; long prefills expand.
The absorbed form runs in three steps, core_query -> core_attention -> core_output (as Attention's do), so that the
middle one, which reads the cache and needs no weights, can run where the cache lies (plan/pipeline.py).
Both have static shapes and no host syncs, so a decode step with either is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.model.layers import RMSNorm, apply_rotary, deinterleaved, linears
from moeserve.spec import ModelSpec

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers gives them the default eps, not rms_norm_eps


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight of an nn.Linear, or of a quantized linear (dequantized, at dtype)."""
    w = linear.weight
    return w if isinstance(w, torch.Tensor) else linear.weight(dtype)


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        m = spec.attention.mla
        self.layer_idx, self.H = layer_idx, spec.attention.num_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        self.scale, self.interleave = m.softmax_scale, spec.attention.rope.interleave
        self.q_lora = m.q_lora_rank is not None
        for name, out_features, in_features, bias in spec.attention_projections():
            setattr(self, name, nn.Linear(in_features, out_features, bias=bias))
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """The projections that read the layer input, run side by side (linears): the query's (or its LoRA's first
        half) and the latent's."""
        return (self.q_a_proj if self.q_lora else self.q_proj), self.kv_a_proj_with_mqa

    def absorbs(self, S: int) -> bool:
        """Whether a pass of S query tokens attends in the latent space: when that is fewer FLOPs than expanding,
        S H (2 r + rope) < H r (nope + v) + S H (nope + rope + v) per key (both share the rope part)."""
        return S * (2 * self.rank - self.nope - self.v_dim) < self.rank * (self.nope + self.v_dim)

    def forward(self, x, cos, sin, mask, kv=None, q_scale=None):
        """x [B, S, D]; cos/sin [B, S, rope]; mask [B, 1, S, S_total] bool (True = attend) or additive (static
        decode); kv: KVCache, SlotKVCache or None; q_scale: None (no MLA family has an attention temperature).
        -> [B, S, D]."""
        q, entry, _ = self.qkv(x, cos, sin, q_scale)
        if kv is not None:
            entry = kv.update(self.layer_idx, entry, None)[0]  # [B, 1, S_total, r + rope]
        return self.project_out(self.attend(q, entry, None, mask))

    def qkv(self, x, cos, sin, q_scale=None):
        """Pre-attention: x [B, S, D] -> (q [B, H, S, nope + rope], its rope part rotated; the new cache entry
        [B, 1, S, r + rope], the normed latent and the rotated shared key; None: MLA caches no values), as
        Attention.qkv gives the query attend() takes and the entry KVCache.update() takes."""
        B, S, _ = x.shape
        q, latent = linears(x, *self.input_projections())  # [B, S, H (nope + rope)] or [B, S, q_lora]; [B, S, r + rope]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(B, S, self.H, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        c, k_rope = latent.split([self.rank, self.rope], dim=-1)  # [B, S, r], [B, S, rope]
        q = torch.cat((q_nope, self._rotate(q_rope, cos, sin)), dim=-1)  # [B, H, S, nope + rope]
        k_rope = self._rotate(k_rope[:, None], cos, sin)  # [B, 1, S, rope]
        return q, torch.cat((self.kv_a_layernorm(c)[:, None], k_rope), dim=-1), None  # entry [B, 1, S, r + rope]

    def attend(self, q, entry, values, mask):
        """q [B, H, S, nope + rope], entry [B, 1, S_total, r + rope] (values: None) -> [B, S, H v], absorbed or
        expanded as absorbs(S) says."""
        if self.absorbs(q.shape[2]):
            return self.core_output(self.core_attention(self.core_query(q), entry, None, mask))
        return self._expanded(q, entry[:, 0], mask)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, S, H v] -> [B, S, D] (o_proj)."""
        return linears(out, self.o_proj)[0]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, h, S, rope], DeepSeek's interleaved pairs deinterleaved first (transformers' interleaved rope gives
        this layout too)."""
        return apply_rotary(deinterleaved(x) if self.interleave else x, cos, sin)

    # absorbed attention in three steps around the part that reads the cache (the core), which needs no weights, so
    # that it can run on the device the cache lies on (plan/pipeline.py's CPU attention), as Attention's
    def core_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, nope + rope] -> the query over the latents [B, H, S, r + rope]: q_nope_h W_UK_h | q_rope."""
        B, H, S, _ = q.shape
        w_uk = self._kv_b_weight(q.dtype)[:, :self.nope]  # [H, nope, r]
        q_lat = torch.bmm(q[..., :self.nope].transpose(0, 1).reshape(H, B * S, self.nope), w_uk)  # [H, B S, r]
        return torch.cat((q_lat.view(H, B, S, self.rank).transpose(0, 1), q[..., self.nope:]), dim=-1)

    def core_attention(self, q_lat, entry, values, mask) -> torch.Tensor:
        """q_lat [B, H, S, r + rope] (core_query), entry [B, 1, S_total, r + rope] (values: None), mask [B, 1, S,
        S_total] bool or additive -> the latent outputs softmax(q_lat entry^T) c [B, H, S, r], on q_lat's device."""
        B, H, S, _ = q_lat.shape
        entry = entry[:, 0]  # [B, S_total, r + rope]: one key for every head
        scores = torch.bmm(q_lat.reshape(B, H * S, -1), entry.transpose(1, 2)).view(B, H, S, -1) * self.scale
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(entry.dtype)
        return torch.bmm(probs.view(B, H * S, -1), entry[..., :self.rank]).view(B, H, S, self.rank)

    def core_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The latent outputs [B, H, S, r] -> [B, S, H v]: o_lat_h W_UV_h^T."""
        B, H, S, _ = o_lat.shape
        w_uv = self._kv_b_weight(o_lat.dtype)[:, self.nope:]  # [H, v, r]
        out = torch.bmm(o_lat.transpose(0, 1).reshape(H, B * S, self.rank), w_uv.transpose(1, 2))  # [H, B S, v]
        return out.view(H, B, S, self.v_dim).permute(1, 2, 0, 3).reshape(B, S, H * self.v_dim)

    def _kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight per head [H, nope + v, r]: W_UK_h (rows :nope) and W_UV_h (rows nope:)."""
        return dense_weight(self.kv_b_proj, dtype).view(self.H, self.nope + self.v_dim, self.rank)

    def _expanded(self, q, entry, mask):
        """q [B, H, S, nope + rope], entry [B, S_total, r + rope] -> [B, S, H v], with keys and values of every head
        expanded from the latents."""
        B, H, S, _ = q.shape
        S_total = entry.shape[1]
        c, k_rope = entry.split([self.rank, self.rope], dim=-1)  # [B, S_total, r], [B, S_total, rope]
        kv = self.kv_b_proj(c).view(B, S_total, H, self.nope + self.v_dim).transpose(1, 2)  # [B, H, S_total, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope[:, None].expand(B, H, S_total, self.rope)  # one rotary key for every head
        k = torch.cat((k_nope, k_rope), dim=-1)  # [B, H, S_total, nope + rope]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, H, S, v]
        return out.transpose(1, 2).reshape(B, S, H * self.v_dim)
