"""Host side of the low-bit kernels: a launch config -> the kernels' compile-time arguments (Tile), x as the kernels
read it (itself, or prepared for the CUDA-core GEMV), the routing -> row arguments, and the launches of
kernels.py. ops.py calls these; the tuners call them directly to time one projection."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import triton

from moeserve.kernels import triton_interpreting
from moeserve.kernels.triton.configs import LowbitConfig
from moeserve.kernels.triton.lowbit.kernels import (down_tma_kernel, gate_up_kernel, gate_up_tma_kernel, lowbit_kernel,
                                                    prepare_x_kernel)
from moeserve.kernels.triton.lowbit.layout import (StackedLowbit, exponent_bits, half_x_limit, pair_codes,
                                                   values_per_column, x_slots)
from moeserve.kernels.triton.pdl import dependent_launch, hopper
from moeserve.kernels.triton.rows import DENSE, SLOT_PROGRAMS, SLOTS, SORTED
from moeserve.kernels.triton.swiglu import act_args
from moeserve.spec import ClampedSwiGLU

GEMV_MAX_ROWS = 8
# rows of x a tensor-core tile holds: a program walks an expert's rows (or a dense call's block) this many at a
# time, re-reading its weight tile per pass, so prompt-sized calls keep decode's tile (and its shared memory)
DOT_MAX_ROWS = 64


@dataclass(frozen=True)
class Tile:
    """The compile-time arguments tile_product takes (and the launch options) for one launch: shared by the
    dense/down kernel and the MoE gate/up kernel (tile_constexprs)."""

    BITS: int
    GROUP: int
    USE_DOT: bool  # tensor cores
    HAS_LR: bool  # a compensator term
    HALF: bool  # 16-bit pairs (CUDA cores) or codes (tensor cores)
    INTERPRET: bool
    PRECISION: str
    BLOCK_N: int
    BLOCK_M: int
    BLOCK_K: int
    BLOCK_R: int
    AHEAD: int
    SUB: int
    PIPE: int
    num_warps: int
    num_stages: int

    @functools.cached_property
    def kwargs(self) -> dict:
        """The launch's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def blocks(bits: int, group: int, rows: int, cfg: LowbitConfig) -> tuple[bool, int, int]:
    """(use tensor cores, BLOCK_M, BLOCK_K) for up to `rows` rows per program. One row, or a config with BLOCK_M
    (rows of x per CUDA-core tile, a power of two <= 8), runs on CUDA cores; more rows on tensor cores, padded to
    >= 16, at most DOT_MAX_ROWS a pass. BLOCK_K holds whole words and units (a dot's K = columns is >= 16) and, on CUDA cores, whole groups."""
    gemv_m = 1 if cfg.BLOCK_M is None else cfg.BLOCK_M
    if gemv_m not in (1, 2, 4, GEMV_MAX_ROWS):
        raise ValueError(f"a CUDA-core config's BLOCK_M must be 1, 2, 4 or {GEMV_MAX_ROWS}, got {gemv_m}")
    use_dot = rows > 1 and cfg.BLOCK_M is None
    per_column = values_per_column(bits)
    if use_dot:
        return True, max(16, min(DOT_MAX_ROWS, triton.next_power_of_2(rows))), max(cfg.BLOCK_K, per_column, 16)
    return False, min(gemv_m, triton.next_power_of_2(rows)), max(cfg.BLOCK_K, group, per_column)


def tile_constexprs(cfg: LowbitConfig, bits: int, group: int, rows: int, dtype: torch.dtype, has_lr: bool) -> Tile:
    """The Tile of a config for up to `rows` rows per program (made once per distinct launch)."""
    return _tile(cfg, bits, group, rows, dtype, has_lr, triton_interpreting())


