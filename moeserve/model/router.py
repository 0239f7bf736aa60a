"""Routers: hidden states -> (expert_ids [T, k], expert_weights [T, k], logits [T, E]), as each family defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import triton_serves
from moeserve.spec import RouterSpec

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over all experts (fp32), keep the top k, optionally renormalise them to sum to one."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k] x2
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class TopKRouter(nn.Module):
    """Linear gate + softmax top-k. `weight` [E, D] is HF's `mlp.gate.weight`; `bias` [E] GPT-OSS's router bias
    (its weights, the softmax of the top-k logits, are these renormalised)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool, weights_fp32: bool,
                 bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.top_k, self.normalize, self.weights_fp32 = top_k, normalize, weights_fp32

    def forward(self, x: torch.Tensor, prepared=None):
        """x [T, D] -> expert_ids [T, k], expert_weights [T, k], logits [T, E] (for aux losses / traces).
        prepared (the experts' x Preparation and its buffer; only on the "triton_topk" path): filled with x prepared
        for the experts' kernels by the same launch."""
        if self.kernel_path(x) == "triton_topk":
            from moeserve.kernels.triton.topk_router import fused_router

            return fused_router(x, self.weight, self.top_k, self.normalize,
                                torch.float32 if self.weights_fp32 else x.dtype, prepared)
        if prepared is not None:
            raise ValueError("only the triton_topk router path prepares x for the experts")
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        ids, weights = softmax_topk(logits, self.top_k, self.normalize)
        if not self.weights_fp32:
            weights = weights.to(x.dtype)
        return ids, weights, logits

    def one_token_router(self, x: torch.Tensor):
        """This router as the one-token layer path takes it (kernels/triton/topk_router.SoftmaxTopK: bias included)
        for one token x [1, D] on CUDA in the gate's dtype, with no autograd, no hooks on this router (the path never
        calls its forward) and the path on (one_token.ONE_TOKEN_ENV), else None."""
        if (x.shape[0] != 1 or not triton_serves(x, self.weight) or x.dtype != self.weight.dtype
                or self._forward_hooks or self._forward_pre_hooks):
            return None
        from moeserve.kernels.triton.one_token import one_token_enabled
        from moeserve.kernels.triton.topk_router import SoftmaxTopK

        if not one_token_enabled():
            return None
        return SoftmaxTopK(self.weight, self.bias, self.top_k, self.normalize,
                           torch.float32 if self.weights_fp32 else x.dtype)

    def kernel_path(self, x: torch.Tensor) -> str:
        """The path of a call on x [T, D] (names in model/paths.py ROUTER_PATHS): "triton_topk", one launch instead of
        eight (decode-sized batches on CUDA, no autograd: it has no backward, no bias: it adds none), else "torch"."""
        if self.bias is not None or not triton_serves(x, self.weight):
            return "torch"
        from moeserve.kernels.triton.topk_router import MAX_TOKENS

        return "triton_topk" if x.shape[0] <= MAX_TOKENS and x.dtype == self.weight.dtype else "torch"


