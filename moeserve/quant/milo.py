"""MiLo: a low-rank compensator U V fitted jointly with the quantized weight, and its storage.

The loop alternates (a) quantize W - U V and (b) a rank-r SVD of the residual W - dequant(Q), tracking
e = ||W - dequant(Q) - U V||_F. Two acceptance rules make e non-increasing by construction: a new
quantization replaces the old one group by group only where it lowers that group's error, and a new
(U, V) replaces the old pair only if it fits the residual better (the randomised SVD is approximate).
The loop stops after `iters` rounds or when the 3-round sliding-window mean of e stops falling
(window=0 turns that off).

Compensators are stored as bf16, INT8 or INT3: symmetric, one absmax scale per group of 64 values (or a
whole row when 64 does not divide it) along each rank component, i.e. along the rows of U^T [r, out]
and V [r, in]; INT3 codes are packed with pack.py (so a rank costs the same bytes at any r).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moeserve.errors import MoeserveError
from moeserve.kernels.pack import pack, packed_words, padded_length, unpack
from moeserve.quant.hqq import QuantizedWeight, dequantize, group_range

COMPENSATOR_BITS = (3, 8, 16)
COMPENSATOR_GROUP = 64
EXACT_SVD_MAX_DIM = 1024  # below this a full SVD is cheap; above, a randomised range finder
OVERSAMPLE, POWER_ITERS = 8, 2

Quantizer = Callable[[torch.Tensor], QuantizedWeight]


@dataclass
class MiloResult:
    q_state: QuantizedWeight
    U: torch.Tensor  # [out, r]
    V: torch.Tensor  # [r, in]
    errors: list[float] = field(default_factory=list)  # ||W - dequant(Q) - U V||_F after each round


# ---- low-rank approximation ------------------------------------------------------------------


def low_rank(R: torch.Tensor, rank: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-r factors of R [m, n]: U [m, r], V [r, n] with the singular values split evenly."""
    if min(R.shape) <= EXACT_SVD_MAX_DIM:
        Uf, S, Vh = torch.linalg.svd(R, full_matrices=False)
    else:
        Uf, S, Vh = randomized_svd(R, rank, generator)
    root = S[:rank].sqrt()
    return Uf[:, :rank] * root, root[:, None] * Vh[:rank]


def randomized_svd(R: torch.Tensor, rank: int, generator: torch.Generator | None):
    """Halko-Martinsson-Tropp range finder with power iterations; returns (U, S, Vh) of width r+p."""
    k = min(rank + OVERSAMPLE, min(R.shape))
    omega = torch.randn(R.shape[1], k, device=R.device, dtype=R.dtype, generator=generator)  # [n, k]
    Q = torch.linalg.qr(R @ omega).Q  # [m, k]
    for _ in range(POWER_ITERS):
        Q = torch.linalg.qr(R @ torch.linalg.qr(R.T @ Q).Q).Q
    Ub, S, Vh = torch.linalg.svd(Q.T @ R, full_matrices=False)  # [k, k], [k], [k, n]
    return Q @ Ub, S, Vh


# ---- the MiLo loop ---------------------------------------------------------------------------


