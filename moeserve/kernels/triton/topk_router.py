"""The softmax -> top-k router in one Triton launch for decode-sized batches.

At one token the router's own work is nothing (an [E, D] GEMV and a softmax over E), yet through torch it is
eight launches: cuBLAS GEMV and its split-K reduce, a cast, softmax, top-k and its sort, a sum and a divide -
about 21 us of a 0.16 ms Mixtral MoE block on an H100. Here one program per token reads the gate weight
(cp.async stages), keeps the logits on chip, and writes the expert ids, their weights and the logits.
Logits are rounded to the activation dtype before the softmax, as F.linear's output is, so the choice of
experts is the one the reference path makes (up to that rounding's ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.lowbit import Preparation, prepare_step
from moeserve.kernels.triton.mxfp4.kernels import prepare_groups
from moeserve.kernels.triton.mxfp4.launch import PREPARE_GROUPS
from moeserve.kernels.triton.pdl import after_previous, dependent_launch

PREP_NONE, PREP_LOWBIT, PREP_MXFP4 = 0, 1, 2  # what the router's launch prepares x for (_router_kernel PREP)
MAX_TOKENS = 64  # above this, cuBLAS and torch's kernels (one program per token re-reads the gate weight)


def tile(block_e: int) -> int:
    """Gate-weight values per loop step (BLOCK_E * BLOCK_D, 4 warps) for BLOCK_E experts (padded to a power of two):
    many-expert routers keep more of their weight in flight with larger steps. H100, one token, 8 routers chained in
    a CUDA graph, us per router with 4096 / 16384 (8192 at 128 experts): 64 experts x 2048 inputs 11.9 / 8.6,
    128 x 2048 21.0 / 13.2; one-token 64-expert top-6 MoE block 44.6 -> 41.6 us (3-bit), 44.8 -> 43.7 (4-bit).
    Fewer experts take 8192: the Mixtral router (8 x 4096) alone 3.8 -> 3.2 us, its one-token block 81.2 -> 80.6 us
    at 3 bits and 93.8 -> 93.4 at 4 (CUDA graphs of one call, three interleaved runs; 16384 and 8 warps gained less)."""
    return 16384 if block_e == 64 else 8192


@triton.jit
def _router_kernel(x_ptr, w_ptr, b_ptr, logits_ptr, ids_ptr, weights_ptr, xw_ptr, xr_ptr, T, D, E, steps,
                   K: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREP: tl.constexpr,
                   BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr, HALF: tl.constexpr,
                   LOG2_LIMIT: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Programs 0..T-1 route token t = program id (_route_token). PREP: programs T.. prepare x for the experts'
    CUDA-core kernels in the same launch, step (block) q % steps of token q // steps, q = program id - T: PREP_LOWBIT
    lowbit.prepare_step into xw, PREP_MXFP4 mxfp4's prepare_groups (BLOCK_G groups a step; HALF: fp16 pairs) into xw
    and xr."""
    after_previous(PDL)
    pid = tl.program_id(0)
    if PREP != 0 and pid >= T:
        q = pid - T
        m = q // steps
        if PREP == 1:
            prepare_step(x_ptr + m.to(tl.int64) * D, xw_ptr, m, steps, q % steps, D // VPC, BITS, VPC, CPS, HALF,
                         LOG2_LIMIT)
        else:
            prepare_groups(x_ptr + m.to(tl.int64) * D, xw_ptr, xr_ptr, m.to(tl.int64), q % steps, D, HALF, BLOCK_G)
    else:
        _route_token(x_ptr, w_ptr, b_ptr, logits_ptr, ids_ptr, weights_ptr, pid.to(tl.int64), D, E, K, NORMALIZE,
                     HAS_BIAS, BLOCK_E, BLOCK_D, BLOCK_K, STAGES)