def grouped_topk(logits: torch.Tensor, k: int, rs: RouterSpec, normalize: bool,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style selection on fp32 logits [T, E] (RouterSpec says which): scores by softmax or sigmoid; the
    choice ranks scores + bias (V3's correction bias steers the choice only), inside the topk_group best of n_group
    groups (a group's rank: its best score, or the sum of its two best for noaux_tc); the weights are the unbiased
    scores of the chosen, renormalised if asked, times routed_scaling_factor. -> ids [T, k], weights [T, k] fp32."""
    scores = logits.softmax(dim=-1) if rs.scoring == "softmax" else logits.sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias.float()  # [T, E]
    if rs.topk_method != "greedy":
        T, E = choice.shape
        grouped = choice.view(T, rs.n_group, E // rs.n_group)  # [T, G, E/G]
        if rs.topk_method == "noaux_tc":
            group_rank = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_rank = grouped.max(dim=-1).values  # [T, G]
        best = group_rank.topk(rs.topk_group, dim=-1).indices  # [T, topk_group]
        kept = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * rs.routed_scaling_factor


class GroupedRouter(nn.Module):
    """DeepSeek-V2/V3 and GLM-4.5 routing (grouped_topk). `weight` [E, D] is HF's `mlp.gate.weight` and
    `e_score_correction_bias` [E] (RouterSpec.correction_bias) V3's; both stay float32 in a model of any dtype
    (FP32_TENSORS, as transformers keeps them) and the logits are computed in float32. Weights come back float32."""

    FP32_TENSORS = ("weight", "e_score_correction_bias")  # the loader keeps these in float32

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool, rs: RouterSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if rs.correction_bias else None
        self.top_k, self.normalize, self.rs = top_k, normalize, rs

    def forward(self, x: torch.Tensor, prepared=None):
        """x [T, D] -> expert_ids [T, k], expert_weights [T, k] (fp32), logits [T, E] (fp32)."""
        if prepared is not None:
            raise ValueError("only the triton_topk router path prepares x for the experts")
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        ids, weights = grouped_topk(logits, self.top_k, self.rs, self.normalize, self.e_score_correction_bias)
        return ids, weights, logits

    def kernel_path(self, x: torch.Tensor) -> str:
        """Always "torch" (model/paths.py ROUTER_PATHS): PyTorch ops, no host sync (CUDA-graph safe)."""
        return "torch"


def sparsemixer_top2(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-MoE's sparsemixer at inference on logits [T, E]: the best expert, then the best of the rest; each one's
    weight is its softmax among the experts whose logit lies within 2 eps (relative to max(|logit|, that
    expert's logit)) of its own, the others masked out. -> ids [T, 2], weights [T, 2] in the logits' dtype."""
    ids, weights = [], []
    scores = logits
    for _ in range(2):
        best, idx = scores.max(dim=-1, keepdim=True)  # [T, 1] x2
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps  # [T, E]
        weights.append(torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx))
        ids.append(idx)
        scores = scores.scatter(-1, idx, float("-inf"))  # the next pick is among the rest
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


class SparseMixerRouter(nn.Module):
    """Phi-MoE's router: a linear gate in the model dtype, then sparsemixer_top2. `weight` [E, D] is HF's
    `block_sparse_moe.gate.weight`."""

    def __init__(self, hidden: int, num_experts: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.eps = 2, eps

    def forward(self, x: torch.Tensor, prepared=None):
        """x [T, D] -> expert_ids [T, 2], expert_weights [T, 2] (x's dtype), logits [T, E]."""
        if prepared is not None:
            raise ValueError("only the triton_topk router path prepares x for the experts")
        logits = F.linear(x, self.weight)  # [T, E]
        ids, weights = sparsemixer_top2(logits, self.eps)
        return ids, weights, logits

    def kernel_path(self, x: torch.Tensor) -> str:
        """Always "torch" (model/paths.py ROUTER_PATHS): PyTorch ops, no host sync (CUDA-graph safe)."""
        return "torch"


class SigmoidTopKRouter(nn.Module):
    """Llama-4's router: a linear gate in the model dtype, then the top-k logits, each through a sigmoid (float32,
    cast back to x's dtype); no renormalisation. `weight` [E, D] is HF's `feed_forward.router.weight`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k = top_k

    def forward(self, x: torch.Tensor, prepared=None):
        """x [T, D] -> expert_ids [T, k], expert_weights [T, k] (x's dtype), logits [T, E]."""
        if prepared is not None:
            raise ValueError("only the triton_topk router path prepares x for the experts")
        logits = F.linear(x, self.weight)  # [T, E]
        top, ids = logits.topk(self.top_k, dim=-1)  # [T, k] x2
        return ids, torch.sigmoid(top.float()).to(x.dtype), logits

    def kernel_path(self, x: torch.Tensor) -> str:
        """Always "torch" (model/paths.py ROUTER_PATHS): PyTorch ops, no host sync (CUDA-graph safe)."""
        return "torch"
