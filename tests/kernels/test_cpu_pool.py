"""The generated kernels' native thread pool (kernels/cpu/pool.py): every job runs once per thread index, results
do not depend on the thread count or on helpers having gone to sleep, jobs started on the helpers are waited for,
and a forked child starts its own helpers."""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

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


LEFT_OUT = """
import os, time, torch
from moeserve.kernels.cpu import gemv, pool
from moeserve.quant import hqq
torch.set_num_threads(1)
kernel = gemv.default_kernel(4)
q = hqq.quantize_rtn(torch.randn(64, 128), 4, 32)
w, x = gemv.pack_for_cpu(q.codes, q.scale, q.zero, 4, 32, kernel), torch.randn(2, 128)
pool.configure([], 500000)  # idle helpers may spin half a second
kernel(x, w, threads=3)  # helpers 1 and 2 start
kernel(x, w, threads=2)  # helper 2 has no part in this job

def cpu_ns():  # CPU time of each thread of this process
    return {t: int(open(f"/proc/self/task/{t}/schedstat").read().split()[0]) for t in os.listdir("/proc/self/task")}

before = cpu_ns()
time.sleep(0.2)
after = cpu_ns()
print(sum(after[t] - before[t] > 40e6 for t in before if t in after))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU times from Linux's /proc")
def test_a_helper_left_out_of_a_job_sleeps_instead_of_spinning():
    """After a job with fewer threads than there are helpers, only the helpers that ran it spin: a left-out helper's
    core is another thread's in that run (the hybrid runtime leaves the last core to the Python thread after the
    tile search started a helper there), so it must not spin on it."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", LEFT_OUT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) <= 1  # the helper that ran the last job, spinning out its window
