"""Attention with learned sinks (GPT-OSS): each head h has a logit s_h that joins every softmax row as one more
column and is dropped after, so a query may give part of its attention to nothing:

    p_j = exp(z_j) / (sum_i exp(z_i) + exp(s_h)),  out = sum_j p_j v_j    (z: scaled, masked scores)

SDPA takes no such column, so the scores are computed explicitly: q k^T per KV head group (no repeated keys), the
mask, the sink column, a float32 softmax, then probs v. Static shapes and no host reads (CUDA-graph capturable);
boolean (True = attend) or additive masks, as Attention.attend receives them. Queries go in chunks so that the
scores of a long prefill stay within SCORE_ELEMENTS values.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 26  # scores held at once (256 MiB of float32): the query chunk of a long prefill


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, Dh], k/v [B, Hkv, S_total, Dh], mask [B, 1, S, S_total] bool or additive, sinks [H] ->
    [B, H, S, Dh] (softmax scale Dh^-0.5)."""
    B, H, S, Dh = q.shape
    Hkv, S_total = k.shape[1], k.shape[2]
    g = H // Hkv
    chunk = max(1, min(S, SCORE_ELEMENTS // max(1, B * H * S_total)))
    outs = [_chunk(q[:, :, i:i + chunk], k, v, mask[:, :, i:i + chunk], sinks, g) for i in range(0, S, chunk)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _chunk(q, k, v, mask, sinks, g):
    """sink_attention over a chunk of queries q [B, H, c, Dh], mask [B, 1, c, S_total]."""
    B, H, c, Dh = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, g * c, Dh)  # query heads of one KV head side by side: [B, Hkv, g c, Dh]
    scores = torch.matmul(qg, k.transpose(2, 3)).view(B, H, c, -1) * Dh ** -0.5  # [B, H, c, S_total]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, c, 1)  # [B, H, c, 1]
    logits = torch.cat((scores, sink), dim=-1).float()  # [B, H, c, S_total + 1]
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(v.dtype)  # the sink's share dropped
    out = torch.matmul(probs.view(B, Hkv, g * c, -1), v)  # [B, Hkv, g c, Dh]
    return out.view(B, H, c, Dh)
