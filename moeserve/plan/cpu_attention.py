"""Attention on the CPU over a host KV cache: a layer's attention core (the part that reads the cache) as the model
defines it (Attention.core_attention, MLAttention.core_attention), with plain GQA softmax attention computed by a
faster route: the query heads of one KV head are folded into the query length of one fused attention call, so the
keys and values are read once per KV head, never repeated to H heads, and read in place from a slice of the cache
(strided: no copy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.model.layers import Attention


def cpu_attention(attn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
                  mask: torch.Tensor) -> torch.Tensor:
    """The core of attention module attn (the host layer's) on host tensors: q as attn.core_query gives it, keys and
    values as the host cache holds them, mask [n, 1, S, S_total] bool -> what attn.core_output takes. GQA without
    sinks: gqa_attention; sinks (GPT-OSS) and MLA's latents: the module's own core."""
    if isinstance(attn, Attention) and attn.sinks is None:
        return gqa_attention(q, keys, values, mask, attn.scale)
    return attn.core_attention(q, keys, values, mask)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """q [n, H, S, Dh], k/v [n, Hkv, S_total, Dh] (any strides, unit last stride), mask [n, 1, S, S_total] bool
    (True = attend), scale: the softmax scale (None: Dh^-0.5) -> [n, S, H*Dh].

    Same result as scaled_dot_product_attention(enable_gqa=True): query head h reads KV head h // (H / Hkv),
    whether or not this torch's CPU kernel supports enable_gqa without repeating K/V. Measured on a 2-core
    Xeon for a bf16 decode micro-batch over a cache slice: 2-4x faster than batched matmuls (which copy the
    strided slice first).
    """
    n, H, S, Dh = q.shape
    Hkv, S_total = k.shape[1], k.shape[2]
    g = H // Hkv
    q = q.reshape(n, Hkv, g * S, Dh)  # rows of a KV head ordered (query head in its group, position)
    mask = mask[:, :, None].expand(n, 1, g, S, S_total).reshape(n, 1, g * S, S_total)  # a view when S = 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [n, Hkv, g*S, Dh]
    return out.view(n, H, S, Dh).transpose(1, 2).reshape(n, S, H * Dh)
