"""Host side of the MXFP4 MoE kernels: the weights one projection passes (Mxfp4Weights), launch configs
(Mxfp4Config; default_config by tokens and dtype) and mxfp4_experts, the launches of a layer: on CUDA cores (few rows)
prepare x, gate/up and down; on tensor cores gate/up and down. Given the table's token ids, the first launch reads
each sorted row from the tokens itself, so the block needs no gather launch.

The launches depend on shapes only (rows T*k, experts, sizes): the routing table's counts stay on the GPU, where each
program finds its expert's rows, so a call can be captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moeserve.kernels import triton_interpreting
from moeserve.kernels.routing import RoutingTable
from moeserve.kernels.triton.mxfp4.kernels import (down_dot_kernel, down_gemv_kernel, gate_up_dot_kernel,
                                                   gate_up_gemv_kernel, prepare_kernel)
from moeserve.kernels.triton.pdl import dependent_launch
from moeserve.kernels.triton.swiglu import act_args
from moeserve.spec import ClampedSwiGLU

HALF_DTYPES = (torch.float16, torch.bfloat16)
GEMV_MAX_ROWS = 8  # CUDA-core programs take up to this many rows of x at once (each a set of unrolled sums)
DOT_MIN_ROWS = 16  # tensor-core tiles: at least this many rows
PREPARE_GROUPS = 32  # groups of 32 inputs per prepare_kernel program


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

    def words(self) -> torch.Tensor:
        """The blocks as int32 words [E, N, K/32, 4] (a view: four words a group, eight codes a word)."""
        return self.blocks.contiguous().view(torch.int32)


@dataclass(frozen=True)
class Mxfp4Config:
    """A launch config of both projections of the MXFP4 experts.

    BLOCK_N     output rows of a program (gate/up: BLOCK_N gate rows and their up rows), a power of two >= 32
    BLOCK_K     inputs a step, a power of two >= 32 (BLOCK_K / 32 groups)
    BLOCK_M     rows of x at once: up to GEMV_MAX_ROWS on CUDA cores (each code decoded once for all of them), from
                DOT_MIN_ROWS on tensor cores (16-bit x; float32 x takes CUDA cores, GEMV_MAX_ROWS at a time)
    HALF        CUDA cores on 16-bit x: sums on fp16 pairs (one HFMA2 per two values, x scaled per group); else fp32
    num_warps, num_stages   Triton's (num_stages: the step loop's software pipeline)"""

    BLOCK_N: int = 32
    BLOCK_K: int = 256
    BLOCK_M: int = 1
    HALF: bool = True
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K", "BLOCK_M"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Mxfp4Config {name} must be a power of two, got {value}")
        if self.BLOCK_N < 32 or self.BLOCK_K < 32:
            raise ValueError(f"Mxfp4Config needs BLOCK_N and BLOCK_K >= 32 (whole groups), got {self}")
        if GEMV_MAX_ROWS < self.BLOCK_M < DOT_MIN_ROWS:
            raise ValueError(f"Mxfp4Config BLOCK_M takes 1..{GEMV_MAX_ROWS} or >= {DOT_MIN_ROWS}, got {self.BLOCK_M}")
        if self.num_stages < 1:
            raise ValueError(f"Mxfp4Config num_stages must be >= 1, got {self.num_stages}")

    def use_dot(self, dtype: torch.dtype) -> bool:
        """Tensor cores: tiles of BLOCK_M >= DOT_MIN_ROWS rows of 16-bit x."""
        return self.BLOCK_M >= DOT_MIN_ROWS and dtype in HALF_DTYPES

    def half(self, dtype: torch.dtype) -> bool:
        """CUDA cores on fp16 pairs: HALF and 16-bit x."""
        return self.HALF and dtype in HALF_DTYPES

    def gemv_rows(self) -> int:
        """Rows of x a CUDA-core program takes at once."""
        return min(self.BLOCK_M, GEMV_MAX_ROWS)


def default_config(num_tokens: int, dtype: torch.dtype) -> Mxfp4Config:
    """16-bit x: up to 8 tokens CUDA-core programs of 32 rows on fp16 pairs, one row of x at once and 512 inputs a
    step for one token, two rows and 256 inputs for more (an expert gets about T*k/E of the T*k rows: one or two);
    above 8 tokens 16-row tensor-core tiles of 64 outputs x 64 inputs, four stages. float32 x: CUDA cores, up to 4
    rows at once. The fastest of bench/gptoss.py --sweep on an H200 (GPT-OSS-20B shape, 1/16/64 tokens)."""
    if dtype not in HALF_DTYPES:
        return Mxfp4Config(BLOCK_M=min(4, triton.next_power_of_2(max(num_tokens, 1))))
    if num_tokens > 8:
        return Mxfp4Config(BLOCK_N=64, BLOCK_K=64, BLOCK_M=16, num_stages=4)
    if num_tokens <= 1:
        return Mxfp4Config(BLOCK_K=512)
    return Mxfp4Config(BLOCK_M=2)


@dataclass(frozen=True)
class Rows:
    """The expert-sorted rows a call computes: how many, and the token each reads (None: x holds the rows)."""

    count: int
    token_ids: torch.Tensor | None

    def args(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the kernels' ids pointer, GATHER): the token ids, or x as an unread placeholder."""
        return (x, False) if self.token_ids is None else (self.token_ids, True)


