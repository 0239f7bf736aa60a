"""x prepared for the CUDA-core GEMV, one step of one row at a time (jit code only): prepare_step is called by the
prepare_x kernel (kernels.py), by the router's launch (kernels/triton/topk_router.py), which prepares x for the
experts in the same launch, and (prepare_when_stored) by the one-token gate/up launch, which prepares h for down."""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton.last_arrival import arrive
from moeserve.kernels.triton.lowbit.codes import slot_offsets


@triton.jit
def _pack_pair(lo, hi):
    """Two fp16 tensors -> one int32 tensor holding the pairs (lo in the low half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _pow2_scale(m, LOG2_LIMIT: tl.constexpr):
    """(r, 1 / r): the power of two that brings m (> 0) just under 2^LOG2_LIMIT, from the exponent bits (exact)."""
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # m < 2^e
    field = tl.minimum(tl.maximum(127 + LOG2_LIMIT - e, 1), 253)
    return (field << 23).to(tl.float32, bitcast=True), ((254 - field) << 23).to(tl.float32, bitcast=True)


@triton.jit
def prepare_step(x_row, xw_ptr, m, steps, t, cols, BITS: tl.constexpr, VPC: tl.constexpr, CPS: tl.constexpr,
                 HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr):
    """Step t of row m (x_row: its inputs, `cols` columns; xw_ptr: the prepared x [rows, steps, XSLOTS, CPS]), zero
    past the last column, fp32: xw[t, j, c] = x[input index of value slot j of column t * CPS + c] and
    xw[t, VPC, c] = that column's sum of x. HALF: the step's x is scaled by a power of two r (max |x r| <
    2^LOG2_LIMIT), xw[t, p, c] = the fp16 pair (x r of slots p, p + VPC / 2), xw[t, VPC / 2, c] = the column's sum of
    those fp16 values (fp32 bits), xw[t, VPC / 2 + 1, :] = 1 / r (fp32 bits)."""
    c = t * CPS + tl.arange(0, CPS)
    c_ok = c < cols
    XSLOTS: tl.constexpr = VPC // 2 + 2 if HALF else VPC + 1  # x_slots
    out = xw_ptr + (m.to(tl.int64) * steps + t) * XSLOTS * CPS + tl.arange(0, CPS)
    vals = ()
    for j in tl.static_range(VPC):
        off = c * VPC + slot_offsets(tl.full((CPS,), j, tl.int32), BITS)
        vals = vals + (tl.load(x_row + off, mask=c_ok, other=0.0).to(tl.float32),)
    total = tl.zeros((CPS,), dtype=tl.float32)
    if HALF:
        big = tl.zeros((CPS,), dtype=tl.float32)
        for j in tl.static_range(VPC):
            big = tl.maximum(big, tl.abs(vals[j]))
        r, inv_r = _pow2_scale(tl.max(big, axis=0), LOG2_LIMIT)
        for p in tl.static_range(VPC // 2):
            lo, hi = (vals[p] * r).to(tl.float16), (vals[p + VPC // 2] * r).to(tl.float16)
            tl.store(out + p * CPS, _pack_pair(lo, hi))
            total += lo.to(tl.float32) + hi.to(tl.float32)
        tl.store(out + (VPC // 2) * CPS, total.to(tl.int32, bitcast=True))
        tl.store(out + (VPC // 2 + 1) * CPS, tl.full((CPS,), inv_r, tl.float32).to(tl.int32, bitcast=True))
    else:
        for j in tl.static_range(VPC):
            tl.store(out + j * CPS, vals[j])
            total += vals[j]
        tl.store(out + VPC * CPS, total)


@triton.jit
def prepare_when_stored(h_row, hw_ptr, m, count_ptr, n0, N, steps, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                        VPC: tl.constexpr, CPS: tl.constexpr, HALF: tl.constexpr, LOG2_LIMIT: tl.constexpr):
    """Outputs [n0, n0 + BLOCK_N) of row m (h_row: its N values) are stored: each prepared step (CPS * VPC values) is
    prepared (prepare_step into hw_ptr [rows, steps, ..]) by the program that stores its last outputs, found by
    counting arrivals per (row, step) at count_ptr [rows * steps] (last_arrival.arrive), so the next launch reads h
    prepared with no prepare_x launch between."""
    STEP: tl.constexpr = CPS * VPC
    if BLOCK_N >= STEP:  # this program stores whole steps
        tl.debug_barrier()  # the other threads' stores first
        for i in tl.static_range(BLOCK_N // STEP):
            t = n0 // STEP + i
            if t < steps:
                prepare_step(h_row, hw_ptr, m, steps, t, N // VPC, BITS, VPC, CPS, HALF, LOG2_LIMIT)
    else:
        t = n0 // STEP
        if arrive(count_ptr + m * steps + t, tl.minimum(STEP // BLOCK_N, tl.cdiv(N - t * STEP, BLOCK_N))):
            prepare_step(h_row, hw_ptr, m, steps, t, N // VPC, BITS, VPC, CPS, HALF, LOG2_LIMIT)
