"""Copies from slow memory into expert slots: on a dedicated CUDA stream, ordered by events, never a
synchronous pageable copy on the hot path.

Pinned sources go straight to the device as DMA copies. Pageable or memory-mapped sources (a store that
could not be pinned) are staged in chunks through two pinned buffers: the host fills one while the DMA
engine drains the other. On a CPU fast tier (no CUDA) a load is a plain memory copy.

Given the link's bandwidth, the copier also keeps an estimate of when its queue drains (bytes queued /
bandwidth), which the CPU-GPU cooperative choice compares with the CPU's cost; without it, nothing is
measured or tracked.
"""

from __future__ import annotations

import time

import torch

from moeserve.timing import link_bandwidth

STAGING_CHUNK = 16 << 20  # bytes per staged piece (16 MiB: ~50 GB/s per piece on an H100 host)


def measure_h2d_bandwidth(device, nbytes: int = 64 << 20) -> float:
    """Pinned host -> device bytes/s: a short median of whole-buffer copies (as the hardware profile measures)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return link_bandwidth(src, dst, nbytes, lambda: torch.cuda.synchronize(device), budget_s=0.05)


class Copier:
    def __init__(self, device, bandwidth: float | None = None):
        """bandwidth: host->device bytes/s, for backlog(); measure it with measure_h2d_bandwidth."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.bandwidth = bandwidth if self.cuda else None
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._next_staging = 0
        self.busy_until = 0.0  # host clock at which the queued copies are expected to be done

    def load(self, dst: list[torch.Tensor], src: list[torch.Tensor], after: torch.cuda.Event | None,
             done: torch.cuda.Event | None) -> None:
        """Copy src[i] into dst[i] (same shapes) after event `after`; record `done` when finished."""
        if not self.cuda:
            for d, s in zip(dst, src):
                d.copy_(s)
            return
        if self.bandwidth:
            nbytes = sum(s.nbytes for s in src)
            self.busy_until = max(time.perf_counter(), self.busy_until) + nbytes / self.bandwidth
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for d, s in zip(dst, src):
                if s.is_pinned():
                    d.copy_(s, non_blocking=True)
                else:
                    self._staged_copy(d, s.to(d.dtype).contiguous())
            done.record(self.stream)

    def backlog(self) -> float:
        """Seconds until the queued copies are expected to be done."""
        return max(self.busy_until - time.perf_counter(), 0.0)

    def _staged_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Pageable src -> pinned chunk -> device, alternating two chunks (called on self.stream)."""
        flat_src, flat_dst = src.reshape(-1).view(torch.uint8), dst.view(torch.uint8).reshape(-1)
        for start in range(0, flat_src.numel(), STAGING_CHUNK):
            n = min(STAGING_CHUNK, flat_src.numel() - start)
            buf, free = self._staging_buffer()
            free.synchronize()  # the DMA that last read this buffer is done
            buf[:n].copy_(flat_src[start:start + n])
            flat_dst[start:start + n].copy_(buf[:n], non_blocking=True)
            free.record(self.stream)

    def _staging_buffer(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        if not self._staging:
            for _ in range(2):
                event = torch.cuda.Event()
                event.record(self.stream)
                self._staging.append((torch.empty(STAGING_CHUNK, dtype=torch.uint8).pin_memory(), event))
        self._next_staging ^= 1
        return self._staging[self._next_staging]
