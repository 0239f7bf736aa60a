"""The low-bit kernels' entry points (jit code only; launch.py launches them).

    lowbit_kernel       y[rows, N] (+)= x[rows, K] dequant(W[e])^T (+ low rank): a dense layer, or the MoE's down
    gate_up_kernel      h[rows] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u): the MoE's gate/up, stacked [E, 2F, ..]
                        (optional biases and GPT-OSS's clamped SwiGLU)
    gate_up_tma_kernel  gate_up for one token through TMA (tma.py)
    down_tma_kernel     down for one token through TMA
    prepare_x_kernel    x prepared for the CUDA-core GEMV (prepare.py)

Grid (output block, K slice, expert | row block); each program finds its rows with rows.py (no host sync) and loops
over them BLOCK_M at a time. SPLIT_K > 1 accumulates with fp32 atomics into an output that the launch zeroes (with
prepare_x on CUDA cores). An optional low-rank compensator adds (x V^T) U^T in the first K slice, computed before the
weight stream: after it, its live values crowd the stream's registers (and spill).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.last_arrival import combine_partials
from moeserve.kernels.triton.lowbit.prepare import prepare_step, prepare_when_stored
from moeserve.kernels.triton.lowbit.tiles import low_rank_tile, tile_product
from moeserve.kernels.triton.lowbit.tma import one_row_low_rank, tma_gemv
from moeserve.kernels.triton.pdl import after_previous
from moeserve.kernels.triton.rows import ROUTE_SLOTS, expert_rows, tile_rows
from moeserve.kernels.triton.swiglu import activation, bias_row, silu_mul


@triton.jit
def lowbit_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, u_ptr, xv_ptr, bias_ptr, route_a, route_b, out_ptr, gw_ptr,
                  count_ptr, M, N, K, R, xv_stride, words_per_row, groups_per_row, steps_per_split, exp_bits,
                  BITS: tl.constexpr, GROUP: tl.constexpr, ROUTE: tl.constexpr, NSLOTS: tl.constexpr,
                  USE_DOT: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                  COMBINE: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  AHEAD: tl.constexpr, SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr,
                  INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """y[rows, N] (+)= x[rows, K] dequant(W[e])^T (+ low rank) (+ bias[e], HAS_BIAS: stacked [E, N], added by the
    first K slice), over (N block, K slice, row block | expert). COMBINE (one token, slot order): y is the partial
    sums [K slices, M, N] and the last program of each N block writes out[n] = sum_j gw[j] y[.., j, n]
    (last_arrival.combine_partials: the weighted combine in this launch)."""
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # values per column: a 3-bit unit or a word
    C: tl.constexpr = BLOCK_K // VPC
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    start, end, e, match, rank = expert_rows(tl.program_id(2), route_a, route_b, M, ROUTE, BLOCK_M, NSLOTS)
    step0 = tl.program_id(1) * steps_per_split
    step1 = tl.minimum(step0 + steps_per_split, tl.cdiv(K, BLOCK_K))
    for row0 in range(start, end, BLOCK_M):  # an expert's rows, BLOCK_M at a time (a loop: no host sync)
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE, BLOCK_M, NSLOTS)
        lr = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if HAS_LR:  # before the weight stream (see the module docstring)
            if tl.program_id(1) == 0:
                lr = low_rank_tile(u_ptr + e * N * R, xv_ptr + e * R, xv_stride, offs_n, n_mask, rows, r_mask, R,
                                   USE_DOT, PRECISION, BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        if HAS_BIAS:
            if tl.program_id(1) == 0:
                lr += bias_row(bias_ptr + e * N, offs_n, n_mask, HAS_BIAS)[:, None]
        acc = tile_product(x_ptr, rows, r_mask, w_ptr + e * N * words_per_row, s_ptr + e * N * groups_per_row,
                           z_ptr + e * N * groups_per_row, tl.program_id(0) * BLOCK_N, N, step0, step1, K,
                           words_per_row, groups_per_row, exp_bits, BITS, GROUP, USE_DOT, PRECISION, BLOCK_N, BLOCK_M,
                           C, VPC, AHEAD, SUB, PIPE, HALF, INTERPRET) + lr
        if COMBINE:  # this K slice's partial sums
            rows = rows + tl.program_id(1) * M
        y = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
        mask = n_mask[:, None] & r_mask[None, :]
        if ATOMIC:
            tl.atomic_add(y, acc, mask=mask, sem="relaxed")
        else:
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    if COMBINE:
        combine_partials(y_ptr, out_ptr, gw_ptr, count_ptr + tl.program_id(0), offs_n, n_mask, M, tl.num_programs(1),
                         N)


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, u_ptr, xv_ptr, bias_ptr, route_a, route_b, hw_ptr, count_ptr,
                   M, F, K, R, xv_stride, words_per_row, groups_per_row, exp_bits, top_k, alpha, limit, h_steps,
                   BITS: tl.constexpr, GROUP: tl.constexpr, ROUTE: tl.constexpr, NSLOTS: tl.constexpr,
                   USE_DOT: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, AHEAD: tl.constexpr,
                   SUB: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
                   PAIRED: tl.constexpr, PREP_H: tl.constexpr, H_CPS: tl.constexpr, H_HALF: tl.constexpr,
                   H_LOG2_LIMIT: tl.constexpr, PDL: tl.constexpr):
    """h[rows, n0 : n0 + BLOCK_N] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u), over (output block, 1, expert |
    slot); weights stacked [E, 2F, ..] (an expert's gate rows, then its up rows). PAIRED: the gate rows and their up
    rows stream through one load pipeline (a tile of 2 BLOCK_N rows); else the gate rows, then the up rows.
    HAS_BIAS: each expert's biases [E, 2F] join the sums; CLAMPED: GPT-OSS's clamped SwiGLU (alpha, limit).
    PREP_H (one row per program: one token): h is also prepared for down's CUDA-core GEMV into hw_ptr [rows, h_steps,
    .., H_CPS] (prepare_when_stored), by the program that stores a step's last outputs."""
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    C: tl.constexpr = BLOCK_K // VPC
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    start, end, e, match, rank = expert_rows(tl.program_id(2), route_a, route_b, M, ROUTE, BLOCK_M, NSLOTS)
    w_base = w_ptr + e * 2 * F * words_per_row  # expert e: [2F, words]
    s_base, z_base = s_ptr + e * 2 * F * groups_per_row, z_ptr + e * 2 * F * groups_per_row
    steps = tl.cdiv(K, BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        rows, r_mask = tile_rows(row0, end, match, rank, ROUTE, BLOCK_M, NSLOTS)  # rows of h
        x_rows = rows // top_k if ROUTE >= ROUTE_SLOTS else rows  # slot order: slot t * k + j reads token t
        lr_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        lr_u = lr_g
        if HAS_LR:  # before the weight stream (see the module docstring)
            lr_base, xv_e = u_ptr + e * 2 * F * R, xv_ptr + e * R
            lr_g = low_rank_tile(lr_base, xv_e, xv_stride, offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                                 BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
            lr_u = low_rank_tile(lr_base, xv_e, xv_stride, F + offs_n, n_mask, x_rows, r_mask, R, USE_DOT, PRECISION,
                                 BLOCK_N, BLOCK_M, BLOCK_R, INTERPRET)
        if HAS_BIAS:
            lr_g += bias_row(bias_ptr + e * 2 * F, offs_n, n_mask, HAS_BIAS)[:, None]
            lr_u += bias_row(bias_ptr + e * 2 * F + F, offs_n, n_mask, HAS_BIAS)[:, None]
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
        h = activation(g + lr_g, u + lr_u, alpha, limit, CLAMPED)  # [BLOCK_N, BLOCK_M]
        tl.store(h_ptr + rows[None, :].to(tl.int64) * F + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])
        if PREP_H:
            m = tl.max(rows, axis=0)  # the one row
            prepare_when_stored(h_ptr + m.to(tl.int64) * F, hw_ptr, m, count_ptr, n0, F, h_steps, BLOCK_N, BITS, VPC,
                                H_CPS, H_HALF, H_LOG2_LIMIT)


@triton.jit
def gate_up_tma_kernel(xw_ptr, w_desc, s_desc, z_desc, ids_ptr, h_ptr, u_ptr, xv_ptr, hw_ptr, count_ptr, F, steps,
                       plane, R, xv_stride, exp_bits, h_steps, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                       G: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
                       HAS_LR: tl.constexpr, BLOCK_R: tl.constexpr, PREP_H: tl.constexpr, H_CPS: tl.constexpr,
                       H_HALF: tl.constexpr, H_LOG2_LIMIT: tl.constexpr, PDL: tl.constexpr):
    """One token: h[slot, n0 : n0 + BLOCK_N] = silu(x Wg[e]^T + lr_g) * (x Wu[e]^T + lr_u), e = ids[slot] (grid axis
    2: the k slots, distinct experts); the gate rows and their up rows come in the same TMA blocks (_tma_block
    PAIRS); HAS_LR: the compensator terms, computed before the weight stream; PREP_H: h also prepared for down
    (gate_up_kernel's)."""
    after_previous(PDL)
    VPC: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # values per column (PREP_H)
    slot = tl.program_id(2)
    n0 = tl.program_id(0) * BLOCK_N
    e = tl.load(ids_ptr + slot).to(tl.int32)
    offs = n0 + tl.arange(0, BLOCK_N)
    lr_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lr_u = lr_g
    if HAS_LR:
        lr_g = one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, 2 * F, offs, offs < F, 0, R, BLOCK_N, BLOCK_R, INTERPRET)
        lr_u = one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, 2 * F, F + offs, offs < F, 0, R, BLOCK_N, BLOCK_R,
                                INTERPRET)
    g, u = tma_gemv(xw_ptr, 0, steps, w_desc, s_desc, z_desc, 2 * e, n0, 0, steps, plane, exp_bits, BITS, BLOCK_N,
                    G, True, HALF, STAGES, INTERPRET)
    tl.store(h_ptr + slot * F + offs, silu_mul(g + lr_g, u + lr_u).to(h_ptr.dtype.element_ty), mask=offs < F)
    if PREP_H:
        prepare_when_stored(h_ptr + slot * F, hw_ptr, slot, count_ptr, n0, F, h_steps, BLOCK_N, BITS, VPC, H_CPS,
                            H_HALF, H_LOG2_LIMIT)


