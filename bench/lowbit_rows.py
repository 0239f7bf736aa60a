"""A low-bit dense layer at prompt-sized row counts: which GPU path wins where (QuantizedLinear's TRITON_MAX_ROWS).

Per projection shape and row count, median ms of:
  triton    lowbit_linear: the packed weight decoded in registers, streamed once per block of 64 rows
  dequant   QuantizedLinear.weight() (one Triton pass to a bf16 weight) + cuBLAS matmul
  torch     pack.unpack + hqq.dequantize in torch ops + cuBLAS (the path 3-bit rows take)
and the floor max(packed bytes / HBM bandwidth, FLOPs / bf16 matmul peak). Shapes: Mixtral-8x7B's expert gate_up
[2F, D] and down [D, F], Qwen3-30B-A3B's, at 4 bits, group 64.

    python bench/lowbit_rows.py                 # GPU: JSON to bench/results/, a table on stdout
    python bench/lowbit_rows.py --quick         # tiny sizes (CPU interpreter where there is no GPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (add_run_args, measure_hbm_bandwidth, measure_matmul_flops, result_record, run_device,  # noqa: E402
                    time_fn, write_result)

from moeserve.kernels.pack import padded_length, unpack  # noqa: E402
from moeserve.quant import hqq  # noqa: E402
from moeserve.quant.qlinear import QuantizedLinear  # noqa: E402

SHAPES = {"mixtral.gate_up": (28672, 4096), "mixtral.down": (4096, 14336), "qwen3.gate_up": (1536, 2048),
          "qwen3.down": (2048, 768)}
QUICK_SHAPES = {"tiny.gate_up": (256, 128)}
ROWS = (16, 64, 128, 256, 512, 1024)
BITS, GROUP = 4, 64


def torch_weight(layer: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack(layer.qweight, layer.bits, padded_length(layer.in_features))[:, :layer.in_features]
    qw = hqq.QuantizedWeight(codes=codes, scale=layer.scale, zero=layer.zero, bits=layer.bits, group=layer.group,
                             shape=(layer.out_features, layer.in_features))
    return hqq.dequantize(qw, dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    from moeserve.kernels.triton.lowbit import lowbit_linear

    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows_list = [4, 80] if args.quick else [int(r) for r in args.rows.split(",")]
    hbm = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]
    flops = measure_matmul_flops(device, dtype)["flop_per_s"] if device.type == "cuda" else None
    results = []
    print(f"{'shape':16s} {'rows':>5s} {'triton ms':>10s} {'dequant ms':>11s} {'torch ms':>9s} {'floor ms':>9s}")
    for name, (N, K) in shapes.items():
        qw = hqq.quantize_hqq(torch.randn(N, K, device=device) * K ** -0.5, BITS, GROUP)
        layer = QuantizedLinear.from_quantized(qw).to(device)
        packed = sum(t.nbytes for t in (layer.qweight, layer.scale, layer.zero))
        for rows in rows_list:
            xs = [torch.randn(rows, K, device=device, dtype=dtype) for _ in range(2)]
            row = {"shape": name, "N": N, "K": K, "rows": rows}
            row["triton_ms"] = time_fn(lambda x: lowbit_linear(x, layer.qweight, layer.scale, layer.zero, BITS,
                                                               GROUP, K), xs, device)
            row["dequant_ms"] = time_fn(lambda x: x @ layer.weight(dtype).T, xs, device)
            row["torch_ms"] = time_fn(lambda x: x @ torch_weight(layer, dtype).T, xs, device)
            floor = max(packed / hbm, 2 * rows * N * K / flops if flops else 0.0)
            row["floor_ms"] = 1e3 * floor
            print(f"{name:16s} {rows:5d} {row['triton_ms']:10.3f} {row['dequant_ms']:11.3f} {row['torch_ms']:9.3f} "
                  f"{row['floor_ms']:9.3f}", flush=True)
            results.append(row)
    record = result_record("lowbit_rows", {"quick": args.quick, "bits": BITS, "group": GROUP, "dtype": str(dtype)},
                           device)
    record.update({"hbm_bytes_per_s": hbm, "matmul_flops_per_s": flops, "rows": results})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
