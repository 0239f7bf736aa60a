"""Low-bit fused MoE for decode: the fused_moe.py schedule over stacked packed experts (lowbit_linear.py tiles).

    gate_up: h[rows] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u)   qweight [E, 2F, words], scale/zero [E, 2F, D/G]
             config PAIRED: a program's BLOCK_N gate rows and their up rows stream through one load pipeline (a tile
             of 2 BLOCK_N rows); else the gate rows, then the up rows
    down:    y[rows] = h Wd[e]^T + lr_d                               qweight [E, D, words'], split-K, fp32 atomics

Grid (output block, K slice, expert); experts with no rows return at once, so there is no host sync. In slot order
with no more slots than experts the last axis is the slot instead (route_args): at one token, no program is spent on
the experts nobody chose (H100, one token, Mixtral 3-bit block 161 -> 149 us, a 64-expert top-6 4-bit 52 -> 49).
Compensators (lr_*) of different ranks are zero-padded to the largest rank (exact): U stacked [E, N, r],
and x V_all^T is one matmul against all experts' V [E * r, K] (skinny.low_rank_input), of which the kernels read
each row's expert's r columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.lowbit_linear import (_SLOTS, _expert_rows, _low_rank, _tile, _tile_rows,
                                                   check_activation, check_weight, exponent_bits, kernel_inputs, launch,
                                                   prepare_step, prepared_x, route_args, routed_tokens,
                                                   tile_constexprs)
from moeserve.kernels.triton.pdl import after_previous, dependent_launch
from moeserve.kernels.triton.router import check_router, partial_logits, router_blocks, top_k_of_partials
from moeserve.kernels.triton.routing import gather_combine
from moeserve.kernels.triton.skinny import low_rank_input
from moeserve.kernels.triton.swiglu import silu_mul


@dataclass
class StackedLowbit:
    """One projection of all E experts: packed weights and (optional) zero-padded compensator factors."""

    qweight: torch.Tensor  # [E, N, words] int32
    scale: torch.Tensor  # [E, N, K / group] fp16
    zero: torch.Tensor  # [E, N, K / group] fp16
    bits: int
    group: int
    in_features: int
    u: torch.Tensor | None = None  # [E, N, r] activation dtype
    v: torch.Tensor | None = None  # [E * r, K] activation dtype

    def low_rank_inputs(self, x_sorted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(U [E, N, r], x_sorted V_all^T [T*k, E * r]), or None: the kernels read each row's expert's r columns
        (one matmul, no gather launches)."""
        if self.u is None:
            return None
        return self.u, low_rank_input(x_sorted, self.v)  # [T*k, E * r]


