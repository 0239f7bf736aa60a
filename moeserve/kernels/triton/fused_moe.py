"""Fused MoE expert GEMMs in Triton over expert-sorted rows: two launches, no host sync.

    gate_up: h[rows] = silu(x[rows] Wg[e]^T) * (x[rows] Wu[e]^T)       gate_up_proj [E, 2F, D]
    down:    y[rows] = h[rows] Wd[e]^T                                  down_proj    [E, D, F]

Two schedules of the same math:
    decode (few tokens): a program per (expert, output block); experts with no rows return at once, the others
        read their weight tile once per block of input and multiply it with all their rows (rows padded to BLOCK_M,
        more rows loop in chunks of BLOCK_M).
    tiles (prefill): a program per (row tile, output block), a row tile being BLOCK_M rows of one expert (each
        expert's rows start a fresh tile). Each program finds its expert and rows from the per-expert counts, so
        the grid is a fixed upper bound on the tiles and tiles past the last return at once. Axis 0 walks the
        row tiles of one output block, so the programs in flight share their weight tiles through L2 and each
        expert weight is read from HBM about once.
Both find their rows on the GPU with rows.py, which the low-bit kernels share. Each projection's config
(configs.FusedMoEConfig) says its schedule and tiles.

The gate-weight scaling and the scatter back to tokens stay in kernels/routing.combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.routing import RoutingTable, build_routing_table
from moeserve.kernels.triton.autotune import Outcome, Problem, bucket, choose, gpu_ms, tune
from moeserve.kernels.triton.configs import ExpertsConfig, FusedMoEConfig, fused_moe_config, shape_key
from moeserve.kernels.triton.device import device_of
from moeserve.kernels.triton.rows import ROUTE_SORTED, expert_rows, expert_tile
from moeserve.kernels.triton.spaces import fused_moe_candidates
from moeserve.kernels.triton.swiglu import silu_mul


@triton.jit
def _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, N, BLOCK_N: tl.constexpr):
    """This program's expert e (axis 0): its rows [start, end) in the sorted order, its block of N outputs, its
    weights."""
    start, end, e, _, _ = expert_rows(tl.program_id(0), offsets_ptr, counts_ptr, 0, ROUTE_SORTED, 1, 1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    return start, end, offs_n, offs_n < N, w_ptr + e * stride_we


@triton.jit
def _gate_up_decode_kernel(x_ptr, w_ptr, h_ptr, offsets_ptr, counts_ptr, D, F, stride_we,
                           PRECISION: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start, end, offs_n, n_mask, w_base = _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, F, BLOCK_N)
    for c in tl.static_range(CHUNKS):  # an expert has at most T rows: CHUNKS = cdiv(T, BLOCK_M), no host sync
      m0 = start + c * BLOCK_M
      if m0 < end:
        rows = m0 + tl.arange(0, BLOCK_M)
        r_mask = rows < end
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < D
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            wmask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(w_base + offs_n[None, :] * D + offs_k[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_base + (F + offs_n[None, :]) * D + offs_k[:, None], mask=wmask, other=0.0)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        h = silu_mul(acc_g, acc_u)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * F + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_decode_kernel(h_ptr, w_ptr, y_ptr, offsets_ptr, counts_ptr, D, F, stride_we,
                        PRECISION: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start, end, offs_n, n_mask, w_base = _program_setup(offsets_ptr, counts_ptr, w_ptr, stride_we, D, BLOCK_N)
    for c in tl.static_range(CHUNKS):
      m0 = start + c * BLOCK_M
      if m0 < end:
        rows = m0 + tl.arange(0, BLOCK_M)
        r_mask = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < F
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * F + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_base + offs_n[None, :] * F + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * D + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_setup(counts_ptr, E, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """A row tile's (expert, first row, end row, rows [BLOCK_M] clamped below the end, outputs [BLOCK_N], the same
    clamped below N): clamped rows and outputs read real memory, so the K loop has no masks."""
    expert, start, end = expert_tile(counts_ptr, E, BLOCK_M, BLOCK_E)
    rows = tl.minimum(start + tl.arange(0, BLOCK_M), end - 1)  # [BLOCK_M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    return expert, start, end, rows, offs_n, tl.minimum(offs_n, N - 1)


@triton.jit
def _rows_tile(src, row0, row_ptrs, k0, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Inputs [k0, k0 + BLOCK_K) of some rows of a row-major matrix: [R, BLOCK_K]. TMA: src is a descriptor and the
    rows are row0.. (past the tensor's end they read as zeros); else the rows' pointers row_ptrs [R, 1]."""
    if TMA:
        tile = src.load([row0, k0])
    else:
        tile = tl.load(row_ptrs + (k0 + tl.arange(0, BLOCK_K))[None, :])
    return tile


