"""Decode attention kernels (jit code only; decode_attention.py launches them).

One query token per sequence against a KV cache read in place: grid (sequence, KV head, split). A program takes
the G query heads that share its KV head (grouped-query attention without repeating K and V), walks its split's
columns BLOCK_S at a time with an online softmax, and skips blocks that the mask hides entirely (so a sequence reads
only the columns it attends to, however long the cache). Each split writes its unnormalised output, running max
and sum; a second kernel merges the splits (flash-decoding).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_exact(a, b, EXACT: tl.constexpr):
    """a @ b in fp32. EXACT: on fp32 copies with IEEE products (float32 models, and the interpreter, whose 16-bit
    dots are not exact); else on a and b's 16-bit dtype (tensor cores)."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr, S, scale,
                                  sq_b, sq_h, sk_r, sk_h, sk_s, sv_r, sv_h, sv_s, sm_b, sm_s,
                                  SPLIT_S, G: tl.constexpr, G_PAD: tl.constexpr, DH: tl.constexpr,
                                  BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr,
                                  MASK_BOOL: tl.constexpr, EXACT: tl.constexpr):
    """For sequence b, KV head g, split sp: over columns [sp * SPLIT_S, (sp + 1) * SPLIT_S) of its cache row
    (rows[b], or b), acc [G, DH] = sum_s exp(q.k_s * scale + mask_s - max) v_s, max [G] and sum [G] of the exps.
    q [B, H, DH]; caches [R, Hkv, >= S, DH]; mask [B, S], additive (0 / -inf) or MASK_BOOL (True = attend)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64) if HAS_ROWS else b.to(tl.int64)
    heads = tl.arange(0, G_PAD)
    h_ok = heads < G
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + b * sq_b + (g * G + heads)[:, None] * sq_h + d[None, :], mask=h_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * scale).to(q.dtype)  # [G_PAD, DH]
    k_base = k_ptr + row * sk_r + g * sk_h
    v_base = v_ptr + row * sv_r + g * sv_h
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, DH), tl.float32)
    start = sp * SPLIT_S
    for s0 in range(start, start + SPLIT_S, BLOCK_S):
        cols = s0 + tl.arange(0, BLOCK_S)
        c_ok = cols < S
        if MASK_BOOL:
            seen = tl.load(mask_ptr + b * sm_b + cols * sm_s, mask=c_ok, other=0).to(tl.int1)
            bias = tl.where(seen, 0.0, float("-inf"))
        else:
            bias = tl.load(mask_ptr + b * sm_b + cols * sm_s, mask=c_ok, other=float("-inf")).to(tl.float32)
        if tl.max(bias, axis=0) > float("-inf"):  # some column of the block is attended to
            k = tl.load(k_base + cols[:, None] * sk_s + d[None, :], mask=c_ok[:, None], other=0.0)  # [BLOCK_S, DH]
            v = tl.load(v_base + cols[:, None] * sv_s + d[None, :], mask=c_ok[:, None], other=0.0)
            s = dot_exact(q, tl.trans(k), EXACT) + bias[None, :]  # [G_PAD, BLOCK_S]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot_exact(p.to(v.dtype), v, EXACT)
            m_i = m_new
    h = (b * (G * tl.num_programs(1)) + g * G + heads) * SPLITS + sp  # [G_PAD] entries of [B, H, SPLITS]
    tl.store(acc_ptr + h[:, None] * DH + d[None, :], acc, mask=h_ok[:, None])
    tl.store(max_ptr + h, m_i, mask=h_ok)
    tl.store(sum_ptr + h, l_i, mask=h_ok)


@triton.jit
def decode_attention_merge_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, so_b, so_h, H: tl.constexpr, DH: tl.constexpr,
                                  SPLITS: tl.constexpr):
    """out[b, h] = sum_sp exp(max_sp - M) acc_sp / sum_sp exp(max_sp - M) sum_sp (M: the largest max); 0 where the
    mask hid every column."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, DH)
    e = (b * H + h) * SPLITS + sp  # [SPLITS]
    m = tl.load(max_ptr + e)
    big = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)  # [SPLITS]
    total = tl.sum(w * tl.load(sum_ptr + e), axis=0)
    acc = tl.sum(w[:, None] * tl.load(acc_ptr + e[:, None] * DH + d[None, :]), axis=0)  # [DH]
    out = tl.where(total > 0, acc / total, 0.0)
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty))
