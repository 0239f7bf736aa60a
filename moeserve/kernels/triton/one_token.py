"""One token through a whole MoE layer's routed experts in three launches: the router (its top-k, and x prepared for
the experts' GEMV, topk_router.fused_router), gate/up (h also prepared for down by the program that stores a step's
last outputs) and down (each output block's k expert rows weighted and summed by its last program, written in x's
dtype). The multi-launch path adds prepare_x(h) and the combine (and the routing table and a gather for MXFP4);
last_arrival.py says how a launch finishes what needs all of its programs. The combine's sums run in a fixed order,
so the output is deterministic. Compensators (3-bit + MiLo) keep their x V^T and h V^T launches (skinny.py).

Routers: softmax top-k with or without renormalisation and GPT-OSS's top-k then softmax with its bias (topk_router
covers these); other routers take the multi-launch path. It is opt-in (ONE_TOKEN_ENV=1) until
bench/one_token_moe.py shows it faster on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton

from moeserve.kernels.triton.configs import ExpertsConfig
from moeserve.kernels.triton.last_arrival import arrival_counters
from moeserve.kernels.triton.lowbit.launch import (PreparedH, Preparation, SlotCombine, k_slices, launch,
                                                   launch_down_tma, launch_gate_up, tile_constexprs, tma_one_token)
from moeserve.kernels.triton.lowbit.layout import StackedLowbit, check_activation, check_weight
from moeserve.kernels.triton.lowbit.ops import experts_config
from moeserve.kernels.triton.mxfp4.kernels import down_gemv_kernel, gate_up_gemv_kernel
from moeserve.kernels.triton.mxfp4.launch import (Mxfp4Config, Mxfp4Weights, common_constexprs, default_config,
                                                  prepared_buffers)
from moeserve.kernels.triton.topk_router import SoftmaxTopK, fused_router
from moeserve.kernels.triton.swiglu import act_args
from moeserve.spec import ClampedSwiGLU

ONE_TOKEN_ENV = "MOESERVE_ONE_TOKEN_MOE"  # "1": one token takes the three-launch layer path


def one_token_enabled() -> bool:
    """Whether the one-token layer path may run (ONE_TOKEN_ENV is "1")."""
    return os.environ.get(ONE_TOKEN_ENV, "0").strip() == "1"


def lowbit_one_token(x: torch.Tensor, router: SoftmaxTopK, gate_up: StackedLowbit, down: StackedLowbit,
                     act: ClampedSwiGLU | None = None, config: ExpertsConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, D] -> (the routed experts' combined output [1, D] in x's dtype, expert_ids [1, k], expert_weights [1, k]):
    the layer's low-bit experts (equal bits; biases and act as lowbit_experts takes them) in three launches."""
    check_activation(x, gate_up.in_features)
    for p in (gate_up, down):
        check_weight(p.qweight, p.scale, p.zero, p.bits, p.group, p.in_features)
    if x.shape[0] != 1 or gate_up.bits != down.bits:
        raise ValueError(f"the one-token path takes one token and experts of one width, got {x.shape[0]} tokens, "
                         f"{gate_up.bits}/{down.bits} bits")
    k, dev = router.k, x.device
    F, D = gate_up.qweight.shape[1] // 2, gate_up.in_features
    x = x.contiguous()
    config = config or experts_config(x, gate_up, down, 1, k)
    x_prep = Preparation.of(tile_constexprs(config.gate_up, gate_up.bits, gate_up.group, 1, x.dtype, False))
    h_tile = tile_constexprs(config.down, down.bits, down.group, 1, x.dtype, down.u is not None)
    h_prep = Preparation.of(h_tile)
    if x_prep is None or h_prep is None:
        raise ValueError("the one-token path runs the experts' CUDA-core GEMV (one row: never tensor-core tiles)")
    xw = x_prep.buffer(1, D, dev)
    ids, weights, _ = fused_router(x, router.weight, k, router.normalize, router.weights_dtype, (x_prep, xw),
                                   bias=router.bias)
    h = torch.empty(k, F, dtype=x.dtype, device=dev)  # [k, F] slot order
    hw = h_prep.buffer(k, F, dev)
    tma = tma_one_token(config.down, down, ids, dev)
    split, _ = k_slices(config.down, h_tile, F, tma)
    out_blocks = triton.cdiv(D, 2 * config.down.BLOCK_N if tma else config.down.BLOCK_N)
    counters = arrival_counters(dev, k * hw.shape[1] + out_blocks)
    launch_gate_up(x, gate_up, h, ids, config.gate_up, xw, act, PreparedH(h_prep, hw, counters[:k * hw.shape[1]]))
    partials = torch.empty(split, k, D, dtype=torch.float32, device=dev)  # [K slices, k, D]
    out = torch.empty(1, D, dtype=x.dtype, device=dev)
    combine = SlotCombine(out, weights.reshape(-1), counters[k * hw.shape[1]:])
    if tma:
        launch_down_tma(h, down, partials, ids, config.down, combine, hw)
    else:
        launch(h, down.qweight, down.scale, down.zero, partials, down.bits, down.group, F, config.down, 1,
               down.qweight.shape[0], lowrank=down.low_rank_inputs(h), routing=ids, bias=down.bias, combine=combine,
               prepared=hw)
    return out, ids, weights