@triton.jit
def _store_rows(out_ptr, vals, start, end, offs_n, N, BLOCK_M: tl.constexpr):
    """out[start + i, n] = vals[i, n] for the tile's real rows and outputs."""
    rows = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=(rows < end)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _gate_up_tiles_kernel(x, w, h_ptr, counts_ptr, E, D, F, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, STAGES: tl.constexpr,
                          TMA: tl.constexpr):
    """x [T*k, D] and w [E * 2F, D] are pointers, or TMA descriptors of [BLOCK_M | BLOCK_N, BLOCK_K] blocks."""
    expert, start, end, rows, offs_n, cols = _tile_setup(counts_ptr, E, F, BLOCK_M, BLOCK_N, BLOCK_E)
    if start < end:
        gate_row = expert * 2 * F + tl.program_id(1) * BLOCK_N  # TMA: first weight row (rows past F: never stored)
        if TMA:
            x_rows, wg_rows, wu_rows = x, w, w  # unused
        else:
            x_rows = x + rows[:, None].to(tl.int64) * D  # [BLOCK_M, 1]
            wg_rows = w + (expert * 2 * F + cols[:, None]).to(tl.int64) * D  # [BLOCK_N, 1]
            wu_rows = wg_rows + F * D
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K, num_stages=STAGES):  # D % BLOCK_K == 0 (launch checks)
            xs = _rows_tile(x, start, x_rows, k0, BLOCK_K, TMA)  # [BLOCK_M, BLOCK_K]
            wg = _rows_tile(w, gate_row, wg_rows, k0, BLOCK_K, TMA)  # [BLOCK_N, BLOCK_K]
            wu = _rows_tile(w, gate_row + F, wu_rows, k0, BLOCK_K, TMA)
            acc_g = tl.dot(xs, wg.T, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xs, wu.T, acc_u, input_precision=PRECISION)
        _store_rows(h_ptr, silu_mul(acc_g, acc_u), start, end, offs_n, F, BLOCK_M)


@triton.jit
def _down_tiles_kernel(h, w, y_ptr, counts_ptr, E, D, F, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, STAGES: tl.constexpr,
                       TMA: tl.constexpr):
    """h [T*k, F] and w [E * D, F] are pointers, or TMA descriptors of [BLOCK_M | BLOCK_N, BLOCK_K] blocks."""
    expert, start, end, rows, offs_n, cols = _tile_setup(counts_ptr, E, D, BLOCK_M, BLOCK_N, BLOCK_E)
    if start < end:
        w_row = expert * D + tl.program_id(1) * BLOCK_N
        if TMA:
            h_rows, w_rows = h, w  # unused
        else:
            h_rows = h + rows[:, None].to(tl.int64) * F  # [BLOCK_M, 1]
            w_rows = w + (expert * D + cols[:, None]).to(tl.int64) * F  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, F, BLOCK_K, num_stages=STAGES):  # F % BLOCK_K == 0 (launch checks)
            acc = tl.dot(_rows_tile(h, start, h_rows, k0, BLOCK_K, TMA),
                         _rows_tile(w, w_row, w_rows, k0, BLOCK_K, TMA).T, acc, input_precision=PRECISION)
        _store_rows(y_ptr, acc, start, end, offs_n, D, BLOCK_M)


def _precision(x: torch.Tensor) -> str:
    """fp32 inputs get exact (IEEE) dots, 16-bit ones tensor-core dots."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def launch_decode(part: str, a, w, out, table: RoutingTable, cfg: FusedMoEConfig) -> None:
    """One projection ("gate_up": x -> h, or "down": h -> y) in the decode schedule: a [T*k, K] with the stacked
    weights w -> out [T*k, N], a program per (expert, output block); table.num_tokens bounds an expert's rows, which
    fixes the kernel's CHUNKS of BLOCK_M rows without a sync."""
    E, _, K = w.shape
    N = out.shape[1]
    kernel, (D, F) = (_gate_up_decode_kernel, (K, N)) if part == "gate_up" else (_down_decode_kernel, (N, K))
    kernel[(E, triton.cdiv(N, cfg.BLOCK_N))](
        a, w, out, table.offsets, table.counts, D, F, w.stride(0), PRECISION=_precision(a),
        CHUNKS=triton.cdiv(table.num_tokens, cfg.BLOCK_M), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps)


def tiles_grid(cfg: FusedMoEConfig, slots: int, E: int, N: int) -> tuple[int, int]:
    """(row tiles, output blocks): the row tiles of `slots` rows over E experts are at most
    cdiv(slots, BLOCK_M) + min(E, slots) - 1 (each expert with rows wastes at most one partial tile)."""
    bm = cfg.BLOCK_M
    return max(1, triton.cdiv(slots, bm) + min(E, slots) - 1), triton.cdiv(N, cfg.BLOCK_N)


def tiles_fit(cfg: FusedMoEConfig, K: int) -> bool:
    """The tile kernels' K loops run unmasked: a tile config's BLOCK_K must divide the projection's inputs K."""
    return K % cfg.BLOCK_K == 0


