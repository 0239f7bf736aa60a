"""Dropless expert parallelism: each rank holds E / P experts of a layer; tokens travel to the ranks
that hold their experts and back with all_to_all_single, each token once per destination rank (not
once per expert), with the split sizes exchanged first. Ranks with no tokens take part all the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeserve.kernels.routing import build_routing_table, combine
from moeserve.parallel.hierarchical import hierarchical_all_to_all


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
              hierarchy: tuple | None = None) -> torch.Tensor:
    if hierarchy is not None:  # (ranks per node, intra-node group, inter-node group)
        return hierarchical_all_to_all(send.contiguous(), send_counts, *hierarchy)
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group)
    return recv


class ExpertParallelExperts(nn.Module):
    """Expert backend over `local` (a backend holding this rank's experts, e.g. ResidentExperts)."""

    def __init__(self, local: nn.Module, num_experts: int, group, group_rank: int, group_size: int,
                 hierarchy: tuple | None = None, tp: tuple | None = None):
        """hierarchy = (ranks per node, intra group, inter group): hierarchical all-to-all (EP over the
        whole world only). tp = (group, rank, size): the TP ranks hold the same tokens, so each dispatches
        only its share and an all-gather restores the rest (DeepSpeed-MoE's coordinated communication)."""
        super().__init__()
        self.local, self.num_experts, self.group, self.hierarchy, self.tp = local, num_experts, group, hierarchy, tp
        self.rank, self.size = group_rank, group_size
        self.per_rank = num_experts // group_size

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.dispatch(x, expert_ids, expert_weights)
        group, rank, size = self.tp
        shares = [len(r) for r in torch.arange(x.shape[0]).tensor_split(size)]  # same on every TP rank
        start = sum(shares[:rank])
        mine = slice(start, start + shares[rank])
        y = self.dispatch(x[mine], expert_ids[mine], expert_weights[mine])  # [share, D]
        width = max(shares)
        padded = torch.cat([y, y.new_zeros(width - y.shape[0], y.shape[1])])
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, shares)])

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """This rank's tokens to the experts' ranks and back: [T, D] gate-weighted expert outputs."""
        T, k = expert_ids.shape
        P, E_local = self.size, self.per_rank
        dest = expert_ids // E_local  # [T, k] destination rank of each selected expert
        token = torch.arange(T, device=x.device).unsqueeze(1).expand(T, k)
        # one row per (destination rank, token): sorted by rank, so rows for each rank are contiguous
        pair, slot_row = torch.unique((dest * T + token).flatten(), return_inverse=True)  # [n_send], [T*k]
        send_token, send_rank = pair % max(T, 1), pair // max(T, 1)
        send_counts = torch.bincount(send_rank, minlength=P)  # [P]
        # per row, the k slots it carries: local expert id (or -1) and gate weight
        local_ids = torch.full((pair.numel(), k), -1, dtype=torch.long, device=x.device)
        weights = torch.zeros((pair.numel(), k), dtype=expert_weights.dtype, device=x.device)
        slot = torch.arange(k, device=x.device).repeat(T)
        local_ids[slot_row, slot] = (expert_ids % E_local).flatten()
        weights[slot_row, slot] = expert_weights.flatten()

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        h = self.hierarchy
        x_recv = _exchange(x[send_token], sc, rc, self.group, h)  # [n_recv, D]
        ids_recv = _exchange(local_ids, sc, rc, self.group, h)  # [n_recv, k]
        w_recv = _exchange(weights, sc, rc, self.group, h)

        y_recv = self._local_experts(x_recv, ids_recv, w_recv)  # [n_recv, D], already gate-weighted
        y_back = _exchange(y_recv, rc, sc, self.group, h)  # [n_send, D]
        return torch.zeros_like(x).index_add_(0, send_token, y_back.to(x.dtype))

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        row, slot = (ids >= 0).nonzero(as_tuple=True)  # the (row, slot) pairs meant for this rank
        table = build_routing_table(ids[row, slot].unsqueeze(1), weights[row, slot].unsqueeze(1), self.per_rank)
        x_pairs = x[row]
        y_pairs = combine(self.local.run_sorted(x_pairs[table.token_ids], table), table, row.numel(), x.dtype)
        return torch.zeros_like(x).index_add_(0, row, y_pairs)


def enable_expert_parallel(model, group, group_rank: int, group_size: int, hierarchy: tuple | None = None,
                           tp: tuple | None = None) -> None:
    """Keep this rank's slice of every MoE layer's experts and route through all-to-all."""
    from moeserve.model.experts import ResidentExperts
    from moeserve.parallel.groups import check_experts

    per_rank = check_experts(model.spec.num_experts, group_size)
    lo = group_rank * per_rank
    for layer in model.model.layers:
        full = getattr(layer.mlp, "experts", None)
        if full is None:
            continue
        local = ResidentExperts(per_rank, model.spec.hidden_size, model.spec.expert_ffn)
        local.gate_up_proj = nn.Parameter(full.gate_up_proj[lo:lo + per_rank].detach().clone(), requires_grad=False)
        local.down_proj = nn.Parameter(full.down_proj[lo:lo + per_rank].detach().clone(), requires_grad=False)
        layer.mlp.experts = ExpertParallelExperts(local, model.spec.num_experts, group, group_rank, group_size,
                                                  hierarchy, tp)
