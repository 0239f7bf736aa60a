"""The 4-bit MoE at serving batch sizes: the MMA kernels (kernels/cuda/w4_moe.cu) beside the Triton low-bit kernels,
the bf16 fused MoE and the byte floor, on the Mixtral-8x7B expert shape (D 4096, F 14336, 8 experts, top-2, group
64, random codes), experts only (gate_up + SwiGLU + down over expert-sorted rows, outputs before gate weighting).

Floor: the packed bytes (4-bit codes + fp16 scale and zero) of the experts the routings hit, over the measured
device copy bandwidth. Each figure is the best of three rounds of 20 calls over four rotating random routings.

    python bench/mma_moe.py            # CUDA (Ampere or later); writes bench/results/mma_moe-<device>-<date>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import measure_hbm_bandwidth, result_record, write_result  # noqa: E402

from moeserve.kernels.cuda.w4_moe import W4Experts, W4Projection, w4_experts  # noqa: E402
from moeserve.kernels.pack import pack  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.fused_moe import fused_experts  # noqa: E402
from moeserve.kernels.triton.lowbit import StackedLowbit, lowbit_experts  # noqa: E402

E, D, F, TOP_K, GROUP = 8, 4096, 14336, 2, 64


def random_projection(N: int, K: int, dev: torch.device) -> StackedLowbit:
    codes = torch.randint(0, 16, (E, N, K), device=dev)
    scale = (torch.rand(E, N, K // GROUP, device=dev) * 0.02 + 0.002).half()
    zero = (torch.rand(E, N, K // GROUP, device=dev) * 15).half()
    return StackedLowbit(pack(codes, 4), scale, zero, 4, GROUP, K)


def best_ms(fn, items, reps: int = 20) -> float:
    for it in items:
        fn(it)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            fn(items[i % len(items)])
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,32,64,128,256", help="token counts (default 1,4,16,32,64,128,256)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)):
        print("bench/mma_moe.py needs an Ampere or later CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = measure_hbm_bandwidth(dev)
    gate_up, down = random_projection(2 * F, D, dev), random_projection(D, F, dev)
    mma = W4Experts(*(W4Projection.of(p.qweight, p.scale, p.zero, GROUP, p.in_features, gate_up=p is gate_up)
                      for p in (gate_up, down)))
    dense = (torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) * 0.02,
             torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) * 0.02)
    expert_bytes = 3 * D * F // 2 + 3 * D * F // GROUP * 4  # codes + fp16 scale and zero
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        items = []
        for _ in range(4):
            ids = torch.stack([torch.randperm(E, device=dev)[:TOP_K] for _ in range(T)])  # [T, k]
            table = build_routing_table(ids, torch.rand(T, TOP_K, device=dev), E)
            items.append((torch.randn(T * TOP_K, D, device=dev, dtype=torch.bfloat16), table))
        hit = sum(int((it[1].counts > 0).sum()) for it in items) / len(items)
        floor = hit * expert_bytes / bw["bytes_per_s"] * 1e3
        x, table = items[0]
        ref = lowbit_experts(x, gate_up, down, table)
        err = float((w4_experts(x, mma, table.offsets, T, TOP_K) - ref).abs().max() / ref.abs().max())
        row = {"tokens": T, "experts_hit": hit, "floor_ms": floor,
               "mma_ms": best_ms(lambda it: w4_experts(it[0], mma, it[1].offsets, T, TOP_K), items),
               "triton_ms": best_ms(lambda it: lowbit_experts(it[0], gate_up, down, it[1]), items),
               "bf16_ms": best_ms(lambda it: fused_experts(it[0], *dense, it[1]), items),
               "max_rel_diff_vs_triton": err}
        row["mma_floor_share"] = floor / row["mma_ms"]
        row["triton_floor_share"] = floor / row["triton_ms"]
        rows.append(row)
        print(f"{T:4d} tokens: mma {row['mma_ms']:.3f} ms ({row['mma_floor_share']:.0%} of floor), triton "
              f"{row['triton_ms']:.3f} ({row['triton_floor_share']:.0%}), bf16 {row['bf16_ms']:.3f}, floor "
              f"{floor:.3f} ms", flush=True)
    record = result_record("mma_moe", {"shape": "mixtral-8x7b experts", "E": E, "D": D, "F": F, "top_k": TOP_K,
                                       "group": GROUP, "dtype": "bfloat16"}, dev)
    record.update(rows=rows, hbm=bw)
    print(f"wrote {write_result(record, args.out)}")


if __name__ == "__main__":
    main()