def launch_tiles(part: str, a, w, out, table: RoutingTable, cfg: FusedMoEConfig) -> None:
    """One projection ("gate_up": x -> h, or "down": h -> y) over row tiles: a [T*k, K] with the stacked weights w
    -> out [T*k, N]; cfg TMA: the operands go as TMA descriptors."""
    E, _, K = w.shape
    N = out.shape[1]
    kernel, (D, F) = (_gate_up_tiles_kernel, (K, N)) if part == "gate_up" else (_down_tiles_kernel, (N, K))
    bm, bn, bk = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    if not w.is_contiguous():
        raise ValueError(f"the tile kernels read contiguous expert weights, got strides {w.stride()}")
    tma = bool(cfg.TMA)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # TMA only; not in every Triton

        a, w = TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w.view(-1, K), [bn, bk])
    kernel[tiles_grid(cfg, out.shape[0], E, N)](
        a, w, out, table.counts, E, D, F, PRECISION=_precision(out), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(E), STAGES=cfg.num_stages, TMA=tma, num_warps=cfg.num_warps)


def fused_experts(x_sorted: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  table: RoutingTable, config: ExpertsConfig | None = None) -> torch.Tensor:
    """x_sorted [T*k, D] expert-sorted rows -> expert outputs [T*k, D] (before gate weighting).

    Each projection runs the decode schedule, or the row tiles where its config's schedule is "tiles" (then its
    BLOCK_K must divide its inputs). table.num_tokens bounds the rows of one expert, which fixes the decode
    kernels' loops without a sync."""
    E, two_f, D = gate_up_proj.shape
    F = two_f // 2
    if config is None:
        config = experts_config(x_sorted, gate_up_proj, down_proj, table.num_tokens)
    for proj, cfg, K in (("gate_up", config.gate_up, D), ("down", config.down, F)):
        if cfg.schedule == "tiles" and not tiles_fit(cfg, K):
            raise ValueError(f"the {proj} tile config needs a BLOCK_K that divides its {K} inputs: {cfg}")
    x_sorted = x_sorted.contiguous()
    h = torch.empty(x_sorted.shape[0], F, dtype=x_sorted.dtype, device=x_sorted.device)  # [T*k, F]
    y = torch.empty(x_sorted.shape[0], D, dtype=x_sorted.dtype, device=x_sorted.device)  # [T*k, D]
    for part, cfg, a, w, out in (("gate_up", config.gate_up, x_sorted, gate_up_proj, h),
                                 ("down", config.down, h, down_proj, y)):
        (launch_tiles if cfg.schedule == "tiles" else launch_decode)(part, a, w, out, table, cfg)
    return y


TIMED_ROUTINGS = 4  # rotating routings a tuning run times each candidate over


def experts_config(x_sorted: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   tokens: int) -> ExpertsConfig:
    """The configs for `tokens` tokens (x_sorted [T*k, D]): stored or default (configs.py), on a GPU after tuning
    the token bucket where nothing is stored for it (autotune.py)."""
    E, two_f, D = gate_up_proj.shape
    F, top_k = two_f // 2, max(1, x_sorted.shape[0] // max(tokens, 1))
    if not x_sorted.is_cuda:
        return fused_moe_config("cpu", E, D, F, tokens, top_k)
    device = device_of(x_sorted)
    return choose(device, "fused_moe", shape_key(E, D, F), tokens,
                  lambda T: fused_moe_config(device, E, D, F, T, top_k),
                  lambda mode, T: fused_moe_candidates(mode, T, D, F),
                  lambda T: experts_timer(gate_up_proj, down_proj, T, top_k))


def experts_timer(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tokens: int, top_k: int):
    """measure(config) -> GPU ms of fused_experts at `tokens` random tokens over TIMED_ROUTINGS random routings."""
    E, _, D = gate_up_proj.shape
    dev, dtype = gate_up_proj.device, gate_up_proj.dtype
    items = []
    for _ in range(TIMED_ROUTINGS):
        ids = torch.rand(tokens, E, device=dev).topk(top_k, dim=1).indices  # [T, k] distinct experts
        items.append((torch.randn(tokens * top_k, D, device=dev, dtype=dtype),
                      build_routing_table(ids, torch.rand(tokens, top_k, device=dev), E)))
    return lambda config: gpu_ms(lambda item: fused_experts(item[0], gate_up_proj, down_proj, item[1], config), items)


def tune_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tokens: int, top_k: int, mode: str,
                 budget_s: float | None = None) -> Outcome:
    """Search this GPU's config for these experts at the bucket of `tokens` now, whatever is stored (`moeserve
    tune`), starting from what a call gets without it, and store the winner in the user's tuning cache."""
    device = device_of(gate_up_proj)
    E, two_f, D = gate_up_proj.shape
    F, T = two_f // 2, bucket(tokens)
    return tune(device, Problem("fused_moe", shape_key(E, D, F), T), fused_moe_config(device, E, D, F, T, top_k),
                fused_moe_candidates(mode, T, D, F), experts_timer(gate_up_proj, down_proj, T, top_k), mode, budget_s)
