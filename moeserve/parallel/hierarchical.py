"""Hierarchical all-to-all for multi-node expert parallelism (DeepSpeed-MoE): an intra-node exchange,
a layout transform, and an inter-node exchange among ranks with the same local index, so each rank
talks across the network to N - 1 peers instead of P - 1. Same result as all_to_all_single.

Ranks are numbered node * G + local (G ranks per node)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S


def node_groups(world: int, per_node: int, rank: int, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """(intra-node group, inter-node group of the same local index) for `rank`; collective: all ranks call.
    timeout_s: their collectives' wait for a peer."""
    timeout = datetime.timedelta(seconds=timeout_s)
    intra = inter = None
    for n in range(world // per_node):
        g = dist.new_group(list(range(n * per_node, (n + 1) * per_node)), timeout=timeout)
        if rank // per_node == n:
            intra = g
    for local in range(per_node):
        g = dist.new_group(list(range(local, world, per_node)), timeout=timeout)
        if rank % per_node == local:
            inter = g
    return intra, inter


def _blocks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, sizes)) if x.shape[0] else [x[:0]] * len(sizes)


def hierarchical_all_to_all(send: torch.Tensor, send_counts: list[int], per_node: int, intra, inter) -> torch.Tensor:
    """Rows of `send` ordered by destination rank (send_counts[d] rows for rank d) -> rows received,
    ordered by source rank, exactly as all_to_all_single would return them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    N, G = world // per_node, per_node
    counts = torch.tensor(send_counts, dtype=torch.long)
    matrix = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(matrix, counts)  # matrix[s][d]: rows from s to d
    C = torch.stack(matrix).tolist()
    node, local = divmod(rank, G)
    # 1. intra-node: to local peer g' everything bound for ranks (*, g'), ordered by destination node
    chunks = _blocks(send, send_counts)  # by destination rank
    step1 = [torch.cat([chunks[n * G + g2] for n in range(N)]) for g2 in range(G)]
    recv1_sizes = [sum(C[node * G + g][n * G + local] for n in range(N)) for g in range(G)]
    out1 = send.new_empty((sum(recv1_sizes), *send.shape[1:]))
    dist.all_to_all_single(out1, torch.cat(step1), recv1_sizes, [b.shape[0] for b in step1], group=intra)
    # 2. layout transform: regroup what came from each local source g by destination node n
    from_local = _blocks(out1, recv1_sizes)
    by_node = [[] for _ in range(N)]
    for g, block in enumerate(from_local):
        for n, piece in enumerate(_blocks(block, [C[node * G + g][n * G + local] for n in range(N)])):
            by_node[n].append(piece)
    step3 = [torch.cat(pieces) for pieces in by_node]
    # 3. inter-node, among ranks with this local index: node n gets its block
    recv3_sizes = [sum(C[n * G + g][rank] for g in range(G)) for n in range(N)]
    out = send.new_empty((sum(recv3_sizes), *send.shape[1:]))
    dist.all_to_all_single(out, torch.cat(step3), recv3_sizes, [b.shape[0] for b in step3], group=inter)
    return out  # from (n, 0..G-1) for n in order: source-rank order
