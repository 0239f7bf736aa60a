"""Tensor slicing (Megatron style, as DeepSpeed-MoE uses for the dense part): attention by heads (MLA: its
per-head projections q_proj / q_b_proj and kv_b_proj; the latent projections and norms stay whole), dense
and shared-expert FFNs by columns then rows, routed experts by their FFN dimension (expert slicing);
each block ends with one all-reduce; embedding and head by vocabulary rows (vocab_parallel.py). Routers and
norms stay replicated.

Low-bit layers (a moeserve quantized checkpoint, --dense-bits) are sliced the same way where that is exact
(quant/slicing.py: rows always, input columns on whole packing units and groups; else a one-line error names the
layer). Low-bit routed experts are packed along their inputs per expert, and their FFN rows would split gate_up
into two runs: they stay whole on every TP rank (replicated, computed in full, no all-reduce), which costs each rank
the memory of all of them; expert parallelism (--ep) splits them instead."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.model.experts import ExpertBackend, expert_tensors, set_expert_tensor
from moeserve.model.layers import MLP, Attention
from moeserve.model.mla import MLAttention
from moeserve.parallel.groups import split_range
from moeserve.parallel.vocab_parallel import enable_vocab_parallel, split_index, vocab_index
from moeserve.quant.mxfp4 import BLOCK
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear
from moeserve.quant.slicing import Parts, slice_linear


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_slice @ W_slice^T) + bias: the closing projection of a sliced block."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class RowParallelQuantized(nn.Module):
    """RowParallelLinear over a QuantizedLinear of this rank's input columns (its compensator's V columns with them:
    (x V^T) U^T sums over the slices as x W^T does)."""

    def __init__(self, linear: QuantizedLinear, bias: torch.Tensor | None, group):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class SlicedExperts(ExpertBackend):
    """An expert backend whose experts hold a slice of their FFN dimension: partial outputs, summed."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "tensor_parallel"

    def forward(self, x, expert_ids, expert_weights):
        y = self.inner(x, expert_ids, expert_weights)
        dist.all_reduce(y, group=self.group)
        return y


# Outputs split (dim 0): q/k/v (whole heads, as the head counts divide) and gate/up of dense MLPs and shared
# experts, biases with them. Inputs split (dim 1): o/down; their bias is added once after the all-reduce.
_OPENING = re.compile(r"\.(self_attn\.([qkv]|q_b|kv_b)_proj|mlp\.(shared_expert\.)?(gate|up)_proj)\.(weight|bias)$")
_CLOSING = re.compile(r"\.(self_attn\.o_proj|mlp\.(shared_expert\.)?down_proj)\.weight$")
# A qk-norm over all heads (OLMoE) has one weight per q/k feature: split with the heads; so are the heads' attention
# sinks (GPT-OSS).
_FULL_QK_NORM = re.compile(r"\.self_attn\.[qk]_norm\.weight$")
_SINKS = re.compile(r"\.self_attn\.sinks$")


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the TP ranks (OLMoE's qk-norm over all heads): each rank holds its
    heads' features and weights; one all-reduce of the per-row sum of squares gives the full mean."""

    def __init__(self, weight: torch.Tensor, eps: float, full_dim: int, group):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.eps, self.full_dim, self.group = eps, full_dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)  # [.., 1] this rank's features
        dist.all_reduce(sum_sq, group=self.group)
        return self.weight * (x32 * torch.rsqrt(sum_sq / self.full_dim + self.eps)).to(x.dtype)


def tp_index(name: str, shape, rank: int, size: int, full_qk_norm: bool = False) -> tuple[slice, ...] | None:
    """The part of the full dense tensor `name` (moeserve's name, also the checkpoint's) of `shape` that TP rank
    `rank` keeps; None: all of it (norms, routers, closing biases). The one rule that both the slicing below
    and sharded loading (loading.py, reading only this part) follow; routed experts: _slice_experts."""
    if _OPENING.search(name) or _SINKS.search(name) or (full_qk_norm and _FULL_QK_NORM.search(name)):
        return split_index(shape, 0, rank, size)
    if _CLOSING.search(name):
        return split_index(shape, 1, rank, size)
    return vocab_index(name, shape, rank, size)