@triton.jit
def _route_token(x_ptr, w_ptr, b_ptr, logits_ptr, ids_ptr, weights_ptr, t, D, E, K: tl.constexpr,
                 NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Token t: logits = x_t W^T (+ b, HAS_BIAS) [E], p = softmax(logits), the K largest p (lowest expert on ties),
    optionally renormalised to sum to one (with NORMALIZE: the softmax of the top-k logits, GPT-OSS's weights)."""
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = e < E
    acc = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
        d_ok = d < D
        x = tl.load(x_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * D + d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]  # [BLOCK_E, BLOCK_D]
    logits = tl.sum(acc, axis=1)  # [BLOCK_E]
    if HAS_BIAS:
        logits += tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    logits = logits.to(logits_ptr.dtype.element_ty)  # rounded as F.linear's output
    tl.store(logits_ptr + t * E + e, logits, mask=e_ok)
    z = tl.where(e_ok, logits.to(tl.float32), float("-inf"))
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)  # [BLOCK_E] softmax in fp32
    kk = tl.arange(0, BLOCK_K)
    top_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    top_p = tl.zeros((BLOCK_K,), dtype=tl.float32)
    left = tl.where(e_ok, p, -1.0)  # probabilities are >= 0: -1 marks taken or absent experts
    for j in tl.static_range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)  # the lowest expert holding the maximum
        top_ids = tl.where(kk == j, pick.to(tl.int64), top_ids)
        top_p = tl.where(kk == j, best, top_p)
        left = tl.where(e == pick, -1.0, left)
    if NORMALIZE:
        top_p = top_p / tl.sum(top_p, axis=0)
    tl.store(ids_ptr + t * K + kk, top_ids, mask=kk < K)
    tl.store(weights_ptr + t * K + kk, top_p.to(weights_ptr.dtype.element_ty), mask=kk < K)


@dataclass(frozen=True)
class SoftmaxTopK:
    """A softmax top-k router as fused_router computes it (TopKRouter's rule): the gate weight [E, D], its bias [E]
    or None, top k, renormalise, and the dtype of the expert weights."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    k: int
    normalize: bool
    weights_dtype: torch.dtype


def fused_router(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, weights_dtype: torch.dtype,
                 prepared: tuple[Preparation, torch.Tensor] | None = None, bias: torch.Tensor | None = None,
                 mxfp4_prepared: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D], gate weight [E, D] -> expert_ids [T, k] int64, expert_weights [T, k] in weights_dtype, logits [T, E]
    in x's dtype: softmax over all experts, the top k, optionally renormalised (TopKRouter's definition).
    prepared (a Preparation, its buffer for x): filled with x prepared for the experts' CUDA-core kernels, by more
    programs of the same launch (one prepare_x launch fewer per MoE block). bias [E]: added to the logits (GPT-OSS).
    mxfp4_prepared (mxfp4.launch.prepared_buffers of the T rows): filled with x prepared for the MXFP4 experts."""
    T, D = x.shape
    E = weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"the gate weight is {tuple(weight.shape)}, the input has {D} features")
    if not 1 <= k <= E:
        raise ValueError(f"top-{k} of {E} experts")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"the router bias is {tuple(bias.shape)}, the gate has {E} experts")
    x, weight = x.contiguous(), weight.contiguous()
    ids = torch.empty(T, k, dtype=torch.long, device=x.device)
    weights = torch.empty(T, k, dtype=weights_dtype, device=x.device)
    logits = torch.empty(T, E, dtype=x.dtype, device=x.device)
    block_e = triton.next_power_of_2(E)
    block_d = min(triton.next_power_of_2(D), max(16, tile(block_e) // block_e))
    if prepared is not None and mxfp4_prepared is not None:
        raise ValueError("the router prepares x for one kind of experts, low-bit or MXFP4")
    prep, xw, xr = Preparation(4, 64, False), logits, logits  # unused without PREP
    constexprs, mode, steps = prep.constexprs(), PREP_NONE, 0
    if prepared is not None:
        (prep, xw), mode = prepared, PREP_LOWBIT
        constexprs, steps = prep.constexprs(), xw.shape[1]
    if mxfp4_prepared is not None:
        (xw, xr), mode = mxfp4_prepared, PREP_MXFP4
        constexprs, steps = {**constexprs, "HALF": xw.dtype == torch.int32}, triton.cdiv(D // 32, PREPARE_GROUPS)
    _router_kernel[(T + T * steps,)](x, weight, weight if bias is None else bias, logits, ids, weights, xw, xr, T, D,
                                     E, steps, K=k, NORMALIZE=normalize, HAS_BIAS=bias is not None,
                                     BLOCK_E=block_e, BLOCK_D=block_d, BLOCK_K=triton.next_power_of_2(k), STAGES=4,
                                     PREP=mode, **constexprs, BLOCK_G=PREPARE_GROUPS, num_warps=4,
                                     **dependent_launch(x.device))
    return ids, weights, logits
