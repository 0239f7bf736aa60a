"""Which rows of x a program of the MoE kernels works on, found on the GPU (no host sync): the row scheduling the
bf16 (fused_moe.py) and the low-bit (lowbit/) kernels share.

An expert's rows are known three ways (ROUTE): a block of a dense matmul's rows (DENSE), an expert's run of
expert-sorted rows from the routing table's end offsets and counts (SORTED), or the slots t * k + j whose expert
id is the program's expert, found among the T*k ids (SLOTS, SLOT_PROGRAMS: no routing table and no gather).
expert_rows says which rows a program owns, tile_rows cuts them into tiles of BLOCK_M rows, expert_tile finds
a program's tile when the grid walks the row tiles of all experts instead (the bf16 prefill schedule), hit_rows an
expert's sorted rows when the grid walks only the experts that have rows (the MXFP4 kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE, SORTED, SLOTS, SLOT_PROGRAMS = 0, 1, 2, 3  # how a kernel finds its rows (ROUTE): see expert_rows
ROUTE_DENSE, ROUTE_SORTED, ROUTE_SLOTS, ROUTE_SLOT_PROGRAMS = (  # the same, for kernels
    tl.constexpr(DENSE), tl.constexpr(SORTED), tl.constexpr(SLOTS), tl.constexpr(SLOT_PROGRAMS))


@triton.jit
def expert_rows(pid, route_a, route_b, M, ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, NSLOTS: tl.constexpr):
    """Program pid's rows (pid: its place on the grid axis that walks experts or row blocks) as (start, end,
    expert, match, rank); its tiles are rows [start, end) in BLOCK_M steps (tile_rows).
    DENSE: block pid of the M rows of x. SORTED: expert pid's rows of expert-sorted x (route_a/b = the routing table's
    end offsets and counts). Slot order (ROUTE >= SLOTS; slot t * k + j: token t's j-th expert), route_a = the M flat
    expert ids [T*k] (NSLOTS >= M): match/rank [NSLOTS] say which slots are the program's expert's and their order
    among them (no routing table, no gather). SLOTS: program pid serves expert pid. SLOT_PROGRAMS (M <= experts):
    program pid serves slot pid's expert if pid is that expert's first slot, else nothing; so no program waits on an
    expert no token chose (at one token, 6 of Mixtral's 8 and 58 of a 64-expert model's)."""
    s = tl.arange(0, NSLOTS)
    match, rank = s < 0, s
    e = pid.to(tl.int64)
    if ROUTE >= ROUTE_SLOTS:
        ids = tl.load(route_a + s, mask=s < M, other=-1)  # [NSLOTS]
        if ROUTE == ROUTE_SLOT_PROGRAMS:
            e = tl.load(route_a + pid).to(tl.int64)
            match = ids == e
            match = match & (tl.min(tl.where(match, s, NSLOTS), axis=0) == pid)  # the expert's first slot only
        else:
            match = ids == e
        hit = match.to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit  # [NSLOTS] place among the expert's slots
        start, end = 0, tl.sum(hit, axis=0)
    if ROUTE == ROUTE_SORTED:
        end = tl.load(route_a + pid)
        start = end - tl.load(route_b + pid)
    if ROUTE == ROUTE_DENSE:
        start = pid * BLOCK_M
        end = tl.minimum(start + BLOCK_M, M)
        e = e * 0
    return start, end, e, match, rank


@triton.jit
def tile_rows(row0, end, match, rank, ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, NSLOTS: tl.constexpr):
    """Tile rows [row0, row0 + BLOCK_M) of expert_rows -> (their rows [BLOCK_M], in range [BLOCK_M]); rows past the
    end repeat a real one. SLOTS: the slots of ranks row0 .. row0 + BLOCK_M - 1."""
    r = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    r_mask = r < end
    if ROUTE >= ROUTE_SLOTS:
        hit = match[None, :] & (rank[None, :] == tl.minimum(r, end - 1)[:, None])  # [BLOCK_M, NSLOTS]
        rows = tl.sum(tl.where(hit, tl.arange(0, NSLOTS)[None, :], 0), axis=1)
    else:
        rows = tl.minimum(r, end - 1)
    return rows, r_mask


@triton.jit
def expert_tile(counts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of this program's row tile (axis 0) when the grid walks the row tiles of all E
    experts (each expert's expert-sorted rows start a fresh tile of BLOCK_M), from the per-expert counts; a tile
    past the last one gets first row >= end row."""
    tile = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [BLOCK_E] row tiles per expert
    tile_end = tl.cumsum(tiles, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    mine = (tile_end - tiles <= tile) & (tile < tile_end)  # one expert, or none past the last tile
    expert = tl.sum(tl.where(mine, e, 0), axis=0)
    end = tl.sum(tl.where(mine, row_end, 0), axis=0)
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, row_end - counts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    return expert, start, end


@triton.jit
def hit_rows(pid, offsets_ptr, counts_ptr, E, BLOCK_E: tl.constexpr):
    """(start, end, expert) of the pid-th expert (in expert order) that has rows in a routing table (end offsets and
    counts [E]): its expert-sorted rows are [start, end). A grid axis of min(T*k, E) programs covers every expert hit,
    and none of them waits on an expert no token chose; past the last expert hit, start == end (no rows)."""
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    hit = (counts > 0).to(tl.int32)
    mine = (hit > 0) & (tl.cumsum(hit, axis=0) - hit == pid)  # one expert, or none past the last hit
    end = tl.sum(tl.where(mine, tl.load(offsets_ptr + e, mask=e < E, other=0).to(tl.int32), 0), axis=0)
    return end - tl.sum(tl.where(mine, counts, 0), axis=0), end, tl.sum(tl.where(mine, e, 0), axis=0)