def _group_errors(target: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """Squared error per quantization group [out, n_groups]."""
    d = target - dequantize(q)
    return d.reshape(d.shape[0], -1, q.group).pow(2).sum(-1)


def merge_groups(new: QuantizedWeight, old: QuantizedWeight, target: torch.Tensor) -> QuantizedWeight:
    """Per group, the one of `new` / `old` closer to `target` (so the error never grows)."""
    keep_new = _group_errors(target, new) <= _group_errors(target, old)  # [out, n_groups]
    codes = torch.where(keep_new.repeat_interleave(new.group, 1), new.codes, old.codes)
    return QuantizedWeight(codes=codes, scale=torch.where(keep_new, new.scale, old.scale),
                           zero=torch.where(keep_new, new.zero, old.zero), bits=new.bits, group=new.group,
                           shape=new.shape)


def milo(W: torch.Tensor, rank: int, quantize: Quantizer, *, iters: int = 20, window: int = 3,
         seed: int = 0) -> MiloResult:
    """Jointly fit Q and (U, V) so that dequant(Q) + U V ~ W; see the module docstring."""
    W = W.float()
    if not 0 < rank <= min(W.shape):
        raise MoeserveError(f"rank {rank} must be between 1 and {min(W.shape)} for a {tuple(W.shape)} matrix")
    gen = torch.Generator(W.device).manual_seed(seed)
    q = quantize(W)
    U = W.new_zeros(W.shape[0], rank)
    V = W.new_zeros(rank, W.shape[1])
    errors: list[float] = []
    for _ in range(iters):
        R = W - dequantize(q)
        U_new, V_new = low_rank(R, rank, gen)
        if (R - U_new @ V_new).norm() <= (R - U @ V).norm():
            U, V = U_new, V_new
        target = W - U @ V
        q = merge_groups(quantize(target), q, target)
        errors.append(float((target - dequantize(q)).norm()))
        if window and len(errors) > window:  # window 0: always run `iters` rounds
            now, before = sum(errors[-window:]) / window, sum(errors[-window - 1:-1]) / window
            if now >= before * (1 - 1e-4):
                break
    return MiloResult(q_state=q, U=U, V=V, errors=errors)


def fit(W: torch.Tensor, rank: int, quantize: Quantizer, compensator_bits: int, *, iters: int = 20,
        seed: int = 0) -> tuple[QuantizedWeight, dict[str, torch.Tensor], list[float]]:
    """MiLo, then the compensator stored at `compensator_bits`, then Q refitted to what the stored
    compensator leaves (per group, only where that helps). Returns (Q, compensator buffers, errors).

    Integer compensators: V is quantized first and U re-solved by least squares against the quantized
    V, so U absorbs V's rounding before it is quantized itself."""
    result = milo(W, rank, quantize, iters=iters, seed=seed)
    q, U, V = result.q_state, result.U, result.V
    if compensator_bits == 16:
        return q, compensator_to_buffers(U, V, 16), result.errors
    out_f, in_f = W.shape
    V = compensator_from_buffers(compensator_to_buffers(U, V, compensator_bits), compensator_bits, out_f, in_f,
                                 rank)[1].to(W.device)  # V as stored, [r, in]
    R = W.float() - dequantize(q)  # [out, in]
    G = V @ V.T  # [r, r]
    ridge = 1e-6 * G.diagonal().mean().clamp_min(1e-30) * torch.eye(rank, device=W.device)
    U = torch.linalg.solve(G + ridge, V @ R.T).T  # argmin ||R - U V||_F, [out, r]
    bufs = compensator_to_buffers(U, V, compensator_bits)
    U, V = (t.to(W.device) for t in compensator_from_buffers(bufs, compensator_bits, out_f, in_f, rank))
    target = W.float() - U @ V
    q = merge_groups(quantize(target), q, target)
    return q, bufs, result.errors


# ---- compensator storage ---------------------------------------------------------------------


def _group(n: int) -> int:
    return COMPENSATOR_GROUP if n % COMPENSATOR_GROUP == 0 else n


def _int_shapes(rows: int, cols: int, bits: int) -> tuple[tuple, tuple]:
    codes = (rows, padded_length(cols) * 3 // 32) if bits == 3 else (rows, cols)
    return codes, (rows, cols // _group(cols))


def compensator_buffers(out_features: int, in_features: int, rank: int, bits: int) -> dict[str, torch.Tensor]:
    """Empty buffers (name -> tensor) that hold a rank-r compensator at `bits`; names do not depend on shape."""
    if bits not in COMPENSATOR_BITS:
        raise MoeserveError(f"compensator bits must be one of {COMPENSATOR_BITS}, got {bits}")
    if bits == 16:
        return {"comp_u": torch.empty(out_features, rank, dtype=torch.bfloat16),
                "comp_v": torch.empty(rank, in_features, dtype=torch.bfloat16)}
    code_dtype = torch.int32 if bits == 3 else torch.int8
    bufs = {}
    for name, (rows, cols) in (("u", (rank, out_features)), ("v", (rank, in_features))):  # U stored as U^T
        codes, scales = _int_shapes(rows, cols, bits)
        bufs[f"comp_{name}_q"] = torch.empty(codes, dtype=code_dtype)
        bufs[f"comp_{name}_scale"] = torch.empty(scales, dtype=torch.float16)
    return bufs


def compensator_bytes(shape: tuple[int, int], rank: int, bits: int) -> int:
    """Storage of a rank-r compensator for a weight of `shape` [out, in]."""
    if not rank:
        return 0
    return sum(t.numel() * t.element_size()
               for t in compensator_buffers(shape[0], shape[1], rank, bits).values())


def quantize_symmetric(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (integer codes in [-(2^(b-1) - 1), 2^(b-1) - 1] [rows, cols], fp16 scales)."""
    qmax = (1 << (bits - 1)) - 1
    g = _group(x.shape[1])
    xg = x.float().reshape(x.shape[0], -1, g)  # [rows, n_groups, g]
    scale = (xg.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12).to(torch.float16)
    codes = torch.round(xg / scale.float()).clamp_(-qmax, qmax)
    return codes.reshape(x.shape), scale.squeeze(-1)


def dequantize_symmetric(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    g = cols // scale.shape[1]
    return (codes.float().reshape(rows, -1, g) * scale.float().unsqueeze(-1)).reshape(rows, cols)


def compensator_to_buffers(U: torch.Tensor, V: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    if bits == 16:
        return {"comp_u": U.to(torch.bfloat16), "comp_v": V.to(torch.bfloat16)}
    bufs = {}
    for name, x in (("u", U.T), ("v", V)):  # U^T [r, out]: rows are rank components, like V
        codes, scale = quantize_symmetric(x, bits)
        if bits == 3:
            shifted = torch.nn.functional.pad(codes + 3, (0, padded_length(x.shape[1]) - x.shape[1]))
            bufs[f"comp_{name}_q"] = pack(shifted.to(torch.uint8), 3)
        else:
            bufs[f"comp_{name}_q"] = codes.to(torch.int8)
        bufs[f"comp_{name}_scale"] = scale
    return bufs


def compensator_from_buffers(bufs: dict[str, torch.Tensor], bits: int, out_features: int, in_features: int,
                             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [out, r], V [r, in]) in float32."""
    if bits == 16:
        return bufs["comp_u"].float(), bufs["comp_v"].float()
    factors = []
    for name, cols in (("u", out_features), ("v", in_features)):
        codes = bufs[f"comp_{name}_q"]
        if bits == 3:
            codes = unpack(codes, 3, padded_length(cols))[:, :cols].to(torch.int8) - 3
        factors.append(dequantize_symmetric(codes, bufs[f"comp_{name}_scale"]))
    return factors[0].T, factors[1]


def compensator_parts(bits: int, out_features: int, in_features: int, rows: range | None = None,
                      cols: range | None = None) -> dict[str, list[tuple[slice, ...]]]:
    """The parts of each compensator buffer (compensator_buffers' names) that hold the compensator of the weight's
    rows `rows` or input columns `cols` (None: all of them): U's rows or V's columns, i.e. columns of the stored
    U^T [r, out] and V [r, in] when they are integers. Each buffer's parts, joined along its last dimension, are that
    slice's own buffer. Integer rows are exact when the run keeps whole groups of COMPENSATOR_GROUP (a row stored
    with one scale keeps it) and, at 3 bits, whole packing units; else MoeserveError names the cut."""
    whole = [(slice(None),)]
    if bits == 16:
        return {"comp_u": whole if rows is None else [(slice(rows.start, rows.stop),)],
                "comp_v": whole if cols is None else [(slice(None), slice(cols.start, cols.stop))]}
    parts = {}
    for name, n, run in (("u", out_features, rows), ("v", in_features, cols)):
        if run is None:
            parts[f"comp_{name}_q"] = parts[f"comp_{name}_scale"] = whole
            continue
        words = packed_words(run, n, 3) if bits == 3 else [slice(run.start, run.stop)]
        parts[f"comp_{name}_q"] = [(slice(None), w) for w in words]
        g = _group(n)
        parts[f"comp_{name}_scale"] = whole if g == n else [(slice(None), group_range(run, g))]
    return parts


def padded_compensator(bufs: dict[str, torch.Tensor], bits: int, rank: int, to_rank: int) -> dict[str, torch.Tensor]:
    """A rank-r compensator's buffers grown to `to_rank` components that are exactly zero (their U columns and V rows
    dequantize to 0: bf16 zeros, or integer code 0 with scale 1), so that experts of different ranks share one shape
    (an expert store's slots) and compute the same (x V^T) U^T. compensator_slice undoes it."""
    extra = to_rank - rank
    if extra < 0:
        raise MoeserveError(f"cannot pad a rank-{rank} compensator to rank {to_rank}")
    out = {}
    for name, t in bufs.items():
        along = 1 if name == "comp_u" else 0  # bf16 U [out, r]; every other buffer has the rank first
        shape = list(t.shape)
        shape[along] = extra
        if name.endswith("_scale"):
            fill = torch.ones(shape, dtype=t.dtype)
        elif name.endswith("_q") and bits == 3:  # packed codes shifted by 3: code 0 is 3 in every field
            fill = pack(torch.full((extra, t.shape[1] * 32 // 3), 3, dtype=torch.uint8), 3)
        else:
            fill = torch.zeros(shape, dtype=t.dtype)
        out[name] = torch.cat([t.cpu(), fill], dim=along)
    return out


def compensator_slice(bufs: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The first `rank` components of a compensator's buffers (contiguous copies; padded_compensator's inverse)."""
    return {name: (t[:, :rank] if name == "comp_u" else t[:rank]).contiguous() for name, t in bufs.items()}
