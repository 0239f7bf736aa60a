"""Launch of the wait-on-host kernel (host_wait_kernels.py): a stream point that CUDA-graph capture can hold."""

from __future__ import annotations

import torch

from moeserve.kernels.triton.host_wait_kernels import wait_word_kernel

DEFAULT_READS = 1 << 24  # each read crosses PCIe (~1 us): gives up after ~10 s, never in a healthy run


def wait_for_host(word: torch.Tensor, want: torch.Tensor, status: torch.Tensor, reads: int = DEFAULT_READS) -> None:
    """Enqueue on the current stream: hold until word[0] (int64, page-locked host memory, written by the host) >=
    want[0] (int64 on the device, written by earlier work of the stream); status[0] (int32, page-locked) set to 1
    if `reads` reads of word pass first."""
    if not (word.is_pinned() and status.is_pinned()) or want.device.type != "cuda":
        raise ValueError("wait_for_host: word and status in page-locked host memory, want on a CUDA device")
    with torch.cuda.device(want.device):
        wait_word_kernel[(1,)](word, want, status, reads, num_warps=1)