@triton.jit
def down_tma_kernel(hw_ptr, w_desc, s_desc, z_desc, ids_ptr, y_ptr, u_ptr, xv_ptr, out_ptr, gw_ptr, count_ptr, D,
                    steps, per_split, plane, R, xv_stride, exp_bits, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    G: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
                    ATOMIC: tl.constexpr, COMBINE: tl.constexpr, HAS_LR: tl.constexpr, BLOCK_R: tl.constexpr,
                    PDL: tl.constexpr):
    """One token: y[slot, n0 : n0 + 2 BLOCK_N] (+)= h[slot] Wd[e]^T (+ lr) over K slice pid 1, e = ids[slot]; ATOMIC
    (split K): fp32 atomics into y that prepare_x zeroed; HAS_LR: the compensator term, added by the first K slice and
    computed before the weight stream. COMBINE: y is the partial sums [K slices, k, D] and the last program of each
    output block writes the weighted combine into out (lowbit_kernel's)."""
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
                part = one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, D, offs, offs < D, slot, R, BLOCK_N, BLOCK_R,
                                        INTERPRET)
        lr = lr + (part,)
    step0 = tl.program_id(1) * per_split
    parts = tma_gemv(hw_ptr, slot, steps, w_desc, s_desc, z_desc, e * D + n0, 0, step0,
                     tl.minimum(step0 + per_split, steps), plane, exp_bits, BITS, BLOCK_N, G, False, HALF, STAGES,
                     INTERPRET)
    row = slot + tl.program_id(1) * tl.num_programs(2) if COMBINE else slot  # COMBINE: this K slice's partials
    for j in tl.static_range(2):
        offs = n0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        if ATOMIC:
            tl.atomic_add(y_ptr + row * D + offs, parts[j] + lr[j], mask=offs < D, sem="relaxed")
        else:
            tl.store(y_ptr + row * D + offs, parts[j] + lr[j], mask=offs < D)
    if COMBINE:
        offs = n0 + tl.arange(0, 2 * BLOCK_N)
        combine_partials(y_ptr, out_ptr, gw_ptr, count_ptr + tl.program_id(0), offs, offs < D, tl.num_programs(2),
                         tl.num_programs(1), D)


