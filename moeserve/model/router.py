"""Routers: hidden states -> (expert_ids [T, k], expert_weights [T, k]), as each family defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import triton_serves

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over all experts (fp32), keep the top k, optionally renormalise them to sum to one."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k] x2
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class TopKRouter(nn.Module):
    """Linear gate + softmax top-k. `weight` [E, D] is HF's `mlp.gate.weight`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool, weights_fp32: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.normalize, self.weights_fp32 = top_k, normalize, weights_fp32

    def forward(self, x: torch.Tensor, prepared=None):
        """x [T, D] -> expert_ids [T, k], expert_weights [T, k], logits [T, E] (for aux losses / traces).
        prepared (a lowbit.Preparation and its buffer; only where fused_applies): filled with x prepared for
        the experts' kernels by the same launch."""
        if self.fused_applies(x):
            from moeserve.kernels.triton.topk_router import fused_router

            return fused_router(x, self.weight, self.top_k, self.normalize,
                                torch.float32 if self.weights_fp32 else x.dtype, prepared)
        if prepared is not None:
            raise ValueError("only the fused router prepares x for the experts (fused_applies)")
        logits = F.linear(x, self.weight)  # [T, E]
        ids, weights = softmax_topk(logits, self.top_k, self.normalize)
        if not self.weights_fp32:
            weights = weights.to(x.dtype)
        return ids, weights, logits

    def fused_applies(self, x: torch.Tensor) -> bool:
        """One Triton launch instead of eight (decode-sized batches on CUDA, no autograd: it has no backward)."""
        if not triton_serves(x, self.weight):
            return False
        from moeserve.kernels.triton.topk_router import MAX_TOKENS

        return x.shape[0] <= MAX_TOKENS and x.dtype == self.weight.dtype
