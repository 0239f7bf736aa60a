"""Vocab-parallel embedding and LM head (Megatron style): each TP rank holds a slice of the vocabulary rows,
so neither the largest dense matrices of a model nor their memory are replicated. The embedding looks up the
tokens it owns and an all-reduce fills in the rest; the head computes its slice of the logits and an
all-gather joins them. Same logits as one process. A low-bit head (--dense-bits) keeps its vocabulary rows as a
low-bit layer of its own."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeserve.parallel.collectives import all_gather_uneven
from moeserve.parallel.groups import split_range
from moeserve.quant.qlinear import QuantizedLinear

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
        return all_gather_uneven(F.linear(x, self.weight, self.bias), vocab_sizes(self.vocab, self.size),
                                 self.group)  # [.., V_r] -> [.., V]


class QuantizedVocabParallelHead(nn.Module):
    """VocabParallelHead over a low-bit layer of this rank's vocabulary rows (and their bias)."""

    def __init__(self, linear: QuantizedLinear, vocab: int, group, size: int):
        super().__init__()
        self.linear, self.vocab, self.group, self.size = linear, vocab, group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_uneven(self.linear(x), vocab_sizes(self.vocab, self.size), self.group)  # [.., V]


def vocab_sizes(vocab: int, size: int) -> list[int]:
    """Vocabulary rows of each of `size` ranks."""
    return [len(split_range(vocab, r, size)) for r in range(size)]


def split_index(shape, dim: int, rank: int, size: int) -> tuple[slice, ...]:
    """The index of `rank`'s share of a tensor of `shape` split along `dim` over `size` ranks (split_range's
    split: uneven sizes need no padding)."""
    part = split_range(shape[dim], rank, size)
    return (slice(None),) * dim + (slice(part.start, part.stop),)


def vocab_index(name: str, shape, rank: int, size: int) -> tuple[slice] | None:
    """The vocabulary rows of the embedding or head `name` that TP rank `rank` keeps; None for other tensors."""
    return split_index(shape, 0, rank, size) if name in VOCAB_PARALLEL else None


def enable_vocab_parallel(model, group, rank: int, size: int,
                          keep_linear: Callable[[QuantizedLinear, str], QuantizedLinear] | None = None) -> None:
    """Keep this rank's vocabulary rows of the embedding and the head (one shared slice when they are tied).
    keep_linear(layer, name): this rank's rows of a low-bit head (tensor_parallel.Slicer.linear)."""
    embed = model.model.embed_tokens.weight  # [V, D]
    (rows,) = vocab_index("model.embed_tokens.weight", embed.shape, rank, size)
    model.model.embed_tokens = VocabParallelEmbedding(embed[rows].detach().clone(), range(rows.start, rows.stop),
                                                      group)
    if isinstance(model.lm_head, QuantizedLinear):
        model.lm_head = QuantizedVocabParallelHead(keep_linear(model.lm_head, "lm_head"), model.spec.vocab_size,
                                                   group, size)
        return
    head = model.lm_head.weight  # [V, D]
    if head is embed:  # tied: one shared slice
        head = model.model.embed_tokens.weight
    else:
        head = head[vocab_index("lm_head.weight", head.shape, rank, size)].detach().clone()
    bias = model.lm_head.bias
    if bias is not None:
        bias = bias[vocab_index("lm_head.bias", bias.shape, rank, size)].detach().clone()
    model.lm_head = VocabParallelHead(head, model.spec.vocab_size, group, size, bias)
