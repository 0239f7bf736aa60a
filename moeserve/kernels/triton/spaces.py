"""What the tuner tries (autotune.py): the launch configs worth timing per kernel family, projection and token count,
in two sizes. "quick" (the tuning a first run does by itself, seconds per shape and token count: each candidate is a
Triton compile) holds the kinds of tile that won somewhere; "full" (`moeserve tune`) the wider sweeps those were
picked from. Candidates come best-first (the tuner stops at its time budget) and only where they fit the GPU (TMA on
Hopper, pipeline stages in its shared memory, tile K dividing the inputs)."""

from __future__ import annotations

import itertools

from moeserve.kernels.triton.configs import FusedMoEConfig, LowbitConfig, pipe_stages
from moeserve.kernels.triton.device import DeviceInfo

MODES = ("quick", "full")

# ---- low-bit MoE (lowbit/) ----------------------------------------------------------------------------------
# one token, CUDA-core GEMV: BLOCK_N, BLOCK_K, warps, SUB (interleaved sub-tiles)
GEMV = {"quick": [(32, 512, 4, 4), (16, 512, 4, 2), (64, 512, 8, 4)],
        "full": [(32, 512, 4, 4), (16, 512, 4, 2), (64, 512, 8, 4), (16, 512, 4, 4), (8, 512, 4, 2),
                 (32, 512, 4, 2), (64, 512, 4, 4), (16, 1024, 4, 2), (32, 1024, 4, 4)]}
# one token by TMA (Hopper, group 64): BLOCK_N, BLOCK_K, warps, stages (down's programs take 2 BLOCK_N rows)
TMA = {"quick": [(8, 1024, 4, 3), (16, 1024, 4, 3), (8, 2048, 4, 2), (16, 512, 4, 3), (4, 2048, 2, 2)],
       "full": [(8, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 4, 2), (16, 512, 4, 3), (8, 512, 4, 3), (32, 512, 4, 2),
                (32, 512, 8, 3), (16, 1024, 8, 2), (8, 2048, 4, 2), (8, 2048, 4, 3), (16, 1024, 4, 3),
                (8, 1024, 2, 3), (4, 1024, 2, 3), (16, 2048, 4, 2), (4, 2048, 2, 2), (8, 2048, 8, 2)]}
# a few rows of x per CUDA-core tile: BLOCK_N, BLOCK_K, warps, SUB, BLOCK_M
ROWS = {"quick": [(16, 512, 4, 2, 2), (32, 512, 4, 4, 1), (16, 512, 4, 2, 4)],
        "full": [(16, 512, 4, 2, 2), (32, 512, 4, 4, 1), (16, 512, 4, 2, 4), (32, 512, 4, 4, 2), (8, 512, 4, 1, 4)]}
# tensor cores on dequantized groups with PIPE steps in flight: BLOCK_N, BLOCK_K, warps, PIPE
PIPED_DOT = {"quick": [(64, 256, 4, 3), (32, 256, 4, 3), (128, 256, 8, 3)],
             "full": [(64, 256, 4, 3), (32, 256, 4, 3), (128, 256, 8, 3), (64, 256, 4, 4), (128, 256, 4, 3)]}
# tensor cores on 16-bit codes (HALF) or fp32 ones: BLOCK_N, BLOCK_K, warps
DOT = {"quick": [(64, 64, 4)], "full": [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 64, 4), (32, 128, 4)]}
SPLITS = {"quick": (1, 2, 4), "full": (1, 2, 4, 8, 16)}
CUDA_CORE_MAX_TOKENS = 16  # more tokens: tensor-core tiles only
DOT_MIN_TOKENS = 4
TENSOR_CORES_FIRST = 4  # rows an expert gets on average from which tensor-core tiles are tried before CUDA-core ones


