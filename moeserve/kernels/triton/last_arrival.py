"""The last program to finish a piece of work does what needs all of it, in the same launch (one-token MoE layers).

At one token a kernel boundary costs more than the work on either side of it: preparing h for the down projection
once every gate/up program has written its share, or summing the k experts' outputs (the combine) once every down
program has written its own. Here each program stores its part, counts its arrival on a per-piece counter (an
acq_rel atomic at GPU scope, after a barrier so every thread's stores come first), and the program that arrives
last reads the others' parts (past L1) and finishes the piece, then puts the counter back to zero for the next
launch (a CUDA graph replays the same counters). The order of a last program's sums is fixed, so the output does not
depend on which program arrives last. arrival_counters are the zeroed counters a launch passes in: one set per
device, so launches that count arrivals must not be in flight on two streams of one device at once (decode runs one
stream per device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = 1 << 14  # counters per device: a launch uses at most its output blocks (or k * prepared steps) of them


@triton.jit
def arrive(count_ptr, expected):
    """Count this program's arrival at count_ptr (after all of its threads' stores); True in the last of `expected`
    arrivals, which also puts the counter back to zero."""
    tl.debug_barrier()  # every thread's stores before the release
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == expected - 1
    if last:
        tl.store(count_ptr, 0)
    return last


@triton.jit
def combine_partials(part_ptr, out_ptr, w_ptr, count_ptr, offs, ok, slots, parts, N):
    """A down program stored its partial sums part[p, slot, offs] (p < parts: K slices, slot < slots); the last of the
    parts * slots programs of this output block writes out[offs] = sum over slots of w[slot] * sum over p of
    part[p, slot, offs] (fp32, in that order), in out's dtype."""
    if arrive(count_ptr, parts * slots):
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for j in range(0, slots):
            row = tl.zeros(offs.shape, dtype=tl.float32)
            for p in range(0, parts):
                row += tl.load(part_ptr + (p * slots + j) * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
            acc += tl.load(w_ptr + j).to(tl.float32) * row
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters on device (the same memory every call: the launches leave them zero)."""
    if n > COUNTERS:
        raise ValueError(f"a launch counts arrivals on at most {COUNTERS} counters, {n} asked")
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device][:n]