@triton.jit
def prepare_x_kernel(x_ptr, xw_ptr, K, cols, fill_ptr, fill_n, BITS: tl.constexpr, VPC: tl.constexpr,
                     CPS: tl.constexpr, HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr, FILL: tl.constexpr,
                     PDL: tl.constexpr):
    """Step pid 0 of row pid 1 (prepare_step). FILL: each program also zeroes its share of fill_ptr's fill_n fp32
    values (the GEMV's split-K target), which saves the separate fill launch: at one row that launch costs as much
    as a tenth of the GEMV."""
    after_previous(PDL)
    if FILL:
        FILL_BLOCK: tl.constexpr = 256
        programs = tl.num_programs(0) * tl.num_programs(1)
        share = tl.cdiv(tl.cdiv(fill_n, programs), FILL_BLOCK) * FILL_BLOCK
        first = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * share
        for i0 in range(first, tl.minimum(first + share, fill_n), FILL_BLOCK):
            i = i0 + tl.arange(0, FILL_BLOCK)  # [FILL_BLOCK]
            tl.store(fill_ptr + i, tl.zeros((FILL_BLOCK,), dtype=tl.float32), mask=i < fill_n)
    m = tl.program_id(1)
    prepare_step(x_ptr + m.to(tl.int64) * K, xw_ptr, m, tl.num_programs(0), tl.program_id(0), cols, BITS, VPC, CPS,
                 HALF, LOG2_LIMIT)
