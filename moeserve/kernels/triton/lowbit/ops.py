"""The low-bit ops the model calls: lowbit_linear (a dense layer, W{2,3,4,8}A16 for decode's 1..64 rows),
lowbit_experts (the fused MoE over stacked packed experts: gate_up with its SwiGLU, then down), with their configs
looked up per GPU and shape (configs.py; the experts' tuned on first use, autotune.py) unless one is given, and
lowbit_dequantize (the float weight, for calls of more rows: a prompt)."""

from __future__ import annotations

import torch
import triton

from moeserve.kernels.routing import build_routing_table, slot_order_pays
from moeserve.kernels.triton.autotune import Outcome, Problem, bucket, choose, gpu_ms, tune
from moeserve.kernels.triton.configs import (ExpertsConfig, LowbitConfig, gpu_name, lowbit_config, lowbit_moe_config,
                                             lowbit_moe_key)
from moeserve.kernels.triton.device import device_of
from moeserve.kernels.triton.lowbit.dequant import dequant_kernel
from moeserve.kernels.triton.lowbit.launch import (Preparation, launch, launch_down_tma, launch_gate_up, routed_tokens,
                                                   tile_constexprs, tma_one_token)
from moeserve.kernels.triton.lowbit.layout import StackedLowbit, check_activation, check_weight
from moeserve.kernels.triton.skinny import low_rank_input
from moeserve.kernels.triton.spaces import lowbit_moe_candidates
from moeserve.spec import ClampedSwiGLU

TIMED_ROUTINGS = 4  # rotating routings a tuning run times each candidate over (the experts hit change, as in decode)
DEQUANT_BITS = (2, 4, 8)  # the widths lowbit_dequantize reads (3-bit rows are unit-planar: dequantized by pack.py)
DEQUANT_BLOCK = (64, 128)  # (rows, columns) of the weight per program


