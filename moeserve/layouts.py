"""Checkpoint layouts of families that store tensors under other names or shapes than moeserve's.

moeserve's names are transformers-5 Mixtral/Qwen-style (`model.layers.{i}.self_attn.q_proj.weight`,
`...mlp.experts.gate_up_proj` [E, 2F, D], `...mlp.experts.down_proj` [E, D, F]). Granite-MoE, DBRX and Llama-4
checkpoints hold the same weights under their own names, some fused or transposed. A family's layout maps each
stored tensor it recognises to the moeserve tensors it holds (a View: the stored tensors it is computed from and
how), so that CheckpointReader answers for moeserve's names and every reader of weights (loading, parallel
loading, quantize, expert stores) works unchanged. A view is computed from whole stored tensors: reading a part
of it (a tensor-parallel slice) reads the stored tensors it comes from whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from moeserve.spec import ModelSpec


@dataclass(frozen=True)
class View:
    """A tensor moeserve names, as build(*stored tensors named by sources)."""

    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor]


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows start..stop of a fused [N, K] weight (one projection of a fused qkv or gate/up)."""
    return lambda t: t[start:stop]


def swap_last(t: torch.Tensor) -> torch.Tensor:
    """[E, K, N] -> [E, N, K] (expert stacks stored as x @ W rather than x @ W^T)."""
    return t.transpose(1, 2).contiguous()


# A rule: (regex on a stored name, [(moeserve name template using the regex's groups, other sources' templates,
# build)]). The stored tensor itself is the first source.
Rule = tuple[str, list[tuple[str, tuple[str, ...], Callable[..., torch.Tensor]]]]


def _granite(spec: ModelSpec) -> list[Rule]:
    F = spec.shared_expert_ffn
    moe = r"^model\.layers\.(\d+)\.block_sparse_moe\."
    return [
        (moe + r"router\.layer\.weight$", [(r"model.layers.\1.mlp.gate.weight", (), same)]),
        (moe + r"input_linear\.weight$", [(r"model.layers.\1.mlp.experts.gate_up_proj", (), same)]),  # [E, 2F, D]
        (moe + r"output_linear\.weight$", [(r"model.layers.\1.mlp.experts.down_proj", (), same)]),  # [E, D, F]
        (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$",  # [2F, D]: gate rows, then up rows
         [(r"model.layers.\1.mlp.shared_expert.gate_proj.weight", (), rows(0, F)),
          (r"model.layers.\1.mlp.shared_expert.up_proj.weight", (), rows(F, 2 * F))]),
        (r"^model\.layers\.(\d+)\.shared_mlp\.output_linear\.weight$",
         [(r"model.layers.\1.mlp.shared_expert.down_proj.weight", (), same)]),
    ]


LAYOUTS: dict[str, Callable[[ModelSpec], list[Rule]]] = {"granitemoe": _granite, "granitemoeshared": _granite}


def stored_views(spec: ModelSpec, stored: Iterable[str]) -> dict[str, View]:
    """moeserve name -> View for the stored tensors (names) that spec.family's layout recognises; {} for the
    families stored under moeserve's own names."""
    layout = LAYOUTS.get(spec.family)
    if layout is None:
        return {}
    rules = [(re.compile(pattern), targets) for pattern, targets in layout(spec)]
    views = {}
    for name in stored:
        for pattern, targets in rules:
            m = pattern.match(name)
            if m is None:
                continue
            for target, others, build in targets:
                views[m.expand(target)] = View((name, *(m.expand(o) for o in others)), build)
            break
    return views
