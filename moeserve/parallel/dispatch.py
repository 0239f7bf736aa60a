"""Where each token goes in expert parallelism: pure layout functions, no communication.

Two layouts of what a rank sends, both once per (token, destination rank) and not once per (token, expert):
  dynamic - only the rows a destination needs, grouped by destination; the split sizes vary per step, so they
            are exchanged and read on the host before the all-to-all;
  static  - `capacity` rows for every destination, row t = token t (padding past the real tokens), slots that
            are not the destination's marked -1; equal splits, static shapes, nothing read on the host.
A row carries its token's k slots: the local expert id on the destination (-1: not there) and the gate weight.
Destinations are ranks base + expert // per_rank: base is the first rank of the sender's copy of the layer
(groups.expert_share; 0 unless the layer has fewer experts than ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SendRows:
    token: torch.Tensor  # [n] source token of each row, rows grouped by destination rank
    counts: torch.Tensor  # [P] rows per destination rank
    local_ids: torch.Tensor  # [n, k] expert id on the destination, -1 for slots elsewhere
    weights: torch.Tensor  # [n, k] gate weights (0 for slots elsewhere)


def dynamic_rows(expert_ids: torch.Tensor, expert_weights: torch.Tensor, per_rank: int, ranks: int,
                 base: int = 0) -> SendRows:
    """One row per (destination rank, token) that has at least one expert there, sorted by rank."""
    T, k = expert_ids.shape
    dest = base + expert_ids // per_rank  # [T, k] destination rank of each selected expert
    token = torch.arange(T, device=expert_ids.device).unsqueeze(1).expand(T, k)  # [T, k]
    pair, row_of_slot = torch.unique((dest * T + token).flatten(), return_inverse=True)  # [n], [T*k]
    local_ids = torch.full((pair.numel(), k), -1, dtype=torch.long, device=expert_ids.device)
    weights = expert_weights.new_zeros((pair.numel(), k))
    slot = torch.arange(k, device=expert_ids.device).repeat(T)  # [T*k]
    local_ids[row_of_slot, slot] = (expert_ids % per_rank).flatten()
    weights[row_of_slot, slot] = expert_weights.flatten()
    return SendRows(token=pair % max(T, 1), counts=torch.bincount(pair // max(T, 1), minlength=ranks),
                    local_ids=local_ids, weights=weights)


def static_rows(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, per_rank: int, ranks: int,
                capacity: int, base: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [P*C, D], local ids [P*C, k], weights [P*C, k]): C = capacity rows per destination, row t = token t."""
    T, k = expert_ids.shape
    dest = base + expert_ids // per_rank  # [T, k]
    token = torch.arange(T, device=x.device).unsqueeze(1).expand(T, k)  # [T, k]
    slot = torch.arange(k, device=x.device).expand(T, k)  # [T, k]
    ids = torch.full((ranks, capacity, k), -1, dtype=torch.long, device=x.device)
    ids[dest, token, slot] = expert_ids % per_rank
    weights = expert_weights.new_zeros((ranks, capacity, k))
    weights[dest, token, slot] = expert_weights
    rows = x.new_zeros((capacity, x.shape[1]))
    rows[:T] = x
    send = rows.expand(ranks, capacity, x.shape[1])  # every token to every rank: its slots say if it is wanted
    return send.reshape(ranks * capacity, -1), ids.reshape(ranks * capacity, k), weights.reshape(ranks * capacity, k)


def rows_sent(expert_ids: torch.Tensor, per_rank: int, ranks: int, rank: int) -> dict:
    """Rows leaving `rank` for other ranks in one dispatch: once per (token, rank) as here, and once per
    (token, expert) as a per-expert all-to-all would send them."""
    no_weights = expert_ids.new_zeros(expert_ids.shape, dtype=torch.float)
    counts = dynamic_rows(expert_ids, no_weights, per_rank, ranks).counts  # [P]
    return {"per_rank": int(counts.sum() - counts[rank]), "per_expert": int((expert_ids // per_rank != rank).sum())}
