"""The one-token GEMV fed by TMA (jit code only): words, scales and zeros come by TMA descriptor loads pipelined
through shared memory, STAGES deep, instead of register prefetch (which holds about one step in flight per program
and waits on it). A program owns two blocks of BLOCK_N rows (gate_up's gate rows and their up rows through a 3-D box,
or down's 2 BLOCK_N rows), loaded as one box per 3-bit plane, scales and zeros, and split in registers; the sums are
gemv.py's."""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.lowbit.gemv import gemv_step, group_cols, x_step_ptrs
from moeserve.kernels.triton.lowbit.tiles import low_rank_tile


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
def tma_gemv(xw_ptr, x_row, steps, w_desc, s_desc, z_desc, row, n0, step0, step1, plane, exp_bits,
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
def one_row_low_rank(u_ptr, xv_ptr, xv_stride, e, rows_per_expert, offs, n_mask, x_row, R, BLOCK_N: tl.constexpr,
                     BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr):
    """(x V^T) U^T of expert e for outputs offs [BLOCK_N] of one row x_row of x: [BLOCK_N] fp32 (low_rank_tile on CUDA
    cores; U stacked [E, rows_per_expert, R], x V_all^T [rows, E * R])."""
    lr = low_rank_tile(u_ptr + e.to(tl.int64) * rows_per_expert * R, xv_ptr + e * R, xv_stride, offs, n_mask,
                       tl.full((1,), 0, tl.int32) + x_row, tl.full((1,), True, tl.int1), R, False, "ieee", BLOCK_N, 1,
                       BLOCK_R, INTERPRET)  # [BLOCK_N, 1]
    return tl.reshape(lr, (BLOCK_N,))
