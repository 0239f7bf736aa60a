"""RMSNorm and the rotary embedding, one launch each, for decode on a GPU.

At one token a decoder layer's own arithmetic is tiny, but torch spends about eight kernels on an RMSNorm
(cast, square, mean, add, rsqrt, multiply, cast, scale) and five on each rotary (negate, concatenate, two
products, a sum): two norms and two rotaries per layer are ~26 launches, each a few microseconds of latency,
about as long as reading the layer's attention weights. These kernels round where the torch expressions in
model/layers.py round, so their outputs match them bit for bit (the norm up to its fp32 sum's order; on an H100
it matched every bit of 16K outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels import triton_interpreting


@triton.jit
def _rms_norm_kernel(x_ptr, h_ptr, sum_ptr, w_ptr, out_ptr, D, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """Row pid: out = w * (x32 * rsqrt(mean(x32^2) + eps)).to(x's dtype), the product in fp32 rounded once. ADD: x is
    first x + h (rounded to x's dtype, as torch adds), stored to sum_ptr: the residual stream's add before a norm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(h_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * D + cols, x, mask=ok)
    x = x.to(tl.float32)
    scale = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., D] -> weight * normalise(x): model/layers.py's RMSNorm (HF's) in one launch. residual h (x's shape
    and dtype): -> (weight * normalise(x + h), x + h), the add in the same launch."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, the rows {D} features")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"the residual to add has {tuple(residual.shape)} {residual.dtype}, x "
                         f"{tuple(x.shape)} {x.dtype}")
    x2 = x.reshape(-1, D).contiguous()  # [R, D]
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x2) if residual is not None else x2  # [R, D] x + h
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        h2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, h2, total, weight, out, D, eps, ADD=residual is not None, BLOCK=block,
                                         num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)


