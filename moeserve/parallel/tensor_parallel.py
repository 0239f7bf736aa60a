"""Tensor slicing (Megatron style, as DeepSpeed-MoE uses for the dense part): attention by heads, dense
and shared-expert FFNs by columns then rows, routed experts by their FFN dimension (expert slicing);
each block ends with one all-reduce; embedding and head by vocabulary rows (vocab_parallel.py). Routers and
norms stay replicated."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.model.layers import MLP, Attention
from moeserve.parallel.vocab_parallel import enable_vocab_parallel


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


class SlicedExperts(nn.Module):
    """An expert backend whose experts hold a slice of their FFN dimension: partial outputs, summed."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x, expert_ids, expert_weights):
        y = self.inner(x, expert_ids, expert_weights)
        dist.all_reduce(y, group=self.group)
        return y


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out.weight = nn.Parameter(linear.weight[start:stop].detach().clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[start:stop].detach().clone(), requires_grad=False)
    return out.to(linear.weight.device)


def _closing(linear: nn.Linear, start: int, stop: int, group) -> RowParallelLinear:
    return RowParallelLinear(linear.weight[:, start:stop].detach().clone(),
                             None if linear.bias is None else linear.bias.detach().clone(), group)


def _slice_attention(attn: Attention, rank: int, size: int, group) -> None:
    h, hkv, dh = attn.H // size, attn.Hkv // size, attn.Dh
    attn.q_proj = _rows(attn.q_proj, rank * h * dh, (rank + 1) * h * dh)
    attn.k_proj = _rows(attn.k_proj, rank * hkv * dh, (rank + 1) * hkv * dh)
    attn.v_proj = _rows(attn.v_proj, rank * hkv * dh, (rank + 1) * hkv * dh)
    attn.o_proj = _closing(attn.o_proj, rank * h * dh, (rank + 1) * h * dh, group)
    attn.H, attn.Hkv = h, hkv


def _slice_mlp(mlp: MLP, rank: int, size: int, group) -> None:
    f = mlp.gate_proj.out_features // size
    mlp.gate_proj = _rows(mlp.gate_proj, rank * f, (rank + 1) * f)
    mlp.up_proj = _rows(mlp.up_proj, rank * f, (rank + 1) * f)
    mlp.down_proj = _closing(mlp.down_proj, rank * f, (rank + 1) * f, group)


def _slice_experts(experts, rank: int, size: int, group) -> SlicedExperts:
    F_full = experts.ffn
    f = F_full // size
    gate, up = experts.gate_up_proj.detach().split(F_full, dim=1)  # [E, F, D] each
    experts.gate_up_proj = nn.Parameter(torch.cat([gate[:, rank * f:(rank + 1) * f],
                                                   up[:, rank * f:(rank + 1) * f]], 1).clone(), requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[:, :, rank * f:(rank + 1) * f].clone(),
                                     requires_grad=False)
    experts.ffn = f
    return SlicedExperts(experts, group)


def check_tensor_parallel(spec, size: int) -> None:
    problems = [f"{name} {n}" for name, n in (("attention heads", spec.num_heads), ("KV heads", spec.num_kv_heads),
                                              ("expert FFN", spec.expert_ffn), ("dense FFN", spec.dense_ffn),
                                              ("shared expert FFN", spec.shared_expert_ffn)) if n % size]
    if problems:
        raise MoeserveError(f"tensor-parallel size {size} does not divide: {', '.join(problems)}")
    if spec.qk_norm == "full":
        raise MoeserveError("tensor parallelism does not support a qk-norm over all heads (OLMoE) yet")


def enable_tensor_parallel(model, group, rank: int, size: int, slice_experts: bool = True) -> None:
    """Keep this rank's slice of every layer; the model then computes the same logits on every TP rank.

    slice_experts=False leaves the routed experts whole (for expert parallelism across TP groups)."""
    check_tensor_parallel(model.spec, size)
    for layer in model.model.layers:
        _slice_attention(layer.self_attn, rank, size, group)
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            _slice_mlp(mlp, rank, size, group)
            continue
        if slice_experts:
            mlp.experts = _slice_experts(mlp.experts, rank, size, group)
        if mlp.shared_expert is not None:
            _slice_mlp(mlp.shared_expert, rank, size, group)
    enable_vocab_parallel(model, group, rank, size)
    # the KV cache holds this rank's heads only
    model.spec = dataclasses.replace(model.spec, num_heads=model.spec.num_heads // size,
                                     num_kv_heads=model.spec.num_kv_heads // size)
