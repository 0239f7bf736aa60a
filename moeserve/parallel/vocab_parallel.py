"""Vocab-parallel embedding and LM head (Megatron style): each TP rank holds a slice of the vocabulary rows,
so neither the largest dense matrices of a model nor their memory are replicated. The embedding looks up the
tokens it owns and an all-reduce fills in the rest; the head computes its slice of the logits and an
all-gather joins them. Same logits as one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeserve.parallel.collectives import all_gather_uneven
from moeserve.parallel.groups import split_range


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, rows: range, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V_r, D]
        self.rows, self.group = rows, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.rows.start) & (tokens < self.rows.stop)  # [B, S]
        local = torch.where(mine, tokens - self.rows.start, 0)
        x = F.embedding(local, self.weight) * mine[..., None]  # [B, S, D]: zero where another rank owns the token
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab: int, group, size: int):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab, self.group, self.size = vocab, group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [len(split_range(self.vocab, r, self.size)) for r in range(self.size)]
        return all_gather_uneven(F.linear(x, self.weight), sizes, self.group)  # [.., V_r] -> [.., V]


def enable_vocab_parallel(model, group, rank: int, size: int) -> None:
    """Keep this rank's vocabulary rows of the embedding and the head (one shared slice when they are tied)."""
    rows = split_range(model.spec.vocab_size, rank, size)
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight[rows.start:rows.stop].detach().clone(), rows, group)
    head = model.model.embed_tokens.weight if tied else model.lm_head.weight[rows.start:rows.stop].detach().clone()
    model.lm_head = VocabParallelHead(head, model.spec.vocab_size, group, size)