@dataclasses.dataclass
class Slicer:
    """This TP rank's part of each full tensor (tp_index's rule) or low-bit layer; `quantized` records the low-bit
    layers it cut (full layer's name -> (this rank's layer, the parts of the full layer's buffers it holds)), so that
    sharded loading reads just those parts into them."""
    rank: int
    size: int
    full_qk_norm: bool = False
    quantized: dict[str, tuple[QuantizedLinear, Parts]] = dataclasses.field(default_factory=dict)

    def __call__(self, t: torch.Tensor, name: str) -> nn.Parameter:
        """This rank's part of the full tensor `name`, a copy (the full one can go; on meta, shapes only)."""
        index = tp_index(name, t.shape, self.rank, self.size, self.full_qk_norm)
        return nn.Parameter((t if index is None else t[index]).detach().clone(), requires_grad=False)

    def linear(self, q: QuantizedLinear, name: str) -> QuantizedLinear:
        """This rank's rows or input columns (as tp_index gives them for `name`.weight) of the low-bit layer `name`."""
        shape = (q.out_features, q.in_features)
        index = tp_index(f"{name}.weight", shape, self.rank, self.size, self.full_qk_norm)
        rows, cols = (index_range(index, shape, dim) for dim in (0, 1))
        try:
            part, parts = slice_linear(q, rows, cols)
        except MoeserveError as e:
            raise MoeserveError(f"tensor-parallel size {self.size} cannot slice the low-bit layer {name} exactly: "
                                f"{e}") from None
        self.quantized[name] = (part, parts)
        return part


def index_range(index: tuple[slice, ...] | None, shape, dim: int) -> range | None:
    """The run of dimension `dim` that `index` (a tp_index answer) keeps; None when it keeps all of it."""
    if index is None or len(index) <= dim or index[dim] == slice(None):
        return None
    return range(*index[dim].indices(shape[dim]))


def _opening(linear: nn.Linear | QuantizedLinear, name: str, keep: Slicer) -> nn.Module:
    """This rank's output rows of `linear`: in place for a float layer, a new layer for a low-bit one."""
    if isinstance(linear, QuantizedLinear):
        return keep.linear(linear, name)
    linear.weight = keep(linear.weight, f"{name}.weight")
    if linear.bias is not None:
        linear.bias = keep(linear.bias, f"{name}.bias")
    linear.out_features = linear.weight.shape[0]
    return linear


def _closing(linear: nn.Linear | QuantizedLinear, name: str, keep: Slicer, group) -> nn.Module:
    bias = None if linear.bias is None else keep(linear.bias, f"{name}.bias")
    if isinstance(linear, QuantizedLinear):
        return RowParallelQuantized(keep.linear(linear, name), bias, group)
    return RowParallelLinear(keep(linear.weight, f"{name}.weight"), bias, group)


def _slice_attention(attn: Attention | MLAttention, name: str, keep: Slicer, group) -> None:
    if isinstance(attn, MLAttention):
        for proj in ("q_b_proj" if attn.q_lora else "q_proj", "kv_b_proj"):
            setattr(attn, proj, _opening(getattr(attn, proj), f"{name}.{proj}", keep))
        attn.o_proj = _closing(attn.o_proj, f"{name}.o_proj", keep, group)
        attn.H = attn.kv_b_proj.out_features // (attn.nope + attn.v_dim)
        return
    full = {"q_norm": attn.H * attn.Dh, "k_norm": attn.Hkv * attn.Dh}  # features a full qk-norm spans
    for proj in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, proj, _opening(getattr(attn, proj), f"{name}.{proj}", keep))
    attn.o_proj = _closing(attn.o_proj, f"{name}.o_proj", keep, group)
    attn.H, attn.Hkv = attn.q_proj.out_features // attn.Dh, attn.k_proj.out_features // attn.Dh
    if attn.sinks is not None:
        attn.sinks = keep(attn.sinks, f"{name}.sinks")
    if attn.qk_norm == "full":
        for norm, dim in full.items():
            old = getattr(attn, norm)
            setattr(attn, norm, ShardedRMSNorm(keep(old.weight, f"{name}.{norm}.weight"), old.eps, dim, group))


