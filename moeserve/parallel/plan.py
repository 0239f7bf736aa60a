"""Static or dynamic dispatch, agreed once per forward pass (DeepSpeed-MoE's small-batch inference).

At decode sizes the all-to-all is latency-bound, and reading split sizes back to the host in every MoE layer
stalls the device. So when every rank of an expert-parallel group dispatches at most `threshold` tokens, all
layers of that pass use static buffers of `capacity` = the largest count rows per destination. The ranks agree
on that number with one all-reduce per forward pass (a host sync per pass, not per layer); they must, or one
would call the static all-to-all while another waits in the dynamic one.

The static decode step (engine/cuda_graph.py: the step a CUDA graph captures, in pieces cut before every
expert-parallel layer) is not a forward() call, so no agreement precedes it: there each layer agrees for itself
(`layer_capacity`), one all-reduce per layer, as the dynamic mode's split sizes cost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeserve.parallel.defaults import STATIC_MAX_TOKENS


class DispatchPlan:
    def __init__(self, group, device: torch.device, threshold: int = STATIC_MAX_TOKENS, tp_size: int = 1):
        """tp_size: under coordinated TP x EP each TP rank dispatches 1/tp of the tokens."""
        self.group, self.device, self.threshold, self.tp_size = group, device, threshold, tp_size
        self.capacity: int | None = None  # rows per destination this pass; None = dynamic
        self.agreed = False  # begin() ran for the pass under way: its layers use self.capacity

    def begin(self, num_tokens: int) -> None:
        """Collective over the group: call with this rank's token count before a forward pass; its layers use the
        agreement until end()."""
        self.capacity = self._agree(num_tokens)
        self.agreed = True

    def end(self) -> None:
        self.agreed = False

    def layer_capacity(self, num_tokens: int) -> int | None:
        """The static capacity for a layer that got num_tokens tokens (None: dynamic): the pass's, or outside an
        agreed pass one agreed for this layer now (collective over the group)."""
        return self.capacity if self.agreed else self._agree(num_tokens)

    def _agree(self, num_tokens: int) -> int | None:
        rows = -(-num_tokens // self.tp_size)  # this rank's share (the first TP rank's, the largest)
        most = torch.tensor([rows], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        most = int(most.item())
        return most if most <= self.threshold else None

    def install(self, model) -> None:
        """Begin every forward pass of `model` (tokens [B, S], first argument) with the agreement, end it after
        (also when the pass raised)."""
        def begin(_, args, kwargs):
            tokens = args[0] if args else kwargs["tokens"]
            self.begin(tokens.numel())

        model.register_forward_pre_hook(begin, with_kwargs=True)
        model.register_forward_hook(lambda *_: self.end(), always_call=True)
