"""MXFP4 experts as GPT-OSS ships them, kept packed: per projection `<name>_blocks` [E, N, K/32, 16] uint8 (two E2M1
values a byte, the low nibble first: value 2i in bits 0-3 of byte i, value 2i + 1 in bits 4-7) and `<name>_scales`
[E, N, K/32] uint8 (E8M0: one power of two, 2^(s - 127), per 32 values of a row). A value is
E2M1_VALUES[code] * 2^(s - 127); E2M1 (sign, 2 exponent bits, 1 mantissa bit) holds 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Mxfp4Experts computes with the packed bytes: on CUDA the Triton kernels of kernels/triton/mxfp4 decode them in
registers (path "mxfp4_triton"); elsewhere the expert loop dequantizes one expert's weights at a time through the
16-entry table and multiplies in x's dtype ("mxfp4_loop"). E2M1's grid is not uniform, so these weights are not
converted to the HQQ 4-bit layout (that would round them again); the whole model is never expanded to floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.kernels import triton_serves
from moeserve.kernels.mxfp4_format import BLOCK, E2M1_VALUES, SCALE_BIAS
from moeserve.kernels.routing import RoutingTable, build_routing_table, combine
from moeserve.model.experts import ExpertBackend, LoopedExperts, ResidentExperts, gated_ffn
from moeserve.spec import ClampedSwiGLU

if TYPE_CHECKING:
    from moeserve.kernels.triton.mxfp4 import Mxfp4Config

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [.., N, G, 16] uint8, scales [.., N, G] uint8 -> weights [.., N, G * 32] in dtype (exact in float32;
    in bf16 too while the scales stay inside its exponent range)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((lut[(blocks & 15).long()], lut[(blocks >> 4).long()]), dim=-1)  # [.., N, G, 16, 2]
    values = pairs.flatten(-3)  # [.., N, G * 32]: low nibble first in each byte
    exponents = (scales.to(torch.int32) - SCALE_BIAS).repeat_interleave(BLOCK, dim=-1)  # [.., N, G * 32]
    return torch.ldexp(values, exponents).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] (K a multiple of 32) -> (blocks [.., N, K/32, 16], scales [.., N, K/32]) by OCP MX's rule: each
    block's scale 2^(floor(log2 max|w|) - 2) (E2M1's largest exponent), values rounded to the nearest E2M1 (ties to
    the smaller magnitude), clamped at 6. For tests and benchmarks: checkpoints ship already quantized."""
    *lead, N, K = w.shape
    if K % BLOCK:
        raise MoeserveError(f"MXFP4 needs rows of a multiple of {BLOCK} values, got {K}")
    groups = w.float().reshape(*lead, N, K // BLOCK, BLOCK)  # [.., N, G, 32]
    amax = groups.abs().amax(dim=-1)  # [.., N, G]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.zeros_like(amax))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exp)[..., None]  # [.., N, G, 32]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [.., N, G, 32] in 0..7
    codes = (codes | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [.., N, G, 16]
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)


@dataclass
class Mxfp4Expert:
    """One expert's MXFP4 weights as shipped (an expert store's high copy, or a device slot holding it): gate_up
    blocks [2F, D/32, 16] and scales [2F, D/32], down blocks [D, F/32, 16] and scales [D, F/32] (views, no copy),
    and its float biases [2F] and [D] or None."""

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @classmethod
    def of_parts(cls, parts: list[torch.Tensor]) -> "Mxfp4Expert":
        """From a store's parts in ExpertStore.part_names order (the two biases last, if any)."""
        return cls(*parts)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2F, D], down [D, F]) dequantized to dtype."""
        return (dequantize(self.gate_up_blocks, self.gate_up_scales, dtype),
                dequantize(self.down_blocks, self.down_scales, dtype))

    def ffn(self, rows: torch.Tensor, act: ClampedSwiGLU | None) -> torch.Tensor:
        """rows [n, D] -> [n, D]: the expert dequantized in rows' dtype, then gated_ffn, as Mxfp4Experts' loop
        computes it (the same function: the resident model's outputs)."""
        return gated_ffn(rows, *self.weights(rows.dtype), self.gate_up_bias, self.down_bias, act)


class Mxfp4Experts(LoopedExperts):
    """A layer's experts in MXFP4 as stored (names and shapes of the checkpoint): gate_up_proj_blocks
    [E, 2F, D/32, 16], gate_up_proj_scales [E, 2F, D/32], down_proj_blocks [E, D, F/32, 16], down_proj_scales
    [E, D, F/32] (gate rows then up rows, as read_tensor arranges them), float biases gate_up_proj_bias [E, 2F] and
    down_proj_bias [E, D], and the gated activation act (model/experts.glu). kernel_config: the Triton launch config
    of every call (None: kernels/triton/mxfp4's default_config by token count; bench/gptoss.py --sweep sets it)."""

    PACKED_BUFFERS = True  # the loader reads these buffers from the checkpoint and keeps their dtype

    def __init__(self, num_experts: int, hidden: int, ffn: int, bias: bool = False, act: ClampedSwiGLU | None = None):
        super().__init__()
        if hidden % BLOCK or ffn % BLOCK:
            raise MoeserveError(f"MXFP4 experts need hidden and FFN sizes divisible by {BLOCK}; got {hidden} and {ffn}")
        self.num_experts, self.hidden, self.ffn, self.act = num_experts, hidden, ffn, act
        for name, (n, k) in (("gate_up_proj", (2 * ffn, hidden)), ("down_proj", (hidden, ffn))):
            blocks = torch.empty(num_experts, n, k // BLOCK, BLOCK // 2, dtype=torch.uint8)
            self.register_buffer(f"{name}_blocks", blocks)
            self.register_buffer(f"{name}_scales", torch.empty(num_experts, n, k // BLOCK, dtype=torch.uint8))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.kernel_config: Mxfp4Config | None = None

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2F, D], down [D, F]) dequantized to dtype."""
        return (dequantize(self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e], dtype),
                dequantize(self.down_proj_blocks[e], self.down_proj_scales[e], dtype))

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        bias = (None, None) if self.gate_up_proj_bias is None else (self.gate_up_proj_bias[e], self.down_proj_bias[e])
        return gated_ffn(rows, *self.weights(e, rows.dtype), *bias, self.act)  # one expert dequantized at a time

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        """"mxfp4_triton" (CUDA, no autograd: the kernels have no backward) or "mxfp4_loop" (model/paths.py)."""
        return "mxfp4_triton" if triton_serves(x) and x.dtype in TRITON_DTYPES else "mxfp4_loop"

    def one_token(self, x: torch.Tensor, router) -> torch.Tensor | None:
        """The one-token layer path (kernels/triton/one_token.mxfp4_one_token) where a call takes "mxfp4_triton" and
        the config is a CUDA-core one."""
        if self.kernel_path(x, 1) != "mxfp4_triton" or (self.kernel_config is not None
                                                        and self.kernel_config.use_dot(x.dtype)):
            return None
        from moeserve.kernels.triton.mxfp4 import Mxfp4Weights
        from moeserve.kernels.triton.one_token import mxfp4_one_token

        gate_up = Mxfp4Weights(self.gate_up_proj_blocks, self.gate_up_proj_scales, self.gate_up_proj_bias)
        down = Mxfp4Weights(self.down_proj_blocks, self.down_proj_scales, self.down_proj_bias)
        return mxfp4_one_token(x, router, gate_up, down, self.act, self.kernel_config)[0]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """The looped path's forward, except on the Triton path: its kernels read each sorted row's token from x
        themselves (no gather launch)."""
        if self.kernel_path(x, x.shape[0]) != "mxfp4_triton":
            return super().forward(x, expert_ids, expert_weights)
        table = build_routing_table(expert_ids, expert_weights, self.num_experts)
        return combine(self.triton_experts(x, table, table.token_ids), table, x.shape[0], x.dtype)

    def run_sorted(self, x_sorted: torch.Tensor, table: RoutingTable) -> torch.Tensor:
        if self.kernel_path(x_sorted, table.num_tokens) != "mxfp4_triton":
            return super().run_sorted(x_sorted, table)
        return self.triton_experts(x_sorted, table)

    def triton_experts(self, x: torch.Tensor, table: RoutingTable,
                       token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The sorted rows (x itself, or with token_ids the tokens of x they read) through the Triton kernels ->
        [T*k, D] float32."""
        from moeserve.kernels.triton.mxfp4 import Mxfp4Weights, mxfp4_experts

        gate_up = Mxfp4Weights(self.gate_up_proj_blocks, self.gate_up_proj_scales, self.gate_up_proj_bias)
        down = Mxfp4Weights(self.down_proj_blocks, self.down_proj_scales, self.down_proj_bias)
        return mxfp4_experts(x, gate_up, down, table, self.act, self.kernel_config, token_ids)


def stored_experts(spec, num_experts: int) -> ExpertBackend:
    """A layer's experts as the checkpoint stores them: MXFP4 kept packed (Mxfp4Experts) where config.json says so
    (GPT-OSS as shipped), else float (ResidentExperts); with the family's biases and activation."""
    cls = Mxfp4Experts if spec.moe.experts_mxfp4 else ResidentExperts
    return cls(num_experts, spec.hidden_size, spec.moe.expert_ffn, spec.moe.expert_bias, spec.moe.expert_act)


def use_stored_experts(model: nn.Module) -> None:
    """Give every MoE layer of `model` (built by the model code with float experts, on the meta device) the experts
    its checkpoint stores (stored_experts): the loader's first step after building the model."""
    spec = model.spec
    if not spec.moe.experts_mxfp4:
        return
    for i, layer in enumerate(model.model.layers):
        if spec.moe.layers[i]:
            layer.mlp.experts = stored_experts(spec, spec.moe.experts_at(i))
