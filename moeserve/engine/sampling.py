"""Next-token choice from logits: greedy, temperature, top-k, top-p, seeded (the parameters: engine/params.py)."""

from __future__ import annotations

import torch

from moeserve.engine.params import SamplingParams

def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] -> the same with filtered-out entries at -inf (the most likely token always survives)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (any dtype) -> next token ids [B]. Sampling runs on the CPU so seeds agree across devices."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1).cpu()  # [B, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


def sample_each(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> next token ids [B], row b drawn with generators[b]: each sequence its own seeded stream, so it
    samples the same tokens whatever it is batched with (as the engine loop samples each request)."""
    if params.greedy:
        return logits.float().argmax(dim=-1)
    return torch.cat([sample_next(logits[b:b + 1], params, g) for b, g in enumerate(generators)])
