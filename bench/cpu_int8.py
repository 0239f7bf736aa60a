"""Int8 activations (--cpu-int8: AVX512-VNNI dots) against the exact float CPU kernels on one MoE layer's experts:
milliseconds of the native whole-layer call (kernels/cpu moe_layer: both projections, SwiGLU, weighted sum) at 1, 4,
8, 16 and 64 rows, for 4-bit HQQ (group 64) and MXFP4 experts, and the int8 output's relative error against the
exact one on the same call.

    python bench/cpu_int8.py                 # Qwen3-30B-A3B's layer: hidden 2048, expert FFN 768, 8 experts active
    python bench/cpu_int8.py --quick         # a small layer, seconds

Every row goes through all 8 experts (a token's top-8: the weights of 8 experts read per call, shared by the rows).
Two weight sources: "dram", layers rotating through copies totalling >= ROTATE_BYTES so the last-level cache does
not flatter anyone (what decoding sees), and "cache", one layer called again and again (its 19 MiB in the last-level
cache where it fits: the arithmetic's own speed, less exposed to other tenants' DRAM traffic on a shared machine).
Both kernels read the same copies (their layouts are the same). Each kernel's register tile is the one tuned for
this CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, start_cpu_bench, time_fn, write_result  # noqa: E402

from moeserve.kernels.cpu import gemv  # noqa: E402
from moeserve.kernels.cpu.machine import INT8_ISA, check_int8_dots  # noqa: E402
from moeserve.quant import hqq  # noqa: E402

ROTATE_BYTES = 512 << 20
ACTIVE = 8  # experts per token
ROWS = (1, 4, 8, 16, 64)


def layers(form: str, hidden: int, ffn: int, kernel: gemv.CpuKernel, g: torch.Generator) -> list[gemv.LayerExperts]:
    """Copies of one layer of ACTIVE random experts (4-bit HQQ group 64, or MXFP4) totalling >= ROTATE_BYTES."""

    def weight(n: int, k: int) -> gemv.PackedForCpu:
        if form == "mxfp4":
            return gemv.pack_mxfp4_for_cpu(torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8),
                                           torch.randint(117, 124, (n, k // 32), generator=g, dtype=torch.uint8),
                                           kernel)
        qw = hqq.quantize_rtn(torch.randn(n, k, generator=g) / k ** 0.5, 4, 64)
        return gemv.pack_for_cpu(qw.codes, qw.scale, qw.zero, 4, 64, kernel)

    first = gemv.LayerExperts.of([weight(2 * ffn, hidden) for _ in range(ACTIVE)],
                                 [weight(hidden, ffn) for _ in range(ACTIVE)])
    nbytes = sum(p.nbytes for p in first.gate_up + first.down)
    out = [first]
    for _ in range(max(2, -(-ROTATE_BYTES // nbytes)) - 1):
        out.append(gemv.LayerExperts.of([p.clone() for p in first.gate_up], [p.clone() for p in first.down]))
    return out


def layer_rows(hidden: int, ffn: int, dram: float, reps: int, int8_tile: tuple[int, int]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for form in ("hqq4", "mxfp4"):
        mxfp4 = form == "mxfp4"
        exact, int8 = gemv.default_kernel(4, mxfp4=mxfp4), gemv.CpuKernel(INT8_ISA, 4, *int8_tile, mxfp4=mxfp4)
        if exact.tile_outputs % int8.tile_outputs and int8.tile_outputs % exact.tile_outputs:
            raise SystemExit(f"tiles of {exact.tile_outputs} and {int8.tile_outputs} outputs pad differently")
        pack_kernel = exact if exact.tile_outputs >= int8.tile_outputs else int8  # padding both tiles divide
        copies = layers(form, hidden, ffn, pack_kernel, g)
        nbytes = sum(p.nbytes for p in copies[0].gate_up + copies[0].down)
        threads = torch.get_num_threads()
        for source, inputs in (("dram", copies), ("cache", copies[:1])):
            for rows in ROWS:
                x = torch.randn(rows, hidden, generator=g)  # [T, D]
                ids = torch.arange(ACTIVE).repeat(rows, 1)  # [T, 8]: every row through every expert
                wts = torch.rand(rows, ACTIVE, generator=g) / ACTIVE  # [T, 8]
                times = {name: time_fn(lambda e: gemv.moe_layer(k, e, x, ids, wts, threads=threads), inputs,
                                       reps=reps, warmup=3) for name, k in (("exact", exact), ("int8", int8))}
                want = gemv.moe_layer(exact, copies[0], x, ids, wts, threads=threads).double()
                got = gemv.moe_layer(int8, copies[0], x, ids, wts, threads=threads).double()
                err = float((got - want).norm() / want.norm())
                row = {"form": form, "weights": source, "rows": rows, "threads": threads, "exact_ms": times["exact"],
                       "int8_ms": times["int8"], "speedup": times["exact"] / times["int8"], "weight_bytes": nbytes,
                       "exact_dram_share": nbytes / (times["exact"] * 1e-3) / dram,
                       "int8_dram_share": nbytes / (times["int8"] * 1e-3) / dram, "int8_relative_error": err}
                out.append(row)
                print(f"layer {hidden}x{ffn}x{ACTIVE} {form:5s} {source:5s} rows {rows:2d}: exact {times['exact']:.3f} "
                      f"ms, int8 {times['int8']:.3f} ms ({row['speedup']:.2f}x; {100 * row['int8_dram_share']:.0f}% "
                      f"DRAM), error {100 * err:.2f}%", flush=True)
    return out


def main() -> None:
    check_int8_dots()
    bench = start_cpu_bench(__doc__.splitlines()[0], 512 << 20)
    args, isa, tile, dram = bench.args, bench.isa, bench.tile, bench.dram
    global ROTATE_BYTES
    if args.quick:
        ROTATE_BYTES = 16 << 20
    hidden, ffn = (256, 128) if args.quick else (2048, 768)
    int8_tile = gemv.tile_for(INT8_ISA)
    print(f"int8 tile {int8_tile}", flush=True)
    record = result_record("cpu_int8", {"quick": args.quick, "isa": isa, "tile": list(tile), "int8_isa": INT8_ISA,
                                        "int8_tile": list(int8_tile), "hidden": hidden, "ffn": ffn,
                                        "active_experts": ACTIVE, "group": 64, "rotate_bytes": ROTATE_BYTES},
                           device="cpu")
    record["floor_rates"] = {"dram_read": dram}
    record["layer"] = layer_rows(hidden, ffn, dram["bytes_per_s"], 5 if args.quick else 15, int8_tile)
    print(write_result(record, args.out))


if __name__ == "__main__":
    main()
