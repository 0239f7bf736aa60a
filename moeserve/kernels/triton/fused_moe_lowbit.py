"""Low-bit fused MoE for decode: the fused_moe.py schedule over stacked packed experts (lowbit_linear.py tiles).

    gate_up: h[rows] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u)   qweight [E, 2F, words], scale/zero [E, 2F, D/G]
             config PAIRED: a program's BLOCK_N gate rows and their up rows stream through one load pipeline (a tile
             of 2 BLOCK_N rows); else the gate rows, then the up rows
    down:    y[rows] = h Wd[e]^T + lr_d                               qweight [E, D, words'], split-K, fp32 atomics

Grid (output block, K slice, expert); experts with no rows return at once, so there is no host sync. In slot order
with no more slots than experts the last axis is the slot instead (route_args): at one token, no program is spent on
the experts nobody chose (H100, one token, Mixtral 3-bit block 161 -> 149 us, a 64-expert top-6 4-bit 52 -> 49).
One token with experts of group 64 and config TMA (tma_one_token): the words, scales and zeros come
by TMA (descriptor loads pipelined through shared memory, STAGES deep) instead of register prefetch, two blocks of
BLOCK_N rows per program (_tma_gemv: gate_up's gate rows and their up rows through a 3-D box, down's 2 BLOCK_N rows)
in one load per 3-bit plane, scales and zeros, split in registers; H100 probes: the register-prefetch loop holds
about one step in flight per program and waits on it (Mixtral 4-bit gate_up 65 -> 56 us); the 3-bit gate_up is
bound by instruction issue (ncu: 74% issue, 58% DRAM), and one load for both blocks instead of one each cut its
loop by 13% (down's by 15%): Mixtral block at one token 0.085 -> 0.081-0.082 ms at 3 bits, 0.098 -> 0.094 at 4.
Compensators (lr_*) of different ranks are zero-padded to the largest rank (exact): U stacked [E, N, r],
and x V_all^T is one matmul against all experts' V [E * r, K] (skinny.low_rank_input), of which the kernels read
each row's expert's r columns (at one token, the TMA launches: only the chosen experts' columns are computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels import triton_interpreting
from moeserve.kernels.triton.configs import gpu_name, lowbit_moe_config
from moeserve.kernels.triton.lowbit_linear import (Preparation, ROUTE_SLOTS, check_activation, check_weight,
                                                   expert_rows, gemv_step, group_cols, kernel_inputs, launch,
                                                   low_rank_args, low_rank_tile, route_args, routed_tokens,
                                                   tile_constexprs, tile_product, tile_rows, values_per_column,
                                                   x_step_ptrs)
from moeserve.kernels.triton.pdl import after_previous, dependent_launch, hopper
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

    def low_rank_inputs(self, x_sorted: torch.Tensor,
                        experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(U [E, N, r], x_sorted V_all^T [T*k, E * r]), or None: the kernels read each row's expert's r columns
        (one matmul, no gather launches); experts (ids, any shape): the kernels read only these experts' columns,
        the others may be left unwritten."""
        if self.u is None:
            return None
        groups = (experts.reshape(-1), self.u.shape[-1]) if experts is not None else None
        return self.u, low_rank_input(x_sorted, self.v, groups)  # [T*k, E * r]


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, u_ptr, xv_ptr, route_a, route_b,
                    M, F, K, R, xv_stride, words_per_row, groups_per_row, exp_bits, top_k,
                    BITS: tl.constexpr, GROUP: tl.constexpr, ROUTE: tl.constexpr, NSLOTS: tl.constexpr,
                    USE_DOT: tl.constexpr, HAS_LR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, AHEAD: tl.constexpr,
                    SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
                    PAIRED: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    C: tl.constexpr = BLOCK_K // VPC
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    start, end, e, match, rank = expert_rows(route_a, route_b, M, ROUTE, BLOCK_M, NSLOTS)
    w_base = w_ptr + e * 2 * F * words_per_row  # expert e: [2F, words]
    s_base, z_base = s_ptr + e * 2 * F * groups_per_row, z_ptr + e * 2 * F * groups_per_row
    steps = tl.cdiv(K, BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE, BLOCK_M, NSLOTS)  # rows of h
        x_rows = rows // top_k if ROUTE >= ROUTE_SLOTS else rows  # slot order: slot t * k + j reads token t
        lr_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        lr_u = lr_g
        if HAS_LR:  # before the weight stream (lowbit_linear.py's docstring says why)
            lr_base, xv_e = u_ptr + e * 2 * F * R, xv_ptr + e * R
            lr_g = low_rank_tile(lr_base, xv_e, xv_stride, offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                                 BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
            lr_u = low_rank_tile(lr_base, xv_e, xv_stride, F + offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                                 BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        if PAIRED:  # one pipeline over the gate rows and their up rows: [2 BLOCK_N, BLOCK_M] -> g, u
            gu = tile_product(x_ptr, x_rows, r_mask, w_base, s_base, z_base, n0, F, 0, steps, K, words_per_row,
                              groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, 2 * BLOCK_N, BLOCK_M, C, VPC,
                              AHEAD, SUB, PIPE, HALF, INTERPRET, PAIRED=True)
            g, u = tl.split(tl.permute(tl.reshape(gu, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))  # [BLOCK_N, BLOCK_M] each
        else:  # the gate rows, then the up rows
            g = tile_product(x_ptr, x_rows, r_mask, w_base, s_base, z_base, n0, F, 0, steps, K, words_per_row,
                             groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M, C, VPC, AHEAD,
                             SUB, PIPE, HALF, INTERPRET)
            u = tile_product(x_ptr, x_rows, r_mask, w_base, s_base, z_base, F + n0, 2 * F, 0, steps, K, words_per_row,
                             groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M, C, VPC, AHEAD,
                             SUB, PIPE, HALF, INTERPRET)
        h = silu_mul(g + lr_g, u + lr_u)  # [BLOCK_N, BLOCK_M]
        tl.store(h_ptr + rows[None, :].to(tl.int64) * F + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])


@triton.jit
def _tma_block(desc, row, n0, col, PAIRS: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """One TMA load of two blocks of ROWS weight rows, W columns from col: a pair of [ROWS, G, W / G] tiles. PAIRS:
    desc is 3-D [E * 2, N / 2, columns] (gate_up: an expert's gate rows, then its up rows) and the blocks are rows
    n0.. of halves row and row + 1; else desc is 2-D and the blocks are rows row.. and row + ROWS.. The blocks are
    split apart in registers: as one [2 ROWS, ..] tile Triton lays the decode out with twice the registers (3 bits)
    or five times the shared-memory bank conflicts (4 bits)."""
    if PAIRS:
        tile = desc.load([row, n0, col])  # [2, ROWS, W]
    else:
        tile = desc.load([row, col]).reshape(2, ROWS, W)
    first, second = tl.split(tile.permute(1, 2, 0))  # [ROWS, W] each
    return first.reshape(ROWS, G, W // G), second.reshape(ROWS, G, W // G)


@triton.jit
def _tma_gemv(xw_ptr, x_row, steps, w_desc, s_desc, z_desc, row, n0, step0, step1, plane, exp_bits,
              BITS: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr, PAIRS: tl.constexpr, HALF: tl.constexpr,
              STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """Row x_row of prepared x (xw_ptr: prepare_x, `steps` steps a row) times two blocks of ROWS weight rows at
    (row, n0) (_tma_block; PAIRS: gate rows and their up rows) over steps [step0, step1): a pair of [ROWS] fp32 sums
    (gemv_step, x loaded once for both). The words [.., words] and scales/zeros [.., groups] come by TMA descriptors in
    boxes of both blocks' G * CPG words or G groups, STAGES deep in shared memory: a load per 3-bit plane (`plane`
    words apart: a step's 96 words are no power of two, its 32 words of a plane are) and one each for scales and
    zeros; rows and steps past the tensors read zeros (a 3-bit step past a plane's end reads the next plane's words:
    the prepared x there is zero)."""
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    CPG: tl.constexpr = 64 // VPC  # columns per group of 64 (tma_one_token)
    CPS: tl.constexpr = G * CPG
    XSLOTS: tl.constexpr = VPC // 2 + 2 if HALF else VPC + 1
    xw_row = xw_ptr + x_row * steps * (XSLOTS * CPS)  # int32: a slot of one token; ints where Triton specializes 1
    col = group_cols(tl.arange(0, G), CPG)
    acc = (tl.zeros((ROWS, G, CPG), dtype=tl.float32), tl.zeros((ROWS, G, CPG), dtype=tl.float32))
    for step in tl.range(step0, step1, num_stages=STAGES):
        planes = ()
        for p in tl.static_range(3 if BITS == 3 else 1):
            planes = planes + (_tma_block(w_desc, row, n0, p * plane + step * CPS, PAIRS, ROWS, G, CPS),)
        s = _tma_block(s_desc, row, n0, step * G, PAIRS, ROWS, G, G)  # [ROWS, G, 1] each
        z = _tma_block(z_desc, row, n0, step * G, PAIRS, ROWS, G, G)
        words = ()
        scales = ()
        for j in tl.static_range(2):
            block = ()
            for p in tl.static_range(3 if BITS == 3 else 1):
                block = block + (planes[p][j],)
            words = words + (block,)
            scales = scales + ((s[j], z[j]),)
        acc = gemv_step(acc, words, scales, x_step_ptrs((xw_row,), step, XSLOTS, CPS, 1), col, exp_bits, BITS, VPC, CPS,
                        2, 1, HALF, INTERPRET)
    return tl.sum(tl.sum(acc[0], axis=2), axis=1), tl.sum(tl.sum(acc[1], axis=2), axis=1)


@triton.jit
def _one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, rows_per_expert, offs, n_mask, x_row, R, BLOCK_N: tl.constexpr,
                      BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr):
    """(x V^T) U^T of expert e for outputs offs [BLOCK_N] of one row x_row of x: [BLOCK_N] fp32 (low_rank_tile on CUDA
    cores; U stacked [E, rows_per_expert, R], x V_all^T [rows, E * R])."""
    lr = low_rank_tile(u_ptr + e.to(tl.int64) * rows_per_expert * R, xv_ptr + e * R, xv_stride, offs, n_mask,
                       tl.full((1,), 0, tl.int32) + x_row, tl.full((1,), True, tl.int1), R, False, "ieee", BLOCK_N, 1,
                       BLOCK_R, INTERPRET)  # [BLOCK_N, 1]
    return tl.reshape(lr, (BLOCK_N,))


@triton.jit
def _gate_up_tma_kernel(xw_ptr, w_desc, s_desc, z_desc, ids_ptr, h_ptr, u_ptr, xv_ptr, F, steps, plane, R,
                        xv_stride, exp_bits, BITS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                        HALF: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr, HAS_LR: tl.constexpr,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One token: h[slot, n0 : n0 + BLOCK_N] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u), e = ids[slot] (grid axis
    2: the k slots, distinct experts); the gate rows and their up rows come in the same TMA blocks (_tma_block
    PAIRS); HAS_LR: the compensator terms, computed before the weight stream."""
    after_previous(PDL)
    slot = tl.program_id(2)
    n0 = tl.program_id(0) * BLOCK_N
    e = tl.load(ids_ptr + slot).to(tl.int32)
    offs = n0 + tl.arange(0, BLOCK_N)
    lr_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lr_u = lr_g
    if HAS_LR:
        lr_g = _one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, 2 * F, offs, offs < F, 0, R, BLOCK_N, BLOCK_R, INTERPRET)
        lr_u = _one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, 2 * F, F + offs, offs < F, 0, R, BLOCK_N, BLOCK_R,
                                 INTERPRET)
    g, u = _tma_gemv(xw_ptr, 0, steps, w_desc, s_desc, z_desc, 2 * e, n0, 0, steps, plane, exp_bits, BITS, BLOCK_N,
                     G, True, HALF, STAGES, INTERPRET)
    tl.store(h_ptr + slot * F + offs, silu_mul(g + lr_g, u + lr_u).to(h_ptr.dtype.element_ty), mask=offs < F)


@triton.jit
def _down_tma_kernel(hw_ptr, w_desc, s_desc, z_desc, ids_ptr, y_ptr, u_ptr, xv_ptr, D, steps, per_split, plane, R,
                     xv_stride, exp_bits, BITS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                     HALF: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr, ATOMIC: tl.constexpr,
                     HAS_LR: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One token: y[slot, n0 : n0 + 2 BLOCK_N] (+)= h[slot] Wd[e]^T (+ lr) over K slice pid 1, e = ids[slot]; ATOMIC
    (split K): fp32 atomics into y that prepare_x zeroed; HAS_LR: the compensator term, added by the first K slice and
    computed before the weight stream."""
    after_previous(PDL)
    slot = tl.program_id(2)
    n0 = tl.program_id(0) * 2 * BLOCK_N
    e = tl.load(ids_ptr + slot).to(tl.int32)
    lr = ()
    for j in tl.static_range(2):
        offs = n0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_LR:
            if tl.program_id(1) == 0:
                part = _one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, D, offs, offs < D, slot, R, BLOCK_N, BLOCK_R,
                                         INTERPRET)
        lr = lr + (part,)
    step0 = tl.program_id(1) * per_split
    parts = _tma_gemv(hw_ptr, slot, steps, w_desc, s_desc, z_desc, e * D + n0, 0, step0,
                      tl.minimum(step0 + per_split, steps), plane, exp_bits, BITS, BLOCK_N, G, False, HALF, STAGES,
                      INTERPRET)
    for j in tl.static_range(2):
        offs = n0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        if ATOMIC:
            tl.atomic_add(y_ptr + slot * D + offs, parts[j] + lr[j], mask=offs < D, sem="relaxed")
        else:
            tl.store(y_ptr + slot * D + offs, parts[j] + lr[j], mask=offs < D)


def tma_experts(bits: int, group: int, device: torch.device) -> bool:
    """Whether experts can take the one-token TMA kernels at all: group 64 and TMA (Hopper, or the interpreter); at
    2/4/8 bits a step's words are a power of two, at 3 bits those of each plane."""
    return (bits in (2, 3, 4, 8) and group == 64
            and (triton_interpreting() or (device.type == "cuda" and hopper(device))))


def tma_one_token(cfg: dict, p: StackedLowbit, routing, device: torch.device) -> bool:
    """Whether a projection runs its TMA kernel (_gate_up_tma_kernel, _down_tma_kernel): config TMA, one token in
    slot order, experts tma_experts takes, steps of whole 16-byte scale rows (BLOCK_K >= 8 groups, rows of
    groups % 8 == 0) and of at most 256 columns, and (3 bits) 16-byte planes (units % 4 == 0)."""
    return bool(cfg.get("TMA") and isinstance(routing, torch.Tensor) and routing.shape[0] == 1
                and cfg["BLOCK_K"] >= 8 * p.group and step_columns(cfg, p.bits) <= 256  # TMA box rows: <= 256
                and p.scale.shape[-1] % 8 == 0 and cfg["BLOCK_K"] <= p.in_features
                and (p.bits != 3 or planes(p) % 4 == 0)
                and tma_experts(p.bits, p.group, device))


def step_columns(cfg: dict, bits: int) -> int:
    """Packed columns (words, or 3-bit units) in a step of cfg's BLOCK_K inputs: a TMA block's width in words."""
    return cfg["BLOCK_K"] // values_per_column(bits)


def tma_descriptors(p: StackedLowbit, cfg: dict, pairs: bool) -> tuple:
    """TMA descriptors (_tma_block) of the stacked words [E * N, words] in [2 BLOCK_N, step_columns] blocks and of the
    scales and zeros [E * N, groups] in [2 BLOCK_N, BLOCK_K / group]; pairs (gate_up): 3-D, [E * 2, N / 2, ..] in
    [2, BLOCK_N, ..] blocks (BLOCK_N gate rows and their up rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # TMA only; not in every Triton

    E, N, _ = p.qweight.shape
    bn = cfg["BLOCK_N"]
    rows = (E * 2, N // 2) if pairs else (E * N,)
    block = [2, bn] if pairs else [2 * bn]
    words, groups = step_columns(cfg, p.bits), cfg["BLOCK_K"] // p.group
    return tuple(TensorDescriptor.from_tensor(t.view(*rows, t.shape[-1]), block + [width])
                 for t, width in ((p.qweight, words), (p.scale, groups), (p.zero, groups)))


def tma_constexprs(p: StackedLowbit, cfg: dict, tile: dict, has_lr: bool) -> dict:
    """The compile-time arguments (and warps) both one-token TMA kernels take, from the config and tile_constexprs."""
    return dict(HAS_LR=has_lr, BLOCK_R=cfg.get("BLOCK_R", 32), BITS=p.bits, BLOCK_N=cfg["BLOCK_N"],
                G=cfg["BLOCK_K"] // p.group, HALF=tile["HALF"], STAGES=cfg.get("num_stages", 3),
                INTERPRET=tile["INTERPRET"], num_warps=cfg["num_warps"])


def planes(p: StackedLowbit) -> int:
    """Words between the planes of a 3-bit row (pack.py), 0 at other widths."""
    return p.qweight.shape[-1] // 3 if p.bits == 3 else 0


def launch_gate_up_tma(x: torch.Tensor, p: StackedLowbit, h: torch.Tensor, ids: torch.Tensor, cfg: dict,
                       prepared: torch.Tensor | None = None) -> None:
    """_gate_up_tma_kernel for one token x [1, D] -> h [k, F] (tma_one_token said yes); prepared: x prepared already
    (x_preparation)."""
    F = p.qweight.shape[1] // 2
    tile = tile_constexprs(cfg, p.bits, p.group, 1, x.dtype, False)
    xw, exp = kernel_inputs(x, tile, prepared=prepared)
    lr = p.low_rank_inputs(x, ids)
    u, xv, R = low_rank_args(lr, h)
    _gate_up_tma_kernel[(triton.cdiv(F, cfg["BLOCK_N"]), 1, ids.numel())](
        xw, *tma_descriptors(p, cfg, pairs=True), ids, h, u, xv, F, triton.cdiv(p.in_features, cfg["BLOCK_K"]),
        planes(p), R, xv.stride(0), exp, **tma_constexprs(p, cfg, tile, lr is not None), **dependent_launch(x.device))


def launch_down_tma(h: torch.Tensor, p: StackedLowbit, y: torch.Tensor, ids: torch.Tensor, cfg: dict) -> None:
    """_down_tma_kernel for one token's h [k, F] -> y [k, D] fp32 (tma_one_token said yes); cfg SPLIT_K slices of
    the F steps (fp32 atomics into y, zeroed by prepare_x), programs of 2 BLOCK_N rows."""
    D = p.qweight.shape[1]
    tile = tile_constexprs(cfg, p.bits, p.group, 1, h.dtype, False)
    steps = triton.cdiv(p.in_features, cfg["BLOCK_K"])
    per_split = triton.cdiv(steps, min(cfg["SPLIT_K"], steps))
    split = triton.cdiv(steps, per_split)
    hw, exp = kernel_inputs(h, tile, y if split > 1 else None)
    lr = p.low_rank_inputs(h, ids)
    u, xv, R = low_rank_args(lr, y)
    _down_tma_kernel[(triton.cdiv(D, 2 * cfg["BLOCK_N"]), split, ids.numel())](
        hw, *tma_descriptors(p, cfg, pairs=False), ids, y, u, xv, D, steps, per_split, planes(p), R, xv.stride(0), exp,
        ATOMIC=split > 1, **tma_constexprs(p, cfg, tile, lr is not None), **dependent_launch(h.device))


def launch_gate_up(x: torch.Tensor, p: StackedLowbit, h: torch.Tensor, routing, cfg: dict,
                   prepared: torch.Tensor | None = None) -> None:
    """h = silu(x Wg^T) * (x Wu^T) per expert row: routing a RoutingTable (x and h expert-sorted) or the expert ids
    [T, k] (x the T tokens, h [T*k, F] in slot order); prepared: x prepared already (x_preparation)."""
    if tma_one_token(cfg, p, routing, x.device):
        launch_gate_up_tma(x, p, h, routing, cfg, prepared)
        return
    E, two_f, _ = p.qweight.shape
    F = two_f // 2
    lr = p.low_rank_inputs(x)
    u, xv, R = low_rank_args(lr, h)
    route = route_args(routing, x.shape[0], h, E)
    T = routed_tokens(routing)
    tile = tile_constexprs(cfg, p.bits, p.group, T, x.dtype, lr is not None)
    xk, exp = kernel_inputs(x, tile, prepared=prepared)
    _gate_up_kernel[(triton.cdiv(F, cfg["BLOCK_N"]), 1, route.pop("programs"))](
        xk, p.qweight, p.scale, p.zero, h, u, xv, route.pop("a"), route.pop("b"), route.pop("rows"), F,
        p.in_features, R, xv.stride(0), p.qweight.shape[-1], p.scale.shape[-1],
        exp, h.shape[0] // T, PAIRED=bool(cfg.get("PAIRED", 0)), **route, **tile,
        **dependent_launch(x.device))  # h [T*k, F]: top_k


def experts_config(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, tokens: int, top_k: int) -> dict:
    """The launch configs ({"gate_up": cfg, "down": cfg}) for `tokens` tokens on x's device (configs.py)."""
    name = gpu_name(x.device.index or 0) if x.is_cuda else "cpu"
    E, two_f, D = gate_up.qweight.shape[0], gate_up.qweight.shape[1], gate_up.in_features
    return lowbit_moe_config(name, gate_up.bits, E, D, two_f // 2, tokens, top_k,
                             gate_up.u is not None or down.u is not None)


def x_preparation(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, top_k: int,
                  config: dict | None = None) -> Preparation | None:
    """How gate_up will read the tokens x [T, D] in slot order (lowbit_experts with expert ids): prepared as this
    says (another launch may do it and pass it in as prepared_x), or None (x itself, for tensor-core tiles)."""
    T = x.shape[0]
    config = config or experts_config(x, gate_up, down, T, top_k)
    return Preparation.of(tile_constexprs(config["gate_up"], gate_up.bits, gate_up.group, T, x.dtype,
                                          False))  # compensators change nothing x is read as


def lowbit_experts(x: torch.Tensor, gate_up: StackedLowbit, down: StackedLowbit, routing,
                   config: dict | None = None, prepared_x: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' outputs before gate weighting, [T*k, D] float32: routing a RoutingTable (x [T*k, D] its
    expert-sorted rows, outputs in that order) or the expert ids [T, k] (x [T, D] the tokens, outputs in slot order
    t * k + j: no routing table and no gather; prepared_x: x prepared already, as x_preparation says)."""
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
    launch_gate_up(x, gate_up, h, routing, config["gate_up"], prepared_x)
    y = torch.empty(n, D, dtype=torch.float32, device=x.device)  # [T*k, D] launch zeroes it
    if tma_one_token(config["down"], down, routing, x.device):
        launch_down_tma(h, down, y, routing, config["down"])
    else:
        launch(h, down.qweight, down.scale, down.zero, y, down.bits, down.group, F, config["down"], T, E,
               lowrank=down.low_rank_inputs(h), routing=routing)
    return y
