"""The MXFP4 MoE kernels (jit code only; launch.py launches them).

A weight row of K values is K/32 groups of 16 bytes, read as four int32 words (codes.py), and K/32 E8M0 scales. The
grid is (output block, expert hit): axis 1 has min(T*k, E) programs, the j-th serving the j-th expert the routing
table gives rows (rows.hit_rows), so no program is launched for, or waits on, an expert no token chose (at one token
top-4 of 32 experts, 4 programs per output block instead of 32). Each loops over its expert's rows BLOCK_M at a time.
Nothing in a step loop is masked: weight rows and groups are clamped in range, a clamped group's scale is zero.

CUDA cores (decode, gemv: up to 8 rows at once): x comes prepared (prepare_kernel / store_prepared): per group, the
inputs that each code slot of the four words meets, the four side by side, so a thread loads a group's words as one
16-byte vector and each slot's inputs as another. Each code is decoded once for all rows. HALF sums a group on fp16
pairs (x scaled per group by a power of two, one HFMA2 per two values), then in fp32 times the group's scale; else
fp32 FMAs. The gate/up kernel writes h prepared the same way, so down needs no prepare launch.

Tensor cores (16+ rows of 16-bit x, dequant_tile): the codes become x's dtype (two 16-bit pair multiplies: by the
decode's bias, by the group's scale), laid out in input order; per step one dot for the gate rows and one for the
up rows on the same x tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.last_arrival import combine_partials
from moeserve.kernels.triton.lowbit.codes import hfma2, interleave, pair_sum
from moeserve.kernels.triton.mxfp4.codes import (BF16_BIAS_PAIR, DECODE_SCALE, FP16_BIAS_PAIR, e2m1_pairs,
                                                 group_scales, mul_pairs, pack_pair, pair_halves, pow2_range, split4)
from moeserve.kernels.triton.pdl import after_previous
from moeserve.kernels.triton.rows import hit_rows
from moeserve.kernels.triton.swiglu import activation, bias_row

HALF_LIMIT = tl.constexpr(15)  # prepared fp16 x: |x r| < 2^15 per group, so 16 products (< 12 each) stay in fp16


# ---- shared ---------------------------------------------------------------------------------------------------


@triton.jit
def step_groups(step, GPR, G: tl.constexpr):
    """The G groups of step `step` of rows of GPR groups: (clamped in range [G], real [G])."""
    g = step * G + tl.arange(0, G)
    return tl.minimum(g, GPR - 1), g < GPR


@triton.jit
def load_words(w_ptr, w_rows, gc):
    """The words of groups gc [G] of weight rows w_rows [BLOCK_N] (int64, row * GPR): [BLOCK_N, G, 4] int32, a
    16-byte vector per (row, group)."""
    return tl.load(w_ptr + (w_rows[:, None, None] + gc[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :])


@triton.jit
def scale_bytes(s_ptr, w_rows, step, GPR, G: tl.constexpr, NT: tl.constexpr):
    """The E8M0 bytes of step `step`'s groups (clamped in range) of each of the NT tiles w_rows: a tuple of
    [BLOCK_N, G] uint8. The step loops load them a step ahead: one byte a thread is too small for the software
    pipeline's cp.async, and loaded where they are used each step would wait a full memory latency."""
    gc, _ = step_groups(step, GPR, G)
    out = ()
    for t in tl.static_range(NT):
        out = out + (tl.load(s_ptr + w_rows[t][:, None] + gc[None, :]),)
    return out


@triton.jit
def source_rows(ids_ptr, rows, GATHER: tl.constexpr):
    """The rows of x that expert-sorted rows [..] (int64) read: ids[rows] (GATHER: x holds the tokens, ids_ptr the
    routing table's token of each sorted row; no gather launch) or the rows themselves (x sorted already)."""
    if GATHER:
        rows = tl.load(ids_ptr + rows).to(tl.int64)
    return rows


@triton.jit
def output_block(N, offsets_ptr, counts_ptr, E, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                 SLOTS: tl.constexpr = False):
    """A program's part of an expert call: its output block pid 0 of N outputs (offs [BLOCK_N], n_ok) and the
    expert-sorted rows [start, end) of the pid 1-th expert hit, e (rows.hit_rows). SLOTS (one token): row pid 1 is
    slot pid 1 of the token's distinct experts, offsets_ptr its expert ids [k]."""
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SLOTS:
        start = tl.program_id(1)
        end = start + 1
        e = tl.load(offsets_ptr + start).to(tl.int32)
    else:
        start, end, e = hit_rows(tl.program_id(1), offsets_ptr, counts_ptr, E, BLOCK_E)
    return offs, offs < N, start, end, e


