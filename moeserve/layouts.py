"""Checkpoint layouts of families that store tensors under other names or shapes than moeserve's.

moeserve's names are transformers-5 Mixtral/Qwen-style (`model.layers.{i}.self_attn.q_proj.weight`,
`...mlp.experts.gate_up_proj` [E, 2F, D], `...mlp.experts.down_proj` [E, D, F]). Granite-MoE, DBRX and Llama-4
checkpoints hold the same weights under their own names, some fused or transposed. A family's layout (its rules,
Family.layout in its module under moeserve/families/, built from the pieces here) maps each stored tensor it
recognises to the moeserve tensors it holds (a View: the stored tensors it is computed from and how), so that
CheckpointReader answers for moeserve's names and every reader of weights (loading, parallel loading, quantize,
expert stores) works unchanged. A view is computed from whole stored tensors, except a renamed or transposed one:
reading a part of it (an expert, a row, a tensor-parallel slice) reads only the stored part it comes from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # annotations only: the family modules that build rules are read by a torch-free `import moeserve`


@dataclass(frozen=True)
class View:
    """A tensor moeserve names, as build(*stored tensors named by sources). part: for a view of one source, the
    part of the source (a tuple of slices) that a part of the view comes from, build turning one into the other;
    None: a part is cut from the whole view."""

    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor]
    part: Callable[[tuple], tuple] | None = None


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows start..stop of a fused [N, K] weight (one projection of a fused qkv or gate/up)."""
    return lambda t: t[start:stop]


def swap_last(t: torch.Tensor) -> torch.Tensor:
    """[E, K, N] -> [E, N, K] (expert stacks stored as x @ W rather than x @ W^T)."""
    return t.transpose(1, 2).contiguous()


def swapped_index(index: tuple) -> tuple:
    """The slices of a stored [E, K, N] tensor that a part (slices) of its swap_last view [E, N, K] comes from."""
    e, n, k = tuple(index) + (slice(None),) * (3 - len(index))
    return e, k, n


PARTS = {same: lambda index: index, swap_last: swapped_index}  # build -> View.part for views of one source


# A rule: (regex on a stored name, [(moeserve name template using the regex's groups, other sources' templates,
# build)]). The stored tensor itself is the first source.
Rule = tuple[str, list[tuple[str, tuple[str, ...], Callable[..., "torch.Tensor"]]]]


def stored_views(layout: list[Rule], stored: Iterable[str]) -> dict[str, View]:
    """moeserve name -> View for the stored tensors (names) that the rules of a family's layout (Family.layout)
    recognise."""
    rules = [(re.compile(pattern), targets) for pattern, targets in layout]
    views = {}
    for name in stored:
        for pattern, targets in rules:
            m = pattern.match(name)
            if m is None:
                continue
            for target, others, build in targets:
                views[m.expand(target)] = View((name, *(m.expand(o) for o in others)), build,
                                               None if others else PARTS.get(build))
            break
    return views