def lowbit_moe_candidates(mode: str, device: DeviceInfo, tokens: int, E: int, top_k: int, D: int, F: int,
                          group: int = 64) -> dict[str, list[LowbitConfig]]:
    """{"gate_up": [...], "down": [...]} for the low-bit fused MoE at `tokens` tokens."""
    average = -(-tokens * top_k // E)  # rows an expert gets on average
    cuda_cores: list[dict] = []
    if tokens == 1:
        cuda_cores += [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, SUB=sub) for n, k, w, sub in GEMV[mode]]
        if mode == "full":  # two steps of words and scales loaded ahead into registers
            cuda_cores += [{**t, "AHEAD": 2} for t in cuda_cores]
    elif tokens <= CUDA_CORE_MAX_TOKENS:
        cuda_cores += [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, SUB=sub, BLOCK_M=m) for n, k, w, sub, m in ROWS[mode]
                       if m <= max(2, 2 * average)]
    tensor_cores: list[dict] = []
    if tokens >= DOT_MIN_TOKENS:
        tensor_cores += [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, PIPE=p) for n, k, w, p in PIPED_DOT[mode]
                         if k % group == 0 and pipe_stages(device, 2 * n, k, p) == p]
        tensor_cores += [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, **half) for n, k, w in DOT[mode]
                         for half in ({"HALF": 0},) + (({},) if mode == "full" else ())]
    # best first: from TENSOR_CORES_FIRST rows an expert (16 tokens of Mixtral) pipelined tiles won every H200 entry
    tiles = tensor_cores + cuda_cores if average >= TENSOR_CORES_FIRST else cuda_cores + tensor_cores
    tiles = [LowbitConfig.of({**t, "num_stages": 3}) for t in tiles]
    gate_up = [t.replace(PAIRED=paired) for t in tiles for paired in (1, 0)]
    down = [t.replace(SPLIT_K=s) for t in tiles for s in splits(mode, t.BLOCK_K, F)]
    if tokens == 1 and device.hopper and group == 64:  # TMA first: on Hopper it won every one-token shape
        tma = [LowbitConfig.of(dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, TMA=1))
               for n, k, w, st in TMA[mode]]
        gate_up = [t for t in tma if t.BLOCK_K <= D] + gate_up
        down = [t.replace(SPLIT_K=s) for t in tma if t.BLOCK_K <= F for s in splits(mode, t.BLOCK_K, F)] + down
    return {"gate_up": gate_up, "down": down}


def splits(mode: str, block_k: int, K: int) -> list[int]:
    """K slices worth trying for steps of block_k inputs over K."""
    steps = -(-K // max(block_k, 64))
    return [s for s in SPLITS[mode] if s <= steps]


# ---- bf16 fused MoE (fused_moe.py) ---------------------------------------------------------------------------
DECODE_MAX_TOKENS = 64  # the decode schedule unrolls cdiv(T, BLOCK_M) row chunks: small T only
TILES_MIN_TOKENS = 64
# the decode schedule: BLOCK_N, BLOCK_K per projection
DECODE = {"quick": {"gate_up": [(128, 128), (64, 256), (32, 256), (64, 128)],
                    "down": [(32, 512), (64, 256), (64, 512), (16, 512)]},
          "full": {"gate_up": list(itertools.product((32, 64, 128), (128, 256))),
                   "down": list(itertools.product((16, 32, 64), (256, 512)))}}


def fused_moe_candidates(mode: str, tokens: int, D: int, F: int) -> dict[str, list[FusedMoEConfig]]:
    """{"gate_up": [...], "down": [...]} for the bf16 fused MoE at `tokens` tokens: the decode schedule up to 64
    tokens, the row tiles from 64 (full: both, more warps and row blocks)."""
    warps = (4, 8) if mode == "full" else (4,)
    rows = (16, 64) if tokens >= 16 else (16,)
    out = {}
    for part, K in (("gate_up", D), ("down", F)):
        cands = []
        if tokens <= DECODE_MAX_TOKENS:
            cands += [FusedMoEConfig.of(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w))
                      for m in rows for (n, k) in DECODE[mode][part] for w in warps]
        if tokens >= TILES_MIN_TOKENS:
            cands += [FusedMoEConfig.of(dict(schedule="tiles", BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_warps=w,
                                             num_stages=s, TMA=t))
                      for m, n, w, s, t in itertools.product((64, 128), (64, 128), warps, (3, 4) if mode == "full"
                                                            else (3,), (0, 1)) if K % 64 == 0]
        out[part] = cands
    return out
