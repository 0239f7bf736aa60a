"""Rank policies: how many compensator ranks each weight gets (MiLo's "mixture of low-rank compensators").

A policy is a comma-separated list of `target=value` rules (a bare value means target `all`); a later
rule overrides an earlier one for the tensor kinds both cover.

    targets  all | dense (= attention + shared + dense_ffn) | attention | shared | dense_ffn | experts
    values   N | uniform:N        every tensor of the target gets rank N
             kurtosis:N           rank proportional to the weight's kurtosis, mean N
             frequency:N          (experts) rank proportional to how often the expert is routed to, mean N
             <value>:4MiB / 4MiB  memory budget: the largest ranks (by the same signal) whose compensators
                                  fit in that many bytes, e.g. `experts=kurtosis:2MiB`, `dense=512KB`

Examples: `uniform:16`, `dense=512,experts=kurtosis:16`, `dense=1MiB,experts=frequency:8`.

A rank never exceeds min(out, in) of its matrix (a larger one adds nothing): budgets stay within it by
construction, and clamp_ranks cuts the ranks asked by N, uniform or signal rules to it and says so once,
so one policy (the default `dense=512,...`) serves a 256-wide demo as well as a 4096-wide model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.errors import MoeserveError
from moeserve.quant.milo import compensator_bytes
from moeserve.units import parse_bytes

TARGETS = {"all": ("attention", "shared_expert", "dense_ffn", "expert"),
           "dense": ("attention", "shared_expert", "dense_ffn"), "attention": ("attention",),
           "shared": ("shared_expert",), "dense_ffn": ("dense_ffn",), "experts": ("expert",)}
SIGNALS = ("uniform", "kurtosis", "frequency")


@dataclass(frozen=True)
class TensorInfo:
    name: str  # module name that will hold the quantized weight
    kind: str  # attention | shared_expert | dense_ffn | expert
    layer: int
    expert: int | None
    shape: tuple[int, int]  # [out, in]


@dataclass(frozen=True)
class RankRule:
    kinds: tuple[str, ...]
    signal: str  # uniform | kurtosis | frequency
    mean_rank: int | None = None  # rank (uniform) or mean rank (signals)
    budget_bytes: int | None = None


def parse_rank_policy(text: str) -> list[RankRule]:
    rules = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        target, _, value = entry.rpartition("=")
        target = target.strip() or "all"
        if target not in TARGETS:
            raise MoeserveError(f"unknown rank target {target!r} in {entry!r}; targets: {', '.join(TARGETS)}")
        signal, _, amount = value.rpartition(":")
        signal = signal.strip() or "uniform"
        if signal not in SIGNALS:
            raise MoeserveError(f"unknown rank signal {signal!r} in {entry!r}; signals: {', '.join(SIGNALS)}")
        budget = parse_bytes(amount)
        if budget is None and not amount.strip().isdigit():
            raise MoeserveError(f"bad rank value {amount!r} in {entry!r}: expected a rank like 16 or a size like 4MiB")
        if signal == "frequency" and target != "experts":
            raise MoeserveError(f"frequency ranks apply to experts only, not {target!r}")
        rules.append(RankRule(TARGETS[target], signal, None if budget is not None else int(amount), budget))
    if not rules:
        raise MoeserveError("empty rank policy; e.g. 'uniform:16' or 'dense=512,experts=kurtosis:16'")
    return rules


# ---- signals ---------------------------------------------------------------------------------


def weight_kurtosis(W: torch.Tensor) -> float:
    """Pearson kurtosis E[(w - mu)^4] / sigma^4 of all entries (3 for a Gaussian; heavy tails more)."""
    w = W.double().flatten()
    d = w - w.mean()
    return float(d.pow(4).mean() / d.pow(2).mean().clamp_min(1e-30) ** 2)


@torch.no_grad()
def expert_frequency(model, ids: list[int], window: int = 512) -> dict[tuple[int, int], int]:
    """How often each (layer, expert) is selected when the model reads `ids` (windows of `window`)."""
    counts: dict[tuple[int, int], int] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue

        def record(_, args, i=i):
            for e, n in enumerate(torch.bincount(args[1].flatten(), minlength=experts.num_experts).tolist()):
                counts[(i, e)] = counts.get((i, e), 0) + n

        hooks.append(experts.register_forward_pre_hook(record))
    try:
        for s in range(0, len(ids), window):
            model(torch.tensor([ids[s:s + window]], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return counts


# ---- assignment ------------------------------------------------------------------------------


def assign_ranks(tensors: list[TensorInfo], policy: list[RankRule], *, kurtosis: dict[str, float] | None = None,
                 frequency: dict[tuple[int, int], int] | None = None, compensator_bits: int = 16) -> dict[str, int]:
    """Rank per tensor name (0 = no compensator) as the policy asks; a rank or mean rank larger than a matrix
    allows is left for clamp_ranks to cut (and report)."""
    owner = {}
    for rule in policy:
        for t in tensors:
            if t.kind in rule.kinds:
                owner[t.name] = rule
    ranks = {t.name: 0 for t in tensors}
    for rule in dict.fromkeys(owner.values()):
        members = [t for t in tensors if owner.get(t.name) is rule]
        if not members:
            continue
        weights = _signal(rule.signal, members, kurtosis, frequency)
        if rule.budget_bytes is not None:
            ranks.update(_ranks_in_budget(members, weights, rule.budget_bytes, compensator_bits))
        elif rule.signal == "uniform":
            ranks.update({t.name: rule.mean_rank for t in members})
        else:
            ranks.update(_proportional(members, weights, rule.mean_rank))
    return ranks


def _signal(signal, members, kurtosis, frequency) -> list[float]:
    if signal == "uniform":
        return [1.0] * len(members)
    if signal == "kurtosis":
        if kurtosis is None:
            raise MoeserveError("kurtosis ranks need the weights' kurtosis")
        return [kurtosis[t.name] for t in members]
    if frequency is None:
        raise MoeserveError("frequency ranks need expert routing counts (run the model on a text first)")
    return [float(frequency.get((t.layer, t.expert), 0)) for t in members]


def _proportional(members: list[TensorInfo], weights: list[float], mean_rank: int) -> dict[str, int]:
    """Ranks proportional to `weights`, summing to mean_rank * n (largest remainder)."""
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(members), float(len(members))
    ideal = [mean_rank * len(members) * w / total for w in weights]
    ranks = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(ideal)), key=lambda i: ideal[i] - ranks[i], reverse=True)
    for i in by_remainder[:mean_rank * len(members) - sum(ranks)]:
        ranks[i] += 1
    return {t.name: r for t, r in zip(members, ranks)}


@dataclass(frozen=True)
class RankClamp:
    """Tensors whose asked rank exceeded min(out, in) of their matrix and were given that instead."""
    count: int
    example: TensorInfo  # the tensor cut the most
    asked: int  # its asked rank

    def message(self) -> str:
        return (f"clamped the rank of {self.count} tensor(s) to min(out, in) of their matrix (e.g. "
                f"{self.example.name} {self.example.shape}: {self.asked} -> {min(self.example.shape)})")


def clamp_ranks(tensors: list[TensorInfo], ranks: dict[str, int]) -> tuple[dict[str, int], RankClamp | None]:
    """Ranks cut to min(out, in) of each matrix, and what was cut (None when nothing was)."""
    over = [t for t in tensors if ranks[t.name] > min(t.shape)]
    clamped = {t.name: min(ranks[t.name], min(t.shape)) for t in tensors}
    if not over:
        return clamped, None
    worst = max(over, key=lambda t: ranks[t.name] - min(t.shape))
    return clamped, RankClamp(len(over), worst, ranks[worst.name])


def _ranks_in_budget(members, weights, budget: int, bits: int) -> dict[str, int]:
    """Largest c such that ranks floor(c * w_i) (capped by shape) fit in `budget` bytes."""
    def ranks_at(c):
        return {t.name: min(int(c * w), min(t.shape)) for t, w in zip(members, weights)}

    def cost(r):
        return sum(compensator_bytes(t.shape, r[t.name], bits) for t in members)

    lo, hi = 0.0, max(min(t.shape) / w for t, w in zip(members, weights) if w > 0) if any(weights) else 0.0
    if cost(ranks_at(hi)) <= budget:
        return ranks_at(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(ranks_at(mid)) <= budget else (lo, mid)
    return ranks_at(lo)
