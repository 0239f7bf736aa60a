"""MoE block: router -> expert backend (dispatch, expert FFNs, combine) (+ shared expert).

The shared expert is added (Mixtral has none), sigmoid-gated (Qwen2-MoE), or mixed with the routed output by a
learned 2-way softmax (PR-MoE's residual MoE, DeepSpeed-MoE's use_residual: out = c0 * routed + c1 * mlp,
c = softmax(Linear(D, 2)(x))). Llama-4's gate weight scales its one expert's input instead of its output: the
experts get x * w with weight 1 (ModelSpec.moe.router_scales_input), the shared expert x."""

from __future__ import annotations

import logging

import torch
from torch import nn

from moeserve.model.experts import ExpertBackend, ResidentExperts
from moeserve.model.layers import MLP
from moeserve.model.router import GroupedRouter, SigmoidTopKRouter, SparseMixerRouter, TopKRouter
from moeserve.spec import ModelSpec

log = logging.getLogger(__name__)


def resident_experts(spec: ModelSpec, num_experts: int) -> ExpertBackend:
    """The experts of an MoE layer in float (with the family's biases and activation). The model code knows no
    storage format: the loader swaps in the kind a checkpoint stores (quant/mxfp4.py stored_experts: MXFP4 kept
    packed; quant/manifest.py: low-bit) on the meta device, before it reads the weights."""
    moe = spec.moe
    return ResidentExperts(num_experts, spec.hidden_size, moe.expert_ffn, moe.expert_bias, moe.expert_act)


class MoEBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int = 0):
        super().__init__()
        D = spec.hidden_size
        self.layer_idx = layer_idx
        E = spec.moe.experts_at(layer_idx)
        if spec.moe.router is not None:
            self.gate = GroupedRouter(D, E, spec.moe.top_k, spec.moe.norm_topk_prob, spec.moe.router)
        elif spec.moe.routing == "sparsemixer":
            self.gate = SparseMixerRouter(D, E, spec.moe.router_jitter_eps)
        elif spec.moe.routing == "sigmoid":
            self.gate = SigmoidTopKRouter(D, E, spec.moe.top_k)
        else:
            self.gate = TopKRouter(D, E, spec.moe.top_k, spec.moe.norm_topk_prob, spec.moe.router_weights_fp32,
                                   spec.moe.router_bias)
        self.experts: ExpertBackend = resident_experts(spec, E)
        if spec.moe.shared_expert_ffn:
            self.shared_expert = MLP(D, spec.moe.shared_expert_ffn)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False) if spec.moe.shared_expert_gate else None
        else:
            self.shared_expert = None
        self.coefficient = nn.Linear(D, 2) if spec.moe.residual_mix else None  # [routed, shared] mix logits
        self.scales_input = spec.moe.router_scales_input
        self._logged: set[tuple[int, str]] = set()  # (tokens, path) pairs already logged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        if log.isEnabledFor(logging.DEBUG):
            self._log_path(x)
        if self.shared_expert is not None and self.experts.overlaps_dense:
            return self.finish(x, *self.route(x)).reshape(shape)
        out = self._one_token(x)  # [1, D] routed and combined, or None
        if out is None:
            out = self._routed(x)  # [T, D]
        mix = self._mix(x)
        if mix is not None:
            out = out * mix[:, :1]
        if self.shared_expert is not None:
            out = out + self._shared(x, mix)
        return out.reshape(shape)

    # forward in two pieces, for a decoder that captures the router in a CUDA graph and runs the experts after it
    def route(self, x: torch.Tensor):
        """x [T, D] -> (expert_ids [T, k], expert_weights [T, k], mix [T, 2] or None): the routed share of a
        residual mix goes into the gate weights (the combine is linear in them)."""
        expert_ids, expert_weights, _ = self.gate(x)  # [T, k] x2
        mix = self._mix(x)
        if mix is not None:
            expert_weights = expert_weights * mix[:, :1].to(expert_weights.dtype)
        return expert_ids, expert_weights, mix

    def finish(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
               mix: torch.Tensor | None) -> torch.Tensor:
        """route()'s output -> the block's output [T, D]: the experts, plus the shared expert (computed by a backend
        that overlaps it with its own work while that is in flight: the hybrid CPU experts, expert parallelism)."""
        routed_x, expert_weights = self._routed_input(x, expert_weights)
        if self.shared_expert is None:
            return self.experts(routed_x, expert_ids, expert_weights)
        # the shared expert reads the block's input x, also where the experts read it scaled (Llama-4)
        if self.experts.overlaps_dense:
            return self.experts(routed_x, expert_ids, expert_weights, dense=lambda _: self._shared(x, mix))
        return self.experts(routed_x, expert_ids, expert_weights) + self._shared(x, mix)

    def _routed_input(self, x: torch.Tensor, expert_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the experts' input [T, D], their gate weights [T, k]): x and the weights as they are, or Llama-4's
        x * w [T, D] (top-1) with weight 1."""
        if not self.scales_input:
            return x, expert_weights
        return x * expert_weights.to(x.dtype), torch.ones_like(expert_weights)

    def _mix(self, x: torch.Tensor) -> torch.Tensor | None:
        """PR-MoE's [routed, shared] mix of x [T, D] -> [T, 2], or None."""
        return torch.softmax(self.coefficient(x), dim=-1) if self.coefficient is not None else None

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the routed experts' combined output [T, D]: the router, then the experts (x prepared by the
        router's launch where _prepared_input says so)."""
        prepared = self._prepared_input(x)
        if prepared is None:
            expert_ids, expert_weights, _ = self.gate(x)  # [T, k] x2
            routed_x, expert_weights = self._routed_input(x, expert_weights)
            return self.experts(routed_x, expert_ids, expert_weights)
        expert_ids, expert_weights, _ = self.gate(x, prepared)
        return self.experts(x, expert_ids, expert_weights, prepared_x=prepared[1])

    def _one_token(self, x: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' output [1, D] for one token by the experts' one-token layer path (the router, the
        experts and the combine in three launches: ExpertBackend.one_token), where the router (a softmax top-k,
        TopKRouter.one_token_router) and the experts take it, else None. Llama-4's scaled input routes first."""
        if x.shape[0] != 1 or self.scales_input or not isinstance(self.gate, TopKRouter):
            return None
        router = self.gate.one_token_router(x)
        return None if router is None else self.experts.one_token(x, router)

    def _prepared_input(self, x: torch.Tensor):
        """(Preparation, its empty buffer) where the experts read x prepared (ExpertBackend.x_preparation) and the
        router's triton_topk launch can write it: one launch fewer per block, else None. Another router (a replay,
        a tap) prepares nothing."""
        if not (isinstance(self.gate, TopKRouter) and self.gate.kernel_path(x) == "triton_topk"):
            return None
        prep = self.experts.x_preparation(x, self.gate.top_k)
        return None if prep is None else (prep, prep.buffer(x.shape[0], x.shape[1], x.device))

    def _log_path(self, x: torch.Tensor) -> None:
        """One debug line per new (tokens, expert path) of this layer (MOESERVE_LOG=debug)."""
        T = x.shape[0]
        path = self.experts.kernel_path(x, T)
        if (T, path) not in self._logged:
            self._logged.add((T, path))
            log.debug("layer %d, %d tokens on %s: experts %s", self.layer_idx, T, x.device, path)

    def _shared(self, x: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
        """The shared expert on x [T, D] -> [T, D]: sigmoid-gated (Qwen2-MoE), DeepSeek's n_shared_experts as one
        wider FFN, or its share mix[:, 1] of a residual mix (PR-MoE)."""
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        if mix is not None:
            shared = shared * mix[:, 1:]
        return shared
