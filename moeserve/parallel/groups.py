"""Rank layout for parallel inference (DeepSpeed-MoE's parallelism-coordinated layout).

Ranks form a grid: tensor-parallel groups are `tp` consecutive ranks; expert-parallel groups are made of
ranks with the same tensor-parallel rank, `ep` at a time, so each TP rank exchanges tokens only with
its peers (all-to-all among p / tp ranks instead of p). Pure functions, plus the torch.distributed
groups built from them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from moeserve.errors import MoeserveError
from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class RankGrid:
    world: int
    tp: int = 1
    ep: int | None = None  # default: every rank with the same TP rank

    def __post_init__(self):
        if self.tp < 1 or self.world % self.tp:
            raise MoeserveError(f"world size {self.world} is not divisible by the tensor-parallel size {self.tp}")
        if self.ep is None:
            object.__setattr__(self, "ep", self.world // self.tp)
        if self.ep < 1 or (self.world // self.tp) % self.ep:
            raise MoeserveError(f"expert-parallel size {self.ep} must divide world / tp = {self.world // self.tp}")

    def tp_groups(self) -> list[list[int]]:
        return [list(range(s, s + self.tp)) for s in range(0, self.world, self.tp)]

    def ep_groups(self) -> list[list[int]]:
        groups = []
        for tp_rank in range(self.tp):
            peers = list(range(tp_rank, self.world, self.tp))
            groups += [peers[s:s + self.ep] for s in range(0, len(peers), self.ep)]
        return groups

    def group_of(self, rank: int, groups: list[list[int]]) -> list[int]:
        return next(g for g in groups if rank in g)


def check_experts(num_experts: int, ep: int) -> int:
    """Experts per rank of a layer of num_experts experts over ep ranks: E / ep when ep divides E, 1 when E divides
    ep (the layer is held ep / E times, DeepSpeed-MoE's expert + data parallelism for PR-MoE's smaller layers);
    otherwise an error."""
    if num_experts % ep and ep % num_experts:
        raise MoeserveError(f"{num_experts} experts cannot be spread over {ep} expert-parallel ranks (needs a "
                            f"divisor or a multiple of {num_experts}; use --tp to slice each expert over more ranks "
                            f"instead)")
    return max(num_experts // ep, 1)


def expert_share(num_experts: int, ep: int, rank: int) -> tuple[range, int]:
    """(the experts `rank` holds, the first rank of its copy of the layer). A layer with fewer experts than ranks
    is held by ep / E copies of E consecutive ranks each; a rank dispatches its tokens within its own copy."""
    per = check_experts(num_experts, ep)
    span = num_experts // per  # ranks that hold one copy of the layer
    start = (rank % span) * per
    return range(start, start + per), rank // span * span


def split_range(n: int, rank: int, size: int) -> range:
    """The share of `rank` in n items split over `size` ranks: contiguous, sizes differing by at most one,
    the larger ones first (torch.tensor_split's split)."""
    per, extra = divmod(n, size)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (rank < extra))


def new_groups(grid: RankGrid, rank: int, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """(tp group, ep group) process groups of `rank`; every rank must call this (new_group is collective).
    timeout_s: their collectives' wait for a peer (a new group does not take the default group's)."""
    import torch.distributed as dist  # on use: the rank-grid arithmetic stays importable without torch

    mine = {}
    for kind, groups in (("tp", grid.tp_groups()), ("ep", grid.ep_groups())):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                mine[kind] = (group, ranks)
    return mine["tp"], mine["ep"]
