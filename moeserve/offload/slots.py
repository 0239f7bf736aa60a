"""Fixed expert slots in fast memory for one precision tier: buffers allocated once, no allocation on
the hot path.

A slot holds one expert's parts (high: gate_up [2F, D], down [D, F]; low: the packed weight, scales and zeros of
both projections; then, for biased experts, their biases gate_up [2F], down [D]). The cache's logical decisions
(CacheState) are mapped onto physical slots here. A slot freed by an eviction while the current chunk of work still
reads it goes to `pending` and is reused only after that chunk is computed; `reserve` slots beyond the logical
capacity give room for the experts loaded and used once (streamed) and for those deferred frees.

Each slot records two CUDA events: when its last load finished (compute waits on it) and when the last
computation that read it was enqueued (the next load into it waits on that).
"""

from __future__ import annotations

import torch

from moeserve.kernels.cpu.gemv import forget_packed
from moeserve.offload.cache_state import Key


class SlotPool:
    def __init__(self, num_slots: int, part_shapes: list[tuple[tuple[int, ...], torch.dtype]], device,
                 make_weights):
        """make_weights(parts) -> the object expert_ffn computes with (views of the slot's buffers)."""
        # zeros, not garbage: a fused pass computes unloaded slots with weight zero, and 0 * a garbage NaN is NaN
        self.buffers = [torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in part_shapes]
        self.weights = [make_weights([b[s] for b in self.buffers]) for s in range(num_slots)]
        self.slot_of: dict[Key, int] = {}  # experts kept in this pool
        self.free = list(range(num_slots))[::-1]
        self.pending: list[int] = []
        cuda = torch.device(device).type == "cuda"
        self.loaded = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self.used = [None] * num_slots  # event after the last computation that read the slot

    @property
    def num_slots(self) -> int:
        return len(self.weights)

    def load_parts(self, slot: int) -> list[torch.Tensor]:
        """The slot's buffers, for a load of another expert into them: what the CPU kernels derived from the
        expert they held (a repacked weight kept on the slot's modules) is dropped."""
        weights = self.weights[slot]
        for m in weights if isinstance(weights, tuple) else ():  # an Mxfp4Expert keeps nothing derived
            if not isinstance(m, torch.Tensor):
                forget_packed(m)
        return [b[slot] for b in self.buffers]

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def keep(self, key: Key, slot: int) -> None:
        self.slot_of[key] = slot

    def evict(self, key: Key, deferred: bool) -> None:
        """Forget `key`; its slot is free now, or after the chunk in flight when `deferred`."""
        (self.pending if deferred else self.free).append(self.slot_of.pop(key))

    def release(self, slot: int) -> None:
        """A streamed (not kept) slot, or the pending ones (slot None), become free."""
        if slot is None:
            self.free += self.pending
            self.pending = []
        else:
            self.free.append(slot)
