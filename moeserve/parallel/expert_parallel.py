"""Dropless expert parallelism: each rank holds E / P experts of a layer; tokens travel to the ranks that hold
their experts and back with all_to_all_single, each token once per destination rank (not once per expert).
Ranks with no tokens take part all the same. Layouts (dynamic / static) are in dispatch.py, the choice between
them in plan.py. The dispatch all-to-all runs asynchronously, so dense work (the shared expert) overlaps it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from moeserve.kernels.routing import RoutingTable, build_routing_table, combine
from moeserve.model.experts import ExpertBackend, expert_tensors, set_expert_tensor
from moeserve.parallel.collectives import all_gather_uneven
from moeserve.parallel.dispatch import dynamic_rows, static_rows
from moeserve.parallel.groups import check_experts, expert_share, split_range
from moeserve.parallel.hierarchical import hierarchical_all_to_all
from moeserve.parallel.defaults import STATIC_MAX_TOKENS
from moeserve.parallel.plan import DispatchPlan
from moeserve.quant.mxfp4 import stored_experts
from moeserve.quant.qlinear import QuantizedExperts


class ExpertParallelExperts(ExpertBackend):
    """Expert backend over `local` (a backend holding this rank's experts: float, MXFP4 or low-bit). A layer with
    fewer experts than ranks is held by several copies of consecutive ranks (groups.expert_share); each rank
    dispatches within its own copy."""

    overlaps_dense = True  # MoEBlock hands it the shared expert to compute while tokens are in flight

    def __init__(self, local: nn.Module, num_experts: int, group, group_rank: int, group_size: int,
                 hierarchy: tuple | None = None, tp: tuple | None = None, plan: DispatchPlan | None = None):
        """hierarchy = (ranks per node, intra group, inter group): hierarchical all-to-all (EP over the
        whole world only). tp = (group, rank, size): the TP ranks hold the same tokens, so each dispatches
        only its share and an all-gather restores the rest (DeepSpeed-MoE's coordinated communication).
        plan: static buffers when it says so (shared by the layers; None = always dynamic)."""
        super().__init__()
        self.local, self.num_experts, self.group, self.hierarchy, self.tp = local, num_experts, group, hierarchy, tp
        self.rank, self.size, self.plan = group_rank, group_size, plan
        self.per_rank = check_experts(num_experts, group_size)
        self.base = expert_share(num_experts, group_size, group_rank)[1]  # first rank of this rank's copy

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "expert_parallel"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                dense: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, D] -> gate-weighted expert outputs [T, D], plus dense(x) when given (computed while the
        dispatch all-to-all is in flight)."""
        T = x.shape[0]
        mine = self._share(T)
        static = self.plan is not None and self.hierarchy is None
        capacity = self.plan.layer_capacity(T) if static else None  # rows per destination, or None: dynamic
        finish = self._start(x[mine], expert_ids[mine], expert_weights[mine], capacity)
        extra = dense(x) if dense is not None else None  # overlaps the dispatch all-to-all
        y = finish()  # [share, D]
        if self.tp is not None:
            group, _, size = self.tp
            y = all_gather_uneven(y.T, [len(split_range(T, r, size)) for r in range(size)], group).T  # [T, D]
        return y if extra is None else y + extra

    def _share(self, T: int) -> slice:
        """The tokens this rank dispatches: all of them, or its share among TP ranks holding the same tokens."""
        if self.tp is None:
            return slice(0, T)
        _, rank, size = self.tp
        r = split_range(T, rank, size)
        return slice(r.start, r.stop)

    def _start(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
               capacity: int | None) -> Callable:
        """Send this rank's tokens (asynchronously), in static buffers of `capacity` rows per destination or
        dynamically (None); returns finish() -> their gate-weighted outputs [T, D]."""
        P, T, D = self.size, x.shape[0], x.shape[1]
        if capacity is not None:
            assert T <= capacity, "the dispatch plan was agreed for fewer tokens than this layer got"
            sends = static_rows(x, expert_ids, expert_weights, self.per_rank, P, capacity, self.base)  # [P*C, D|k|k]
            inflight = [self._exchange(t) for t in sends]

            def finish_static():
                y_back = self._wait(self._exchange(self._local_experts(*map(self._wait, inflight))))  # [P*C, D]
                return y_back.view(P, capacity, D).sum(0)[:T].to(x.dtype)  # sum the ranks' partial outputs

            return finish_static
        rows = dynamic_rows(expert_ids, expert_weights, self.per_rank, P, self.base)
        recv_counts = torch.empty_like(rows.counts)
        dist.all_to_all_single(recv_counts, rows.counts, group=self.group)
        sc, rc = rows.counts.tolist(), recv_counts.tolist()  # the dynamic mode's host sync
        inflight = [self._exchange(t, sc, rc) for t in (x[rows.token], rows.local_ids, rows.weights)]

        def finish_dynamic():
            y_back = self._wait(self._exchange(self._local_experts(*map(self._wait, inflight)), rc, sc))  # [n, D]
            return torch.zeros_like(x).index_add_(0, rows.token, y_back.to(x.dtype))

        return finish_dynamic

    def _exchange(self, send: torch.Tensor, send_counts: list[int] | None = None,
                  recv_counts: list[int] | None = None) -> tuple[torch.Tensor, object]:
        """Start an all-to-all (equal splits when no counts): (receive buffer, work to wait on or None)."""
        send = send.contiguous()
        if self.hierarchy is not None:  # synchronous: (ranks per node, intra-node group, inter-node group)
            return hierarchical_all_to_all(send, send_counts, *self.hierarchy), None
        recv = torch.empty_like(send) if recv_counts is None else send.new_empty((sum(recv_counts), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group, async_op=True)
        return recv, work

    @staticmethod
    def _wait(pending: tuple[torch.Tensor, object]) -> torch.Tensor:
        recv, work = pending
        if work is not None:
            work.wait()
        return recv

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Received rows x [N, D] with their slots ids/weights [N, k] (-1: not here) -> [N, D] gate-weighted.

        No nonzero(): slots that are not here go to a sentinel expert past the last, which sorts them to the
        end where the experts never read them, so shapes do not depend on the routing."""
        N, k = ids.shape
        here = ids >= 0  # [N, k]
        table = build_routing_table(torch.where(here, ids, self.per_rank), weights * here, self.per_rank + 1)
        real = RoutingTable(table.token_ids, table.weights, table.counts[:-1], table.offsets[:-1], table.num_tokens)
        y = self.local.run_sorted(x[table.token_ids], real)  # [N*k, D]; rows past the real slots are unset
        y = torch.where((torch.arange(N * k, device=x.device) < real.offsets[-1])[:, None], y, 0)
        return combine(y, table, N, x.dtype)


def enable_expert_parallel(model, group, group_rank: int, group_size: int, hierarchy: tuple | None = None,
                           tp: tuple | None = None, static_max_tokens: int = STATIC_MAX_TOKENS) -> None:
    """Keep this rank's slice of every MoE layer's experts (each layer its own, when layers differ) and route
    through all-to-all. Works on a model whose experts are still on the meta device (sharded loading fills them in
    afterwards).

    static_max_tokens: tokens per rank up to which dispatch uses static buffers (0 = always dynamic)."""
    spec = model.spec
    plan = DispatchPlan(group, model.device, static_max_tokens, tp[2] if tp is not None else 1)
    plan.install(model)
    for i, layer in enumerate(model.model.layers):
        full = getattr(layer.mlp, "experts", None)
        if full is None:
            continue
        mine = expert_share(spec.moe.experts_at(i), group_size, group_rank)[0]
        layer.mlp.experts = ExpertParallelExperts(local_experts(full, spec, mine), spec.moe.experts_at(i), group,
                                                  group_rank, group_size, hierarchy, tp, plan)


def local_experts(full: ExpertBackend, spec, mine: range) -> ExpertBackend:
    """The experts `mine` of a layer's backend `full` (loaded or on the meta device): low-bit ones are its own
    per-expert layers; float or MXFP4 ones a backend of copies of their slice of every stacked tensor."""
    if isinstance(full, QuantizedExperts):
        return QuantizedExperts(list(full.gate_up[mine.start:mine.stop]), list(full.down[mine.start:mine.stop]),
                                full.act)
    with torch.device("meta"):  # shapes only: the weights are this rank's slice of the full ones
        local = stored_experts(spec, len(mine))  # float or MXFP4, with the family's biases and activation
    for name, t in expert_tensors(full):
        set_expert_tensor(local, name, t[mine.start:mine.stop].detach().clone())  # every expert tensor: [E, ...]
    return local
