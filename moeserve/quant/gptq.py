"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", 2023)
as pure functions: a calibration-based baseline for the calibration-free RTN / HQQ / MiLo.

GPTQ quantizes the columns (inputs) of W [out, in] one at a time and, Optimal Brain Surgeon style, moves each
column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss ||X W^T - X Q^T||^2, H = 2 X^T X / n over calibration inputs X [n, in]. The paper's three
changes to OBQ are kept: one column order for every row (so one H^-1 for all of them), lazy batches of `block`
columns (updates inside a block, one matrix product for the rest), and the Cholesky form of H^-1 (numerically
stable: the upper Cholesky factor's rows are the OBS updates). H is damped by `damp` x its mean diagonal. The
quantization grid is RTN's (hqq.minmax_scale_zero: asymmetric, scale and zero per group of `group` inputs, kept
in fp16), each group's grid fitted when the algorithm reaches the group's first column, on the columns as the
earlier errors left them (the paper's group-wise variant). Inputs never seen (zero diagonal) are set to 0.

Every function takes leading batch dimensions (W [.., out, in], H [.., in, in]): a layer's experts are quantized
in one call.
"""

from __future__ import annotations

import torch

from moeserve.errors import MoeserveError
from moeserve.quant.hqq import FP16_MAX_ZERO, QuantizedWeight, check_shape, minmax_scale_zero

BLOCK = 128  # lazy-batch width (the paper's B)
DAMP = 0.01  # lambda = DAMP x mean(diag(H)) added to the diagonal


def accumulate_hessian(H: torch.Tensor, x: torch.Tensor) -> None:
    """H [in, in] += 2 x^T x for calibration inputs x [n, in] (float32 or float64, H's dtype); divide by the row
    count at the end (hessian_mean) for the mean."""
    x = x.reshape(-1, x.shape[-1]).to(H.dtype)
    H.addmm_(x.T, x, alpha=2.0)


def inverse_cholesky(H: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """H [.., in, in] -> the upper Cholesky factor U of (H + lambda I)^-1 (U^T U = H^-1), after the dead inputs
    (zero diagonal) got a unit diagonal."""
    H = H.clone()
    diag = H.diagonal(dim1=-2, dim2=-1)  # [.., in], a view
    dead = diag == 0
    diag[dead] = 1.0
    diag += damp * diag.mean(-1, keepdim=True)
    L, info = torch.linalg.cholesky_ex(H)
    if info.any():
        raise MoeserveError("GPTQ: the damped Hessian is not positive definite; use more calibration tokens or a "
                            "larger damp")
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def grid(W: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [.., out, 1] of one group W [.., out, G]: RTN's min/max grid, rounded to fp16 as stored."""
    scale, zero = minmax_scale_zero(W, bits)
    scale = scale.clamp(-FP16_MAX_ZERO, FP16_MAX_ZERO).to(torch.float16).to(W.dtype)
    zero = zero.clamp(-FP16_MAX_ZERO, FP16_MAX_ZERO).to(torch.float16).to(W.dtype)
    return scale, zero


def quantize_gptq(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group: int = 128, *, block: int = BLOCK,
                  damp: float = DAMP) -> QuantizedWeight:
    """W [.., out, in] with the Hessian H [.., in, in] of its calibration inputs -> QuantizedWeight whose codes
    [.., out, in], scale and zero [.., out, in / group] dequantize like RTN's (hqq.dequantize, batch dims
    flattened into the rows first). Computes in float64 for a float64 W, else float32, on W's device."""
    check_shape(W.reshape(-1, W.shape[-1]), bits, group)
    if block % group and group % block:
        raise MoeserveError(f"GPTQ's block {block} and group {group} must divide one another")
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.to(dtype).clone()
    *lead, rows, cols = W.shape
    dead = H.diagonal(dim1=-2, dim2=-1) == 0  # [.., in]
    W.masked_fill_(dead.unsqueeze(-2), 0.0)
    U = inverse_cholesky(H.to(dtype), damp)  # [.., in, in]
    qmax = (1 << bits) - 1
    codes = torch.empty(W.shape, dtype=torch.uint8, device=W.device)
    scales = torch.empty(*lead, rows, cols // group, dtype=dtype, device=W.device)
    zeros = torch.empty_like(scales)
    scale = zero = None
    step = max(block, group)
    for b0 in range(0, cols, step):
        b1 = min(b0 + step, cols)
        W1 = W[..., b0:b1].clone()  # [.., out, b]
        err = torch.empty_like(W1)
        U1 = U[..., b0:b1, b0:b1]  # [.., b, b]
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:
                scale, zero = grid(W1[..., i:i + group], bits)  # [.., out, 1]
                scales[..., c // group], zeros[..., c // group] = scale[..., 0], zero[..., 0]
            w = W1[..., i]  # [.., out]
            q = torch.round(w / scale[..., 0] + zero[..., 0]).clamp_(0, qmax)
            codes[..., c] = q.to(torch.uint8)
            d = U1[..., i, i]  # [..]
            e = (w - (q - zero[..., 0]) * scale[..., 0]) / d.unsqueeze(-1)  # [.., out]
            W1[..., i:] -= e.unsqueeze(-1) * U1[..., i, i:].unsqueeze(-2)  # [.., out, b - i]
            err[..., i] = e
        W[..., b1:] -= err @ U[..., b0:b1, b1:]  # lazy batch: the block's errors onto the later columns
    return QuantizedWeight(codes=codes, scale=scales.to(torch.float16), zero=zeros.to(torch.float16), bits=bits,
                           group=group, shape=(rows, cols))


def dequantize_batched(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_gptq's result -> weights [.., out, in] in dtype: (q - z) * s per group."""
    *lead, rows, cols = qw.codes.shape
    codes = qw.codes.reshape(*lead, rows, cols // qw.group, qw.group).to(torch.float64 if dtype == torch.float64
                                                                        else torch.float32)
    W = (codes - qw.zero.to(codes.dtype).unsqueeze(-1)) * qw.scale.to(codes.dtype).unsqueeze(-1)
    return W.reshape(*lead, rows, cols).to(dtype)
