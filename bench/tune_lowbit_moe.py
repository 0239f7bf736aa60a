"""Tune the low-bit fused MoE's launch configs on this GPU and write them as data: the "lowbit_moe" section of
moeserve/kernels/triton/configs/<gpu>.json, per (bits, MoE shape, token count), gate_up and down tuned apart then in
pairs, for
experts without compensators and (key `_lr`) with rank-32 ones (the low-rank term held through the weight stream
moves the best tile: Mixtral 3-bit, one token, H100: 0.142 ms with the plain entry, 0.127 with its own).

Candidates: one token, CUDA-core GEMV tiles (then the best with two steps of register prefetch, or with 3 or 4
cp.async stages), and for experts of group 64 tiles fed by TMA; 2..16 tokens, CUDA-core tiles
of 1..4 rows of x (each code decoded once for them) sized to the rows an expert gets; 4 tokens and up, tensor-core
tiles (the dot on 16-bit codes or on dequantized weights). down also tries K splits. Each candidate, and the config
the dispatch used until now, is timed as the GPU time of a CUDA graph over rotating routings (decode replays
graphs; eager times of 20-us kernels are host noise); then the PAIR_FINALISTS best of each projection are timed in
pairs, both projections as QuantizedExperts runs them, and the fastest pair is kept (the dispatch's own pair where
none beats it). The kernels compile first in parallel worker processes (Triton's disk cache then serves the timing
run).

    python bench/tune_lowbit_moe.py               # Mixtral and DeepSeek-like, 4 and 3 bits, 1..64 tokens, ranks 0, 32
    python bench/tune_lowbit_moe.py --shapes mixtral --bits 4 --tokens 1,16 --ranks 0 --no-write
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import functools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_tuner_args, capture_graph, result_record, tuner_shapes, write_result  # noqa: E402
from kernels import GROUP, load_variants, random_layer  # noqa: E402

from moeserve.kernels.routing import build_routing_table, slot_order_pays  # noqa: E402
from moeserve.kernels.triton.configs import (ExpertsConfig, LowbitConfig, lowbit_moe_config,  # noqa: E402
                                             lowbit_moe_key, write_sections)
from moeserve.kernels.triton.lowbit import BITS, lowbit_experts  # noqa: E402
from moeserve.kernels.triton.lowbit.launch import (launch, launch_down_tma, launch_gate_up, tma_experts,  # noqa: E402
                                                   tma_one_token)
from moeserve.quant.qlinear import QuantizedExperts  # noqa: E402

SHAPES = {"mixtral": (8, 2, 4096, 14336), "deepseek_like": (64, 6, 2048, 1408)}  # E, k, D, F
TOKENS = (1, 2, 4, 16, 64)
ROUTINGS = 4  # rotating routings per token count (the experts hit change, as in decode)
# the H100 winners of a wider first sweep (16 / 32 x 512 sub-tiled GEMVs; 1-2 rows of x per CUDA-core tile; 8-row
# tiles never won and take 15 s each to compile at 3 bits), and tiles with a whole group for every thread (a 3-bit
# plane's two words of a group as one 8-byte vector; 1024-input steps won Mixtral's 3-bit experts at one token)
# gate_up's BLOCK_N counts h outputs: PAIRED, its tiles hold 2 BLOCK_N weight rows (gate and up in one pipeline)
GEMV = [(32, 512, 4, 4), (16, 512, 4, 2), (64, 512, 8, 4), (16, 512, 4, 4), (8, 512, 4, 2),
        (32, 512, 4, 2), (64, 512, 4, 4), (16, 1024, 4, 2), (32, 1024, 4, 4)]  # BN, BK, warps, SUB
ROWS = [(32, 512, 4, 4, 1), (16, 512, 4, 2, 2), (16, 512, 4, 2, 4)]  # BN, BK, warps, SUB, BLOCK_M (rows of x)
DOT = [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 64, 4), (32, 128, 4)]  # BN, BK, warps: tensor cores
# tensor cores on dequantized tiles with PIPE steps in flight (lowbit/tiles.py): BN, BK, warps, PIPE
PIPED_DOT = [(64, 256, 4, 3), (128, 256, 8, 3), (32, 256, 4, 3), (64, 256, 4, 4)]
# one-token gate_up and down by TMA (lowbit/launch.py's tma_one_token: group 64): BN, BK, warps,
# stages; down's programs take 2 BN rows
TMA_TILES = [(8, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 4, 2), (16, 512, 4, 3), (8, 512, 4, 3), (32, 512, 4, 2),
             (32, 512, 8, 3), (16, 1024, 8, 2), (8, 2048, 4, 2), (8, 2048, 4, 3), (16, 1024, 4, 3), (8, 1024, 2, 3),
             (4, 1024, 2, 3)]
TMA_DOWN_TILES = [(16, 2048, 4, 2), (4, 2048, 2, 2), (8, 2048, 8, 2)]  # more for down, whose K is the long F
# more for gate_up: its 3-bit TMA kernel is bound by instruction issue (H100 ncu: 74% issue, 58% DRAM), and a step's
# loads with their synchronisation are a large part of its loop: more rows or inputs a step share them (H100, Mixtral
# 3-bit one token: 16 x 2048 won the experts' pair time by 0.7% but not the block,
# bench/results/partial/tune_lowbit_moe-more-gate-up-tma-tiles-20261125.log)
TMA_GATE_UP_TILES = [(16, 2048, 4, 2), (16, 2048, 8, 2), (8, 2048, 8, 2), (8, 4096, 4, 2)]
TMA_DOWN_SPLITS = (1, 2, 4, 8)
SPLITS = (1, 2, 4, 8, 16, 32)
# the best few of each projection, timed apart, are then timed in pairs as the block runs them (lowbit_experts: the
# launches between and around them included): per-projection times did not predict the block (DeepSeek-like one
# token, H100: picks that tied apart measured 0.043-0.044 ms in the block against 0.040)
PAIR_FINALISTS = 3
CUDA_CORE_MAX_TOKENS = 16
DOT_MIN_TOKENS = 4


def tiles(T: int, E: int, k: int) -> list[LowbitConfig]:
    """The tiles worth timing at T tokens (K split left to the caller)."""
    average = -(-T * k // E)  # rows an expert gets on average
    out = []
    if T == 1:
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, SUB=sub) for bn, bk, w, sub in GEMV]
    elif T <= CUDA_CORE_MAX_TOKENS:
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, SUB=sub, BLOCK_M=m) for bn, bk, w, sub, m in ROWS
                if m <= max(2, 2 * average)]
    if T >= DOT_MIN_TOKENS:  # the dot on 16-bit codes, scale/zero per group after it (HALF), or on dequantized tiles
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, **half) for bn, bk, w in DOT for half in ({}, {"HALF": 0})]
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, PIPE=pipe) for bn, bk, w, pipe in PIPED_DOT]
    return [LowbitConfig.of({**t, "num_stages": 3}) for t in out]


def splits(cfg: LowbitConfig, K: int) -> list[int]:
    steps = -(-K // max(cfg.BLOCK_K, 64))
    return sorted({s for s in SPLITS if s <= steps} | ({steps} if steps <= max(SPLITS) else set()))


class Problem:
    """Stacked random experts of one (shape, bits, compensator rank) and rotating routings per token count, on the
    GPU."""

    def __init__(self, E: int, k: int, D: int, F: int, bits: int, rank: int = 0, seed: int = 0):
        torch.manual_seed(seed)
        dev = torch.device("cuda")
        experts = QuantizedExperts([random_layer(2 * F, D, bits, dev, rank) for _ in range(E)],
                                   [random_layer(D, F, bits, dev, rank) for _ in range(E)])
        self.gate_up, self.down = experts.stacked(torch.bfloat16)
        self.E, self.k, self.D, self.F, self.bits = E, k, D, F, bits
        self.experts = experts  # keeps the stacked buffers alive
        self._routed: dict[int, list[tuple]] = {}

    def routed(self, T: int) -> list[tuple]:
        """ROUTINGS x (routing, x, h [T*k, F], y [T*k, D] fp32), made once per T, in the row order
        QuantizedExperts.forward runs the kernels in: slot order (expert ids [T, k], x [T, D]) where slot_order_pays,
        else expert-sorted (a routing table, x [T*k, D])."""
        if T in self._routed:
            return self._routed[T]
        dev = torch.device("cuda")
        out = self._routed[T] = []
        slots = slot_order_pays(T)
        for _ in range(ROUTINGS):
            ids = torch.stack([torch.randperm(self.E, device=dev)[:self.k] for _ in range(T)])  # [T, k]
            routing = ids if slots else build_routing_table(ids, torch.rand(T, self.k, device=dev), self.E)
            out.append((routing, torch.randn(T if slots else T * self.k, self.D, device=dev, dtype=torch.bfloat16),
                        torch.randn(T * self.k, self.F, device=dev, dtype=torch.bfloat16),
                        torch.zeros(T * self.k, self.D, device=dev, dtype=torch.float32)))
        return out

    def run_pair(self, config: ExpertsConfig, item: tuple) -> None:
        """Both projections, as QuantizedExperts runs them."""
        routing, x, _, _ = item
        lowbit_experts(x, self.gate_up, self.down, routing, config)

    def run(self, part: str, cfg: LowbitConfig, item: tuple) -> None:
        """One launch of `part` as lowbit_experts runs it (each with its prepare_x and output fill): down by TMA
        where tma_one_token says so, else the CUDA-core or tensor-core kernel."""
        routing, x, h, y = item
        if part == "gate_up":
            launch_gate_up(x, self.gate_up, h, routing, cfg.replace(SPLIT_K=1))
            return
        p = self.down
        if tma_one_token(cfg, p, routing, h.device):
            launch_down_tma(h, p, y, routing, cfg)
        else:
            launch(h, p.qweight, p.scale, p.zero, y, p.bits, p.group, p.in_features, cfg, h.shape[0] // self.k,
                   self.E, lowrank=p.low_rank_inputs(h), routing=routing)


def graph_ms(fn, items, replays: int = 10) -> float:
    """Median GPU ms per call of fn over the rotating items, replayed from one CUDA graph (a short timing: hundreds of
    candidates; bench/common's time_cuda_graph spends 125 ms on each)."""
    graph = capture_graph(fn, items)
    times = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(items))
    return statistics.median(times[2:])