@triton.jit
def _routed_slot(part_ptr, ids_ptr, gates_ptr, chunks, E, LOGITS: tl.constexpr, TOP_K: tl.constexpr,
                 NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, NSLOTS: tl.constexpr):
    """_expert_rows for one token whose router ran as partial logits (_route_prepare_kernel): every program picks
    the top k itself (the same in all), program 0 also stores them (ids and gate weights for the down launch), and
    program pid serves slot pid's expert (a token's experts are distinct)."""
    ids, gates = top_k_of_partials(part_ptr, chunks, E, LOGITS, TOP_K, NORMALIZE, BLOCK_E, BLOCK_C, NSLOTS)
    s = tl.arange(0, NSLOTS)  # [NSLOTS]
    slot = tl.program_id(2)
    if (tl.program_id(0) == 0) & (slot == 0):
        tl.store(ids_ptr + s, ids, mask=s < TOP_K)
        tl.store(gates_ptr + s, gates.to(gates_ptr.dtype.element_ty), mask=s < TOP_K)
    mine = s == slot
    return 0, tl.sum(mine.to(tl.int32), axis=0), tl.sum(tl.where(mine, ids, 0), axis=0), mine, s * 0


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, u_ptr, xv_ptr, route_a, route_b, gates_ptr,
                    M, F, K, R, xv_stride, words_per_row, groups_per_row, exp_bits, top_k, chunks, E,
                    BITS: tl.constexpr, GROUP: tl.constexpr, ROUTE: tl.constexpr, NSLOTS: tl.constexpr,
                    USE_DOT: tl.constexpr, HAS_LR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, AHEAD: tl.constexpr,
                    SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
                    PAIRED: tl.constexpr, ROUTER: tl.constexpr, LOGITS: tl.constexpr, TOP_K: tl.constexpr,
                    NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """ROUTER (one token, slot programs): route_a holds the router's partial logits, route_b and gates_ptr receive
    the expert ids and gate weights (_routed_slot)."""
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    C: tl.constexpr = BLOCK_K // VPC
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    if ROUTER:
        start, end, e, match, rank = _routed_slot(route_a, route_b, gates_ptr, chunks, E, LOGITS, TOP_K, NORMALIZE,
                                                  BLOCK_E, BLOCK_C, NSLOTS)
    else:
        start, end, e, match, rank = _expert_rows(route_a, route_b, M, ROUTE, BLOCK_M, NSLOTS)
    w_base = w_ptr + e * 2 * F * words_per_row  # expert e: [2F, words]
    s_base, z_base = s_ptr + e * 2 * F * groups_per_row, z_ptr + e * 2 * F * groups_per_row
    steps = tl.cdiv(K, BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        rows, r_mask = _tile_rows(row0, end, match, rank, ROUTE, BLOCK_M, NSLOTS)  # rows of h
        x_rows = rows // top_k if ROUTE >= _SLOTS else rows  # slot order: slot t * k + j reads token t
        lr_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        lr_u = lr_g
        if HAS_LR:  # before the weight stream (lowbit_linear.py's docstring says why)
            lr_base, xv_e = u_ptr + e * 2 * F * R, xv_ptr + e * R
            lr_g = _low_rank(lr_base, xv_e, xv_stride, offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                             BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
            lr_u = _low_rank(lr_base, xv_e, xv_stride, F + offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                             BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        if PAIRED:  # one pipeline over the gate rows and their up rows: [2 BLOCK_N, BLOCK_M] -> g, u
            gu = _tile(x_ptr, x_rows, r_mask, w_base, s_base, z_base, n0, F, 0, steps, K, words_per_row,
                       groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, 2 * BLOCK_N, BLOCK_M, C, VPC, AHEAD,
                       SUB, PIPE, HALF, INTERPRET, PAIRED=True)
            g, u = tl.split(tl.permute(tl.reshape(gu, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))  # [BLOCK_N, BLOCK_M] each
        else:  # the gate rows, then the up rows
            g = _tile(x_ptr, x_rows, r_mask, w_base, s_base, z_base, n0, F, 0, steps, K, words_per_row,
                      groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M, C, VPC, AHEAD, SUB,
                      PIPE, HALF, INTERPRET)
            u = _tile(x_ptr, x_rows, r_mask, w_base, s_base, z_base, F + n0, 2 * F, 0, steps, K, words_per_row,
                      groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M, C, VPC, AHEAD, SUB,
                      PIPE, HALF, INTERPRET)
        h = silu_mul(g + lr_g, u + lr_u)  # [BLOCK_N, BLOCK_M]
        tl.store(h_ptr + rows[None, :].to(tl.int64) * F + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])


NO_ROUTER = dict(ROUTER=False, LOGITS=tl.float32, TOP_K=1, NORMALIZE=False, BLOCK_E=1, BLOCK_C=1)
LOGIT_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def launch_gate_up(x: torch.Tensor, p: StackedLowbit, h: torch.Tensor, routing, cfg: dict,
                   routed: tuple | None = None) -> None:
    """h = silu(x Wg^T) * (x Wu^T) per expert row: routing a RoutingTable (x and h expert-sorted) or the expert ids
    [T, k] (x the T tokens, h [T*k, F] in slot order). routed: (x prepared by _route_prepare_kernel, the router's
    partial logits, the gate weights to fill, (chunks, experts, the router constexprs)); routing then the ids [1, k]
    to fill."""
    E, two_f, _ = p.qweight.shape
    F = two_f // 2
    lr = p.low_rank_inputs(x)
    u, xv = lr if lr is not None else (h, h)
    route = route_args(routing, x.shape[0], h, E)
    T = routed_tokens(routing)
    tile = tile_constexprs(cfg, p.bits, p.group, T, x.dtype, lr is not None)
    (xk, exp), part, gates, (chunks, E_router, router) = (
        (kernel_inputs(x, tile), route["a"], h, (1, 1, NO_ROUTER)) if routed is None else routed)
    route.pop("a")
    _gate_up_kernel[(triton.cdiv(F, cfg["BLOCK_N"]), 1, route.pop("programs"))](
        xk, p.qweight, p.scale, p.zero, h, u, xv, part, route.pop("b"), gates, route.pop("rows"), F,
        p.in_features, p.u.shape[-1] if lr is not None else 0, xv.stride(0), p.qweight.shape[-1], p.scale.shape[-1],
        exp, h.shape[0] // T, chunks, E_router, PAIRED=bool(cfg.get("PAIRED", 0)), **route, **tile, **router,
        **dependent_launch(x.device))  # h [T*k, F]: top_k


@triton.jit
def _route_prepare_kernel(x_ptr, xw_ptr, gate_w_ptr, part_ptr, K, cols, steps, E, BITS: tl.constexpr,
                          VPC: tl.constexpr, CPS: tl.constexpr, HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token: programs below `steps` prepare x for the gate/up kernel (prepare_step), the others each take a
    chunk of the router's GEMV (partial_logits), which the gate/up kernel finishes: the router has no launch and no
    single program reading all of its weight."""
    after_previous(PDL)
    pid = tl.program_id(0)
    if pid < steps:
        prepare_step(x_ptr, xw_ptr, tl.program_id(1), pid, steps, K, cols, BITS, VPC, CPS, HALF, LOG2_LIMIT)
    else:
        partial_logits(x_ptr, gate_w_ptr, part_ptr, pid - steps, K, E, BLOCK_E, BLOCK_D)


def routed_lowbit_moe(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool,
                      weights_dtype: torch.dtype, gate_up: StackedLowbit, down: StackedLowbit,
                      config: dict | None = None) -> torch.Tensor:
    """One token x [1, D] through the softmax top-k router (router.fused_router's definition) and the experts -> [1, D]
    in x's dtype: x prepared beside the router's GEMV in chunks (one launch), the top k picked in the gate/up launch,
    then down and combine (and the compensators' x V^T where there are compensators). No router launch, and no
    program reading all of the router's weight (a 64-expert router took 9.5 us in one program on an H100)."""
    check_activation(x, gate_up.in_features)
    for p in (gate_up, down):
        check_weight(p.qweight, p.scale, p.zero, p.bits, p.group, p.in_features)
    check_router(router_weight, x.shape[1], top_k)
    if x.shape[0] != 1:
        raise ValueError(f"the routed low-bit MoE takes one token, got {x.shape[0]}")
    E, two_f, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1], gate_up.in_features
    F = two_f // 2
    if router_weight.shape[0] != E:
        raise ValueError(f"the router scores {router_weight.shape[0]} experts, the stacked weights hold {E}")
    config = config or _config(x, gate_up, down, E, D, F, 1, top_k)
    x, router_weight = x.contiguous(), router_weight.contiguous()
    tile = tile_constexprs(config["gate_up"], gate_up.bits, gate_up.group, 1, x.dtype, gate_up.u is not None)
    xw, prep = prepared_x(x, gate_up.bits, tile["BLOCK_K"], tile["HALF"])
    block_e, block_d = router_blocks(E, D)
    chunks = triton.cdiv(D, block_d)
    part = torch.empty(chunks, E, dtype=torch.float32, device=x.device)  # [chunks, E] partial logits
    _route_prepare_kernel[(prep["steps"] + chunks,)](x, xw, router_weight, part, prep.pop("K"), prep.pop("cols"),
                                                     prep.pop("steps"), E, BLOCK_E=block_e, BLOCK_D=block_d, **prep,
                                                     **dependent_launch(x.device))
    ids = torch.empty(1, top_k, dtype=torch.long, device=x.device)
    gates = torch.empty(1, top_k, dtype=weights_dtype, device=x.device)
    h = torch.empty(top_k, F, dtype=x.dtype, device=x.device)  # [k, F] slot order
    router = dict(ROUTER=True, LOGITS=LOGIT_TYPES[x.dtype], TOP_K=top_k, NORMALIZE=normalize, BLOCK_E=block_e,
                  BLOCK_C=min(16, triton.next_power_of_2(chunks)))
    launch_gate_up(x, gate_up, h, ids, config["gate_up"],
                   routed=((xw, exponent_bits(gate_up.bits, tile["HALF"])), part, gates, (chunks, E, router)))
    y = torch.empty(top_k, D, dtype=torch.float32, device=x.device)  # [k, D] slot order, launch zeroes it
    launch(h, down.qweight, down.scale, down.zero, y, down.bits, down.group, F, config["down"], 1, E,
           lowrank=down.low_rank_inputs(h), routing=ids)
    return gather_combine(y, None, gates, top_k, x.dtype)


def _config(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, E: int, D: int, F: int, T: int,
            top_k: int) -> dict:
    """The tuned gate_up/down configs for this device, shape, width, token count and compensators."""
    from moeserve.kernels.triton.configs import gpu_name, lowbit_moe_config

    name = gpu_name(x.device.index or 0) if x.is_cuda else "cpu"
    return lowbit_moe_config(name, gate_up.bits, E, D, F, T, top_k, gate_up.u is not None or down.u is not None)


def lowbit_experts(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, routing,
                   config: dict | None = None) -> torch.Tensor:
    """The experts' outputs before gate weighting, [T*k, D] float32: routing a RoutingTable (x [T*k, D] its
    expert-sorted rows, outputs in that order) or the expert ids [T, k] (x [T, D] the tokens, outputs in slot order
    t * k + j: no routing table and no gather)."""
    check_activation(x, gate_up.in_features)
    for p in (gate_up, down):
        check_weight(p.qweight, p.scale, p.zero, p.bits, p.group, p.in_features)
    E, two_f, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1], gate_up.in_features
    F = two_f // 2
    T = routed_tokens(routing)
    n = routing.numel() if isinstance(routing, torch.Tensor) else x.shape[0]  # rows of h and y: T * top_k
    config = config or _config(x, gate_up, down, E, D, F, T, n // T)
    x = x.contiguous()
    h = torch.empty(n, F, dtype=x.dtype, device=x.device)  # [T*k, F]
    launch_gate_up(x, gate_up, h, routing, config["gate_up"])
    y = torch.empty(n, D, dtype=torch.float32, device=x.device)  # [T*k, D] launch zeroes it
    launch(h, down.qweight, down.scale, down.zero, y, down.bits, down.group, F, config["down"], T, E,
           lowrank=down.low_rank_inputs(h), routing=routing)
    return y
