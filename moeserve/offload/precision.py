"""HOBBIT's token-level precision choice for the experts a token selects.

Rank the token's experts by gate weight (normalised to sum 1); expert i's "unimportance" is the gate
mass of the experts ranked before it, s_i = sum_{j<i} g_j. s_i <= T1: high precision; T1 < s_i <= T2:
low precision; s_i > T2: skipped. The top-1 expert (s = 0) is therefore always high precision.
HOBBIT uses T1 = 0.6, T2 = 0.9 for Mixtral.
"""

from __future__ import annotations

import torch

HIGH, LOW, SKIP = 0, 1, 2
HOBBIT_T1, HOBBIT_T2 = 0.6, 0.9


def choose_precision(weights: torch.Tensor, t1: float = HOBBIT_T1, t2: float = HOBBIT_T2) -> torch.Tensor:
    """weights [T, k] gate weights of the selected experts -> [T, k] HIGH / LOW / SKIP per expert (long, on the
    weights' device; no host sync, so a CUDA graph may capture it)."""
    if not 0 <= t1 <= t2:
        raise ValueError(f"thresholds must satisfy 0 <= T1 <= T2, got T1={t1}, T2={t2}")
    g = weights.float() / weights.float().sum(-1, keepdim=True).clamp_min(1e-12)  # [T, k]
    order = torch.argsort(g, dim=-1, descending=True)
    ranked = torch.gather(g, -1, order)
    unimportance = torch.cumsum(ranked, -1) - ranked  # s_i = sum_{j<i} g_j, [T, k]
    choice = torch.where(unimportance <= t1, HIGH, torch.where(unimportance > t2, SKIP, LOW))  # [T, k] ranked
    choice[:, 0] = HIGH  # the top-1 expert is always high precision
    return torch.empty_like(choice).scatter_(-1, order, choice)  # back to the input order
