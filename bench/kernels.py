"""Low-bit linear (Triton, W{4,3}A16, dequantized in registers) vs bf16 cuBLAS and vs the HBM floor.

    python bench/kernels.py            # H100: Mixtral-size matrices, 1/16/64 rows, tuned launch configs
    python bench/kernels.py --quick    # tiny shapes in the Triton interpreter on a CPU (smoke run)
    python bench/kernels.py --profile  # per-kernel GPU times (torch.profiler): GEMV and the MoE block

Each run first checks the kernel against dequantize + float32 matmul (real and odd shapes, compensator on),
then times a small sweep of launch configs per (bits, shape, rows) and reports the best, which is also
written as the "lowbit" table that kernels/triton/configs/<gpu>.json holds.
Weights rotate through enough copies to exceed L2. Floor = bytes read (packed weight + fp16 scale/zero, or
the bf16 weight) over the measured HBM copy bandwidth (read + write bytes per second).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if "--quick" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import measure_hbm_bandwidth, result_record, time_cuda_graph, time_fn, write_result  # noqa: E402

from moeserve.kernels.triton.configs import (LowbitConfig, lowbit_config, lowbit_shape_key, split_for,  # noqa: E402
                                             write_sections)
from moeserve.kernels.triton.lowbit import lowbit_linear  # noqa: E402
from moeserve.quant import milo  # noqa: E402
from moeserve.quant.hqq import QuantizedWeight  # noqa: E402
from moeserve.quant.qlinear import QuantizedLinear  # noqa: E402

ROTATE_BYTES = 256 << 20  # 5x the H100's L2
GROUP = 64
# one row: BLOCK_N, BLOCK_K, warps, SUB (interleaved sub-tiles: x is loaded once per SUB rows). Each sub-tile's rows x
# groups per step stay below the thread count, or Triton converts the tile's layout through shared memory.
GEMV_SWEEP = [(16, 256, 4, 1), (32, 256, 4, 2), (64, 256, 4, 4), (32, 512, 8, 2), (64, 512, 8, 4), (32, 512, 4, 4)]
# 2..8 rows on CUDA cores: BLOCK_N, BLOCK_K, warps, SUB, BLOCK_M (rows of x per tile; codes decoded once for them)
GEMV_ROWS_SWEEP = [(16, 512, 4, 2, 4), (8, 512, 4, 1, 4), (8, 512, 4, 1, 8), (32, 512, 4, 4, 2), (16, 512, 4, 2, 2)]
DOT_SWEEP = [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 64, 4)]  # BN, BK, warps (64 x 256 at 4 warps spills)
# tensor cores on dequantized tiles, PIPE steps in flight through shared memory (lowbit/tiles.py): BN, BK, warps,
# PIPE (an H100 probe's best four at 16 and 64 rows of the 4-bit Mixtral FFN shapes)
PIPED_DOT_SWEEP = [(64, 256, 4, 3), (128, 256, 8, 3), (128, 256, 4, 3), (128, 256, 8, 4)]


def load_variants(best: LowbitConfig) -> list[LowbitConfig]:
    """A one-row winner with more loads in flight: two steps of register prefetch, or 3/4 cp.async stages."""
    return [best.replace(AHEAD=2), best.replace(PIPE=3), best.replace(PIPE=4)]


def random_layer(N: int, K: int, bits: int, device, rank: int = 0) -> QuantizedLinear:
    """Random codes, scales and zeros (never zeros: each call draws fresh ones), optional bf16 compensator."""
    qw = QuantizedWeight(codes=torch.randint(0, 1 << bits, (N, K), dtype=torch.uint8, device=device),
                         scale=(torch.rand(N, K // GROUP, device=device) * 0.01 + 1e-3).half(),
                         zero=(torch.rand(N, K // GROUP, device=device) * ((1 << bits) - 1)).half(), bits=bits,
                         group=GROUP, shape=(N, K))  # drawn and packed on the device: seconds, not minutes, on a GPU
    comp = (milo.compensator_to_buffers(torch.randn(N, rank, device=device) * 0.01,
                                        torch.randn(rank, K, device=device) * 0.01, 16) if rank else None)
    return QuantizedLinear.from_quantized(qw, comp, rank, 16).to(device)


def call(layer: QuantizedLinear, x: torch.Tensor, config: LowbitConfig | None = None, lowrank: bool = False):
    return lowbit_linear(x, layer.qweight, layer.scale, layer.zero, layer.bits, layer.group, layer.in_features,
                         lowrank=layer.cached_compensator(x.dtype) if lowrank else None, config=config)


def check(shapes, rows_list, device, dtype) -> list[dict]:
    """Max relative error against dequantize + float32 matmul, with and without a compensator."""
    out = []
    for N, K in shapes:
        for bits, rank in ((2, 0), (3, 0), (4, 0), (3, 32)):
            layer = random_layer(N, K, bits, device, rank)
            w = layer.weight(torch.float32)
            uv = layer.compensator(torch.float32)
            for M in rows_list:
                x = torch.randn(M, K, device=device, dtype=dtype)
                ref = x.float() @ w.T + ((x.float() @ uv[1].T) @ uv[0].T if uv else 0)
                y = call(layer, x, lowrank=bool(rank)).float()
                err = float((y - ref).norm() / ref.norm())
                out.append({"N": N, "K": K, "bits": bits, "rank": rank, "rows": M, "rel_err": err,
                            "nan": bool(y.isnan().any())})
                if err > (1e-5 if dtype == torch.float32 else 1e-2) or out[-1]["nan"]:
                    print(f"CHECK FAILED {out[-1]}", flush=True)
    print(f"correctness: {len(out)} cases, worst rel err {max(r['rel_err'] for r in out):.2e}", flush=True)
    return out


def candidates(M: int, N: int, K: int, quick: bool) -> list[LowbitConfig]:
    """Launch configs to time: block shapes x split-K around the one that fills the GPU."""
    if M == 1:
        sweep = [(*tile, 1) for tile in GEMV_SWEEP]
    else:
        sweep = ([tile for tile in GEMV_ROWS_SWEEP if tile[4] <= 2 * M] if M <= 8 else []) + [
            (*tile, 1, 0) for tile in DOT_SWEEP] + [  # BLOCK_M 0: tensor cores
            (bn, bk, warps, 1, 0, pipe) for bn, bk, warps, pipe in PIPED_DOT_SWEEP if M > 8]
    out = []
    for bn, bk, warps, sub, block_m, *pipe in sweep[:1 if quick else None]:
        auto = split_for(-(-N // bn), -(-K // bk))
        steps = -(-K // bk)
        splits = {auto, 2 * auto, 4 * auto, steps // 2, steps} if M == 1 else {1, 4, auto, 2 * auto}
        for split in sorted(splits if not quick else {auto}):
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=3, SPLIT_K=max(1, min(split, steps, 64)))
            if sub > 1:
                cfg["SUB"] = sub
            if block_m > 1:
                cfg["BLOCK_M"] = block_m
            if pipe:
                cfg["PIPE"] = pipe[0]
            cfg = LowbitConfig.of(cfg)
            if cfg not in out:
                out.append(cfg)
    return out


def gpu_time(fn, items, device) -> float:
    """Median ms of fn over the rotating items: CUDA-graph replay on a GPU (decode replays graphs, and eager times of
    20-us kernels are host launch noise), else wall time."""
    return time_cuda_graph(fn, items) if device.type == "cuda" else time_fn(fn, items, device)


def bench(N, K, bits, M, layers, dense, x, bw, device, quick, sweep=True) -> tuple[dict, dict]:
    nbytes = sum(b.numel() * b.element_size() for b in (layers[0].qweight, layers[0].scale, layers[0].zero))
    best_ms, best = float("inf"), None
    for cfg in candidates(M, N, K, quick) if sweep else []:  # chosen by GPU time: decode replays CUDA graphs
        ms = gpu_time(lambda l: call(l, x, cfg), layers, device)
        if ms < best_ms:
            best_ms, best = ms, cfg
    if best is not None and M == 1 and not quick:  # more loads in flight (registers or cp.async stages): helps some
        for variant in load_variants(best):  # shapes, costs others
            ms = gpu_time(lambda l: call(l, x, variant), layers, device)
            if ms < best_ms:
                best_ms, best = ms, variant
    best_gpu_ms = best_ms  # GPU time of the best swept config (CUDA-graph replay on a GPU)
    default_ms = time_fn(lambda l: call(l, x), layers, device)  # what the dispatch picks (table or default)
    best_ms = min(time_fn(lambda l: call(l, x, best), layers, device) if best else default_ms, default_ms)
    bf16 = time_fn(lambda w: torch.nn.functional.linear(x, w), dense, device)
    graphs = {}
    if device.type == "cuda":  # the GPU's own time: a decode step replays these from a CUDA graph
        graphs = {"dispatch_graph_ms": time_cuda_graph(lambda l: call(l, x), layers),
                  "bf16_graph_ms": time_cuda_graph(lambda w: torch.nn.functional.linear(x, w), dense)}
        graphs["graph_hbm_share"] = nbytes / bw["bytes_per_s"] * 1e3 / graphs["dispatch_graph_ms"]
        if best is not None:
            graphs["best_graph_ms"] = best_gpu_ms
            graphs["best_graph_hbm_share"] = nbytes / bw["bytes_per_s"] * 1e3 / best_gpu_ms
            if M == 1 or best.BLOCK_M is not None:  # the same CUDA-core tile summing in fp32
                fp32_sums = best.replace(HALF=0)
                graphs["fp32_sums_graph_ms"] = gpu_time(lambda l: call(l, x, fp32_sums), layers, device)
                print(f"   fp16 pairs {best_gpu_ms:.4f} ms vs fp32 sums {graphs['fp32_sums_graph_ms']:.4f} ms")
        print(f"   graph replay: ours {graphs['dispatch_graph_ms']:.4f} ms ({100 * graphs['graph_hbm_share']:.0f}% of "
              f"HBM; best swept {graphs.get('best_graph_ms', float('nan')):.4f} ms), bf16 "
              f"{graphs['bf16_graph_ms']:.4f} ms", flush=True)
    floor = nbytes / bw["bytes_per_s"] * 1e3
    row = {"N": N, "K": K, "bits": bits, "rows": M, **graphs, "ours_ms": best_ms,
           "config": best.as_dict() if best is not None else None, "dispatch_ms": default_ms,
           "bf16_ms": bf16, "weight_bytes": nbytes, "floor_ms": floor, "bf16_floor_ms": N * K * 2 / bw["bytes_per_s"] * 1e3,
           "achieved_GBps": nbytes / best_ms / 1e6, "hbm_share": floor / best_ms, "speedup_vs_bf16": bf16 / best_ms}
    print(f"{N}x{K} {bits}-bit M={M}: {best_ms:.4f} ms ({row['achieved_GBps']:.0f} GB/s, {100 * row['hbm_share']:.0f}% "
          f"of HBM) dispatch {default_ms:.4f} | bf16 {bf16:.4f} ms -> {row['speedup_vs_bf16']:.2f}x | {row['config']}",
          flush=True)
    # the table entry, with the GPU time it won with
    return row, (best.replace(ms=round(best_gpu_ms, 4)).as_dict() if best is not None else None)


def compensator_overhead(shapes, ranks, device, dtype, rotate) -> list[dict]:
    """One row, 4-bit: fused compensator (x V^T matmul + U^T in the epilogue) vs the same call without it."""
    out = []
    for N, K in shapes:
        for r in ranks:
            layers = [random_layer(N, K, 4, device, r) for _ in range(rotate)]
            x = torch.randn(1, K, device=device, dtype=dtype)
            base = gpu_time(lambda l: call(l, x), layers, device)
            with_lr = gpu_time(lambda l: call(l, x, lowrank=True), layers, device)
            comp_bytes = (N + K) * r * 2
            out.append({"N": N, "K": K, "rank": r, "base_ms": base, "with_compensator_ms": with_lr,
                        "overhead_ms": with_lr - base, "compensator_bytes_bf16": comp_bytes})
            print(f"{N}x{K} rank {r}: {base:.4f} -> {with_lr:.4f} ms (+{with_lr - base:.4f}; reads "
                  f"{comp_bytes / 1e6:.1f} MB more)", flush=True)
    return out


def profile_kernels(device) -> None:
    """Per-kernel GPU time (torch.profiler) of the one-row GEMV and the Mixtral MoE block (bf16 at 1 and 1024 tokens;
    low-bit experts at 1, without the router, whose launch prepares x in the block): what each launch costs besides
    the main kernels (prepare_x, output fill, routing, combine)."""
    from torch.profiler import ProfilerActivity, profile

    from moeserve.model.experts import ResidentExperts
    from moeserve.quant.qlinear import QuantizedExperts

    def show(title, fn, reps=20):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        print(f"== {title}")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
            if e.device_time_total:
                print(f"   {e.device_time_total / reps:8.1f} us/call  x{e.count // reps:<3d} {e.key[:90]}")

    for N, K in [(14336, 4096), (4096, 14336)]:
        for bits in (4, 3):
            layers = [random_layer(N, K, bits, device) for _ in range(8)]
            x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
            show(f"GEMV {N}x{K} {bits}-bit, 8 layers per call", lambda: [call(layer, x) for layer in layers], 5)
    E, D, F = 8, 4096, 14336
    bf16 = ResidentExperts(E, D, F).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in (bf16.gate_up_proj, bf16.down_proj):
            p.normal_(0, 0.02)
    for T in (1, 1024):
        x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=device)[:2] for _ in range(T)])  # [T, 2]
        weights = torch.rand(T, 2, device=device)
        show(f"Mixtral MoE block, {T} tokens, bf16 experts ({bf16.kernel_path(x, T)})",
             lambda: bf16(x, ids, weights), 5)
    del bf16
    for bits in (4, 3):
        experts = QuantizedExperts([random_layer(2 * F, D, bits, device) for _ in range(E)],
                                   [random_layer(D, F, bits, device) for _ in range(E)])
        x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
        ids, weights = torch.tensor([[1, 5]], device=device), torch.rand(1, 2, device=device)
        show(f"Mixtral experts, 1 token, {bits}-bit (the block less its router: x prepared by prepare_x here)",
             lambda: experts(x, ids, weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="time only the configs the dispatch picks")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the correctness check against float32 (tests/test_gpu.py runs it too; it compiles many "
                         "configs)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated rows of x to time (default 1,2,4,16,64; the full sweep takes over 5 minutes "
                         "on an H100)")
    ap.add_argument("--profile", action="store_true",
                    help="only print per-kernel GPU times (torch.profiler) of the one-row GEMV and the MoE block")
    ap.add_argument("--write-config", action="store_true",
                    help="merge the best swept configs into moeserve/kernels/triton/configs/<gpu>.json ('lowbit')")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.profile:
        if device.type != "cuda":
            sys.exit("--profile needs a CUDA GPU")
        return profile_kernels(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(64, 256)] if args.quick else [(14336, 4096), (4096, 14336)]
    rows_list = (1, 4, 16) if args.quick else (1, 2, 4, 16, 64)
    if args.rows:
        try:
            rows_list = tuple(int(r) for r in args.rows.split(","))
        except ValueError:
            sys.exit(f"--rows takes comma-separated positive integers, got {args.rows!r}")
        if min(rows_list) < 1:
            sys.exit(f"--rows takes comma-separated positive integers, got {args.rows!r}")
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)
    record = result_record("kernels", {"quick": args.quick, "group": GROUP, "dtype": str(dtype).removeprefix("torch."),
                                       "timing": "do_bench median, rotating weights > L2"}, device=device)
    record["floor_rates"] = {"copy_bandwidth": bw}
    if not args.no_check:
        record["correctness"] = check([(96, 320)] if args.quick else [shapes[0], (1000, 4160)],
                                      (1, 3) if args.quick else (1, 3, 17, 64), device, dtype)
    rows, table = [], {}
    for N, K in shapes:
        dense = [torch.randn(N, K, device=device, dtype=dtype) * K ** -0.5
                 for _ in range(2 if args.quick else max(2, ROTATE_BYTES // (N * K * 2)))]
        for bits in (4, 3):
            layers = [random_layer(N, K, bits, device)
                      for _ in range(2 if args.quick else max(2, ROTATE_BYTES * 8 // (N * K * bits)))]
            for M in rows_list:
                x = torch.randn(M, K, device=device, dtype=dtype)
                row, best = bench(N, K, bits, M, layers, dense, x, bw, device, args.quick, not args.no_sweep)
                rows.append(row)
                if best is not None:
                    table.setdefault(lowbit_shape_key(bits, N, K), {})[str(M)] = best
            del layers
    record["rows"] = rows
    record["lowbit_config_table"] = table
    if args.write_config and table and device.type == "cuda":
        print(f"wrote {write_sections(torch.cuda.get_device_name(), {'lowbit': table})}")
    if 1 in rows_list:  # the compensator's cost is measured on the one-row GEMV
        record["compensator"] = compensator_overhead(shapes, (16,) if args.quick else (16, 32, 512), device, dtype,
                                                     2 if args.quick else 8)
    lowbit_config.cache_clear()
    print(f"\nwrote {write_result(record, args.out)}")


if __name__ == "__main__":
    main()