def mxfp4_one_token(x: torch.Tensor, router: SoftmaxTopK, gate_up: Mxfp4Weights, down: Mxfp4Weights,
                    act: ClampedSwiGLU | None = None, config: Mxfp4Config | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, D] -> (the routed experts' combined output [1, D] in x's dtype, expert_ids [1, k], expert_weights
    [1, k]): the layer's MXFP4 experts (biases, act) in three launches: the router (x prepared in its launch), gate/up
    (h written prepared, as mxfp4's kernels always do) over the k slots, down with the combine."""
    E, two_f, D = gate_up.shape
    F, k, dev = two_f // 2, router.k, x.device
    if x.shape != (1, D) or down.shape != (E, D, F):
        raise ValueError(f"the one-token MXFP4 path takes x [1, {D}] and down [{E}, {D}, {F}], got x "
                         f"{tuple(x.shape)}, down {down.shape}")
    cfg = config or default_config(1, x.dtype)
    if cfg.use_dot(x.dtype):
        raise ValueError(f"the one-token MXFP4 path runs the CUDA-core kernels, not tensor-core tiles ({cfg})")
    x, half = x.contiguous(), cfg.half(x.dtype)
    xp, xr = prepared_buffers(1, D, half, dev)
    ids, weights, _ = fused_router(x, router.weight, k, router.normalize, router.weights_dtype, bias=router.bias,
                                   mxfp4_prepared=(xp, xr))
    hp, hr = prepared_buffers(k, F, half, dev)
    common = dict(HALF=half, BLOCK_M=1, SLOTS=True, **common_constexprs(cfg, E, dev))
    gate_up_gemv_kernel[(triton.cdiv(F, cfg.BLOCK_N), k)](
        xp, xr, gate_up.words(), gate_up.scales, gate_up.bias if gate_up.bias is not None else xr, hp, hr, ids, ids,
        E, F, D, *act_args(act), HAS_BIAS=gate_up.bias is not None, CLAMPED=act is not None, **common)
    blocks = triton.cdiv(D, cfg.BLOCK_N)
    partials = torch.empty(k, D, dtype=torch.float32, device=dev)  # [k, D] each slot's expert output
    out = torch.empty(1, D, dtype=x.dtype, device=dev)
    down_gemv_kernel[(blocks, k)](
        hp, hr, down.words(), down.scales, down.bias if down.bias is not None else hr, partials, ids, ids, out,
        weights.reshape(-1), arrival_counters(dev, blocks), E, D, F, HAS_BIAS=down.bias is not None, COMBINE=True,
        **common)
    return out, ids, weights
