"""Launch configs of the Triton kernels, stored as data: one JSON per GPU name, written by
bench/tune_fused_moe.py; lookups fall back to defaults for unknown devices or shapes."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT = {"gate_up": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4),
           "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)}


@functools.cache
def gpu_name(index: int) -> str:
    """Cached: asking CUDA for the name costs tens of microseconds, too much for every MoE layer."""
    import torch

    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(E: int, D: int, F: int) -> str:
    return f"E{E}_D{D}_F{F}"


@functools.cache
def _table(device_name: str) -> dict:
    path = CONFIG_DIR / f"{device_slug(device_name)}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


DEFAULT_MAX_TOKENS = 16  # untuned GPUs: the fused path for decode-sized batches only


@functools.cache
def fused_max_tokens(device_name: str, E: int, D: int, F: int) -> int:
    """Largest token count for which the fused kernels beat grouped GEMMs on this GPU and shape."""
    return int(_table(device_name).get("max_tokens", {}).get(shape_key(E, D, F), DEFAULT_MAX_TOKENS))


@functools.cache
def fused_moe_config(device_name: str, E: int, D: int, F: int, tokens: int) -> dict:
    """The tuned config for the largest tuned token count <= tokens (else the smallest), or the default."""
    by_tokens = _table(device_name).get("fused_moe", {}).get(shape_key(E, D, F))
    if not by_tokens:
        return DEFAULT
    counts = sorted(int(t) for t in by_tokens)
    chosen = max((t for t in counts if t <= tokens), default=counts[0])
    return by_tokens[str(chosen)]