def _slice_mlp(mlp: MLP, name: str, keep: Slicer, group) -> None:
    for proj in ("gate_proj", "up_proj"):
        setattr(mlp, proj, _opening(getattr(mlp, proj), f"{name}.{proj}", keep))
    mlp.down_proj = _closing(mlp.down_proj, f"{name}.down_proj", keep, group)


def _slice_experts(experts, rank: int, size: int, group) -> SlicedExperts:
    """Keep this rank's FFN rows of every expert tensor (float or MXFP4, loading.py reads the same): gate_up's
    [E, 2F, ..] gate and up rows, down's FFN columns (MXFP4: whole blocks of BLOCK); down's bias on the first rank
    only (the others' are zero: it is added once when the partial sums are summed)."""
    part = split_range(experts.ffn, rank, size)
    f = slice(part.start, part.stop)
    for name, t in expert_tensors(experts):
        t = t.detach()
        if name.startswith("gate_up_proj"):
            gate, up = t.split(experts.ffn, dim=1)  # [E, F, ..] each
            t = torch.cat([gate[:, f], up[:, f]], 1)
        elif name == "down_proj":
            t = t[:, :, f]
        elif name == "down_proj_bias":  # [E, D]
            t = t if rank == 0 else torch.zeros_like(t)
        elif name.startswith("down_proj_"):  # MXFP4 blocks / scales [E, D, F / BLOCK, ..]
            t = t[:, :, f.start // BLOCK:f.stop // BLOCK]
        set_expert_tensor(experts, name, t.clone())
    experts.ffn = len(part)
    return SlicedExperts(experts, group)


def check_tensor_parallel(spec, size: int) -> None:
    problems = [f"{name} {n}" for name, n in (("attention heads", spec.attention.num_heads),
                                              ("KV heads", spec.attention.num_kv_heads),
                                              ("expert FFN", spec.moe.expert_ffn), ("dense FFN", spec.moe.dense_ffn),
                                              ("shared expert FFN", spec.moe.shared_expert_ffn)) if n % size]
    if problems:
        raise MoeserveError(f"tensor-parallel size {size} does not divide: {', '.join(problems)}")
    if spec.moe.experts_mxfp4 and (spec.moe.expert_ffn // size) % BLOCK:
        raise MoeserveError(f"tensor-parallel size {size} would cut MXFP4 blocks: each rank's "
                            f"{spec.moe.expert_ffn // size} expert FFN rows must be a multiple of {BLOCK}")


def enable_tensor_parallel(model, group, rank: int, size: int, slice_experts: bool = True
                           ) -> dict[str, tuple[QuantizedLinear, Parts]]:
    """Keep this rank's slice of every layer; the model then computes the same logits on every TP rank. Returns the
    low-bit layers it cut (Slicer.quantized).

    slice_experts=False leaves the routed experts whole (for expert parallelism across TP groups); low-bit routed
    experts stay whole anyway (see the module docstring). Works on a model still on the meta device too: sharded
    loading then reads just the slices (tp_index, and the returned parts for low-bit layers)."""
    check_tensor_parallel(model.spec, size)
    keep = Slicer(rank, size, model.spec.attention.qk_norm == "full")
    for i, layer in enumerate(model.model.layers):
        _slice_attention(layer.self_attn, f"model.layers.{i}.self_attn", keep, group)
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            _slice_mlp(mlp, f"model.layers.{i}.mlp", keep, group)
            continue
        if slice_experts and not isinstance(mlp.experts, QuantizedExperts):
            mlp.experts = _slice_experts(mlp.experts, rank, size, group)
        if mlp.shared_expert is not None:
            _slice_mlp(mlp.shared_expert, f"model.layers.{i}.mlp.shared_expert", keep, group)
    enable_vocab_parallel(model, group, rank, size, keep.linear)
    # the KV cache holds this rank's heads only
    model.spec = model.spec.replace(num_heads=model.spec.attention.num_heads // size,
                                     num_kv_heads=model.spec.attention.num_kv_heads // size)
    return keep.quantized
