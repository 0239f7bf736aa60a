"""Launch configs of the Triton kernels, stored as data: one JSON per GPU name, written by
bench/tune_fused_moe.py; lookups fall back to defaults for unknown devices or shapes."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT = {"gate_up": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4),
           "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)}
# prefill-sized batches where nothing is tuned and torch has no grouped GEMM (before sm90): the row-tile schedule
DEFAULT_TILES = {"gate_up": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
                 "down": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)}


@functools.cache
def gpu_name(index: int) -> str:
    """Cached: asking CUDA for the name costs tens of microseconds, too much for every MoE layer."""
    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(E: int, D: int, F: int) -> str:
    return f"E{E}_D{D}_F{F}"


@functools.cache
def device_table(device_name: str) -> dict:
    path = CONFIG_DIR / f"{device_slug(device_name)}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _merged(old, new, depth: int):
    """new over old, dicts merged `depth` levels deep."""
    if depth == 0 or not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: _merged(old.get(k), v, depth - 1) for k, v in new.items()}}


def write_sections(device_name: str, sections: dict) -> Path:
    """Merge tuned sections ({"lowbit": {shape: {count: config}}, ...}) into this GPU's config JSON: a tuned
    (shape, count) replaces its own entry only, so a run over a subset of shapes or counts keeps the rest; later
    lookups see them."""
    path = CONFIG_DIR / f"{device_slug(device_name)}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    table = _merged(table, {"device": device_name, **sections}, 3)
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    for cached in (device_table, fused_max_tokens, fused_moe_config, lowbit_config, lowbit_moe_config):
        cached.cache_clear()
    return path


DEFAULT_MAX_TOKENS = 16  # untuned GPUs: the fused path for decode-sized batches only


@functools.cache
def fused_max_tokens(device_name: str, E: int, D: int, F: int) -> int:
    """Largest token count for which the fused kernels beat grouped GEMMs on this GPU and shape."""
    return int(device_table(device_name).get("max_tokens", {}).get(shape_key(E, D, F), DEFAULT_MAX_TOKENS))


@functools.cache
def fused_moe_config(device_name: str, E: int, D: int, F: int, tokens: int) -> dict:
    """The tuned config for the largest tuned token count <= tokens (else the smallest), or the default."""
    by_tokens = device_table(device_name).get("fused_moe", {}).get(shape_key(E, D, F))
    return _at_most(by_tokens, tokens) if by_tokens else DEFAULT


def _at_most(by_count: dict, n: int) -> dict:
    """The entry of {"count": config} for the largest count <= n (else the smallest count)."""
    counts = sorted(int(c) for c in by_count)
    return by_count[str(max((c for c in counts if c <= n), default=counts[0]))]


# ---- low-bit matmul (kernels/triton/lowbit_linear.py) ---------------------------------------------
# one row, CUDA cores: the H100 sweep's winner on all four Mixtral shapes (4 sub-tiles of 8 rows x 512 inputs)
LOWBIT_GEMV = dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3, SUB=4)
# 2..4 rows, CUDA cores: each code decoded once for up to 4 rows of x (H100, 4 rows: 0.047 ms vs 0.074 on tensor cores)
LOWBIT_GEMV_ROWS = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3, SUB=2, BLOCK_M=4)
LOWBIT_DOT = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)  # rows padded to >= 16: tensor cores
TARGET_PROGRAMS = 264  # two per SM on a 132-SM H100: split K until the grid has about this many programs
MAX_SPLIT_K = 8


def lowbit_shape_key(bits: int, N: int, K: int) -> str:
    return f"b{bits}_N{N}_K{K}"


def split_for(programs: int, steps: int) -> int:
    """K slices so that `programs` output blocks become about TARGET_PROGRAMS programs (1 when already many)."""
    return max(1, min(MAX_SPLIT_K, steps, -(-TARGET_PROGRAMS // max(programs, 1))))


@functools.cache
def lowbit_config(device_name: str, bits: int, rows: int, N: int, K: int) -> dict:
    """Tuned config for the largest tuned row count <= rows (a one-row GEMV config serves one row only), else a
    default with SPLIT_K from the shape."""
    by_rows = device_table(device_name).get("lowbit", {}).get(lowbit_shape_key(bits, N, K), {})
    fits = [r for r in map(int, by_rows) if r <= rows and (r == 1) == (rows == 1)]
    if fits:
        return by_rows[str(max(fits))]
    cfg = dict(LOWBIT_GEMV if rows == 1 else LOWBIT_GEMV_ROWS if rows <= 4 else LOWBIT_DOT)
    return {**cfg, "SPLIT_K": split_for(-(-N // cfg["BLOCK_N"]), -(-K // cfg["BLOCK_K"]))}


def lowbit_moe_key(bits: int, E: int, D: int, F: int, lowrank: bool = False) -> str:
    """The table key of a low-bit MoE shape; `_lr`: experts with compensators (their kernels hold the low-rank term
    in registers through the weight stream, which moves the best tile)."""
    return f"b{bits}_{shape_key(E, D, F)}{'_lr' if lowrank else ''}"


@functools.cache
def lowbit_moe_config(device_name: str, bits: int, E: int, D: int, F: int, tokens: int, top_k: int = 2,
                      lowrank: bool = False) -> dict:
    """{"gate_up": cfg, "down": cfg} for the low-bit fused MoE: tuned (largest tuned token count <= tokens, by
    bench/tune_lowbit_moe.py; a one-token entry serves one token only; with compensators the `_lr` entry where
    there is one), else the dense low-bit config of the same matrix shapes (gate_up tiles F x D, down D x F) for the
    rows an expert gets on average; gate_up is never split (SiLU needs whole sums), down splits K to fill the GPU."""
    table = device_table(device_name).get("lowbit_moe", {})
    for key in dict.fromkeys((lowbit_moe_key(bits, E, D, F, lowrank), lowbit_moe_key(bits, E, D, F))):
        fits = {t: cfg for t, cfg in table.get(key, {}).items() if (t == "1") == (tokens == 1)}  # GEMV: one token only
        if fits:
            return _at_most(fits, tokens)
    average = -(-tokens * top_k // E)  # rows an expert gets on average
    if tokens == 1:
        rows = 1  # the GEMV
    elif average <= 2:
        rows = 2  # CUDA-core tiles of 1-2 rows (an H100 GEMV of 2 rows costs 1.3x one row, a tensor-core tile 3.4x)
    else:
        rows = max(average, 16)  # tensor-core tiles (the H100's 16 tokens: 1.39 ms)
    gate_up, down = lowbit_config(device_name, bits, rows, F, D), lowbit_config(device_name, bits, rows, D, F)
    if rows == 2:
        fit = {"BLOCK_M": 1 << (average - 1).bit_length()}  # more rows than that: more chunks
        gate_up, down = {**gate_up, **fit}, {**down, **fit}
    active = min(E, top_k * tokens)  # experts with rows
    return {"gate_up": {**gate_up, "SPLIT_K": 1},
            "down": {**down, "SPLIT_K": split_for(active * -(-D // down["BLOCK_N"]), -(-F // down["BLOCK_K"]))}}
