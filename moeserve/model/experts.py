"""Expert backends: how routed experts are computed. The MoE block calls one of these and nothing else.

The interface is one call, `experts(x [T, D], expert_ids [T, k], expert_weights [T, k]) -> [T, D]`
(already combined with the gate weights), so quantized, offloaded or expert-parallel backends plug in
by replacing `MoEBlock.experts` without touching the model code.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import triton_serves
from moeserve.kernels.routing import RoutingTable, build_routing_table, combine
from moeserve.spec import ClampedSwiGLU

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


@functools.cache
def _sm90_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def grouped_mm_available(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm runs on CUDA (sm90+) in bf16 with 16-byte aligned rows."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(d % 8 == 0 for d in dims) and _sm90_or_newer(x.device))


def fused_moe_available(x: torch.Tensor, num_tokens: int, gate_up_proj: torch.Tensor) -> bool:
    """The Triton fused-MoE kernels: CUDA, 16-bit weights, Triton importable, no autograd (they have no backward),
    and few enough tokens that they beat grouped GEMMs here (measured per GPU and shape by bench/tune_fused_moe.py)."""
    if not (x.dtype in (torch.bfloat16, torch.float16) and gate_up_proj.dtype == x.dtype
            and triton_serves(x, gate_up_proj)):
        return False
    from moeserve.kernels.triton.configs import fused_max_tokens, gpu_name

    E, two_f, D = gate_up_proj.shape
    return num_tokens <= fused_max_tokens(gpu_name(x.device.index or 0), E, D, two_f // 2)


def default_tiles_available(x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """The Triton row-tile kernels with their default configs: the fused path's conditions, less the token limit,
    and D and F divisible by the default BLOCK_Ks."""
    if not fused_moe_available(x, 0, gate_up_proj):  # before any Triton import: CPU installs have no Triton
        return False
    from moeserve.kernels.triton.configs import DEFAULT_TILES
    from moeserve.kernels.triton.fused_moe import tiles_fit

    E, two_f, D = gate_up_proj.shape
    return tiles_fit(DEFAULT_TILES.gate_up, D) and tiles_fit(DEFAULT_TILES.down, two_f // 2)


class ExpertBackend(nn.Module):
    """What the MoE block needs of an expert backend: the call, the path a call takes, and two optional hooks."""

    overlaps_dense = False  # True: forward takes dense= and computes it while its own work is in flight

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        """The path (a model/paths.py EXPERT_PATHS name) of a call on num_tokens rows like x [.., D]; forward runs
        the path this names. expert_weights: the call's gate weights, where autograd through them matters."""
        raise NotImplementedError

    def x_preparation(self, x: torch.Tensor, top_k: int):
        """How this backend will read x when the router may prepare it in its own launch, or None (nothing to
        prepare). See QuantizedExperts."""
        return None

    def one_token(self, x: torch.Tensor, router) -> torch.Tensor | None:
        """One token x [1, D] routed by `router` (kernels/triton/topk_router.SoftmaxTopK) through these experts and
        combined, [1, D], where this backend has a one-token layer path (kernels/triton/one_token.py: router, experts
        and combine in three launches), else None (the block routes and calls forward)."""
        return None


class LoopedExperts(ExpertBackend):
    """Dispatch through the routing table, one FFN call per active expert, weighted combine.

    Subclasses say how one expert computes its rows (`expert_ffn`); the loop is the CPU path and the
    reference for every faster path.
    """

    num_experts: int

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "loop"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        table = build_routing_table(expert_ids, expert_weights, self.num_experts)
        return combine(self.run_sorted(x[table.token_ids], table), table, x.shape[0], x.dtype)

    def run_sorted(self, x_sorted: torch.Tensor, table: RoutingTable) -> torch.Tensor:
        """x_sorted [T*k, D] (expert-sorted rows) -> expert outputs [T*k, D], before gate weighting."""
        y = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(table.counts.tolist()):
            if n:
                y[start:start + n] = self.expert_ffn(e, x_sorted[start:start + n])  # [n, D]
                start += n
        return y


