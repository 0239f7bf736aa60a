"""Tune the Triton fused-MoE launch configs on this GPU and write them as data
(moeserve/kernels/triton/configs/<gpu>.json), with the token counts where the fused path beats
torch._grouped_mm ("max_tokens", used by ResidentExperts).

    python bench/tune_fused_moe.py                # Mixtral and DeepSeek-like shapes, 1..64 tokens
    python bench/tune_fused_moe.py --out DIR      # also copy the JSON and a timing log to DIR
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import time_fn  # noqa: E402

from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.model.experts import swiglu  # noqa: E402
from moeserve.kernels.triton import fused_moe  # noqa: E402
from moeserve.kernels.triton.configs import shape_key, write_sections  # noqa: E402

SHAPES = {"mixtral": (8, 2, 4096, 14336), "deepseek_like": (64, 6, 2048, 1408)}
TOKENS = (1, 4, 16, 64)
GATE_UP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w)
           for m, n, k, w in itertools.product((16, 64), (32, 64, 128), (128, 256), (4, 8))]
DOWN = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w)
        for m, n, k, w in itertools.product((16, 64), (16, 32, 64), (256, 512), (4, 8))]


def tune_shape(E, k, D, F, log) -> dict:
    dev = torch.device("cuda")
    gu = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) * D ** -0.5
    dn = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) * F ** -0.5
    out = {}
    for T in TOKENS:
        tables, xs = [], []
        for _ in range(4):  # rotating routings
            ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
            tables.append(build_routing_table(ids, torch.rand(T, k, device=dev), E))
            xs.append(torch.randn(T * k, D, device=dev, dtype=torch.bfloat16))
        h = torch.empty(T * k, F, device=dev, dtype=torch.bfloat16)
        y = torch.empty(T * k, D, device=dev, dtype=torch.bfloat16)
        best = {}
        for name, space, run in (
                ("gate_up", GATE_UP, lambda c, i: fused_moe.launch_gate_up(xs[i], gu, h, tables[i], T, c)),
                ("down", DOWN, lambda c, i: fused_moe.launch_down(h, dn, y, tables[i], T, c))):
            timings = []
            for cfg in space:
                if cfg["BLOCK_M"] > 16 and T < 16:
                    continue
                try:
                    ms = time_fn(lambda i, cfg=cfg: run(cfg, i), range(4), dev)
                except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
                    log.append(f"{name} {cfg} failed: {type(e).__name__}")
                    continue
                timings.append((ms, cfg))
            ms, cfg = min(timings, key=lambda p: p[0])
            best[name] = {**cfg, "ms": round(ms, 4)}
        fused_ms = best["gate_up"]["ms"] + best["down"]["ms"]
        offs = [t.offsets for t in tables]
        grouped = time_fn(lambda i: torch._grouped_mm(
            swiglu(torch._grouped_mm(xs[i], gu.transpose(1, 2), offs=offs[i])), dn.transpose(1, 2), offs=offs[i]),
            range(4), dev)
        weight_bytes = 3 * F * D * 2 * torch.stack([(t.counts > 0).sum() for t in tables]).float().mean().item()
        floor_ms = weight_bytes / 2.94e12 * 1e3
        out[str(T)] = {**best, "fused_ms": round(fused_ms, 4), "grouped_mm_ms": round(grouped, 4),
                       "floor_ms": round(floor_ms, 4)}
        log.append(f"E{E} D{D} F{F} T={T}: fused {fused_ms:.3f} ms (gate_up {best['gate_up']}, down {best['down']}) "
                   f"| grouped_mm {grouped:.3f} ms | floor {floor_ms:.3f} ms")
        print(log[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also copy the config JSON and the log here")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    log, table = [], {"device": name, "fused_moe": {}, "max_tokens": {}}
    for label, (E, k, D, F) in SHAPES.items():
        results = tune_shape(E, k, D, F, log)
        key = shape_key(E, D, F)
        table["fused_moe"][key] = {t: {"gate_up": r["gate_up"], "down": r["down"]} for t, r in results.items()}
        table["max_tokens"][key] = max((int(t) for t, r in results.items() if r["fused_ms"] < r["grouped_mm_ms"]),
                                       default=0)
        table.setdefault("timings", {})[key] = {t: {f: r[f] for f in ("fused_ms", "grouped_mm_ms", "floor_ms")}
                                                for t, r in results.items()}
    path = write_sections(name, table)
    print(f"wrote {path}")
    if args.out:
        shutil.copy(path, Path(args.out) / path.name)
        (Path(args.out) / "tune_log.txt").write_text("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
