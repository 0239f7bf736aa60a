"""The device end of the device link (the CPU end: kernels/cpu/device_link.py): a hybrid layer's CPU experts asked
for and waited on from the device's own stream, so a decode step with CPU layers never waits on the host and is
captured whole as one CUDA graph.

Per layer call of T tokens, all enqueued on the current stream:
  1. x [T, D], the expert ids and gate weights [T, k] are copied into the link's page-locked buffers;
  2. the link's counter goes up one step and the ask word (step, layer, T) is copied after them: the CPU thread,
     polling that word, starts the layer's experts (one native call on the helper threads);
  3. the caller may enqueue more device work here (the shared expert overlaps the CPU);
  4. a one-program kernel spins on the answer word until it reaches the counter, then the output [T, D] is copied
     back to the device.
The link serves layers whose every CPU pair runs from one precision in one native call (HostExperts.native: the
low-bit copies, or MXFP4 high copies as GPT-OSS ships them, biases and clamped SwiGLU included; mixed precision can
only skip pairs there: they go with expert id -1) and calls of at most `rows` tokens; others take the host path
(hybrid/experts.py). With a GPU cache, the pairs its
slots hold go to the CPU with expert id -1 (skipped there) and run on the device meanwhile (offload/slot_cache.py).
"""

from __future__ import annotations

import os
import warnings

import torch

from moeserve.kernels.cpu.device_link import LAYER_SHIFT, SEQ_SHIFT, CpuLinkEnd
from moeserve.kernels.triton.host_wait import wait_for_host
from moeserve.offload.host_compute import HostExperts

LINK_ROWS = 64  # tokens a linked call takes at most: decode batches and short prompt chunks
PING_READS = 1 << 21  # the start-up round trip gives up after ~2 s


def link_wanted() -> bool:
    """MOESERVE_DEVICE_LINK=0 turns the link off (the host path then serves every call: A/B runs, debugging)."""
    return os.environ.get("MOESERVE_DEVICE_LINK", "1") != "0"


class DeviceLink:
    def __init__(self, host: HostExperts, num_layers: int, top_k: int, device: torch.device, threads: int,
                 cpu: int, spin_us: int, low: bool, rows: int = LINK_ROWS):
        """threads: the CPU thread and the pool helpers it computes with; cpu: the core the thread is pinned to;
        low: the CPU pairs read the low-bit copies (else the high ones, which must be MXFP4: HostExperts.native)."""
        kernel = host.native_kernel(low) if host.native(low) else None
        if kernel is None:
            raise RuntimeError("no generated CPU kernel for this machine and these experts")
        self.host, self.rows, self.top_k, self.device, self.low = host, rows, top_k, device, low
        self.hidden = host.store.meta["hidden"]
        self.cpu = CpuLinkEnd(kernel, num_layers, rows, self.hidden, top_k, threads, cpu, spin_us, pin=True)
        self.buffers = self.cpu.buffers
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # step << SEQ_SHIFT of the last ask
        self.ask_word = torch.zeros(1, dtype=torch.int64, device=device)
        self.out = torch.empty(rows, self.hidden, device=device)  # [R, D] float32: the answer, on the device
        self.status = torch.zeros(8, dtype=torch.int32).pin_memory()  # [0]: a wait gave up
        self.refused: set[int] = set()  # layers the generated kernels cannot run in one call

    def serves(self, layer: int, x: torch.Tensor) -> bool:
        """Whether a call of x [T, D] at `layer` goes over the link (registering the layer on its first call)."""
        if x.shape[0] > self.rows or layer in self.refused:
            return False
        if not self.cpu.registered(layer):
            experts = self.host.native_layer(layer, torch.empty(1, self.hidden), self.low)  # [1, D]: a decode row
            if experts is None:
                self.refused.add(layer)
                return False
            self.cpu.register(layer, experts, self.top_k)
        return True

    def ask(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> None:
        """Enqueue steps 1-2 for x [T, D], expert_ids / expert_weights [T, k] on the device."""
        b, T = self.buffers, x.shape[0]
        b.x[:T].copy_(x.float(), non_blocking=True)
        b.ids[:T].copy_(expert_ids.to(torch.int64), non_blocking=True)
        b.wts[:T].copy_(expert_weights.float(), non_blocking=True)
        self._send(layer, T)

    def answer(self, T: int) -> torch.Tensor:
        """Enqueue step 4 -> the layer's output [T, D] float32 on the device (valid until the next linked call)."""
        wait_for_host(self.buffers.answer, self.counter, self.status)
        return self.out[:T].copy_(self.buffers.out[:T], non_blocking=True)

    def ping(self) -> bool:
        """One empty round trip through both ends, waited for: whether this device and host can hold the link."""
        self._send(0, 0)
        wait_for_host(self.buffers.answer, self.counter, self.status, PING_READS)
        torch.cuda.synchronize(self.device)
        return not self.failed()

    def failed(self) -> bool:
        """A wait gave up (the CPU end did not answer): outputs since then are wrong."""
        return bool(self.status[0])

    def pairs(self) -> tuple[int, int, int]:
        """((token, expert) pairs the CPU computed over the link, the linked calls' other pairs (a GPU cache slot's,
        or skipped), calls answered with zeros for a bad table entry)."""
        _, rows, errors, cpu = self.cpu.counts()
        return cpu, rows * self.top_k - cpu, errors

    def close(self) -> None:
        self.cpu.close()

    def _send(self, layer: int, T: int) -> None:
        """The next step's ask word for (layer, T tokens), copied to the host after the inputs before it."""
        self.counter.add_(1 << SEQ_SHIFT)
        torch.add(self.counter, layer << LAYER_SHIFT | T, out=self.ask_word)
        self.buffers.ask[:1].copy_(self.ask_word, non_blocking=True)


def start_link(host: HostExperts, num_layers: int, top_k: int, device: torch.device, threads: int, cpu: int,
               spin_us: int, low: bool) -> DeviceLink | None:
    """A running link after a successful round trip, else None with one warning (the host path serves instead)."""
    try:
        link = DeviceLink(host, num_layers, top_k, device, threads, cpu, spin_us, low)
    except RuntimeError as e:
        warnings.warn(f"moeserve: CPU experts over the host path ({e})", stacklevel=3)
        return None
    if link.ping():
        return link
    link.close()
    warnings.warn("moeserve: the device could not wait on the CPU through page-locked memory; CPU experts take the "
                  "host path", stacklevel=3)
    return None