def expert_tensors(experts: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """An expert backend's own stacked tensors [E, ...]: parameters (weights, biases) and buffers (packed blocks,
    scales), by name."""
    return [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]


def set_expert_tensor(experts: nn.Module, name: str, t: torch.Tensor) -> None:
    """Replace one of expert_tensors(experts): a frozen parameter where it was a parameter, else a buffer."""
    setattr(experts, name, nn.Parameter(t, requires_grad=False) if isinstance(getattr(experts, name), nn.Parameter)
            else t)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused gate/up projection output [n, 2F] -> [n, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def glu(gate_up: torch.Tensor, act: ClampedSwiGLU | None) -> torch.Tensor:
    """The experts' gated activation of gate_up [n, 2F] (gate half, up half) -> [n, F]: silu(gate) * up, or GPT-OSS's
    clamped SwiGLU (spec.ClampedSwiGLU)."""
    if act is None:
        return swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def gated_ffn(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """One float expert on rows [n, D]: glu(rows gate_up^T + gate_up_bias) down^T + down_bias -> [n, D]; gate_up
    [2F, D], down [D, F], the biases [2F] and [D] (GPT-OSS) or None. Every backend that computes a float expert
    calls this, so that their outputs equal the resident model's bit for bit."""
    return F.linear(glu(F.linear(rows, gate_up, gate_up_bias), act), down, down_bias)


def sorted_experts(table: RoutingTable, rows: int) -> torch.Tensor:
    """The expert of each of `rows` expert-sorted rows [rows] (no host sync: the length is given)."""
    ids = torch.arange(table.counts.shape[0], device=table.counts.device)
    return torch.repeat_interleave(ids, table.counts, output_size=rows)


class ResidentExperts(LoopedExperts):
    """All experts of a layer in device memory, stacked: gate_up_proj [E, 2F, D], down_proj [E, D, F]; with
    bias (GPT-OSS) gate_up_proj_bias [E, 2F] and down_proj_bias [E, D]; act: the gated activation (glu)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, bias: bool = False, act: ClampedSwiGLU | None = None):
        super().__init__()
        self.num_experts, self.ffn, self.act = num_experts, ffn, act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        biases = (None, None) if self.gate_up_proj_bias is None else (self.gate_up_proj_bias[e], self.down_proj_bias[e])
        return gated_ffn(rows, self.gate_up_proj[e], self.down_proj[e], *biases, self.act)

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        """The path: "fused" (Triton, tuned), "grouped_mm", "tiles" (Triton row tiles with default configs, on GPUs
        without grouped GEMMs) or "loop". Experts with biases or another activation (GPT-OSS) take "grouped_mm"
        where it runs, else "loop": the Triton kernels add no biases."""
        if self.gate_up_proj_bias is not None or self.act is not None:
            return "grouped_mm" if grouped_mm_available(x, x.shape[1], self.ffn) else "loop"
        if fused_moe_available(x, num_tokens, self.gate_up_proj):
            return "fused"
        if grouped_mm_available(x, x.shape[1], self.ffn):
            return "grouped_mm"
        return "tiles" if default_tiles_available(x, self.gate_up_proj) else "loop"

    def run_sorted(self, x_sorted: torch.Tensor, table: RoutingTable) -> torch.Tensor:
        path = self.kernel_path(x_sorted, table.num_tokens)
        if path in ("fused", "tiles"):
            from moeserve.kernels.triton.configs import DEFAULT_TILES
            from moeserve.kernels.triton.fused_moe import fused_experts

            return fused_experts(x_sorted, self.gate_up_proj, self.down_proj, table,
                                 DEFAULT_TILES if path == "tiles" else None)
        if path == "loop":
            return super().run_sorted(x_sorted, table)
        # one grouped GEMM per projection over the expert-sorted rows (no host sync)
        h = torch._grouped_mm(x_sorted, self.gate_up_proj.transpose(1, 2), offs=table.offsets)  # [T*k, 2F]
        if self.gate_up_proj_bias is not None or self.act is not None:
            experts = sorted_experts(table, x_sorted.shape[0])  # [T*k]
            if self.gate_up_proj_bias is not None:
                h = h + self.gate_up_proj_bias[experts]
            y = torch._grouped_mm(glu(h, self.act), self.down_proj.transpose(1, 2), offs=table.offsets)  # [T*k, D]
            return y if self.down_proj_bias is None else y + self.down_proj_bias[experts]
        if triton_serves(h):  # no backward: under autograd torch's silu and product run
            from moeserve.kernels.triton.swiglu import fused_swiglu

            act = fused_swiglu(h)  # one pass over h instead of two elementwise kernels
        else:
            act = swiglu(h)
        return torch._grouped_mm(act, self.down_proj.transpose(1, 2), offs=table.offsets)