def lowbit_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  group: int, in_features: int, lowrank: tuple[torch.Tensor, torch.Tensor] | None = None,
                  config: LowbitConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T (+ (x V^T) U^T) -> [..., N] in x's dtype.

    qweight [N, padded K * bits / 32] int32, scale/zero [N, K / group] fp16; lowrank = (U [N, r], V [r, K])
    in x's dtype (x V^T is a tiny matmul here, U^T is applied in the kernel's epilogue)."""
    check_activation(x, in_features)
    check_weight(qweight, scale, zero, bits, group, in_features)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [M, K]
    M, N = x2.shape[0], qweight.shape[0]
    if config is None:
        config = lowbit_config(gpu_name(x.device.index or 0) if x.is_cuda else "cpu", bits, M, N, in_features)
    lr = None
    if lowrank is not None:
        u, v = lowrank
        lr = (u.contiguous(), low_rank_input(x2, v).contiguous())  # U [N, r], xv [M, r]
    split = config.SPLIT_K > 1
    y = torch.empty(M, N, dtype=torch.float32 if split else x.dtype, device=x.device)  # split-K: launch zeroes it
    # CUDA-core tiles: a program per BLOCK_M rows
    rows_per_block = M if M == 1 else min(M, 64 if config.BLOCK_M is None else config.BLOCK_M)
    launch(x2, qweight, scale, zero, y, bits, group, in_features, config, rows_per_block,
           triton.cdiv(M, rows_per_block), lowrank=lr)
    return y.to(x.dtype).reshape(*lead, N)


def experts_config(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, tokens: int,
                   top_k: int) -> ExpertsConfig:
    """The launch configs for `tokens` tokens on x's device: stored or default (configs.py), on a GPU after tuning
    the token bucket where nothing is stored for it (autotune.py)."""
    E, two_f, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1], gate_up.in_features
    F, lowrank = two_f // 2, gate_up.u is not None or down.u is not None
    if not x.is_cuda:
        return lowbit_moe_config("cpu", gate_up.bits, E, D, F, tokens, top_k, lowrank, gate_up.group)
    device = device_of(x)
    return choose(device, "lowbit_moe", lowbit_moe_key(gate_up.bits, E, D, F, lowrank), tokens,
                  lambda T: lowbit_moe_config(device, gate_up.bits, E, D, F, T, top_k, lowrank, gate_up.group),
                  lambda mode, T: lowbit_moe_candidates(mode, device, T, E, top_k, D, F, gate_up.group),
                  lambda T: experts_timer(gate_up, down, T, top_k, x.dtype))


def experts_timer(gate_up: StackedLowbit, down: StackedLowbit, tokens: int, top_k: int, dtype: torch.dtype):
    """measure(config) -> GPU ms of lowbit_experts at `tokens` random tokens of `dtype` over TIMED_ROUTINGS random
    routings, in the row order QuantizedExperts runs it (slot order where slot_order_pays, else expert-sorted)."""
    E, D, dev = gate_up.qweight.shape[0], gate_up.in_features, gate_up.qweight.device
    items = []
    for _ in range(TIMED_ROUTINGS):
        ids = torch.stack([torch.randperm(E, device=dev)[:top_k] for _ in range(tokens)])  # [T, k] distinct experts
        if slot_order_pays(tokens):
            items.append((torch.randn(tokens, D, device=dev, dtype=dtype), ids))  # x [T, D], slot order
        else:
            table = build_routing_table(ids, torch.rand(tokens, top_k, device=dev), E)
            items.append((torch.randn(tokens * top_k, D, device=dev, dtype=dtype), table))  # x [T*k, D] sorted
    return lambda config: gpu_ms(lambda item: lowbit_experts(item[0], gate_up, down, item[1], config), items)


def tune_experts(gate_up: StackedLowbit, down: StackedLowbit, tokens: int, top_k: int, mode: str,
                 dtype: torch.dtype = torch.bfloat16, budget_s: float | None = None) -> Outcome:
    """Search this GPU's config for these experts at the bucket of `tokens` now, whatever is stored (`moeserve
    tune`), starting from what a call gets without it, and store the winner in the user's tuning cache."""
    device = device_of(gate_up.qweight)
    E, D, F = gate_up.qweight.shape[0], gate_up.in_features, gate_up.qweight.shape[1] // 2
    lowrank, T = gate_up.u is not None or down.u is not None, bucket(tokens)
    problem = Problem("lowbit_moe", lowbit_moe_key(gate_up.bits, E, D, F, lowrank), T)
    return tune(device, problem, lowbit_moe_config(device, gate_up.bits, E, D, F, T, top_k, lowrank, gate_up.group),
                lowbit_moe_candidates(mode, device, T, E, top_k, D, F, gate_up.group),
                experts_timer(gate_up, down, T, top_k, dtype), mode, budget_s)


def x_preparation(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, top_k: int,
                  config: ExpertsConfig | None = None) -> Preparation | None:
    """How gate_up will read the tokens x [T, D] in slot order (lowbit_experts with expert ids): prepared as this
    says (another launch may do it and pass it in as prepared_x), or None (x itself, for tensor-core tiles)."""
    T = x.shape[0]
    config = config or experts_config(x, gate_up, down, T, top_k)
    return Preparation.of(tile_constexprs(config.gate_up, gate_up.bits, gate_up.group, T, x.dtype,
                                          False))  # compensators change nothing x is read as


def lowbit_experts(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, routing,
                   config: ExpertsConfig | None = None, prepared_x: torch.Tensor | None = None,
                   act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The experts' outputs before gate weighting, [T*k, D] float32: routing a RoutingTable (x [T*k, D] its
    expert-sorted rows, outputs in that order) or the expert ids [T, k] (x [T, D] the tokens, outputs in slot order
    t * k + j: no routing table and no gather; prepared_x: x prepared already, as x_preparation says).

    Grid (output block, K slice, expert); experts with no rows return at once, so there is no host sync. In slot order
    with no more slots than experts the last axis is the slot instead (launch.route_args): at one token, no program is
    spent on the experts nobody chose. One token with experts of group 64 and config TMA (launch.tma_one_token): the
    weights come by TMA (tma.py). Compensators: each row's expert's columns of x V_all^T (StackedLowbit), at one token
    by TMA only the chosen experts' columns are computed. Biases (StackedLowbit.bias) and act (GPT-OSS's clamped
    SwiGLU): in the kernels' epilogues (not on the TMA path)."""
    check_activation(x, gate_up.in_features)
    for p in (gate_up, down):
        check_weight(p.qweight, p.scale, p.zero, p.bits, p.group, p.in_features)
    E, F, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1] // 2, gate_up.in_features
    T = routed_tokens(routing)
    n = routing.numel() if isinstance(routing, torch.Tensor) else x.shape[0]  # rows of h and y: T * top_k
    config = config or experts_config(x, gate_up, down, T, n // T)
    if prepared_x is not None and not isinstance(routing, torch.Tensor):
        raise ValueError("prepared x is for the slot-order path (expert ids), not for expert-sorted rows")
    x = x.contiguous()
    h = torch.empty(n, F, dtype=x.dtype, device=x.device)  # [T*k, F]
    launch_gate_up(x, gate_up, h, routing, config.gate_up, prepared_x, act)
    y = torch.empty(n, D, dtype=torch.float32, device=x.device)  # [T*k, D] launch zeroes it
    if tma_one_token(config.down, down, routing, x.device):
        launch_down_tma(h, down, y, routing, config.down)
    else:
        launch(h, down.qweight, down.scale, down.zero, y, down.bits, down.group, F, config.down, T, E,
               lowrank=down.low_rank_inputs(h), routing=routing, bias=down.bias)
    return y


def lowbit_dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                      in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """dequant(W) [N, in_features] in `dtype` ((q - z) * s in float32, as hqq.dequantize), 2/4/8 bits (DEQUANT_BITS):
    qweight [N, padded K * bits / 32] int32, scale/zero [N, K / group] fp16."""
    if bits not in DEQUANT_BITS:
        raise ValueError(f"lowbit_dequantize reads {DEQUANT_BITS}-bit rows, not {bits}-bit")
    check_weight(qweight, scale, zero, bits, group, in_features)
    N = qweight.shape[0]
    out = torch.empty(N, in_features, dtype=dtype, device=qweight.device)
    bn, bk = DEQUANT_BLOCK
    dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(in_features, bk))](
        qweight, scale, zero, out, N, in_features, qweight.shape[1], scale.shape[1], BITS=bits, GROUP=group,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out
