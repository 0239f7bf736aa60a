"""Sampling parameters, checked when made; torch-free, so the command line checks them before torch loads."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