def jobs_for(T: int, E: int, k: int, D: int, F: int, tma: bool = False) -> list[tuple[str, LowbitConfig]]:
    """(part, config) pairs to time at T tokens before the one-token load variants; tma: the experts can take the
    one-token TMA kernels (launch.tma_experts)."""
    out = []
    for tile in tiles(T, E, k):
        out += [("gate_up", tile.replace(SPLIT_K=1, PAIRED=paired)) for paired in (0, 1)]
        out += [("down", tile.replace(SPLIT_K=s)) for s in splits(tile, F)]
    if T == 1 and tma:
        out += [("gate_up", LowbitConfig.of(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=1, TMA=1)))
                for bn, bk, w, st in TMA_TILES + TMA_GATE_UP_TILES if bk <= D]
        out += [("down", LowbitConfig.of(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=s, TMA=1)))
                for bn, bk, w, st in TMA_TILES + TMA_DOWN_TILES if bk <= F for s in TMA_DOWN_SPLITS]
    return out


def compile_jobs(T: int, E: int, k: int, D: int, F: int, tma: bool = False) -> list[tuple[str, LowbitConfig]]:
    """jobs_for, plus the load variants of every one-token register-prefetch tile (whichever wins, its variants are
    compiled)."""
    jobs = jobs_for(T, E, k, D, F, tma)
    if T == 1:
        jobs += [(part, variant) for part, cfg in jobs if cfg.SPLIT_K <= 2 and not cfg.TMA
                 for variant in load_variants(cfg)]
    return jobs


