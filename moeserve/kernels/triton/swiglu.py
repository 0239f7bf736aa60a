"""silu(gate) * up in one pass for the grouped-GEMM expert path (prefill-sized batches).

torch computes it as two elementwise kernels (silu, then the product) with a bf16 round trip between; at 1024
Mixtral tokens those read and write the [T*k, 2F] gate/up output twice (172 us on an H100). One kernel reads it
once, computes in float32 and writes [T*k, F] once. silu_mul is also the fused MoE kernels' gate/up epilogue, and
activation (with GPT-OSS's clamped SwiGLU) and bias_row the low-bit and MXFP4 kernels'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.spec import ClampedSwiGLU

BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32 registers (every SwiGLU epilogue here computes it this way)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def activation(gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """CLAMPED (GPT-OSS): (clamp(u, -l, l) + 1) g' sigmoid(alpha g'), g' = min(g, l); else silu(g) u. float32."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        h = silu_mul(gate, up)
    return h


@triton.jit
def bias_row(bias_ptr, offs, ok, HAS_BIAS: tl.constexpr):
    """The biases at offs [BLOCK_N] (float32), or zeros without."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(offs.shape, dtype=tl.float32)
    return b


@triton.jit
def _swiglu_kernel(h_ptr, out_ptr, F, BLOCK: tl.constexpr):
    """Row pid(0), columns [pid(1) * BLOCK, +BLOCK): out[row, c] = silu(h[row, c]) * h[row, F + c]."""
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: up to 2^31 of them (axis 1 stops at 65535)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < F
    gate = tl.load(h_ptr + row * 2 * F + cols, mask=ok).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * F + F + cols, mask=ok).to(tl.float32)
    tl.store(out_ptr + row * F + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=ok)


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2F] (gate columns, then up) -> silu(gate) * up [n, F] in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"fused_swiglu takes [n, 2F] gate/up rows, got {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    n, F = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, F, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        _swiglu_kernel[(n, triton.cdiv(F, BLOCK))](gate_up, out, F, BLOCK=BLOCK)
    return out


def act_args(act: ClampedSwiGLU | None) -> tuple[float, float]:
    """(alpha, limit) of the clamped SwiGLU, or placeholders for silu."""
    return (act.alpha, act.limit) if act else (0.0, 0.0)
