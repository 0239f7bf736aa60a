"""Attention of one query token per sequence over a KV cache read in place (decode steps), in two Triton launches.

PyTorch's SDPA on a decode step with a mask and grouped-query heads falls back to its math backend: it repeats K and
V to every query head and computes in float32, and a slot cache (continuous batching) first gathers the rows in use.
On a 64-slot, 4096-token cache that is gigabytes of copies per layer. Here each (sequence, KV head) reads its own
cache row once, for all the query heads that share it, and skips the blocks of columns its mask hides: a sequence
costs the columns it attends to. Splits over the columns keep the GPU busy when there are few sequences
(flash-decoding); their partial results are merged by a second launch. Shapes depend only on the batch, the heads
and the cache length, and nothing is read back to the host: a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton

from moeserve.kernels import triton_interpreting
from moeserve.kernels.triton.decode_attention_kernels import (decode_attention_merge_kernel,
                                                              decode_attention_split_kernel)

BLOCK_S = 64  # cache columns a program takes at once
MIN_SPLIT = 256  # columns a split covers at least
MAX_SPLITS = 16
PROGRAMS = 264  # programs to aim for (2 per SM of an H100/H200): splits are added while there are fewer
MAX_HEAD_DIM = 256


def decode_attention_serves(q: torch.Tensor, v: torch.Tensor | None, sinks) -> bool:
    """Whether a call's shapes can run here (where it runs is the caller's choice): one query token, 16-bit or
    float32, values (not MLA's latents), no sink logits, a power-of-two head dim of at most 256."""
    Dh = q.shape[-1]
    return (q.shape[2] == 1 and v is not None and sinks is None
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and Dh & (Dh - 1) == 0
            and 16 <= Dh <= MAX_HEAD_DIM)


def split_count(B: int, Hkv: int, S: int) -> int:
    """Splits of the columns: enough programs to fill the GPU, each split at least MIN_SPLIT columns (a power of
    two, so the merge can take them in one vector)."""
    splits = 1
    while splits < MAX_SPLITS and B * Hkv * splits < PROGRAMS and S > 2 * splits * MIN_SPLIT - 1:
        splits *= 2
    return splits


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None,
                     mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, H, 1, Dh]; keys/values [R, Hkv, >= S, Dh] (the cache, read in place; Dh contiguous); rows [B] the cache
    row of each sequence (None: row b); mask [B or 1, 1, 1, S], additive (0 / -inf) or bool (True = attend) ->
    the attention output [B, 1, H * Dh] in q's dtype (before o_proj)."""
    B, H, _, Dh = q.shape
    Hkv, S = keys.shape[1], mask.shape[-1]
    G = H // Hkv
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.shape[2] < S:
        raise ValueError(f"decode attention: caches {tuple(keys.shape)} (last stride {keys.stride(-1)}) and a mask "
                         f"over {S} columns do not fit")
    q3 = q[:, :, 0]  # [B, H, Dh]
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    m2 = mask[:, 0, 0]  # [B or 1, S]
    splits = split_count(B, Hkv, S)
    split_s = triton.cdiv(triton.cdiv(S, splits), BLOCK_S) * BLOCK_S
    acc = torch.empty(B, H, splits, Dh, dtype=torch.float32, device=q.device)
    best = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    total = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, 1, H, Dh, dtype=q.dtype, device=q.device)
    exact = q.dtype == torch.float32 or triton_interpreting()
    decode_attention_split_kernel[(B, Hkv, splits)](
        q3, keys, values, rows if rows is not None else q3, m2, acc, best, total, S,
        scale if scale is not None else Dh ** -0.5, q3.stride(0), q3.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), m2.stride(0) if m2.shape[0] > 1 else 0,
        m2.stride(1), split_s, G=G, G_PAD=max(16, triton.next_power_of_2(G)), DH=Dh, BLOCK_S=BLOCK_S,
        SPLITS=splits, HAS_ROWS=rows is not None, MASK_BOOL=mask.dtype == torch.bool, EXACT=exact, num_warps=4)
    decode_attention_merge_kernel[(B, H)](acc, best, total, out, out.stride(0), out.stride(2), H=H, DH=Dh,
                                          SPLITS=splits, num_warps=1 if Dh <= 64 else 2)
    return out.view(B, 1, H * Dh)
