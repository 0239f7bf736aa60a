"""Tune the bf16 Triton fused-MoE launch configs on this GPU and write them as data
(moeserve/kernels/triton/configs/<gpu>.json): per shape and token count the fastest config of each projection,
over the decode schedule (a program per expert and output block; up to 64 tokens) and the row-tile schedule
(a program per row tile of one expert and output block; 64 tokens and up), and "max_tokens", the largest token
count where the fused kernels beat torch's grouped GEMMs (ResidentExperts takes them up to there).

    python bench/tune_fused_moe.py                                 # Mixtral and DeepSeek-like, 1..4096 tokens
    python bench/tune_fused_moe.py --shapes mixtral --tokens 1024 --no-write
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import itertools
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import add_tuner_args, result_record, time_fn, tuner_shapes, write_result  # noqa: E402

from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton import fused_moe  # noqa: E402
from moeserve.kernels.triton.configs import FusedMoEConfig, device_table, shape_key, write_sections  # noqa: E402
from moeserve.kernels.triton.swiglu import fused_swiglu  # noqa: E402

SHAPES = {"mixtral": (8, 2, 4096, 14336), "deepseek_like": (64, 6, 2048, 1408)}  # E, k, D, F
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
ROUTINGS = 4
DECODE_MAX_TOKENS = 64  # the decode schedule unrolls cdiv(T, BLOCK_M) row chunks: small T only
TILES_MIN_TOKENS = 64
DECODE = {"gate_up": [FusedMoEConfig.of(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w))
                      for m, n, k, w in itertools.product((16, 64), (32, 64, 128), (128, 256), (4, 8))],
          "down": [FusedMoEConfig.of(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w))
                   for m, n, k, w in itertools.product((16, 64), (16, 32, 64), (256, 512), (4, 8))]}
TILES = {"gate_up": [FusedMoEConfig.of(dict(schedule="tiles", BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_warps=w,
                                            num_stages=s, TMA=t))
                     for m, n, w, s, t in itertools.product((64, 128), (64, 128), (4, 8), (3, 4), (0, 1))],
         "down": [FusedMoEConfig.of(dict(schedule="tiles", BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_warps=w,
                                         num_stages=s, TMA=t))
                  for m, n, w, s, t in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), (0, 1))]}


def candidates(part: str, T: int, D: int, F: int) -> list[FusedMoEConfig]:
    K = D if part == "gate_up" else F
    out = [c for c in DECODE[part] if T <= DECODE_MAX_TOKENS and (c.BLOCK_M == 16 or T >= 16)]
    return out + [c for c in TILES[part] if T >= TILES_MIN_TOKENS and fused_moe.tiles_fit(c, K)]


class Problem:
    """Random bf16 experts of one shape and rotating routings per token count, on the GPU."""

    def __init__(self, E: int, k: int, D: int, F: int, seed: int = 0):
        torch.manual_seed(seed)
        dev = self.dev = torch.device("cuda")
        self.gu = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) * D ** -0.5
        self.dn = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) * F ** -0.5
        self.E, self.k, self.D, self.F = E, k, D, F
        self._routed: dict[int, list[tuple]] = {}

    def routed(self, T: int) -> list[tuple]:
        """ROUTINGS x (table, x_sorted [T*k, D], h [T*k, F], y [T*k, D]), made once per T."""
        if T not in self._routed:
            self._routed[T] = []
            for _ in range(ROUTINGS):
                ids = torch.rand(T, self.E, device=self.dev).topk(self.k, dim=1).indices  # [T, k] distinct experts
                self._routed[T].append((build_routing_table(ids, torch.rand(T, self.k, device=self.dev), self.E),
                                        torch.randn(T * self.k, self.D, device=self.dev, dtype=torch.bfloat16),
                                        torch.randn(T * self.k, self.F, device=self.dev, dtype=torch.bfloat16),
                                        torch.empty(T * self.k, self.D, device=self.dev, dtype=torch.bfloat16)))
        return self._routed[T]

    def run(self, part: str, cfg: FusedMoEConfig, item: tuple) -> None:
        table, x, h, y = item
        launch = fused_moe.launch_tiles if cfg.schedule == "tiles" else fused_moe.launch_decode
        launch(part, *((x, self.gu, h) if part == "gate_up" else (h, self.dn, y)), table, cfg)

    def grouped_mm(self, item: tuple) -> torch.Tensor:
        """The path the fused kernels compete with: grouped GEMM, fused SwiGLU, grouped GEMM."""
        table, x, _, _ = item
        h = fused_swiglu(torch._grouped_mm(x, self.gu.transpose(1, 2), offs=table.offsets))
        return torch._grouped_mm(h, self.dn.transpose(1, 2), offs=table.offsets)


_WORKER: dict = {}


def _compile(job: tuple) -> str | None:
    """Worker: run one (shape, T, part, cfg) once, so that Triton compiles it into its disk cache."""
    name, T, part, cfg = job
    if name not in _WORKER:
        _WORKER.clear()
        _WORKER[name] = Problem(*SHAPES[name])
    try:
        _WORKER[name].run(part, cfg, _WORKER[name].routed(T)[0])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the timing run skips it
        return f"{name} T={T} {part} {cfg.as_dict()}: {type(e).__name__}: {str(e)[:200]}"
    return None


def precompile(jobs: list[tuple], workers: int) -> list[str]:
    """Compile each distinct kernel once in parallel processes (tile kernels do not depend on T; the decode ones
    unroll cdiv(T, BLOCK_M) chunks), grouped by shape so that a worker builds few problems."""
    distinct = {(j[0], j[2], j[3], None if j[3].schedule == "tiles" else -(-j[1] // j[3].BLOCK_M)): j for j in jobs}
    ordered = sorted(distinct.values(), key=lambda j: j[0])
    if workers <= 1 or not ordered:
        return []
    with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [e for e in pool.map(_compile, ordered, chunksize=max(1, len(ordered) // (2 * workers))) if e]


def tune_shape(name: str, tokens, log: list) -> dict:
    E, k, D, F = SHAPES[name]
    problem = Problem(E, k, D, F)
    out = {}
    for T in tokens:
        items = problem.routed(T)
        best = {}
        for part in ("gate_up", "down"):
            timed = []
            for cfg in candidates(part, T, D, F):
                try:
                    timed.append((time_fn(lambda item, cfg=cfg: problem.run(part, cfg, item), items, "cuda"), cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
                    log.append(f"{name} T={T} {part} {cfg.as_dict()} failed: {type(e).__name__}")
            ms, cfg = min(timed, key=lambda p: p[0])
            best[part] = cfg.replace(ms=round(ms, 4)).as_dict()
        fused_ms = best["gate_up"]["ms"] + best["down"]["ms"]
        grouped = time_fn(problem.grouped_mm, items, "cuda")
        # floor: the distinct experts hit, read once, or the FLOPs at the H100's measured 774 TFLOP/s
        hit = torch.stack([(t.counts > 0).sum() for t, *_ in items]).float().mean().item()
        floor_ms = max(3 * F * D * 2 * hit / 2.94e12, 2 * T * k * 3 * D * F / 774e12) * 1e3
        out[str(T)] = {**best, "fused_ms": round(fused_ms, 4), "grouped_mm_ms": round(grouped, 4),
                       "floor_ms": round(floor_ms, 4)}
        log.append(f"{name} T={T}: fused {fused_ms:.3f} ms (gate_up {best['gate_up']}, down {best['down']}) | "
                   f"grouped_mm + fused SwiGLU {grouped:.3f} ms | floor {floor_ms:.3f} ms")
        print(log[-1], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tuner_args(ap, SHAPES, TOKENS)
    args = ap.parse_args(argv)
    shapes = tuner_shapes(args, SHAPES, "tune_fused_moe")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        sys.exit(f"--tokens takes comma-separated positive integers, got {args.tokens!r}")
    if min(tokens) < 1:
        sys.exit(f"--tokens takes comma-separated positive integers, got {args.tokens!r}")
    start = time.perf_counter()
    jobs = [(n, T, part, cfg) for n in shapes for T in tokens for part in ("gate_up", "down")
            for cfg in candidates(part, T, *SHAPES[n][2:])]
    log = precompile(jobs, args.workers)
    print(f"compiled {len(jobs)} candidates with {args.workers} workers in {time.perf_counter() - start:.0f} s",
          flush=True)
    name = torch.cuda.get_device_name()
    section = {}
    for n in shapes:
        E, _, D, F = SHAPES[n]
        section[n] = results = tune_shape(n, tokens, log)
        if not args.no_write:
            key = shape_key(E, D, F)
            write_sections(name, {
                "fused_moe": {key: {t: {p: r[p] for p in ("gate_up", "down")} for t, r in results.items()}},
                "timings": {key: {t: {f: r[f] for f in ("fused_ms", "grouped_mm_ms", "floor_ms")}
                                  for t, r in results.items()}}})
            timings = device_table(name)["timings"][key]  # this run's counts and those tuned before
            wins = [int(t) for t, r in timings.items() if r["fused_ms"] < r["grouped_mm_ms"]]
            print(f"wrote {write_sections(name, {'max_tokens': {key: max(wins, default=0)}})}")
    record = result_record("tune_fused_moe", {"shapes": shapes, "tokens": tokens, "routings": ROUTINGS,
                                              "timing": "triton.testing.do_bench median (L2 flushed)"},
                           torch.device("cuda"))
    record["fused_moe"], record["log"] = section, log
    print(f"wrote {write_result(record, args.out)} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
