"""Host side of the MXFP4 MoE kernels: the weights one projection passes (Mxfp4Weights), launch configs
(Mxfp4Config; default_config by tokens and dtype) and mxfp4_experts, the two launches of a layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moeserve.kernels import triton_interpreting
from moeserve.kernels.routing import RoutingTable
from moeserve.kernels.triton.mxfp4.kernels import down_kernel, gate_up_kernel
from moeserve.spec import ClampedSwiGLU

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Mxfp4Weights:
    """One projection of all experts: blocks [E, N, K/32, 16] uint8, scales [E, N, K/32] uint8, bias [E, N] or None."""

    blocks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K)."""
        E, N, G, _ = self.blocks.shape
        return E, N, G * 32


@dataclass(frozen=True)
class Mxfp4Config:
    """Tile sizes: BLOCK_N output rows of a program, BLOCK_K values of a step (a multiple of 32), BLOCK_M rows of x
    at once (tensor cores from 16 on 16-bit x, else CUDA-core sums)."""

    BLOCK_N: int = 32
    BLOCK_K: int = 256
    BLOCK_M: int = 1
    num_warps: int = 4

    def use_dot(self, dtype: torch.dtype) -> bool:
        return self.BLOCK_M >= 16 and dtype in HALF_DTYPES


def default_config(num_tokens: int, dtype: torch.dtype) -> Mxfp4Config:
    """One token: GEMV programs of 32 rows x 256 values a step; more: tiles of 16 rows on tensor cores (16-bit x), or
    up to 4 rows on CUDA cores (float32). Not tuned per GPU yet (bench/gptoss.py measures them)."""
    if num_tokens == 1:
        return Mxfp4Config()
    if dtype in HALF_DTYPES:
        return Mxfp4Config(BLOCK_N=64, BLOCK_K=128, BLOCK_M=16)
    return Mxfp4Config(BLOCK_N=32, BLOCK_K=64, BLOCK_M=min(4, triton.next_power_of_2(num_tokens)))


def mxfp4_experts(x_sorted: torch.Tensor, gate_up: Mxfp4Weights, down: Mxfp4Weights, table: RoutingTable,
                  act: ClampedSwiGLU | None, config: Mxfp4Config | None = None) -> torch.Tensor:
    """Expert-sorted rows x_sorted [T*k, D] through their experts (table) -> [T*k, D] float32, before gate weights:
    gate/up with its biases and act (None: silu(gate) * up) into h [T*k, F] in x's dtype, then down with its bias."""
    E, two_f, D = gate_up.shape
    F = two_f // 2
    if x_sorted.shape[1] != D or down.shape != (E, D, F):
        raise ValueError(f"MXFP4 experts: x [.., {x_sorted.shape[1]}], gate_up {gate_up.shape}, down {down.shape} "
                         f"do not fit together")
    cfg = config or default_config(table.num_tokens, x_sorted.dtype)
    x = x_sorted.contiguous()
    rows = x.shape[0]
    h = torch.empty(rows, F, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, D, dtype=torch.float32, device=x.device)
    common = dict(USE_DOT=cfg.use_dot(x.dtype), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  INTERPRET=triton_interpreting(), num_warps=cfg.num_warps)
    gate_up_kernel[(triton.cdiv(F, cfg.BLOCK_N), E)](
        x, gate_up.blocks, gate_up.scales, gate_up.bias if gate_up.bias is not None else gate_up.scales, h,
        table.offsets, table.counts, F, D, act.alpha if act else 0.0, act.limit if act else 0.0,
        HAS_BIAS=gate_up.bias is not None, CLAMPED=act is not None, **common)
    down_kernel[(triton.cdiv(D, cfg.BLOCK_N), E)](
        h, down.blocks, down.scales, down.bias if down.bias is not None else down.scales, y, table.offsets,
        table.counts, D, F, HAS_BIAS=down.bias is not None, **common)
    return y