def mxfp4_experts(x: torch.Tensor, gate_up: Mxfp4Weights, down: Mxfp4Weights, table: RoutingTable,
                  act: ClampedSwiGLU | None, config: Mxfp4Config | None = None,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The expert-sorted rows through their experts (table) -> [T*k, D] float32, before gate weights: gate/up with its
    biases and act (None: silu(gate) * up) into h [T*k, F], then down with its bias. x: the rows [T*k, D], or with
    token_ids (the table's [T*k] token of each sorted row) the tokens [T, D], gathered by the kernels (no gather
    launch). h is x's dtype on tensor cores; on CUDA cores fp16 scaled per group of 32 (HALF) or float32."""
    E, two_f, D = gate_up.shape
    F = two_f // 2
    if x.shape[1] != D or down.shape != (E, D, F):
        raise ValueError(f"MXFP4 experts: x [.., {x.shape[1]}], gate_up {gate_up.shape}, down {down.shape} "
                         f"do not fit together")
    cfg = config or default_config(table.num_tokens, x.dtype)
    x = x.contiguous()
    rows = Rows(x.shape[0] if token_ids is None else token_ids.numel(), token_ids)
    y = torch.empty(rows.count, D, dtype=torch.float32, device=x.device)
    if rows.count == 0:
        return y
    if cfg.use_dot(x.dtype):
        dot_experts(x, rows, gate_up, down, table, act, cfg, y)
    else:
        gemv_experts(x, rows, gate_up, down, table, act, cfg, y)
    return y


def common_constexprs(cfg: Mxfp4Config, E: int, device: torch.device) -> dict:
    """The compile-time arguments and launch options every gate/up and down launch of cfg takes."""
    return dict(BLOCK_N=cfg.BLOCK_N, G=cfg.BLOCK_K // 32, BLOCK_E=triton.next_power_of_2(E), STAGES=cfg.num_stages,
                INTERPRET=triton_interpreting(), num_warps=cfg.num_warps, **dependent_launch(device))


def grid(N: int, cfg: Mxfp4Config, rows: int, E: int) -> tuple[int, int]:
    """(output blocks of N, experts hit at most: min(rows, E)): sizes only, no routing result."""
    return triton.cdiv(N, cfg.BLOCK_N), min(rows, E)


def prepared_buffers(rows: int, K: int, half: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty prepared x for `rows` rows of K inputs (kernels.store_prepared): HALF (int32 [rows, K/32, 4, 4] fp16
    pairs, float32 [rows, K/32] 1 / r), else (float32 [rows, K/32, 8, 4], an unused placeholder)."""
    if half:
        return (torch.empty(rows, K // 32, 4, 4, dtype=torch.int32, device=device),
                torch.empty(rows, K // 32, dtype=torch.float32, device=device))
    return torch.empty(rows, K // 32, 8, 4, dtype=torch.float32, device=device), torch.empty(1, device=device)


def prepare(x: torch.Tensor, rows: Rows, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of x -> their prepared buffers (prepared_buffers), one launch (that also gathers them)."""
    K = x.shape[1]
    xp, xr = prepared_buffers(rows.count, K, half, x.device)
    ids, gather = rows.args(x)
    prepare_kernel[(rows.count, triton.cdiv(K // 32, PREPARE_GROUPS))](
        x, ids, xp, xr, K, HALF=half, GATHER=gather, BLOCK_G=PREPARE_GROUPS, num_warps=4, **dependent_launch(x.device))
    return xp, xr


def gemv_experts(x: torch.Tensor, rows: Rows, gate_up: Mxfp4Weights, down: Mxfp4Weights, table: RoutingTable,
                 act: ClampedSwiGLU | None, cfg: Mxfp4Config, y: torch.Tensor) -> None:
    """CUDA cores: prepare (and gather) x, gate/up into h prepared for down, down into y."""
    E, two_f, D = gate_up.shape
    F = two_f // 2
    half = cfg.half(x.dtype)
    common = dict(HALF=half, BLOCK_M=cfg.gemv_rows(), **common_constexprs(cfg, E, x.device))
    xp, xr = prepare(x, rows, half)
    hp, hr = prepared_buffers(rows.count, F, half, x.device)
    gate_up_gemv_kernel[grid(F, cfg, rows.count, E)](
        xp, xr, gate_up.words(), gate_up.scales, gate_up.bias if gate_up.bias is not None else xr, hp, hr,
        table.offsets, table.counts, E, F, D, *act_args(act), HAS_BIAS=gate_up.bias is not None,
        CLAMPED=act is not None, SLOTS=False, **common)
    down_gemv_kernel[grid(D, cfg, rows.count, E)](
        hp, hr, down.words(), down.scales, down.bias if down.bias is not None else hr, y, table.offsets,
        table.counts, y, y, y, E, D, F, HAS_BIAS=down.bias is not None, SLOTS=False, COMBINE=False, **common)


def dot_experts(x: torch.Tensor, rows: Rows, gate_up: Mxfp4Weights, down: Mxfp4Weights, table: RoutingTable,
                act: ClampedSwiGLU | None, cfg: Mxfp4Config, y: torch.Tensor) -> None:
    """Tensor cores: gate/up (gathering x's rows) into h [rows, F] in x's dtype, down into y."""
    E, two_f, D = gate_up.shape
    F = two_f // 2
    common = dict(BLOCK_M=cfg.BLOCK_M, **common_constexprs(cfg, E, x.device))
    h = torch.empty(rows.count, F, dtype=x.dtype, device=x.device)
    ids, gather = rows.args(x)
    gate_up_dot_kernel[grid(F, cfg, rows.count, E)](
        x, ids, gate_up.words(), gate_up.scales, gate_up.bias if gate_up.bias is not None else x, h, table.offsets,
        table.counts, E, F, D, *act_args(act), HAS_BIAS=gate_up.bias is not None, CLAMPED=act is not None,
        GATHER=gather, **common)
    down_dot_kernel[grid(D, cfg, rows.count, E)](
        h, down.words(), down.scales, down.bias if down.bias is not None else h, y, table.offsets, table.counts, E,
        D, F, HAS_BIAS=down.bias is not None, **common)