_WORKER: dict = {}


def _compile(job: tuple) -> str | None:
    """Worker: run one (shape, bits, rank, T, part, cfg) once, so Triton compiles it into its disk cache."""
    name, bits, rank, T, part, cfg = job
    key = (name, bits, rank)
    if key not in _WORKER:
        _WORKER.clear()
        _WORKER[key] = Problem(*SHAPES[name], bits, rank)
    problem = _WORKER[key]
    try:
        problem.run(part, cfg, problem.routed(T)[0])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported, then skipped by the timing run
        return f"{name} {bits}-bit r{rank} T={T} {part} {cfg.as_dict()}: {type(e).__name__}: {str(e)[:200]}"
    return None


def compiled_as(job: tuple) -> tuple:
    """What Triton compiles a job's launch as: its config but the K split (only split or not), and for down, how
    Triton specializes the row count T*k (1, a multiple of 16, other), and whether it has compensators."""
    name, bits, rank, T, part, cfg = job
    rows = T * SHAPES[name][1]
    spec = (rows == 1, rows % 16 == 0) if part == "down" else ()
    return (name, bits, rank > 0, part, spec, cfg.SPLIT_K > 1, cfg.replace(SPLIT_K=1))


def precompile(jobs: list[tuple], workers: int) -> list[str]:
    """Compile every distinct candidate once in parallel processes (a fresh GPU machine has an empty Triton cache)."""
    if workers <= 1 or not jobs:
        return []
    by_problem: dict = {}
    for job in {compiled_as(j): j for j in jobs}.values():  # a worker keeps one problem: jobs grouped by problem
        by_problem.setdefault(job[:3], []).append(job)
    ordered = [j for group in by_problem.values() for j in group]
    with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [e for e in pool.map(_compile, ordered, chunksize=max(1, len(ordered) // (2 * workers))) if e]


def table_key(name: str, bits: int, rank: int) -> str:
    E, _, D, F = SHAPES[name]
    return lowbit_moe_key(bits, E, D, F, rank > 0)


def best_few(timed: list[tuple[float, LowbitConfig]], n: int) -> list[tuple[float, LowbitConfig]]:
    """The n fastest distinct configs of (ms, config) timings, each with its best time."""
    best: dict[LowbitConfig, tuple[float, LowbitConfig]] = {}
    for ms, cfg in timed:
        if cfg not in best or ms < best[cfg][0]:
            best[cfg] = (ms, cfg)
    return sorted(best.values(), key=lambda p: p[0])[:n]


def tune(name: str, bits: int, rank: int, tokens, log: list) -> dict:
    E, k, D, F = SHAPES[name]
    problem = Problem(E, k, D, F, bits, rank)
    table = {}
    for T in tokens:
        items = problem.routed(T)
        timed = {"gate_up": [], "down": []}

        def time_job(part, cfg):
            try:
                ms = graph_ms(lambda item: problem.run(part, cfg, item), items)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
                log.append(f"{name} b{bits} r{rank} T={T} {part} {cfg.as_dict()} failed: {type(e).__name__}")
                return
            timed[part].append((ms, cfg))

        for part, cfg in jobs_for(T, E, k, D, F, tma_experts(bits, GROUP, torch.device("cuda"))):
            time_job(part, cfg)
        if T == 1:
            for part in ("gate_up", "down"):
                best = min([t for t in timed[part] if not t[1].TMA], key=lambda p: p[0])[1]
                for cfg in load_variants(best):
                    time_job(part, cfg)
        default = lowbit_moe_config(torch.cuda.get_device_name(), bits, E, D, F, T, k, rank > 0)  # dispatch till now
        default = ExpertsConfig(default.gate_up.replace(ms=None), default.down.replace(ms=None))
        part_ms = {}
        # the dispatch's own config is a finalist where it is among the best
        for part, cfg in (("gate_up", default.gate_up), ("down", default.down)):
            part_ms[part] = graph_ms(lambda item: problem.run(part, cfg, item), items)
            timed[part].append((part_ms[part], cfg))
        finalists = {part: best_few(timed[part], PAIR_FINALISTS) for part in ("gate_up", "down")}
        pairs = [(graph_ms(functools.partial(problem.run_pair, default), items), default, part_ms)]
        for gu_ms, gu in finalists["gate_up"]:
            for dn_ms, dn in finalists["down"]:
                config = ExpertsConfig(gu, dn)
                try:
                    pairs.append((graph_ms(functools.partial(problem.run_pair, config), items), config,
                                  {"gate_up": gu_ms, "down": dn_ms}))
                except Exception as e:  # noqa: BLE001 - reported; the others still compete
                    log.append(f"{name} b{bits} r{rank} T={T} pair {config.as_dict()} failed: {type(e).__name__}")
        ms, config, apart = min(pairs, key=lambda p: p[0])  # the dispatch's own pair stays where none beat it
        entry = {part: cfg.replace(ms=round(apart[part], 4)).as_dict()
                 for part, cfg in (("gate_up", config.gate_up), ("down", config.down))}
        log.append(f"{name} {bits}-bit r{rank} T={T}: experts {ms:.4f} ms (dispatch before {pairs[0][0]:.4f}) | "
                   f"gate_up {entry['gate_up']} | down {entry['down']}")
        print(log[-1], flush=True)
        table[str(T)] = {**entry, "experts_ms": round(ms, 4), "dispatch_before_ms": round(pairs[0][0], 4)}
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tuner_args(ap, SHAPES, TOKENS)
    ap.add_argument("--bits", default="4,3", help="comma-separated expert bit widths (default 4,3)")
    ap.add_argument("--ranks", default="0,32", help="comma-separated compensator ranks: 0 tunes the plain entries, "
                    "any other rank the `_lr` ones used by every expert with compensators (default 0,32)")
    args = ap.parse_args(argv)
    shapes = tuner_shapes(args, SHAPES, "tune_lowbit_moe")
    try:
        bit_list, tokens = [int(b) for b in args.bits.split(",")], [int(t) for t in args.tokens.split(",")]
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        sys.exit(f"--bits, --tokens and --ranks take comma-separated integers, got {args.bits!r}, {args.tokens!r} "
                 f"and {args.ranks!r}")
    if set(bit_list) - set(BITS) or min(tokens) < 1 or min(ranks) < 0 or len({r > 0 for r in ranks}) < len(ranks):
        sys.exit(f"--bits takes some of {BITS}, --tokens positive counts, --ranks 0 and/or one positive rank; got "
                 f"{args.bits!r}, {args.tokens!r} and {args.ranks!r}")
    start = time.perf_counter()
    jobs = [(n, b, r, T, part, cfg) for n in shapes for b in bit_list for r in ranks for T in tokens
            for part, cfg in compile_jobs(T, *SHAPES[n], tma_experts(b, GROUP, torch.device("cuda")))]
    errors = precompile(jobs, args.workers)
    print(f"compiled {len({compiled_as(j) for j in jobs})} kernels for {len(jobs)} candidates with {args.workers} "
          f"workers in {time.perf_counter() - start:.0f} s{f' ({len(errors)} failed)' if errors else ''}", flush=True)
    log = list(errors)
    section = {}
    for n in shapes:
        for b in bit_list:
            for r in ranks:
                key = table_key(n, b, r)
                section[key] = tuned = tune(n, b, r, tokens, log)
                if not args.no_write:  # after each problem: a run cut short keeps what it finished
                    entries = {T: {part: e[part] for part in ("gate_up", "down")} for T, e in tuned.items()}
                    print(f"wrote {write_sections(torch.cuda.get_device_name(), {'lowbit_moe': {key: entries}})}")
    record = result_record("tune_lowbit_moe", {"shapes": shapes, "bits": bit_list, "ranks": ranks, "tokens": tokens,
                                               "routings": ROUTINGS, "timing": "CUDA graph replay, median of 10"},
                           torch.device("cuda"))
    record["lowbit_moe"], record["log"] = section, log
    print(f"wrote {write_result(record, args.out)} in {time.perf_counter() - start:.0f} s")
    print(json.dumps({k: {t: e["experts_ms"] for t, e in v.items()} for k, v in section.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
