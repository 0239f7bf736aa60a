"""Balanced micro-batches: split requests of different prompt lengths so every micro-batch carries about the
same number of tokens (the pipeline's stages then take about the same time) and each one is padded only to
its own longest prompt, never to the longest of the whole batch."""

from __future__ import annotations

from moeserve.errors import MoeserveError


def balanced_micro_batches(lengths: list[int], micro_batch: int) -> list[list[int]]:
    """Request indices grouped into ceil(len / micro_batch) micro-batches of at most `micro_batch` each.

    Longest first, each request goes to the micro-batch with the fewest tokens so far that still has room
    (greedy LPT), so the fullest one holds at most total / num_micro_batches + the longest prompt tokens.
    Indices inside a micro-batch are in request order.
    """
    if micro_batch < 1:
        raise MoeserveError(f"micro-batch size must be positive, got {micro_batch}")
    count = -(-len(lengths) // micro_batch)
    groups: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        m = min((m for m in range(count) if len(groups[m]) < micro_batch), key=lambda m: (tokens[m], m))
        groups[m].append(i)
        tokens[m] += lengths[i]
    return [sorted(g) for g in groups]


def padded_tokens(lengths: list[int], groups: list[list[int]]) -> int:
    """Token slots the prefill computes: each micro-batch padded to its own longest prompt."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
