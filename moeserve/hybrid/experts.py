"""The hybrid expert backend of one MoE layer: experts computed where they lie.

Per call, with the router's output on the model device:
  1. the routing (ids and gate weights, one small tensor) and x come to the host: the one wait on the device;
  2. the host decides each (token, k) pair: its expert's slot when the cache holds it loaded, else the CPU (and
     with mixed precision, the high or low copy, or a skip);
  3. all of the layer's CPU pairs start as one job: one native call on the kernels' helper threads where every
     pair reads a low-bit copy (HostExperts.start_layer), else on the CPU worker (HostExperts.run_layer: rows
     grouped per expert, each expert's matmuls back to back on the worker's threads);
  4. meanwhile the calling thread enqueues the cached experts (one routed pass over the slots) and the shared
     expert on the device, then does the cache's bookkeeping (uses, a background admission);
  5. the CPU's output comes back and is added on the model device.
With the model on the CPU the same steps run inline (no copies, no hand-off). A call of many tokens (a prompt, at
least the placement's stream_from) computes its missed experts on the model device instead, each streamed there
once (hybrid/stream.py): no CPU job. Where the runtime holds a device link (a GPU, every pair on the CPU's low-bit
copy in one native call; cache slots looked up on the device), steps 1-5 are enqueued on the device instead and
the host never waits (hybrid/link.py); mixed precision's skips are then chosen on the device too, and the cache is
kept between steps (offload/slot_cache.py).
"""

from __future__ import annotations

import torch

from moeserve.hybrid.runtime import HybridRuntime
from moeserve.model.experts import ExpertBackend
from moeserve.offload.host_compute import CpuPairs
from moeserve.offload.precision import SKIP


def routing_to_host(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, with_x: bool = True):
    """(x [T, D] or None without with_x, expert_ids [T, k] long, expert_weights [T, k]) on the host: one copy of the
    routing, one of x, one wait for the device. On the CPU: the tensors themselves."""
    if x.device.type == "cpu":
        return x, expert_ids, expert_weights
    k = expert_ids.shape[1]
    route = torch.cat([expert_ids.to(torch.float32), expert_weights.float()], 1).to("cpu", non_blocking=True)  # [T, 2k]
    x_host = x.to("cpu", non_blocking=True) if with_x else None  # [T, D]
    torch.cuda.current_stream(x.device).synchronize()
    return x_host, route[:, :k].long(), route[:, k:].to(expert_weights.dtype)


class HybridExperts(ExpertBackend):
    overlaps_dense = True  # the shared expert runs on the device while the CPU computes

    def __init__(self, layer: int, num_experts: int, runtime: HybridRuntime):
        super().__init__()
        self.layer, self.num_experts, self.runtime = layer, num_experts, runtime

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "hybrid_linked" if self._linked(x) else "hybrid"

    def _linked(self, x: torch.Tensor) -> bool:
        """Whether a call of x [T, D] goes over the device link (hybrid/link.py): the runtime has one, the call is
        not a streamed prompt and the link takes its layer and size."""
        link = self.runtime.link
        return link is not None and not self.runtime.streams(x.shape[0]) and link.serves(self.layer, x)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                dense=None) -> torch.Tensor:
        """x [T, D], expert_ids / expert_weights [T, k] -> [T, D] (+ dense(x), the shared expert, when given)."""
        rt = self.runtime
        if self._linked(x):  # asked and waited for on the device: no host wait, capturable
            slot = rt.cache.device_slots(self.layer, expert_ids) if rt.cache is not None else None  # [T, k] or -1
            cpu_ids = expert_ids if slot is None else torch.where(slot >= 0, -1, expert_ids)  # [T, k] -1: cached
            skip = rt.linked_skips(expert_weights)  # [T, k] bool (mixed precision) or None
            if skip is not None:  # skipped pairs run nowhere
                cpu_ids = torch.where(skip, -1, cpu_ids)
                slot = None if slot is None else torch.where(skip, -1, slot)
            rt.link.ask(self.layer, x, cpu_ids, expert_weights)
            cached = rt.cache.linked_pass(x, expert_weights, slot) if slot is not None else None  # [T, D]
            shared = dense(x) if dense is not None else None  # [T, D], while the CPU computes
            out = rt.link.answer(x.shape[0]).to(x.dtype, copy=True)  # [T, D], its own: the link's buffer is reused
            for part in (cached, shared):
                out = out if part is None else out + part
            return out
        streamed = rt.streams(x.shape[0])  # a prompt: missed experts streamed to x's device, not run on the CPU
        x_host, ids, weights = routing_to_host(x, expert_ids, expert_weights, not streamed)  # host [T, D], [T, k] x2
        choice = rt.choose(weights)  # [T, k] HIGH / LOW / SKIP, or None: every pair at the run's precision
        slot = rt.cache.where(self.layer, ids) if rt.cache is not None else None  # [T, k] slot or -1
        on_gpu, on_cpu = self._split(slot, choice)  # [T, k] bool each; None: no pair / every pair
        job = out = None
        if streamed:
            out = rt.streamer.compute(self.layer, x, ids, expert_weights, on_cpu)
        elif on_cpu is None or on_cpu.any():
            pairs = CpuPairs(ids, weights, on_cpu, rt.low_copy(choice))
            job = rt.start_cpu(self.layer, x_host, pairs)
        if on_gpu is not None and on_gpu.any():
            cached = rt.cache.slots.compute(x, expert_weights, torch.where(on_gpu, slot, rt.cache.slots.none))
            out = cached if out is None else out + cached
        shared = dense(x) if dense is not None else None
        if rt.cache is not None:
            rt.cache.account(self.layer, ids, choice if choice is not None else torch.zeros_like(ids),
                             on_cpu if on_cpu is not None else torch.ones_like(ids, dtype=torch.bool))
        if job is not None:
            y = job.result().to(x.device, x.dtype)  # [T, D]
            out = y if out is None else out + y
        if out is None:
            out = torch.zeros_like(x)
        rt.count(ids.numel(), on_gpu, on_cpu, choice, streamed,
                 x.shape[0] if self.layer == rt.placement.cpu_layers[0] else 0)
        return out if shared is None else out + shared

    @staticmethod
    def _split(slot: torch.Tensor | None, choice: torch.Tensor | None):
        """(on_gpu, on_cpu) [T, k] masks from the slots (None: no cache) and the precision choice (None: no skips);
        on_gpu None: no pair in a slot, on_cpu None: every pair on the CPU."""
        kept = None if choice is None else choice != SKIP
        if slot is None:
            return None, kept
        cached = slot >= 0
        return (cached, ~cached) if kept is None else (cached & kept, ~cached & kept)