@triton.jit
def down_rows(offs, n_ok, e, N, GPR, bias_ptr, HAS_BIAS: tl.constexpr):
    """Down's weight rows of outputs offs [BLOCK_N] of expert e (weights [E, N, ..]; int64, row * GPR, clamped in
    range) and their biases (float32, zeros without)."""
    w_rows = (tl.minimum(offs, N - 1).to(tl.int64) + e.to(tl.int64) * N) * GPR
    return w_rows, bias_row(bias_ptr + e.to(tl.int64) * N, offs, n_ok, HAS_BIAS)


# ---- CUDA cores: prepared x, GEMV ------------------------------------------------------------------------------


@triton.jit
def store_prepared(vals, xp_ptr, xr_ptr, row, g, GPR, ok, HALF: tl.constexpr):
    """Inputs vals [BG, 32] float32 (input 32 g + i of row `row`, groups g [BG], stored where ok) -> the prepared x:
    input 8w + jj of a group at slot jj, word w. HALF: int32 [rows, GPR, 4, 4], slot j holding the fp16 pair (x r of
    inputs 8w + j, 8w + j + 4), r a power of two per group with |x r| < 2^15, and 1 / r at xr [rows, GPR]; else
    float32 [rows, GPR, 8, 4]."""
    BG: tl.constexpr = vals.shape[0]
    by_slot = tl.permute(tl.reshape(vals, (BG, 4, 8)), (0, 2, 1))  # [BG, 8 (slot jj), 4 (word w)]
    w = tl.arange(0, 4)[None, None, :]
    if HALF:
        r, inv_r = pow2_range(tl.max(tl.abs(vals), axis=1), HALF_LIMIT)  # [BG]
        halves = tl.reshape(by_slot * r[:, None, None], (BG, 2, 4, 4))  # [BG, half, j, w]: slot jj = 4 half + j
        lo, hi = tl.split(tl.permute(halves, (0, 2, 3, 1)))  # [BG, 4 (j), 4 (w)] each
        out = xp_ptr + (row * GPR + g)[:, None, None] * 16 + tl.arange(0, 4)[None, :, None] * 4 + w
        tl.store(out, pack_pair(lo.to(tl.float16), hi.to(tl.float16)), mask=ok[:, None, None])
        tl.store(xr_ptr + row * GPR + g, inv_r, mask=ok)
    else:
        out = xp_ptr + (row * GPR + g)[:, None, None] * 32 + tl.arange(0, 8)[None, :, None] * 4 + w
        tl.store(out, by_slot, mask=ok[:, None, None])


@triton.jit
def x_step(xp_ptr, row, gc, GPR, HALF: tl.constexpr):
    """Row `row`'s prepared x of groups gc [G]: a tuple, slot j word w at 4j + w, of [1, G]: 16 fp16 pairs (HALF) or
    32 float32 inputs. One 16-byte vector load per slot."""
    SLOTS: tl.constexpr = 4 if HALF else 8
    base = xp_ptr + (row * GPR + gc)[None, :, None] * (4 * SLOTS) + tl.arange(0, 4)[None, None, :]  # [1, G, 4]
    xs = ()
    for j in tl.static_range(SLOTS):
        xs = xs + split4(tl.load(base + 4 * j))
    return xs


@triton.jit
def decoded(words, HALF: tl.constexpr):
    """A step's words [BLOCK_N, G, 4] -> their codes, E2M1 times 2^-14, a tuple indexed as x_step's slots: 16 fp16
    pairs (HALF; codes j and j + 4 of word w at 4j + w) or 32 float32 values (code jj of word w at 4 jj + w)."""
    words = split4(words)
    lo = ()
    hi = ()
    for j in tl.static_range(4):
        for w in tl.static_range(4):
            pair = e2m1_pairs(words[w], j, False)
            if HALF:
                lo = lo + (pair,)
            else:
                a, b = pair_halves(pair, tl.float16)
                lo = lo + (a.to(tl.float32),)
                hi = hi + (b.to(tl.float32),)
    return lo + hi


