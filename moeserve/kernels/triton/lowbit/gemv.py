"""The CUDA-core GEMV of the low-bit kernels (jit code only): one to eight rows of x against BLOCK_N packed weight
rows, a step of whole groups at a time.

The weight rows are SUB interleaved sub-tiles, each [BLOCK_N / SUB, groups, columns per group], so words load as
vectors of a group's columns and scale/zero once per (row, group), in the tile's layout (keep a sub-tile's rows *
groups per step below the thread count, or Triton converts the tile through shared memory). x comes prepared per
step (prepare.py: the inputs of each value slot side by side, plus each column's sum of x), so its loads are vectors
at constant offsets, one per thread for all SUB sub-tiles (L1 bandwidth bounds this loop), and
acc += s * (sum_i f_i x_i - (z + 2^bits) * sum x) needs no per-value zero term. Each code is decoded once for all
rows of x. Nothing in the loop is masked (rows and groups clamped, x zero-padded); the next AHEAD steps' words and
scale/zero are loaded before this step's arithmetic, or (config PIPE) the words go through PIPE shared-memory stages
(cp.async) and only scale/zero are loaded ahead. HALF (16-bit x): the same sums on fp16 pairs, two codes per shift +
LOP3 and one HFMA2 per two values, x scaled per step by a power of two so the fp16 sums cannot overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.lowbit.codes import (column_words, hfma2, interleave, pair_sum, plane_stride, slot_code,
                                                  slot_pair)


@triton.jit
def group_cols(g, CPG: tl.constexpr):
    """The columns of groups g [G]: [G, CPG]."""
    return g[:, None] * CPG + tl.arange(0, CPG)[None, :]


@triton.jit
def _step_groups(step, last, G: tl.constexpr):
    """The G groups of step `step`, clamped to the last (`last`): [G]."""
    return tl.minimum(step * G + tl.arange(0, G), last)


@triton.jit
def _word_loads(tiles, plane, step, last, G: tl.constexpr, CPG: tl.constexpr, BITS: tl.constexpr,
                SUB: tl.constexpr):
    """The packed words step `step` reads from HBM, per sub-tile: one [ROWS, G, CPG] tile of words (vector loads),
    three at 3 bits (a unit's stored words, one per plane, `plane` words apart). A tuple of SUB stored-word tuples.
    No mask: rows come clamped."""
    groups = _step_groups(step, last, G)  # [G]
    out = ()
    for j in tl.static_range(SUB):
        ptr = tiles[j][0][:, None, None] + group_cols(groups, CPG)[None, :, :]  # [ROWS, G, CPG]
        if BITS == 3:
            out = out + ((tl.load(ptr), tl.load(ptr + plane), tl.load(ptr + 2 * plane)),)
        else:
            out = out + ((tl.load(ptr),),)
    return out


@triton.jit
def _scale_loads(tiles, s_ptr, z_ptr, step, last, G: tl.constexpr, SUB: tl.constexpr):
    """Scale/zero of step `step`'s groups, per sub-tile: a tuple of SUB (scale, zero) [ROWS, G, 1] fp16, loaded in
    the word tile's layout."""
    g = _step_groups(step, last, G)[None, :, None]
    out = ()
    for j in tl.static_range(SUB):
        sz = tiles[j][1][:, None, None] + g
        out = out + ((tl.load(s_ptr + sz), tl.load(z_ptr + sz)),)
    return out


@triton.jit
def _step_loads(tiles, plane, s_ptr, z_ptr, step, last, G: tl.constexpr, CPG: tl.constexpr, BITS: tl.constexpr,
                SUB: tl.constexpr):
    """Everything step `step` reads from HBM: (_word_loads, _scale_loads)."""
    return (_word_loads(tiles, plane, step, last, G, CPG, BITS, SUB),
            _scale_loads(tiles, s_ptr, z_ptr, step, last, G, SUB))


@triton.jit
def weight_rows(n0, n_end, v, TILE_N: tl.constexpr, PAIRED: tl.constexpr):
    """The weight rows of tile rows v [..]: n0 + v, or (PAIRED: a stacked gate/up weight [2 n_end, K], one pipeline
    for both) n0 + v of the gate half for v < TILE_N / 2 and n0 + v - TILE_N / 2 of the up half after. Returns
    (rows clamped in range [..] int64, in-range mask): the clamped rows' sums are never stored."""
    if PAIRED:
        local = n0 + v % (TILE_N // 2)
        second = (v >= TILE_N // 2).to(tl.int64) * n_end
    else:
        local = n0 + v
        second = 0
    return tl.minimum(local, n_end - 1).to(tl.int64) + second, local < n_end


@triton.jit
def _sub_tiles(w_base, n0, n_end, words_per_row, groups_per_row, ROWS: tl.constexpr, SUB: tl.constexpr,
               PAIRED: tl.constexpr):
    """Sub-tile j holds tile rows j + SUB * i (i < ROWS), weight rows by weight_rows: a tuple of SUB (word pointers
    [ROWS], group offsets [ROWS])."""
    tiles = ()
    for j in tl.static_range(SUB):
        n, _ = weight_rows(n0, n_end, j + SUB * tl.arange(0, ROWS), ROWS * SUB, PAIRED)
        tiles = tiles + ((w_base + n * words_per_row, n * groups_per_row),)
    return tiles


@triton.jit
def _step_sums(acc, units, scales, x_steps, col, exp, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
               SUB: tl.constexpr, M: tl.constexpr):
    """acc (tuple M * SUB of [ROWS, G, CPG]) + one step: s * (sum (2^BITS + q) x - (z + 2^BITS) * sum x) per column,
    units[j] the decode words (column_words) of sub-tile j.
    Each code is decoded once for all M rows of x, each x load serves all SUB sub-tiles: x of slot i of column c is
    x_steps[m][i * CPS + c] of this step's prepared x, a constant offset from one address."""
    qx = ()
    for _ in tl.static_range(M * SUB):
        qx = qx + (tl.zeros(acc[0].shape, dtype=tl.float32),)
    for i in tl.static_range(VPC):
        codes = ()
        for j in tl.static_range(SUB):
            codes = codes + (slot_code(units[j], exp, i, BITS),)
        new = ()
        for m in tl.static_range(M):
            x = tl.load(x_steps[m] + i * CPS + col)[None, :, :]  # [1, G, CPG] fp32
            for j in tl.static_range(SUB):
                new = new + (qx[m * SUB + j] + codes[j] * x,)
        qx = new
    new = ()
    for m in tl.static_range(M):
        xs = tl.load(x_steps[m] + VPC * CPS + col)[None, :, :]  # [1, G, CPG] sum of each column's x
        for j in tl.static_range(SUB):
            s, z = scales[j][0].to(tl.float32), scales[j][1].to(tl.float32)
            new = new + (acc[m * SUB + j] + s * (qx[m * SUB + j] - (z + (1 << BITS)) * xs),)  # 2^BITS extra per value
    return new


@triton.jit
def _half_step_sums(acc, units, scales, x_steps, col, exp2, BITS: tl.constexpr, VPC: tl.constexpr,
                    CPS: tl.constexpr, SUB: tl.constexpr, M: tl.constexpr, INTERPRET: tl.constexpr):
    """_step_sums on fp16 pairs: per column, sum (2^BITS + q) x over its VPC / 2 value pairs with one HFMA2 per
    pair into an fp16 pair (the prepared x is scaled per step so that it cannot overflow), then in fp32
    s / r * (that pair's two halves - (z + 2^BITS) * sum x), r the step's x scale. Half the FMAs of _step_sums
    and one shift + LOP3 per two values."""
    PAIRS: tl.constexpr = VPC // 2
    qx = ()
    for _ in tl.static_range(M * SUB):
        qx = qx + (tl.zeros(acc[0].shape, dtype=tl.int32),)  # fp16 pair (0, 0)
    for p in tl.static_range(PAIRS):
        codes = ()
        for j in tl.static_range(SUB):
            codes = codes + (slot_pair(units[j], exp2, p, BITS),)
        new = ()
        for m in tl.static_range(M):
            x = tl.load(x_steps[m] + p * CPS + col)[None, :, :]  # [1, G, CPG] fp16 pairs
            for j in tl.static_range(SUB):
                new = new + (hfma2(codes[j], x, qx[m * SUB + j], INTERPRET),)
        qx = new
    new = ()
    for m in tl.static_range(M):
        xs = tl.load(x_steps[m] + PAIRS * CPS + col).to(tl.float32, bitcast=True)[None, :, :]  # [1, G, CPG] sum x
        inv_r = tl.load(x_steps[m] + (PAIRS + 1) * CPS).to(tl.float32, bitcast=True)  # the step's 1 / scale
        for j in tl.static_range(SUB):
            s, z = scales[j][0].to(tl.float32) * inv_r, scales[j][1].to(tl.float32)
            new = new + (acc[m * SUB + j] + s * (pair_sum(qx[m * SUB + j], INTERPRET) - (z + (1 << BITS)) * xs),)
    return new


@triton.jit
def x_step_ptrs(x_rows, step, XSLOTS: tl.constexpr, CPS: tl.constexpr, M: tl.constexpr):
    """This step's prepared x of each of the M rows: a tuple of M pointers."""
    x_steps = ()
    for m in tl.static_range(M):
        x_steps = x_steps + (x_rows[m] + step * XSLOTS * CPS,)
    return x_steps


@triton.jit
def gemv_step(acc, words, scales, x_steps, col, exp, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
              SUB: tl.constexpr, M: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """One step of the GEMV (words: each sub-tile's stored words): on fp16 pairs (HALF) or in fp32."""
    units = ()
    for j in tl.static_range(SUB):
        units = units + (column_words(words[j], BITS),)
    if HALF:
        acc = _half_step_sums(acc, units, scales, x_steps, col, exp, BITS, VPC, CPS, SUB, M, INTERPRET)
    else:
        acc = _step_sums(acc, units, scales, x_steps, col, exp, BITS, VPC, CPS, SUB, M)
    return acc


@triton.jit
def gemv(xw_ptr, x_rows, w_base, s_ptr, z_ptr, n0, n_end, step0, step1, steps, words_per_row, groups_per_row,
         exp, BITS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, CPG: tl.constexpr, VPC: tl.constexpr,
         AHEAD: tl.constexpr, SUB: tl.constexpr, M: tl.constexpr, PIPE: tl.constexpr, HALF: tl.constexpr,
         INTERPRET: tl.constexpr, PAIRED: tl.constexpr):
    """Rows x_rows [M] of x (all in range: masked rows repeat a real one) times steps [step0, step1) of BLOCK_N weight
    rows from n0 (weight_rows), on CUDA cores, a step = G whole groups of CPG columns: [BLOCK_N, M] fp32.

    xw_ptr: the prepared x [rows, steps, XSLOTS, G * CPG] (prepare_x, zero past the last column). Per column
    s * (sum (2^BITS + q) x - (z + 2^BITS) * sum x), scale/zero loaded once per (row, group). Nothing is masked:
    weight rows, x rows and groups are clamped in range and the zero x past the end cancels what they read.
    The weight rows are SUB interleaved sub-tiles of BLOCK_N / SUB: each thread works on one row of every sub-tile, so
    x, which every row reads, is loaded once per SUB rows (L1 bandwidth, not HBM, bounds this loop), while each
    sub-tile keeps the layout in which its scale/zero load needs no shared-memory conversion. Each code is decoded
    once for the M rows of x.
    Loads in flight: PIPE = 0 loads the next AHEAD steps' words and scale/zero into registers before this step's
    arithmetic (AHEAD + 1 steps in flight per thread: without it every step would wait a full HBM latency for its
    scales); PIPE > 1 leaves the words to Triton's pipeliner, PIPE stages through shared memory (cp.async, fewer
    registers), and loads the 2-byte scale/zero, too small for cp.async, one step ahead into registers."""
    ROWS: tl.constexpr = BLOCK_N // SUB
    CPS: tl.constexpr = G * CPG  # columns per step
    XSLOTS: tl.constexpr = VPC // 2 + 2 if HALF else VPC + 1  # prepared x per column and step (x_slots)
    col = group_cols(tl.arange(0, G), CPG)  # [G, CPG] columns within a step
    last = groups_per_row - 1
    tiles = _sub_tiles(w_base, n0, n_end, words_per_row, groups_per_row, ROWS, SUB, PAIRED)
    plane = plane_stride(words_per_row, CPG)  # 3 bits
    x_row_ptrs = ()
    acc = ()
    for m in tl.static_range(M):
        row = tl.sum(tl.where(tl.arange(0, M) == m, x_rows, 0), axis=0).to(tl.int64)  # x_rows[m]
        x_row_ptrs = x_row_ptrs + (xw_ptr + row * steps * XSLOTS * CPS,)
        for j in tl.static_range(SUB):
            acc = acc + (tl.zeros((ROWS, G, CPG), dtype=tl.float32),)
    if PIPE > 1:
        scales = _scale_loads(tiles, s_ptr, z_ptr, step0, last, G, SUB)
        for step in tl.range(step0, step1, num_stages=PIPE):
            words = _word_loads(tiles, plane, step, last, G, CPG, BITS, SUB)
            cur = scales
            scales = _scale_loads(tiles, s_ptr, z_ptr, step + 1, last, G, SUB)
            acc = gemv_step(acc, words, cur, x_step_ptrs(x_row_ptrs, step, XSLOTS, CPS, M), col, exp, BITS, VPC, CPS,
                            SUB, M, HALF, INTERPRET)
    else:
        nxt = _step_loads(tiles, plane, s_ptr, z_ptr, step0, last, G, CPG, BITS, SUB)
        if AHEAD == 2:
            nxt2 = _step_loads(tiles, plane, s_ptr, z_ptr, step0 + 1, last, G, CPG, BITS, SUB)
        for step in range(step0, step1):
            cur = nxt
            fresh = _step_loads(tiles, plane, s_ptr, z_ptr, step + AHEAD, last, G, CPG, BITS, SUB)  # in flight from now
            if AHEAD == 2:
                nxt, nxt2 = nxt2, fresh
            else:
                nxt = fresh
            acc = gemv_step(acc, cur[0], cur[1], x_step_ptrs(x_row_ptrs, step, XSLOTS, CPS, M), col, exp, BITS, VPC,
                            CPS, SUB, M, HALF, INTERPRET)
    outs = ()
    for m in tl.static_range(M):
        parts = ()
        for j in tl.static_range(SUB):
            parts = parts + (tl.sum(tl.sum(acc[m * SUB + j], axis=2), axis=1),)  # [ROWS]
        outs = outs + (interleave(parts, SUB),)  # [BLOCK_N]: row n0 + j + SUB * i
    return tl.reshape(interleave(outs, M), (BLOCK_N, M))
