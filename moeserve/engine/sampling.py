"""Sampling parameters and next-token choice: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.errors import MoeserveError

SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes 64-bit seeds
# temperatures below this are greedy (vLLM's epsilon): dividing logits by them overflows float32 to inf
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the text contains one (it is cut off)
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise MoeserveError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise MoeserveError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise MoeserveError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise MoeserveError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise MoeserveError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise MoeserveError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