@triton.jit
def _products_sum(a, b, c, d, dt: tl.constexpr, INTERPRET: tl.constexpr):
    """a * b + c * d (float32 inputs) as torch computes it in dtype dt: each product rounded to dt, then the sum, in
    float32 (the caller rounds it to dt). Compiled, in inline PTX with explicit rounding: Triton's own code let the
    compiler fuse the products into the sum (an FMA), one bit off in a quarter of the outputs on an H100."""
    if INTERPRET:
        out = (a * b).to(dt).to(tl.float32) + (c * d).to(dt).to(tl.float32)
    elif dt == tl.float32:
        out = tl.inline_asm_elementwise(
            "{ .reg .f32 p, q; mul.rn.f32 p, $1, $2; mul.rn.f32 q, $3, $4; add.rn.f32 $0, p, q; }",
            "=r,r,r,r,r", [a, b, c, d], dtype=tl.float32, is_pure=True, pack=1)
    elif dt == tl.bfloat16:
        out = tl.inline_asm_elementwise(
            "{ .reg .f32 p, q; .reg .b16 hp, hq; mul.rn.f32 p, $1, $2; mul.rn.f32 q, $3, $4; cvt.rn.bf16.f32 hp, p; "
            "cvt.rn.bf16.f32 hq, q; cvt.f32.bf16 p, hp; cvt.f32.bf16 q, hq; add.rn.f32 $0, p, q; }",
            "=r,r,r,r,r", [a, b, c, d], dtype=tl.float32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(
            "{ .reg .f32 p, q; .reg .b16 hp, hq; mul.rn.f32 p, $1, $2; mul.rn.f32 q, $3, $4; cvt.rn.f16.f32 hp, p; "
            "cvt.rn.f16.f32 hq, q; cvt.f32.f16 p, hp; cvt.f32.f16 q, hq; add.rn.f32 $0, p, q; }",
            "=r,r,r,r,r", [a, b, c, d], dtype=tl.float32, is_pure=True, pack=1)
    return out


@triton.jit
def _rotated_row(src, cos_ptr, sin_ptr, cs, dst, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """dst[:] = src * cos + rotate_half(src) * sin for one head row of 2 * HALF (cos/sin from offset cs), each product
    and the sum rounded to dst's dtype, as torch computes it."""
    lo = tl.arange(0, HALF)  # [HALF]
    x1 = tl.load(src + lo).to(tl.float32)
    x2 = tl.load(src + HALF + lo).to(tl.float32)
    c1, c2 = tl.load(cos_ptr + cs + lo).to(tl.float32), tl.load(cos_ptr + cs + HALF + lo).to(tl.float32)
    s1, s2 = tl.load(sin_ptr + cs + lo).to(tl.float32), tl.load(sin_ptr + cs + HALF + lo).to(tl.float32)
    dt = dst.dtype.element_ty
    tl.store(dst + lo, _products_sum(x1, c1, -x2, s1, dt, INTERPRET).to(dt))
    tl.store(dst + HALF + lo, _products_sum(x2, c2, x1, s2, dt, INTERPRET).to(dt))


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, S, stride_b, stride_h, stride_s, HALF: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Row pid = (b, h, s) of x [B, H, S, 2 * HALF] (any strides but the last): out = x * cos + rotate_half(x) * sin
    with each product and the sum rounded to x's dtype, as torch computes it; cos/sin [B, S, 2 * HALF]."""
    pid = tl.program_id(0)
    s = pid % S
    h = (pid // S) % H
    b = (pid // S // H).to(tl.int64)
    _rotated_row(x_ptr + b * stride_b + h * stride_h + s * stride_s, cos_ptr, sin_ptr, (b * S + s) * 2 * HALF,
                 out_ptr + pid.to(tl.int64) * 2 * HALF, HALF, INTERPRET)


@triton.jit
def _rotary_into_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, row_ptr, H, Hkv, stride_row,
                              stride_cr, stride_ch, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """Head row pid = (b, j) of one decode token's projections qkv [B, (H + 2 Hkv) * 2 HALF] (q, k, v heads side by
    side): q heads rotated into q [B, H, 1, 2 HALF], k heads rotated and v heads copied into the caches
    [R, Hkv, S_max, 2 HALF] (strides stride_cr, stride_ch) at row row_ptr[b], column slot_ptr[b]."""
    pid = tl.program_id(0)
    heads = H + 2 * Hkv
    b = (pid // heads).to(tl.int64)
    j = pid % heads
    src = qkv_ptr + b * stride_row + j * 2 * HALF
    cs = b * 2 * HALF  # cos/sin [B, 1, 2 HALF]
    dst = tl.load(row_ptr + b).to(tl.int64) * stride_cr + tl.load(slot_ptr + b).to(tl.int64) * 2 * HALF
    if j < H:
        _rotated_row(src, cos_ptr, sin_ptr, cs, q_ptr + (b * H + j) * 2 * HALF, HALF, INTERPRET)
    elif j < H + Hkv:
        _rotated_row(src, cos_ptr, sin_ptr, cs, k_ptr + dst + (j - H) * stride_ch, HALF, INTERPRET)
    else:
        lo = tl.arange(0, 2 * HALF)  # [2 HALF]
        tl.store(v_ptr + dst + (j - H - Hkv) * stride_ch + lo, tl.load(src + lo))


def rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether rotary() takes these: a power-of-two head dim (>= 2) with unit stride, cos/sin [B, S, Dh] in x's dtype."""
    B, H, S, Dh = x.shape
    return (Dh >= 2 and Dh & (Dh - 1) == 0 and x.stride(-1) == 1 and cos.shape == (B, S, Dh)
            and sin.shape == cos.shape and cos.dtype == sin.dtype == x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, Dh] (a transposed view is fine), cos/sin [B, S, Dh] -> contiguous [B, H, S, Dh]: model/layers.py's
    apply_rotary (rotate-half, HF's convention) in one launch."""
    if not rotary_fits(x, cos, sin):
        raise ValueError(f"the fused rotary takes x [B, H, S, Dh] with a power-of-two Dh and unit stride and cos/sin "
                         f"[B, S, Dh] in x's dtype; got x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}")
    B, H, S, Dh = x.shape
    out = torch.empty(B, H, S, Dh, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _rotary_kernel[(B * H * S,)](x, cos.contiguous(), sin.contiguous(), out, H, S, x.stride(0), x.stride(1),
                                 x.stride(2), HALF=Dh // 2, INTERPRET=triton_interpreting(), num_warps=1)
    return out


def rotary_into_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One decode token's projections qkv [B, 1, (heads + 2 Hkv) * Dh] (q, k, v side by side, rows of any stride)
    -> q [B, heads, 1, Dh] rotated; k rotated and v written into the caches [R, Hkv, S_max, Dh], sequence b's at row
    rows[b], column slots[b] (device tensors [B]): apply_rotary on q and k and the two cache writes in one launch,
    the same roundings."""
    B, S, N = qkv.shape
    _, Hkv, _, Dh = k_cache.shape
    if (S != 1 or N != (heads + 2 * Hkv) * Dh or qkv.stride(-1) != 1 or Dh < 2 or Dh & (Dh - 1)
            or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1
            or k_cache.stride(-2) != Dh or cos.shape != (B, 1, Dh) or sin.shape != cos.shape
            or slots.shape != (B,) or rows.shape != (B,)
            or not cos.dtype == sin.dtype == qkv.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"rotary_into_cache takes qkv [B, 1, (heads + 2 Hkv) * Dh], caches [R, Hkv, S_max, Dh], "
                         f"cos/sin [B, 1, Dh] of one dtype, a power-of-two Dh and slots/rows [B]; got qkv "
                         f"{tuple(qkv.shape)} {qkv.dtype}, {heads} heads, cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, cos {tuple(cos.shape)}, slots {tuple(slots.shape)}, rows {tuple(rows.shape)}")
    q = torch.empty(B, heads, 1, Dh, dtype=qkv.dtype, device=qkv.device)
    _rotary_into_cache_kernel[(B * (heads + 2 * Hkv),)](
        qkv, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slots.contiguous(), rows.contiguous(), heads,
        Hkv, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), HALF=Dh // 2, INTERPRET=triton_interpreting(),
        num_warps=1)
    return q
