"""Low-bit linear (Triton, W{4,3}A16, dequantized in registers) vs bf16 cuBLAS and vs the HBM floor.

    python bench/kernels.py            # H100: Mixtral-size matrices, 1/16/64 rows
    python bench/kernels.py --quick    # tiny shapes in the Triton interpreter on a CPU (smoke run)

Weights rotate through enough copies to exceed L2. Floor = bytes read (packed weight + fp16 scale/zero,
or the bf16 weight) over the measured HBM copy bandwidth.
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
from common import measure_hbm_bandwidth, result_record, time_fn, write_result  # noqa: E402

from moeserve.kernels.triton.lowbit_linear import lowbit_linear  # noqa: E402
from moeserve.quant.hqq import QuantizedWeight  # noqa: E402
from moeserve.quant.qlinear import QuantizedLinear  # noqa: E402

ROTATE_BYTES = 256 << 20  # 5x the H100's L2


def random_layer(N: int, K: int, bits: int, device) -> QuantizedLinear:
    qw = QuantizedWeight(codes=torch.randint(0, 1 << bits, (N, K), dtype=torch.uint8),
                         scale=(torch.rand(N, K // 64) * 0.01 + 1e-3).half(),
                         zero=(torch.rand(N, K // 64) * ((1 << bits) - 1)).half(), bits=bits, group=64, shape=(N, K))
    return QuantizedLinear.from_quantized(qw).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(64, 128)] if args.quick else [(14336, 4096), (4096, 14336)]
    rows_list = (1, 5) if args.quick else (1, 16, 64)
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)
    record = result_record("kernels", {"quick": args.quick, "group": 64, "dtype": str(dtype).removeprefix("torch.")},
                           device=device)
    record["floor_rates"] = {"copy_bandwidth": bw}
    rows = []
    for N, K in shapes:
        dense = [torch.randn(N, K, device=device, dtype=dtype) * K ** -0.5
                 for _ in range(max(2, ROTATE_BYTES // (N * K * 2)) if not args.quick else 2)]
        for bits in (4, 3):
            layers = [random_layer(N, K, bits, device) for _ in range(max(2, ROTATE_BYTES * 8 // (N * K * bits))
                                                                      if not args.quick else 2)]
            nbytes = sum(b.numel() * b.element_size() for b in (layers[0].qweight, layers[0].scale, layers[0].zero))
            for M in rows_list:
                x = torch.randn(M, K, device=device, dtype=dtype)
                ours = time_fn(lambda l: lowbit_linear(x, l.qweight, l.scale, l.zero, bits, 64, K), layers, device)
                bf16 = time_fn(lambda w: torch.nn.functional.linear(x, w), dense, device)
                deq = time_fn(lambda l: torch.nn.functional.linear(x, l.weight(dtype)), layers[:2], device)
                floor = nbytes / bw["bytes_per_s"] * 2 * 1e3  # copy bandwidth counts read+write
                bf16_floor = N * K * 2 / bw["bytes_per_s"] * 2 * 1e3
                rows.append({"N": N, "K": K, "bits": bits, "rows": M, "ours_ms": ours, "bf16_ms": bf16,
                             "dequant_matmul_ms": deq, "weight_bytes": nbytes, "floor_ms": floor,
                             "bf16_floor_ms": bf16_floor, "ours_over_floor": ours / floor,
                             "speed_vs_bf16": bf16 / ours, "hbm_share": floor / ours})
                print(f"{N}x{K} {bits}-bit M={M}: {ours:.4f} ms (floor {floor:.4f}, {100 * floor / ours:.0f}% of HBM) | "
                      f"bf16 {bf16:.4f} ms (floor {bf16_floor:.4f}) | dequant+matmul {deq:.3f} ms", flush=True)
    record["rows"] = rows
    write_result(record, args.out)


if __name__ == "__main__":
    main()
