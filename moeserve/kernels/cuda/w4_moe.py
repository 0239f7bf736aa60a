"""Host side of the 4-bit MMA MoE kernels (w4_moe.cu): the experts' weights in their layout (W4Experts, built once
from the packed experts), the launch arguments, and w4_experts, the gate_up + down pass over expert-sorted rows."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.kernels.cuda import build, driver
from moeserve.kernels.cuda.w4_layout import CHUNK, mma_layout, supported

SOURCE = Path(__file__).resolve().with_name("w4_moe.cu")
WARPS, RT = 4, 4  # the source's defaults: warps a block, 16-row tiles a warp
SPLIT = 4  # K slices of the down projection (fp32 atomics): its 4096-row outputs alone fill too few warps
ENV = "MOESERVE_MMA_MOE"  # "1": QuantizedExperts runs 2..MAX_ROWS tokens on these kernels
ROW_TILES = (1, 2, 4)  # n-tiles of 8 rows an expert a pass (the kernels' NT)
MAX_ROWS = 64  # tokens a call takes (from 128 the Triton tiles are faster; an expert's rows beyond 8 * NT
# re-read its weights per pass)


@dataclass
class W4Projection:
    """One projection of all experts in the kernel's layout."""

    words: torch.Tensor  # [E, N / 16, K / 64, 32, 4] int32
    scales: torch.Tensor  # [E, N / 16, G, 8, 4] fp16
    group: int
    in_features: int
    out_features: int

    @staticmethod
    def of(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, in_features: int,
           gate_up: bool) -> W4Projection:
        words, scales = mma_layout(qweight, scale, zero, in_features, gate_up)
        return W4Projection(words, scales, group, in_features, qweight.shape[1])


@dataclass
class W4Experts:
    gate_up: W4Projection  # out_features 2F
    down: W4Projection


def applies(bits: int, group: int, gate_up_shape: tuple[int, int], in_features: int, biased: bool,
            lowrank: bool) -> bool:
    """Experts the kernels take: 4-bit, groups of whole 64-input chunks, F and D whole 32-row pairs of tiles, no
    biases or compensators."""
    two_f, d = gate_up_shape
    return (not biased and not lowrank and supported(bits, group, two_f, in_features)
            and supported(bits, group, d, two_f // 2))


def enabled() -> bool:
    """Whether the MMA kernels are switched on (ENV): they keep a second copy of the experts in their layout."""
    return os.environ.get(ENV, "0") == "1"


@functools.lru_cache(maxsize=8)
def usable(device_index: int) -> bool:
    """An Ampere or later GPU and the kernels' PTX (shipped, cached or built by nvcc); else a one-line note."""
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        module()
    except RuntimeError as exc:
        print(f"moeserve: the 4-bit MMA MoE kernels are unavailable ({exc}); using the Triton kernels")
        return False
    return True


@functools.lru_cache(maxsize=8)
def module(defines: tuple[str, ...] = ()) -> driver.Module:
    return driver.Module(build.ptx(SOURCE, defines))


def row_tiles(tokens: int, experts: int, top_k: int) -> int:
    """NT for a call: room for twice an expert's average rows, at most 4 n-tiles (32 rows) a pass."""
    rows = max(1, 2 * tokens * top_k // experts)
    return next((nt for nt in ROW_TILES if 8 * nt >= rows), ROW_TILES[-1])


def launch(name: str, x: torch.Tensor, p: W4Projection, out: torch.Tensor, offsets: torch.Tensor, nt: int,
           split: int = 1, defines: tuple[str, ...] = (), warps: int = WARPS, rt: int = RT) -> None:
    """One projection: x [rows, K] expert-sorted -> out (gate_up: h [rows, F] in x's dtype; down: [rows, N] fp32,
    zeroed when split > 1)."""
    E, tiles, chunks = p.words.shape[:3]
    dtype = "bf16" if x.dtype == torch.bfloat16 else "fp16"
    per_split = -(-chunks // split)
    fn = module(defines).function(f"w4_{name}_{dtype}_{nt}", x.device.index or 0)
    grid = (-(-tiles // (warps * rt)), E, -(-chunks // per_split))
    driver.launch(fn, grid, warps * 32, (x, p.words, p.scales, out, offsets, tiles, chunks, p.group // CHUNK,
                                         p.in_features // p.group, p.in_features, per_split), x.device)


def w4_experts(x: torch.Tensor, experts: W4Experts, offsets: torch.Tensor, tokens: int, top_k: int, split: int = SPLIT,
               nt: int | None = None, defines: tuple[str, ...] = ()) -> torch.Tensor:
    """x [T*k, D] expert-sorted rows (offsets [E] int32, their exclusive ends) -> the experts' outputs before gate
    weighting [T*k, D] fp32: h = silu(x Wg^T) * (x Wu^T) then h Wd^T."""
    E = experts.gate_up.words.shape[0]
    nt = nt or row_tiles(tokens, E, top_k)
    F = experts.gate_up.out_features // 2
    h = torch.empty(x.shape[0], F, dtype=x.dtype, device=x.device)  # [T*k, F]
    launch("gate_up", x, experts.gate_up, h, offsets, nt, 1, defines)
    D = experts.down.out_features
    y = (torch.zeros if split > 1 else torch.empty)(x.shape[0], D, dtype=torch.float32, device=x.device)
    launch("down", h, experts.down, y, offsets, nt, split, defines)
    return y
