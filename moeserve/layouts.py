"""Checkpoint layouts of families that store tensors under other names or shapes than moeserve's.

moeserve's names are transformers-5 Mixtral/Qwen-style (`model.layers.{i}.self_attn.q_proj.weight`,
`...mlp.experts.gate_up_proj` [E, 2F, D], `...mlp.experts.down_proj` [E, D, F]). Granite-MoE, DBRX and Llama-4
checkpoints hold the same weights under their own names, some fused or transposed. A family's layout maps each
stored tensor it recognises to the moeserve tensors it holds (a View: the stored tensors it is computed from and
how), so that CheckpointReader answers for moeserve's names and every reader of weights (loading, parallel
loading, quantize, expert stores) works unchanged. A view is computed from whole stored tensors, except a renamed
or transposed one: reading a part of it (an expert, a row, a tensor-parallel slice) reads only the stored part it
comes from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from moeserve.spec import ModelSpec


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


def _dbrx(spec: ModelSpec) -> list[Rule]:
    E, F, D = spec.num_experts, spec.expert_ffn, spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    block, layer = r"^transformer\.blocks\.(\d+)\.", r"model.layers.\1."
    return [
        (r"^transformer\.wte\.weight$", [("model.embed_tokens.weight", (), same)]),
        (r"^transformer\.norm_f\.weight$", [("model.norm.weight", (), same)]),
        (block + r"norm_attn_norm\.norm_1\.weight$", [(layer + "input_layernorm.weight", (), same)]),
        (block + r"norm_attn_norm\.norm_2\.weight$", [(layer + "post_attention_layernorm.weight", (), same)]),
        (block + r"norm_attn_norm\.attn\.Wqkv\.weight$",  # [q + 2 kv, D]
         [(layer + "self_attn.q_proj.weight", (), rows(0, q)),
          (layer + "self_attn.k_proj.weight", (), rows(q, q + kv)),
          (layer + "self_attn.v_proj.weight", (), rows(q + kv, q + 2 * kv))]),
        (block + r"norm_attn_norm\.attn\.out_proj\.weight$", [(layer + "self_attn.o_proj.weight", (), same)]),
        (block + r"ffn\.router\.layer\.weight$", [(layer + "mlp.gate.weight", (), same)]),
        # w1 (gate) and v1 (up) [E*F, D] -> [E, 2F, D]; w2 [E*F, D] is each expert's down weight transposed
        (block + r"ffn\.experts\.mlp\.w1$",
         [(layer + "mlp.experts.gate_up_proj", (r"transformer.blocks.\1.ffn.experts.mlp.v1",),
           lambda w1, v1: torch.cat([w1.view(E, F, D), v1.view(E, F, D)], 1))]),
        (block + r"ffn\.experts\.mlp\.w2$",
         [(layer + "mlp.experts.down_proj", (), lambda w2: w2.view(E, F, D).transpose(1, 2).contiguous())]),
    ]


def _llama4(spec: ModelSpec) -> list[Rule]:
    """Llama-4's feed_forward (experts [E, D, 2F] gate then up columns and [E, F, D], router, shared expert, dense
    MLP), with or without Llama4ForConditionalGeneration's `language_model.` prefix; its vision tensors match no
    rule and are never read."""
    ffn, layer = r"^(?:language_model\.)?model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."
    return [
        (ffn + r"experts\.(gate_up_proj|down_proj)$", [(layer + r"experts.\2", (), swap_last)]),
        (ffn + r"router\.weight$", [(layer + "gate.weight", (), same)]),
        (ffn + r"((?:shared_expert\.)?(?:gate|up|down)_proj\.weight)$", [(layer + r"\2", (), same)]),
        (r"^language_model\.((?:model\.|lm_head\.).+)$", [(r"\1", (), same)]),
    ]


LAYOUTS: dict[str, Callable[[ModelSpec], list[Rule]]] = {"granitemoe": _granite, "granitemoeshared": _granite,
                                                         "dbrx": _dbrx, "llama4": _llama4}


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
                views[m.expand(target)] = View((name, *(m.expand(o) for o in others)), build,
                                               None if others else PARTS.get(build))
            break
    return views
