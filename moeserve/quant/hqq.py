"""Weight quantizers (pure functions): round-to-nearest and HQQ, asymmetric, groups along the input dim.

A weight W [out, in] is cut into groups of G consecutive inputs; each group keeps a scale s and a zero
z (in code units) and W ~ (q - z) * s with integer codes q in [0, 2^bits).

HQQ (Badri & Shaji, "Half-Quadratic Quantization of Large Machine Learning Models", 2023) keeps the
min/max scale and optimises the zero-point by half-quadratic splitting of min ||W - Q^-1(Q(W))||_p,
p < 1: alternately (1) W_e = shrink_p(W - W_r, beta), a generalised soft-threshold, and (2) the
closed-form zero z = mean(q - (W - W_e) / s) over the group; beta grows by kappa each step; stop when
the mean absolute error stops falling. Defaults are those published in the HQQ reference code
(hqq/core/optimize.py, optimize_weights_proximal_legacy): lp_norm 0.7, beta 10, kappa 1.01, 20 iters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moeserve.errors import MoeserveError

BITS = (2, 3, 4, 8)
HQQ_LP_NORM, HQQ_BETA, HQQ_KAPPA, HQQ_ITERS = 0.7, 10.0, 1.01, 20
FP16_MAX_ZERO = 6e4  # zero points are stored in fp16


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # [out, in] uint8
    scale: torch.Tensor  # [out, in / G]
    zero: torch.Tensor  # [out, in / G], code units
    bits: int
    group: int
    shape: tuple[int, int]


def check_shape(W: torch.Tensor, bits: int, group: int) -> None:
    if bits not in BITS:
        raise MoeserveError(f"unsupported bit width {bits}; choose one of {', '.join(map(str, BITS))}")
    if W.dim() != 2:
        raise MoeserveError(f"expected a 2-D weight, got shape {tuple(W.shape)}")
    if group < 1 or W.shape[1] % group:
        raise MoeserveError(f"group size {group} does not divide the input dimension {W.shape[1]}")


def group_range(values: range, group: int) -> slice:
    """The groups of `group` consecutive values that hold exactly `values` (a run that starts and ends on group
    boundaries); MoeserveError when the run cuts a group."""
    if values.start % group or values.stop % group:
        raise MoeserveError(f"values {values.start}..{values.stop - 1} cut a group of {group}")
    return slice(values.start // group, values.stop // group)


def _grouped(W: torch.Tensor, group: int) -> torch.Tensor:
    return W.float().reshape(W.shape[0], W.shape[1] // group, group)  # [out, n_groups, G]


def minmax_scale_zero(Wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [out, n_groups, 1] mapping each group's [min, max] onto [0, 2^bits - 1].

    The range is widened to at least max|w| / (qmax * 128) so near-constant groups keep a zero that
    fits fp16 and a non-zero scale.
    """
    qmax = (1 << bits) - 1
    lo, hi = Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True)
    floor = torch.maximum(hi.abs(), lo.abs()) / (qmax * 128) + 1e-12
    scale = torch.maximum((hi - lo) / qmax, floor)
    return scale, -lo / scale


def _codes(Wg, scale, zero, bits):
    return torch.round(Wg / scale + zero).clamp_(0, (1 << bits) - 1)


def _stored(x: torch.Tensor) -> torch.Tensor:
    """x as it will be stored (fp16), back in float32: errors are judged with what is kept."""
    return x.clamp(-FP16_MAX_ZERO, FP16_MAX_ZERO).to(torch.float16).float()


def _finish(W, Wg, scale, zero, bits, group) -> QuantizedWeight:
    """Store scale/zero in fp16 and compute the codes with the stored (rounded) values."""
    scale, zero = _stored(scale).to(torch.float16), _stored(zero).to(torch.float16)
    codes = _codes(Wg, scale.float(), zero.float(), bits).to(torch.uint8)
    return QuantizedWeight(codes=codes.reshape(W.shape), scale=scale.squeeze(-1), zero=zero.squeeze(-1),
                           bits=bits, group=group, shape=tuple(W.shape))


def quantize_rtn(W: torch.Tensor, bits: int = 3, group: int = 64) -> QuantizedWeight:
    """Round-to-nearest with min/max scale and zero: the baseline."""
    check_shape(W, bits, group)
    Wg = _grouped(W, group)
    scale, zero = minmax_scale_zero(Wg, bits)
    return _finish(W, Wg, scale, zero, bits, group)


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalised soft-thresholding: the proximal operator of (1/beta) |x|^p, p < 1."""
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * (x.abs() + 1e-8).pow(p - 1))


def quantize_hqq(W: torch.Tensor, bits: int = 3, group: int = 64, *, lp_norm: float = HQQ_LP_NORM,
                 beta: float = HQQ_BETA, kappa: float = HQQ_KAPPA, iters: int = HQQ_ITERS) -> QuantizedWeight:
    """HQQ zero-point optimisation from the min/max start; each group keeps its best zero seen.

    Keeping the per-group best (by mean absolute error, HQQ's stopping metric) means the result is
    never worse than RTN on that metric.
    """
    check_shape(W, bits, group)
    Wg = _grouped(W, group)
    scale, zero = minmax_scale_zero(Wg, bits)
    scale = _stored(scale)
    step = _compiled_step() if Wg.is_cuda else hqq_step
    beta_t = torch.tensor(beta, device=Wg.device)  # a tensor, so a compiled step is not re-specialised
    best_zero, best_err = zero.clone(), None
    total_best = float("inf")
    for _ in range(iters):
        err, new_zero = step(Wg, scale, zero, beta_t, lp_norm, (1 << bits) - 1)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_zero, best_err = torch.where(better, zero, best_zero), torch.minimum(err, best_err)
        total = float(err.mean())
        if total >= total_best:
            break  # the error stopped falling
        total_best, zero, beta_t = total, new_zero, beta_t * kappa
    return _finish(W, Wg, scale, best_zero, bits, group)


def hqq_step(Wg, scale, zero, beta, p: float, qmax: int):
    """One half-quadratic round: the error of `zero` as stored [out, n_groups, 1], and the next zero."""
    z = _stored(zero)
    q = torch.round(Wg / scale + z).clamp(0, qmax)
    err = (Wg - (q - z) * scale).abs().mean(-1, keepdim=True)
    We = shrink_lp(Wg - (q - zero) * scale, beta, p)
    return err, (q - (Wg - We) / scale).mean(-1, keepdim=True)


@functools.cache
def _compiled_step():
    """On CUDA the round is one fused kernel (torch.compile); 5x faster on a 14336 x 4096 matrix on the H100.
    Compiled in this process: inductor's default pool of compile workers (a process per core, each importing torch)
    would outlive the compile and burn CPU beside the run that follows (about 12 core-seconds on the H200 host's
    16 cores, while the CPU experts' pinned threads ran)."""
    from torch._inductor import config as inductor_config  # CUDA only: CPU runs never import the compiler

    compiled = torch.compile(hqq_step, dynamic=True)

    def step(*args):
        with inductor_config.patch(compile_threads=1):
            return compiled(*args)
    return step


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - z) * s -> [out, in] in `dtype` (computed in float32)."""
    out, n = qw.shape
    codes = qw.codes.reshape(out, n // qw.group, qw.group).float()
    W = (codes - qw.zero.float().unsqueeze(-1)) * qw.scale.float().unsqueeze(-1)
    return W.reshape(out, n).to(dtype)
