"""The generated kernels' native thread pool (kernels/cpu/pool.py): every job runs once per thread index, results
do not depend on the thread count or on helpers having gone to sleep, jobs started on the helpers are waited for,
and a forked child starts its own helpers."""

import multiprocessing
import pytest
import torch

from moeserve.kernels.cpu import gemv, pool
from moeserve.kernels.cpu.gemv import pack_for_cpu
from moeserve.quant import hqq

kernel = gemv.default_kernel(4)
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler")


def packed(out_f: int, in_f: int):
    q = hqq.quantize_rtn(torch.randn(out_f, in_f), 4, 32)
    return pack_for_cpu(q.codes, q.scale, q.zero, 4, 32, kernel)


def test_many_jobs_over_thread_counts_and_sleeping_helpers_equal_one_thread():
    """Thousands of short jobs with 1..4 threads, with helpers that spin and helpers that sleep at once (spin 0):
    each result equals the one-thread result bit for bit (no lost or repeated tile)."""
    w, x = packed(96, 128), torch.randn(3, 128)
    one = kernel(x, w, threads=1)
    try:
        for spin_us in (200, 0):
            pool.configure([], spin_us)
            for i in range(1500):
                assert torch.equal(kernel(x, w, threads=1 + i % 4), one), (spin_us, i)
    finally:
        pool.configure([], 100)
    assert pool.helpers() >= 3


def test_started_layers_overlap_the_caller_and_wait():
    """moe_layer(start=True) returns before its helpers finish; result() waits and equals the blocking call;
    several started one after another (each waited for) stay correct."""
    E, D, F, k = 4, 256, 128, 2
    experts = gemv.LayerExperts.of([packed(2 * F, D) for _ in range(E)], [packed(D, F) for _ in range(E)])
    for T in (1, 5):
        x, ids, w = torch.randn(T, D), torch.stack([torch.randperm(E)[:k] for _ in range(T)]), torch.rand(T, k)
        ref = gemv.moe_layer(kernel, experts, x, ids, w, threads=1)
        for _ in range(50):
            assert torch.equal(gemv.moe_layer(kernel, experts, x, ids, w, threads=2, start=True).result(), ref)


def _child(queue, x, w, ref):
    queue.put(bool(torch.equal(kernel(x, w, threads=3), ref)))  # no other torch op: OpenMP is not fork-safe


def test_a_forked_child_starts_its_own_helpers():
    x, w = torch.randn(2, 64), packed(64, 64)
    ref = kernel(x, w, threads=3)  # the parent's helpers exist
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, x, w, ref))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and queue.get(timeout=5)
