"""GQA attention on the CPU over a host KV cache: the query heads of one KV head are stacked into one batched
matmul, so the keys and values are read once per KV head and never repeated to H heads."""

from __future__ import annotations

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, S, Dh], k/v [n, Hkv, S_total, Dh], mask [n, 1, S, S_total] bool (True = attend) -> [n, S, H*Dh].

    Same result as scaled_dot_product_attention(enable_gqa=True): query head h reads KV head h // (H / Hkv).
    """
    n, H, S, Dh = q.shape
    Hkv, S_total = k.shape[1], k.shape[2]
    g = H // Hkv
    scores = torch.matmul(q.reshape(n, Hkv, g * S, Dh), k.transpose(-1, -2))  # [n, Hkv, g*S, S_total]
    scores = scores.view(n, Hkv, g, S, S_total).float() * Dh ** -0.5
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask [n, 1, 1, S, S_total]
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(n, Hkv, g * S, S_total)
    out = torch.matmul(probs, v).view(n, H, S, Dh)  # [n, H, S, Dh]
    return out.transpose(1, 2).reshape(n, S, H * Dh)