@triton.jit
def pair_floats(pairs):
    """A tuple of 16 fp16 pairs (slot j word w at 4j + w) -> the 32 float32 values in decoded's order (value jj of
    word w at 4 jj + w): the interpreter's view of the HALF sums."""
    lo = ()
    hi = ()
    for i in tl.static_range(16):
        a, b = pair_halves(pairs[i], tl.float16)
        lo = lo + (a.to(tl.float32),)
        hi = hi + (b.to(tl.float32),)
    return lo + hi


@triton.jit
def group_sums(codes, xs, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (weight row, group): sum of codes times x over the group's 32 values, float32 [BLOCK_N, G]. HALF: on fp16
    pairs (16 HFMA2s into one pair), then one float32 sum of the pair; in the interpreter (codes and x as float32
    there) the same two chains, each step rounded to fp16."""
    if HALF and INTERPRET:
        lo = tl.zeros(codes[0].shape, dtype=tl.float32)
        hi = tl.zeros(codes[0].shape, dtype=tl.float32)
        for i in tl.static_range(16):
            lo = (codes[i] * xs[i] + lo).to(tl.float16).to(tl.float32)
            hi = (codes[16 + i] * xs[16 + i] + hi).to(tl.float16).to(tl.float32)
        out = lo + hi
    elif HALF:
        acc = tl.zeros(codes[0].shape, dtype=tl.int32)  # the fp16 pair (0, 0)
        for i in tl.static_range(16):
            acc = hfma2(codes[i], xs[i], acc, False)
        out = pair_sum(acc, False)
    else:
        out = tl.zeros(codes[0].shape, dtype=tl.float32)
        for i in tl.static_range(32):
            out += codes[i] * xs[i]
    return out


@triton.jit
def gemv(xp_ptr, xr_ptr, x_rows, w_ptr, s_ptr, w_rows, GPR, HALF: tl.constexpr, M: tl.constexpr, NT: tl.constexpr,
         BLOCK_N: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows x_rows (a tuple of M int64 rows of the prepared x) times the weight rows of NT tiles w_rows (a tuple of
    [BLOCK_N] int64, row * GPR) over all GPR groups: a tuple of NT * M [BLOCK_N] float32, (tile t, x row m) at
    t * M + m. Per step: each tile's words (and the next step's scales), each row's x, then the sums; each code is
    decoded once."""
    acc = ()
    for _ in tl.static_range(NT * M):
        acc = acc + (tl.zeros((BLOCK_N, G), dtype=tl.float32),)
    nxt = scale_bytes(s_ptr, w_rows, 0, GPR, G, NT)
    for step in tl.range(0, tl.cdiv(GPR, G), num_stages=STAGES):
        gc, g_ok = step_groups(step, GPR, G)
        cur = nxt
        nxt = scale_bytes(s_ptr, w_rows, step + 1, GPR, G, NT)  # in flight during this step
        codes = ()
        for t in tl.static_range(NT):
            codes = codes + (decoded(load_words(w_ptr, w_rows[t], gc), HALF and not INTERPRET),)
        xs = ()
        for m in tl.static_range(M):
            xm = x_step(xp_ptr, x_rows[m], gc, GPR, HALF)
            if HALF and INTERPRET:
                xm = pair_floats(xm)
            if HALF:  # x's 1 / r per group joins the weights' scale
                xs = xs + ((xm, tl.load(xr_ptr + x_rows[m] * GPR + gc)[None, :]),)
            else:
                xs = xs + ((xm, 1.0),)
        new = ()
        for t in tl.static_range(NT):
            scale = group_scales(cur[t], g_ok[None, :])
            for m in tl.static_range(M):
                part = group_sums(codes[t], xs[m][0], HALF, INTERPRET)
                new = new + (acc[t * M + m] + part * (scale * xs[m][1]),)
        acc = new
    out = ()
    for i in tl.static_range(NT * M):
        out = out + (tl.sum(acc[i], axis=1) * DECODE_SCALE,)
    return out


@triton.jit
def row_tuple(row0, end, M: tl.constexpr):
    """Rows row0 .. row0 + M - 1 of the expert-sorted rows, clamped below end: a tuple of M int64. A row past the end
    repeats the last one, whose outputs it writes again with the same values (so no row needs a mask)."""
    rows = ()
    for m in tl.static_range(M):
        rows = rows + (tl.minimum(row0 + m, end - 1).to(tl.int64),)
    return rows


@triton.jit
def prepare_groups(src, xp_ptr, xr_ptr, row, block, K, HALF: tl.constexpr, BLOCK_G: tl.constexpr):
    """Groups [block * BLOCK_G, + BLOCK_G) of the K inputs at src -> row `row` of the prepared x (store_prepared).
    prepare_kernel's programs, and the router's launch (kernels/triton/topk_router.py) at one token."""
    GPR = K // 32
    g = block * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = g < GPR
    vals = tl.load(src + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0.0)
    store_prepared(vals.to(tl.float32), xp_ptr, xr_ptr, row, g, GPR, ok, HALF)


@triton.jit
def prepare_kernel(x_ptr, ids_ptr, xp_ptr, xr_ptr, K, HALF: tl.constexpr, GATHER: tl.constexpr,
                   BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Groups [pid 1 * BLOCK_G, + BLOCK_G) of expert-sorted row pid 0 (source_rows of x [.., K]) -> the prepared x
    (prepare_groups)."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    prepare_groups(x_ptr + source_rows(ids_ptr, row, GATHER) * K, xp_ptr, xr_ptr, row, tl.program_id(1), K, HALF,
                   BLOCK_G)


@triton.jit
def gate_up_gemv_kernel(xp_ptr, xr_ptr, w_ptr, s_ptr, bias_ptr, hp_ptr, hr_ptr, offsets_ptr, counts_ptr, E, F, K,
                        alpha, limit, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr,
                        STAGES: tl.constexpr, INTERPRET: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr):
    """h = act(x Wg[e]^T + bg[e], x Wu[e]^T + bu[e]) for output block pid 0 (BLOCK_N of F, a multiple of 32) of the
    pid 1-th expert hit, on CUDA cores; weights [E, 2F, ..] (gate rows, then up rows), x prepared, h written prepared
    (store_prepared) for down. SLOTS (one token, output_block's): h row j is slot j's, x is the token's row 0."""
    after_previous(PDL)
    offs, n_ok, start, end, e = output_block(F, offsets_ptr, counts_ptr, E, BLOCK_N, BLOCK_E, SLOTS)
    GPR = K // 32
    gate = tl.minimum(offs, F - 1).to(tl.int64) + e.to(tl.int64) * 2 * F  # [BLOCK_N] gate rows of expert e
    bias_g = bias_row(bias_ptr + e.to(tl.int64) * 2 * F, offs, n_ok, HAS_BIAS)
    bias_u = bias_row(bias_ptr + e.to(tl.int64) * 2 * F + F, offs, n_ok, HAS_BIAS)
    groups = tl.program_id(0) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)  # h's groups this block writes
    for row0 in range(start, end, BLOCK_M):
        rows = row_tuple(row0, end, BLOCK_M)
        if SLOTS:
            x_rows = row_tuple(row0 * 0, 1, BLOCK_M)  # the token's row 0 (row0 * 0: an int tensor, as the rows are)
        else:
            x_rows = rows
        sums = gemv(xp_ptr, xr_ptr, x_rows, w_ptr, s_ptr, (gate * GPR, (gate + F) * GPR), GPR, HALF, BLOCK_M, 2,
                    BLOCK_N, G, STAGES, INTERPRET)
        for m in tl.static_range(BLOCK_M):
            h = activation(sums[m] + bias_g, sums[BLOCK_M + m] + bias_u, alpha, limit, CLAMPED)  # [BLOCK_N]
            store_prepared(tl.reshape(h, (BLOCK_N // 32, 32)), hp_ptr, hr_ptr, rows[m], groups, F // 32,
                           groups < F // 32, HALF)


@triton.jit
def down_gemv_kernel(hp_ptr, hr_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, offsets_ptr, counts_ptr, out_ptr, gw_ptr,
                     count_ptr, E, N, K, HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr, STAGES: tl.constexpr,
                     INTERPRET: tl.constexpr, SLOTS: tl.constexpr, COMBINE: tl.constexpr, PDL: tl.constexpr):
    """y[rows, n block] = h Wd[e]^T + bd[e] (float32) for output block pid 0 of the pid 1-th expert hit, on CUDA
    cores; weights [E, N, ..], h prepared. SLOTS (one token): output_block's; COMBINE (with SLOTS): the last program
    of each output block writes out[n] = sum_j gw[j] y[j, n] in out's dtype (last_arrival.combine_partials)."""
    after_previous(PDL)
    offs, n_ok, start, end, e = output_block(N, offsets_ptr, counts_ptr, E, BLOCK_N, BLOCK_E, SLOTS)
    GPR = K // 32
    w_rows, bias = down_rows(offs, n_ok, e, N, GPR, bias_ptr, HAS_BIAS)
    for row0 in range(start, end, BLOCK_M):
        rows = row_tuple(row0, end, BLOCK_M)
        sums = gemv(hp_ptr, hr_ptr, rows, w_ptr, s_ptr, (w_rows,), GPR, HALF, BLOCK_M, 1, BLOCK_N, G, STAGES,
                    INTERPRET)
        for m in tl.static_range(BLOCK_M):
            tl.store(y_ptr + rows[m] * N + offs, sums[m] + bias, mask=n_ok)
    if COMBINE:
        combine_partials(y_ptr, out_ptr, gw_ptr, count_ptr + tl.program_id(0), offs, n_ok, tl.num_programs(1), 1, N)


# ---- tensor cores ------------------------------------------------------------------------------------------


@triton.jit
def dot16(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b (fp32) on 16-bit a, b. Triton 3.9's interpreter miscomputes bf16 dots: there in fp32, the same sums
    (products of 16-bit values are exact in fp32)."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def dequant_tile(w_ptr, s, w_rows, gc, g_ok, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight rows w_rows [BLOCK_N] (int64, row * GPR), groups gc [G], their scale bytes s [BLOCK_N, G] -> their
    values [BLOCK_N, 32 G] in dtype (16-bit), zero for groups not g_ok, in pair order: input 8q + j + 4 half
    (q = 4g + w, j < 4) at column 8q + 2j + half, so the two values of a decoded pair stay side by side in one
    register (x_tile takes x in the same order; the input order would cost a register shuffle per value). Per two
    values two shifts and two masks (e2m1_pairs), a pair multiply by the decode's bias (the exact E2M1 values) and
    one by the group's scale (together they could overflow the 16-bit range)."""
    BF16: tl.constexpr = dtype == tl.bfloat16
    BIAS: tl.constexpr = BF16_BIAS_PAIR if BF16 else FP16_BIAS_PAIR
    words = load_words(w_ptr, w_rows, gc)  # [BLOCK_N, G, 4]
    BN: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1] * 4
    scale = group_scales(s, g_ok[None, :]).to(dtype)  # [BLOCK_N, G]
    scale = pack_pair(scale, scale)[:, :, None]
    bias = tl.full(words.shape, BIAS, tl.int32)
    parts = ()
    for j in tl.static_range(4):
        pair = mul_pairs(mul_pairs(e2m1_pairs(words, j, BF16), bias, dtype, INTERPRET), scale, dtype, INTERPRET)
        a, b = pair_halves(pair, dtype)  # [BLOCK_N, G, 4]: inputs 8w + j, 8w + j + 4 of each group
        parts = parts + (tl.reshape(a, (BN, C)), tl.reshape(b, (BN, C)))
    return interleave(parts, 8)  # [BLOCK_N, 8 C]: part 2j + half at column 8q + 2j + half


@triton.jit
def pair_order(c):
    """Column of input c [..] in dequant_tile's pair order: input 8q + j + 4 half at 8q + 2j + half."""
    return c - c % 8 + 2 * (c % 4) + (c % 8) // 4


@triton.jit
def x_tile(x_ptr, rows, K, step, BLOCK_K: tl.constexpr, IN_PAIR_ORDER: tl.constexpr):
    """Rows rows [BLOCK_M] (int64) of x [.., K], the inputs of step `step` in dequant_tile's pair order (zero past
    K): [BLOCK_M, BLOCK_K]. IN_PAIR_ORDER: x is stored so (h, as gate_up_dot_kernel writes it), one contiguous load;
    else two loads of 4 inputs side by side (half 0 and 1 of each 8) joined in registers."""
    BM: tl.constexpr = rows.shape[0]
    if IN_PAIR_ORDER:
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0.0)
    else:
        k = step * BLOCK_K + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 4)[None, :]  # [BLOCK_K / 8, 4]
        ptr = x_ptr + rows[:, None, None] * K + k[None, :, :]
        ok = (k < K)[None, :, :]
        halves = tl.join(tl.load(ptr, mask=ok, other=0.0), tl.load(ptr + 4, mask=ok, other=0.0))  # [.., 4, 2]
        x = tl.reshape(halves, (BM, BLOCK_K))
    return x


@triton.jit
def gate_up_dot_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, offsets_ptr, counts_ptr, E, F, K, alpha,
                       limit, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, GATHER: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr,
                       STAGES: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """h[rows, n block] = act(x Wg[e]^T + bg[e], x Wu[e]^T + bu[e]) for output block pid 0 of the pid 1-th expert
    hit, on tensor cores (16-bit x, rows by source_rows); weights [E, 2F, ..], h [rows, F] in x's dtype, its columns
    in pair order (so down loads its tiles contiguously)."""
    after_previous(PDL)
    offs, n_ok, start, end, e = output_block(F, offsets_ptr, counts_ptr, E, BLOCK_N, BLOCK_E)
    GPR = K // 32
    gate = tl.minimum(offs, F - 1).to(tl.int64) + e.to(tl.int64) * 2 * F
    g_rows, u_rows = gate * GPR, (gate + F) * GPR
    bias_g = bias_row(bias_ptr + e.to(tl.int64) * 2 * F, offs, n_ok, HAS_BIAS)[None, :]
    bias_u = bias_row(bias_ptr + e.to(tl.int64) * 2 * F + F, offs, n_ok, HAS_BIAS)[None, :]
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    for row0 in range(start, end, BLOCK_M):
        r = row0 + tl.arange(0, BLOCK_M)
        rows = tl.minimum(r, end - 1).to(tl.int64)  # [BLOCK_M]
        x_rows = source_rows(ids_ptr, rows, GATHER)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        nxt = scale_bytes(s_ptr, (g_rows, u_rows), 0, GPR, G, 2)
        for step in tl.range(0, tl.cdiv(GPR, G), num_stages=STAGES):
            gc, g_ok = step_groups(step, GPR, G)
            cur = nxt
            nxt = scale_bytes(s_ptr, (g_rows, u_rows), step + 1, GPR, G, 2)  # in flight during this step
            x = x_tile(x_ptr, x_rows, K, step, 32 * G, False)
            acc_g = dot16(x, tl.trans(dequant_tile(w_ptr, cur[0], g_rows, gc, g_ok, dtype, INTERPRET)), acc_g,
                          INTERPRET)
            acc_u = dot16(x, tl.trans(dequant_tile(w_ptr, cur[1], u_rows, gc, g_ok, dtype, INTERPRET)), acc_u,
                          INTERPRET)
        h = activation(acc_g + bias_g, acc_u + bias_u, alpha, limit, CLAMPED)
        tl.store(h_ptr + rows[:, None] * F + pair_order(offs)[None, :], h.to(dtype),
                 mask=(r < end)[:, None] & n_ok[None, :])


@triton.jit
def down_dot_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, offsets_ptr, counts_ptr, E, N, K, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr,
                    STAGES: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """y[rows, n block] = h Wd[e]^T + bd[e] (float32) for output block pid 0 of the pid 1-th expert hit, on tensor
    cores; weights [E, N, ..], h [rows, K] 16-bit in pair order (gate_up_dot_kernel)."""
    after_previous(PDL)
    offs, n_ok, start, end, e = output_block(N, offsets_ptr, counts_ptr, E, BLOCK_N, BLOCK_E)
    GPR = K // 32
    w_rows, bias = down_rows(offs, n_ok, e, N, GPR, bias_ptr, HAS_BIAS)
    bias = bias[None, :]  # [1, BLOCK_N]
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    for row0 in range(start, end, BLOCK_M):
        r = row0 + tl.arange(0, BLOCK_M)
        rows = tl.minimum(r, end - 1).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        nxt = scale_bytes(s_ptr, (w_rows,), 0, GPR, G, 1)
        for step in tl.range(0, tl.cdiv(GPR, G), num_stages=STAGES):
            gc, g_ok = step_groups(step, GPR, G)
            cur = nxt
            nxt = scale_bytes(s_ptr, (w_rows,), step + 1, GPR, G, 1)  # in flight during this step
            acc = dot16(x_tile(h_ptr, rows, K, step, 32 * G, True),
                        tl.trans(dequant_tile(w_ptr, cur[0], w_rows, gc, g_ok, dtype, INTERPRET)), acc, INTERPRET)
        tl.store(y_ptr + rows[:, None] * N + offs[None, :], acc + bias, mask=(r < end)[:, None] & n_ok[None, :])
