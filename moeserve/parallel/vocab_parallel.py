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

VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias")  # [V, D], [V]: split by rows


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
    def __init__(self, weight: torch.Tensor, vocab: int, group, size: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [V_r] (Phi-MoE's)
        self.vocab, self.group, self.size = vocab, group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [len(split_range(self.vocab, r, self.size)) for r in range(self.size)]
        return all_gather_uneven(F.linear(x, self.weight, self.bias), sizes, self.group)  # [.., V_r] -> [.., V]


def split_index(shape, dim: int, rank: int, size: int) -> tuple[slice, ...]:
    """The index of `rank`'s share of a tensor of `shape` split along `dim` over `size` ranks (split_range's
    split: uneven sizes need no padding)."""
    part = split_range(shape[dim], rank, size)
    return (slice(None),) * dim + (slice(part.start, part.stop),)


def vocab_index(name: str, shape, rank: int, size: int) -> tuple[slice] | None:
    """The vocabulary rows of the embedding or head `name` that TP rank `rank` keeps; None for other tensors."""
    return split_index(shape, 0, rank, size) if name in VOCAB_PARALLEL else None


def enable_vocab_parallel(model, group, rank: int, size: int) -> None:
    """Keep this rank's vocabulary rows of the embedding and the head (one shared slice when they are tied)."""
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # [V, D] each
    (rows,) = vocab_index("model.embed_tokens.weight", embed.shape, rank, size)
    model.model.embed_tokens = VocabParallelEmbedding(embed[rows].detach().clone(), range(rows.start, rows.stop),
                                                      group)
    if head is embed:  # tied: one shared slice
        head = model.model.embed_tokens.weight
    else:
        head = head[vocab_index("lm_head.weight", head.shape, rank, size)].detach().clone()
    bias = model.lm_head.bias
    if bias is not None:
        bias = bias[vocab_index("lm_head.bias", bias.shape, rank, size)].detach().clone()
    model.lm_head = VocabParallelHead(head, model.spec.vocab_size, group, size, bias)
