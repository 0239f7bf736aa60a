"""A kernel that holds its stream until the host writes a word: the device end of a wait on the CPU (jit only;
launch in host_wait.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_word_kernel(word_ptr, want_ptr, status_ptr, limit):
    """Spin (one program) until the host-written int64 word_ptr[0] reaches the device's want_ptr[0], reading it at
    most `limit` times; status_ptr[0] = 1 when it gave up. word_ptr points into page-locked host memory: each
    volatile read crosses the bus, so the host's write is seen as soon as it lands."""
    want = tl.load(want_ptr)
    got = tl.load(word_ptr, volatile=True)
    reads = 1
    while (got < want) & (reads < limit):
        got = tl.load(word_ptr, volatile=True)
        reads += 1
    if got < want:
        tl.store(status_ptr, 1)