@functools.lru_cache(maxsize=4096)
def _tile(cfg: LowbitConfig, bits: int, group: int, rows: int, dtype: torch.dtype, has_lr: bool,
          interpret: bool) -> Tile:
    use_dot, block_m, block_k = blocks(bits, group, rows, cfg)
    pipelined_dot = use_dot and cfg.PIPE > 0  # tiles.py's PIPE: dequantized tiles of whole groups
    if pipelined_dot and block_k % group:
        raise ValueError(f"a pipelined tensor-core config (PIPE) needs BLOCK_K a multiple of the group {group}, got "
                         f"{block_k}")
    # 16-bit pairs for 16-bit activations (relative error ~2e-3, bf16's own output rounding) unless a config says no
    half = pair_codes(bits, dtype, use_dot) and bool(cfg.HALF) and not pipelined_dot
    if use_dot and half:
        block_k = group  # a step is one group: its scale/zero apply to the step's dot
    return Tile(BITS=bits, GROUP=group, USE_DOT=use_dot, HAS_LR=has_lr, HALF=half, INTERPRET=interpret,
                PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_N=cfg.BLOCK_N, BLOCK_M=block_m,
                BLOCK_K=block_k, BLOCK_R=cfg.BLOCK_R, AHEAD=cfg.AHEAD, SUB=cfg.SUB, PIPE=cfg.PIPE,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---- x as the kernels read it ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Preparation:
    """How the CUDA-core kernels want x prepared (prepare_x's layout): packed width, inputs per step, fp16 pairs.
    Another kernel that reads x anyway can write it (kernels/triton/topk_router.py), one launch fewer."""

    bits: int
    block_k: int
    half: bool

    @staticmethod
    def of(tile: Tile) -> Preparation | None:
        """What a tile (tile_constexprs) reads as x, or None for tensor-core tiles (they read x itself)."""
        return None if tile.USE_DOT else Preparation(tile.BITS, tile.BLOCK_K, tile.HALF)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int32 if self.half else torch.float32  # fp16 pairs, or fp32 values

    def shape(self, rows: int, K: int) -> tuple[int, int, int, int]:
        """[rows, steps, x_slots, CPS] of rows of K inputs."""
        per_column = values_per_column(self.bits)
        cps = self.block_k // per_column
        return rows, triton.cdiv(K // per_column, cps), x_slots(per_column, self.half), cps

    def buffer(self, rows: int, K: int, device) -> torch.Tensor:
        """An empty prepared x for rows of K inputs."""
        return torch.empty(self.shape(rows, K), dtype=self.dtype, device=device)

    def constexprs(self) -> dict:
        """prepare_step's compile-time arguments."""
        per_column = values_per_column(self.bits)
        return dict(BITS=self.bits, VPC=per_column, CPS=self.block_k // per_column, HALF=self.half,
                    LOG2_LIMIT=half_x_limit(self.bits) if self.half else 0)


def prepare_x(x: torch.Tensor, bits: int, block_k: int, half: bool = False,
              fill: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, steps, x_slots, CPS] for the CUDA-core kernel, a step = block_k inputs = CPS columns: per step,
    the inputs of value slot j of its columns side by side (slot j of a 3-bit unit = value i of its word T,
    j = 8T + i; half: fp16 pairs of slots p and p + VPC / 2, scaled per step), then each column's sum of x (and,
    half, the step's 1 / scale). The kernel finds each slot at a constant offset from the step. fill (fp32): zeroed
    by the same launch (the GEMV's split-K target), which saves a fill launch."""
    M, K = x.shape
    prep = Preparation(bits, block_k, half)
    xw = prep.buffer(M, K, x.device)
    constexprs = prep.constexprs()
    prepare_x_kernel[(xw.shape[1], M)](x, xw, K, K // values_per_column(bits), xw if fill is None else fill,
                                       0 if fill is None else fill.numel(), FILL=fill is not None, **constexprs,
                                       num_warps=prepare_warps(constexprs["CPS"]), **dependent_launch(x.device))
    return xw


def prepare_warps(columns: int) -> int:
    """Warps of a prepare_x program: a thread per column of the step, at most 4 (more threads only repeat the
    work)."""
    return min(4, max(1, columns // 32))


def kernel_inputs(x: torch.Tensor, tile: Tile, fill: torch.Tensor | None = None,
                  prepared: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(what the kernels read as x, the exponent bits their decode ORs in) for a Tile: x itself for tensor-core
    tiles, prepare_x(x) for the CUDA-core path (or `prepared`, x prepared already as Preparation.of(tile) says).
    fill (fp32): zeroed on the way (by prepare_x)."""
    bits = tile.BITS
    if not tile.USE_DOT and prepared is None:
        return prepare_x(x, bits, tile.BLOCK_K, tile.HALF, fill), exponent_bits(bits, tile.HALF)
    if fill is not None:
        fill.zero_()
    if tile.USE_DOT:
        return x, exponent_bits(bits, tile.HALF, 7 if x.dtype == torch.bfloat16 else 10)
    want = Preparation.of(tile)
    if tuple(prepared.shape) != want.shape(*x.shape) or prepared.dtype != want.dtype:
        raise ValueError(f"x prepared as {tuple(prepared.shape)} {prepared.dtype}, this tile reads "
                         f"{want.shape(*x.shape)} {want.dtype} ({want})")
    return prepared, exponent_bits(bits, tile.HALF)


# ---- one token: h prepared and the combine by the launches themselves (last_arrival.py) --------------------


@dataclass(frozen=True)
class PreparedH:
    """gate_up's epilogue at one token: h also prepared for down's CUDA-core GEMV (as `prep` says) into `buffer`
    [k, steps, .., CPS], counting arrivals on `counters` (zeroed, >= k * steps): no prepare_x launch before down."""

    prep: Preparation
    buffer: torch.Tensor
    counters: torch.Tensor

    def args(self) -> tuple:
        """(hw_ptr, count_ptr) and h_steps of the gate/up kernels."""
        return self.buffer, self.counters, self.buffer.shape[1]

    def constexprs(self) -> dict:
        c = self.prep.constexprs()
        return dict(PREP_H=True, H_CPS=c["CPS"], H_HALF=c["HALF"], H_LOG2_LIMIT=c["LOG2_LIMIT"])


def k_slices(cfg: LowbitConfig, tile: Tile, K: int, tma: bool) -> tuple[int, int]:
    """(K slices, steps per slice) a projection's launch splits its K inputs into: cfg SPLIT_K, fewer where the steps
    are fewer; steps of BLOCK_K inputs, the config's by TMA, else the Tile's."""
    steps = triton.cdiv(K, cfg.BLOCK_K if tma else tile.BLOCK_K)
    per_split = triton.cdiv(steps, min(cfg.SPLIT_K, steps))
    return triton.cdiv(steps, per_split), per_split


def no_prepared_h(placeholder: torch.Tensor) -> tuple[tuple, dict]:
    """The gate/up kernels' PreparedH arguments and constexprs when h is not prepared by them."""
    return (placeholder, placeholder, 0), dict(PREP_H=False, H_CPS=1, H_HALF=False, H_LOG2_LIMIT=0)


@dataclass(frozen=True)
class SlotCombine:
    """down's epilogue at one token: out [1, N] = sum_j weights[j] y_j in out's dtype, written by the last program of
    each output block (counting on `counters`, zeroed, >= the output blocks): no combine launch after down. The
    kernels' y is then their partial sums [K slices, k, N] fp32."""

    out: torch.Tensor
    weights: torch.Tensor  # [k] the token's gate weights
    counters: torch.Tensor


# ---- rows and compensators --------------------------------------------------------------------------------


def routed_tokens(routing) -> int:
    """The tokens T behind a routing (expert ids [T, k] or a RoutingTable): the most rows one expert can get."""
    return routing.shape[0] if isinstance(routing, torch.Tensor) else routing.num_tokens


def route_args(routing, rows: int, placeholder: torch.Tensor, programs: int) -> dict:
    """The kernels' row arguments (rows.expert_rows) and grid axis 2 (`programs`: the experts, or the row blocks of a
    dense matmul) for a routing: None (dense, `rows` rows), a RoutingTable (sorted rows: its end offsets and counts) or
    expert ids [T, k] (slot order: the T*k flat ids; a program per slot where there are no more slots than
    experts)."""
    if routing is None:
        return dict(a=placeholder, b=placeholder, rows=rows, programs=programs, ROUTE=DENSE, NSLOTS=1)
    if isinstance(routing, torch.Tensor):
        ids = routing.reshape(-1)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        n = ids.numel()
        by_slot = n <= programs
        return dict(a=ids, b=ids, rows=n, programs=n if by_slot else programs,
                    ROUTE=SLOT_PROGRAMS if by_slot else SLOTS, NSLOTS=max(16, triton.next_power_of_2(n)))
    return dict(a=routing.offsets, b=routing.counts, rows=rows, programs=programs, ROUTE=SORTED, NSLOTS=1)


def low_rank_args(lowrank: tuple[torch.Tensor, torch.Tensor] | None, placeholder: torch.Tensor) -> tuple:
    """The kernels' compensator arguments (U [(E,) N, r], x V^T, r) for lowrank = (U, x V^T), or placeholders and
    rank 0 without one (HAS_LR off: never read)."""
    if lowrank is None:
        return placeholder, placeholder, 0
    u, xv = lowrank
    return u, xv, u.shape[-1]


# ---- launches ---------------------------------------------------------------------------------------------


def launch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, y: torch.Tensor,
           bits: int, group: int, K: int, cfg: LowbitConfig, rows_per_block: int, grid_z: int, *,
           lowrank: tuple[torch.Tensor, torch.Tensor] | None = None, routing=None,
           bias: torch.Tensor | None = None, combine: SlotCombine | None = None,
           prepared: torch.Tensor | None = None) -> None:
    """lowbit_kernel: x [rows, K] -> y [rows, N] (fp32 when cfg SPLIT_K > 1: then zeroed here, with prepare_x).

    routing (grid_z = the experts, weights stacked [E, N, ...]): a RoutingTable (x and y expert-sorted) or the
    expert ids [T, k] (x and y in slot order, [T*k, ...]; see route_args). Without it, grid axis 2 walks
    blocks of rows_per_block rows of a dense matmul. bias: the experts' biases [E, N], with routing only.
    combine (one token in slot order): y is the partial sums [K slices, k, N] fp32 and the launch writes combine.out;
    prepared: x prepared already (a PreparedH buffer)."""
    if bias is not None and routing is None:
        raise ValueError("lowbit_kernel adds stacked expert biases [E, N]: a dense call adds its own")
    N = qweight.shape[-2]
    tile = tile_constexprs(cfg, bits, group, rows_per_block, x.dtype, lowrank is not None)
    split, per_split = k_slices(cfg, tile, K, False)
    atomic = split > 1 and combine is None
    if atomic and y.dtype != torch.float32:
        raise ValueError("split-K accumulates with fp32 atomics: the output must be float32")
    if combine is not None and tuple(y.shape) != (split, x.shape[0], N):
        raise ValueError(f"the combine's partial sums are [{split}, {x.shape[0]}, {N}], got {tuple(y.shape)}")
    u, xv, R = low_rank_args(lowrank, y)
    route = route_args(routing, x.shape[0], y, grid_z)
    grid = (triton.cdiv(N, cfg.BLOCK_N), split, route.pop("programs"))
    xk, exp = kernel_inputs(x, tile, y if atomic else None, prepared)
    out, gw, counters = (y, y, y) if combine is None else (combine.out, combine.weights, combine.counters)
    lowbit_kernel[grid](
        xk, qweight, scale, zero, y, u, xv, y if bias is None else bias, route.pop("a"), route.pop("b"), out, gw,
        counters, route.pop("rows"), N, K, R, xv.stride(0), qweight.shape[-1], scale.shape[-1], per_split, exp,
        HAS_BIAS=bias is not None, ATOMIC=atomic, COMBINE=combine is not None, **route, **tile.kwargs,
        **dependent_launch(x.device))


def launch_gate_up(x: torch.Tensor, p: StackedLowbit, h: torch.Tensor, routing, cfg: LowbitConfig,
                   prepared: torch.Tensor | None = None, act: ClampedSwiGLU | None = None,
                   prep_h: PreparedH | None = None) -> None:
    """h = silu(x Wg^T) * (x Wu^T) per expert row: routing a RoutingTable (x and h expert-sorted) or the expert ids
    [T, k] (x the T tokens, h [T*k, F] in slot order); prepared: x prepared already (x_preparation); with p.bias
    and act (GPT-OSS) act(x Wg^T + b_g, x Wu^T + b_u). One token by TMA where tma_one_token says so. prep_h (one
    token): h also prepared for down by this launch."""
    if tma_one_token(cfg, p, routing, x.device) and act is None:
        launch_gate_up_tma(x, p, h, routing, cfg, prepared, prep_h)
        return
    if prep_h is not None and routed_tokens(routing) != 1:
        raise ValueError("gate_up prepares h for down at one token only")
    E, two_f, _ = p.qweight.shape
    F = two_f // 2
    lr = p.low_rank_inputs(x)
    u, xv, R = low_rank_args(lr, h)
    route = route_args(routing, x.shape[0], h, E)
    T = routed_tokens(routing)
    tile = tile_constexprs(cfg, p.bits, p.group, T, x.dtype, lr is not None)
    xk, exp = kernel_inputs(x, tile, prepared=prepared)
    (hw, counters, h_steps), prep_consts = no_prepared_h(h) if prep_h is None else (prep_h.args(), prep_h.constexprs())
    gate_up_kernel[(triton.cdiv(F, cfg.BLOCK_N), 1, route.pop("programs"))](
        xk, p.qweight, p.scale, p.zero, h, u, xv, h if p.bias is None else p.bias, route.pop("a"), route.pop("b"), hw,
        counters, route.pop("rows"), F, p.in_features, R, xv.stride(0), p.qweight.shape[-1], p.scale.shape[-1],
        exp, h.shape[0] // T, *act_args(act), h_steps, HAS_BIAS=p.bias is not None, CLAMPED=act is not None,
        PAIRED=bool(cfg.PAIRED), **prep_consts, **route, **tile.kwargs,
        **dependent_launch(x.device))  # h [T*k, F]: top_k


# ---- one token by TMA (tma.py) ------------------------------------------------------------------------------


def tma_experts(bits: int, group: int, device: torch.device) -> bool:
    """Whether experts can take the one-token TMA kernels at all: group 64 and TMA (Hopper, or the interpreter); at
    2/4/8 bits a step's words are a power of two, at 3 bits those of each plane."""
    return (bits in (2, 3, 4, 8) and group == 64
            and (triton_interpreting() or (device.type == "cuda" and hopper(device))))


def tma_one_token(cfg: LowbitConfig, p: StackedLowbit, routing, device: torch.device) -> bool:
    """Whether a projection runs its TMA kernel (gate_up_tma_kernel, down_tma_kernel): config TMA, one token in
    slot order, experts tma_experts takes, steps of whole 16-byte scale rows (BLOCK_K >= 8 groups, rows of
    groups % 8 == 0) and of at most 256 columns, (3 bits) 16-byte planes (units % 4 == 0), and no biases."""
    return bool(cfg.TMA and isinstance(routing, torch.Tensor) and routing.shape[0] == 1 and p.bias is None
                and cfg.BLOCK_K >= 8 * p.group and step_columns(cfg, p.bits) <= 256  # TMA box rows: <= 256
                and p.scale.shape[-1] % 8 == 0 and cfg.BLOCK_K <= p.in_features
                and (p.bits != 3 or p.planes() % 4 == 0)
                and tma_experts(p.bits, p.group, device))


def step_columns(cfg: LowbitConfig, bits: int) -> int:
    """Packed columns (words, or 3-bit units) in a step of cfg's BLOCK_K inputs: a TMA block's width in words."""
    return cfg.BLOCK_K // values_per_column(bits)


def tma_descriptors(p: StackedLowbit, cfg: LowbitConfig, pairs: bool) -> tuple:
    """TMA descriptors (tma.py's _tma_block) of the stacked words [E * N, words] in [2 BLOCK_N, step_columns] blocks
    and of the scales and zeros [E * N, groups] in [2 BLOCK_N, BLOCK_K / group]; pairs (gate_up): 3-D,
    [E * 2, N / 2, ..] in [2, BLOCK_N, ..] blocks (BLOCK_N gate rows and their up rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # TMA only; not in every Triton

    E, N, _ = p.qweight.shape
    bn = cfg.BLOCK_N
    rows = (E * 2, N // 2) if pairs else (E * N,)
    block = [2, bn] if pairs else [2 * bn]
    words, groups = step_columns(cfg, p.bits), cfg.BLOCK_K // p.group
    return tuple(TensorDescriptor.from_tensor(t.view(*rows, t.shape[-1]), block + [width])
                 for t, width in ((p.qweight, words), (p.scale, groups), (p.zero, groups)))


def tma_constexprs(p: StackedLowbit, cfg: LowbitConfig, tile: Tile, has_lr: bool) -> dict:
    """The compile-time arguments (and warps) both one-token TMA kernels take, from the config and its Tile."""
    return dict(HAS_LR=has_lr, BLOCK_R=cfg.BLOCK_R, BITS=p.bits, BLOCK_N=cfg.BLOCK_N, G=cfg.BLOCK_K // p.group,
                HALF=tile.HALF, STAGES=cfg.num_stages, INTERPRET=tile.INTERPRET, num_warps=cfg.num_warps)


def launch_gate_up_tma(x: torch.Tensor, p: StackedLowbit, h: torch.Tensor, ids: torch.Tensor, cfg: LowbitConfig,
                       prepared: torch.Tensor | None = None, prep_h: PreparedH | None = None) -> None:
    """gate_up_tma_kernel for one token x [1, D] -> h [k, F] (tma_one_token said yes); prepared: x prepared already
    (x_preparation); prep_h: h also prepared for down."""
    F = p.qweight.shape[1] // 2
    tile = tile_constexprs(cfg, p.bits, p.group, 1, x.dtype, False)
    xw, exp = kernel_inputs(x, tile, prepared=prepared)
    lr = p.low_rank_inputs(x, ids)
    u, xv, R = low_rank_args(lr, h)
    (hw, counters, h_steps), prep_consts = no_prepared_h(h) if prep_h is None else (prep_h.args(), prep_h.constexprs())
    gate_up_tma_kernel[(triton.cdiv(F, cfg.BLOCK_N), 1, ids.numel())](
        xw, *tma_descriptors(p, cfg, pairs=True), ids, h, u, xv, hw, counters, F,
        triton.cdiv(p.in_features, cfg.BLOCK_K), p.planes(), R, xv.stride(0), exp, h_steps, **prep_consts,
        **tma_constexprs(p, cfg, tile, lr is not None), **dependent_launch(x.device))


def launch_down_tma(h: torch.Tensor, p: StackedLowbit, y: torch.Tensor, ids: torch.Tensor, cfg: LowbitConfig,
                    combine: SlotCombine | None = None, prepared: torch.Tensor | None = None) -> None:
    """down_tma_kernel for one token's h [k, F] -> y [k, D] fp32 (tma_one_token said yes); cfg SPLIT_K slices of
    the F steps (fp32 atomics into y, zeroed by prepare_x), programs of 2 BLOCK_N rows. combine: y is the partial
    sums [K slices, k, D] and the launch writes combine.out; prepared: h prepared already (PreparedH)."""
    D = p.qweight.shape[1]
    tile = tile_constexprs(cfg, p.bits, p.group, 1, h.dtype, False)
    steps = triton.cdiv(p.in_features, cfg.BLOCK_K)
    split, per_split = k_slices(cfg, tile, p.in_features, True)
    atomic = split > 1 and combine is None
    if combine is not None and tuple(y.shape) != (split, ids.numel(), D):
        raise ValueError(f"the combine's partial sums are [{split}, {ids.numel()}, {D}], got {tuple(y.shape)}")
    hw, exp = kernel_inputs(h, tile, y if atomic else None, prepared)
    lr = p.low_rank_inputs(h, ids)
    u, xv, R = low_rank_args(lr, y)
    out, gw, counters = (y, y, y) if combine is None else (combine.out, combine.weights, combine.counters)
    down_tma_kernel[(triton.cdiv(D, 2 * cfg.BLOCK_N), split, ids.numel())](
        hw, *tma_descriptors(p, cfg, pairs=False), ids, y, u, xv, out, gw, counters, D, steps, per_split, p.planes(),
        R, xv.stride(0), exp, ATOMIC=atomic, COMBINE=combine is not None,
        **tma_constexprs(p, cfg, tile, lr is not None), **dependent_launch(h.device))
