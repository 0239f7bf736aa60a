"""The CPU worker: one long-lived thread that computes a layer's CPU experts while the calling thread enqueues
the GPU's work (cached experts, shared expert) and waits only for the result. A layer that is one native call
(every pair on a low-bit copy the generated kernels read) skips it: it starts on the kernels' own helper threads
(HybridRuntime.start_cpu); the worker takes the rest (float experts, mixed precision, compensators).

The worker's Python does little: each job is a few torch calls per expert group, and torch's CPU ops and the
generated kernels release the GIL and spread over the worker's intra-op threads (`threads`, set on the worker
thread itself), so the caller keeps the GIL for its launches. The worker thread is pinned to one logical CPU
per physical core where the OS allows it; the OpenMP threads it starts inherit that mask.

With the model on the CPU there is nothing to overlap: jobs run inline, on the calling thread (no hand-off).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moeserve.kernels.cpu.machine import expert_cores


def _grad_modes(fn):
    """fn run under the caller's inference / no-grad mode (thread-local in torch, so the worker takes them over)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run(*args):
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(*args)

    return run


def _start_thread(threads: int | None, cpus: list[int]) -> None:
    """Runs once on the worker thread: pin it, then size its intra-op pool."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux)
        except OSError:
            pass  # not allowed here (a container's cpuset): unpinned
    if threads:
        torch.set_num_threads(threads)


class CpuWorker:
    def __init__(self, threads: int | None = None, inline: bool = False, pin: bool = True):
        """threads: intra-op threads for the experts (None: torch's setting). inline: run each job on the caller."""
        self.threads, self.inline = threads, inline
        self.cpus = list(expert_cores().cpus)[:threads] if pin and threads else []
        if inline and threads:
            torch.set_num_threads(threads)  # the caller's own pool computes the experts
        self._pool = None if inline else ThreadPoolExecutor(
            1, thread_name_prefix="moeserve-cpu-experts", initializer=_start_thread, initargs=(threads, self.cpus))

    def submit(self, fn, *args) -> Future:
        """Start fn(*args); the returned future's result() waits for it (and raises what it raised)."""
        if self._pool is not None:
            return self._pool.submit(_grad_modes(fn), *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
