"""GPT-OSS's experts on the CPU: one expert (gate_up [2F, D] then down [D, F]) per decode row from MXFP4 as shipped
(the generated MXFP4 kernels), from bf16 copies (torch, the hybrid's float path before MXFP4 stayed packed) and from
HQQ 4-bit copies (the generated affine kernels, --experts-bits 4); weight bytes, milliseconds, GB/s and the share of
the measured DRAM read bandwidth, on one thread and on all of torch's.

    python bench/cpu_mxfp4.py                 # GPT-OSS-20B's expert (hidden 2880, FFN 2880), 1 and 4 rows
    python bench/cpu_mxfp4.py --quick         # a small shape, seconds

Weights rotate through copies totalling >= ROTATE_BYTES so the last-level cache does not flatter anyone; the kernels
run on all of torch's threads (the native pool's helpers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, start_cpu_bench, time_fn, write_result  # noqa: E402

from moeserve.kernels.cpu import gemv  # noqa: E402
from moeserve.quant import hqq  # noqa: E402

ROTATE_BYTES = 512 << 20


def copies(make, nbytes_each: int) -> list:
    """make() called for enough copies (other memory, same kind) to total ROTATE_BYTES."""
    return [make() for _ in range(max(2, -(-ROTATE_BYTES // nbytes_each)))]


def expert_rows(hidden: int, ffn: int, rows_list, threads_list, dram: float, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    shapes = ((2 * ffn, hidden), (hidden, ffn))  # gate_up, down
    mx_kernel, q_kernel = gemv.default_kernel(4, mxfp4=True), gemv.default_kernel(4)
    group = 64 if hidden % 64 == 0 and ffn % 64 == 0 else 32

    def mxfp4_expert():
        return [gemv.pack_mxfp4_for_cpu(torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8),
                                        torch.randint(117, 130, (n, k // 32), generator=g, dtype=torch.uint8),
                                        mx_kernel) for n, k in shapes]

    def hqq_expert():
        out = []
        for n, k in shapes:
            qw = hqq.quantize_rtn(torch.randn(n, k, generator=g) * 0.02, 4, group)
            out.append(gemv.pack_for_cpu(qw.codes, qw.scale, qw.zero, 4, group, q_kernel))
        return out

    def bf16_expert():
        return [torch.randn(n, k, generator=g).bfloat16() for n, k in shapes]

    nbytes = {"mxfp4": sum(p.nbytes for p in mxfp4_expert()), "hqq4": sum(p.nbytes for p in hqq_expert()),
              "bf16": 3 * hidden * ffn * 2}
    experts = {"mxfp4": copies(mxfp4_expert, nbytes["mxfp4"]), "hqq4": copies(hqq_expert, nbytes["hqq4"]),
               "bf16": copies(bf16_expert, nbytes["bf16"])}
    out = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for rows in rows_list:
            x = torch.randn(rows, hidden, generator=g)
            xb = x.bfloat16()
            calls = {  # an expert's two projections, no activation between them (its cost is the same for all)
                "mxfp4": lambda e: mx_kernel(mx_kernel(x, e[0], threads)[:, :ffn], e[1], threads),
                "hqq4": lambda e: q_kernel(q_kernel(x, e[0], threads)[:, :ffn], e[1], threads),
                "bf16": lambda e: torch.nn.functional.linear(torch.nn.functional.linear(xb, e[0])[:, :ffn], e[1]),
            }
            for form, fn in calls.items():
                ms = time_fn(fn, experts[form], reps=reps, warmup=3)
                row = {"form": form, "rows": rows, "threads": threads, "ms": ms, "weight_bytes": nbytes[form],
                       "bits_per_weight": 8 * nbytes[form] / (3 * hidden * ffn), "gb_s": nbytes[form] / ms / 1e6,
                       "dram_share": nbytes[form] / (ms * 1e-3) / dram}
                out.append(row)
                print(f"expert {hidden}x{ffn} {form:5s} rows {rows} threads {threads}: {ms:.3f} ms, "
                      f"{nbytes[form] / 2**20:.1f} MiB ({row['bits_per_weight']:.2f} bits/weight), "
                      f"{row['gb_s']:.1f} GB/s ({100 * row['dram_share']:.0f}% DRAM)", flush=True)
    return out


def main() -> None:
    bench = start_cpu_bench(__doc__.splitlines()[0], 512 << 20)
    args, isa, tile, dram = bench.args, bench.isa, bench.tile, bench.dram
    global ROTATE_BYTES
    if args.quick:
        ROTATE_BYTES = 16 << 20
    hidden, ffn = (256, 256) if args.quick else (2880, 2880)
    record = result_record("cpu_mxfp4", {"quick": args.quick, "isa": isa, "tile_rows": tile[0],
                                         "tile_vectors": tile[1], "hidden": hidden, "ffn": ffn,
                                         "rotate_bytes": ROTATE_BYTES}, device="cpu")
    record["floor_rates"] = {"dram_read": dram}
    threads = sorted({1, torch.get_num_threads()})  # 1: torch's bf16 GEMV slows down on a busy machine's 2 threads
    record["expert"] = expert_rows(hidden, ffn, (1, 4), threads, dram["bytes_per_s"], 5 if args.quick else 21)
    print(write_result(record, args.out))


if __name__ == "__main__":
    main()
