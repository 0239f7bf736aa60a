"""Generated CPU kernels vs PyTorch on the CPU: weight GB/s and share of DRAM read bandwidth for low-bit
GEMV/GEMM, and end-to-end tokens/s with 4-bit and 3-bit experts.

    python bench/cpu_kernels.py                 # full (Mixtral-size matrices; ~2 GB of RAM)
    python bench/cpu_kernels.py --quick         # small shapes, seconds

Matrices rotate through copies totalling >= 1 GiB so the last-level cache does not flatter anyone.
Baselines on the same matrices: torch float32 and bfloat16 matmul, and the plain "unpack then matmul"
PyTorch path of QuantizedLinear.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, start_cpu_bench, time_fn, write_result  # noqa: E402

import moeserve  # noqa: E402
from moeserve.cli import DEMO_DIR  # noqa: E402
from moeserve.engine.generate import generate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.kernels.cpu import gemv  # noqa: E402
from moeserve.model.experts import ResidentExperts  # noqa: E402
from moeserve.compress import QuantConfig, quantize_checkpoint  # noqa: E402
from moeserve.quant.hqq import QuantizedWeight  # noqa: E402
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear  # noqa: E402

ROTATE_BYTES = 1 << 30


def random_quantized(out_f: int, in_f: int, bits: int, group: int = 64) -> QuantizedLinear:
    """A QuantizedLinear with random codes, scales and zeros (speed does not depend on the values)."""
    qw = QuantizedWeight(codes=torch.randint(0, 1 << bits, (out_f, in_f), dtype=torch.uint8),
                         scale=(torch.rand(out_f, in_f // group) * 0.01 + 1e-3).half(),
                         zero=(torch.rand(out_f, in_f // group) * ((1 << bits) - 1)).half(),
                         bits=bits, group=group, shape=(out_f, in_f))
    return QuantizedLinear.from_quantized(qw)


def copies(item, nbytes_each: int, max_copies: int = 64) -> list:
    """`item` and clones of it (same values, other memory) totalling ROTATE_BYTES."""
    n = max(2, min(max_copies, -(-ROTATE_BYTES // nbytes_each)))
    return [item] + [item.clone() for _ in range(n - 1)]  # a tensor or a gemv.PackedForCpu


def gemv_rows(shapes, rows_list, bits_list, dram: float, reps: int) -> list[dict]:
    kernel_rows = []
    for out_f, in_f in shapes:
        dense = {dt: copies(torch.randn(out_f, in_f).to(dt), out_f * in_f * (2 if dt == torch.bfloat16 else 4))
                 for dt in (torch.float32, torch.bfloat16)}
        for bits in bits_list:
            kernel = gemv.default_kernel(bits)
            layer = random_quantized(out_f, in_f, bits)
            packed = copies(gemv.pack_for_cpu(layer.qweight, layer.scale, layer.zero, bits, 64, kernel,
                                              packed_words=True), out_f * in_f * bits // 8)
            for rows in rows_list:
                x = torch.randn(rows, in_f)
                ours = time_fn(lambda p: kernel(x, p), packed, reps=reps)
                unpack = time_fn(lambda l: torch.nn.functional.linear(x, l.weight()), [layer], reps=3, warmup=1)
                fp32 = time_fn(lambda w: x @ w.T, dense[torch.float32], reps=reps)
                xb = x.bfloat16()
                bf16 = time_fn(lambda w: xb @ w.T, dense[torch.bfloat16], reps=reps)
                nbytes = packed[0].nbytes
                row = {"out": out_f, "in": in_f, "bits": bits, "rows": rows, "ours_ms": ours, "torch_fp32_ms": fp32,
                       "torch_bf16_ms": bf16, "unpack_matmul_ms": unpack, "weight_bytes": nbytes,
                       "ours_gb_s": nbytes / ours / 1e6, "dram_share": nbytes / ours / 1e-3 / dram,
                       "floor_ms": nbytes / dram * 1e3, "speed_vs_bf16": bf16 / ours, "speed_vs_fp32": fp32 / ours,
                       "speed_vs_unpack": unpack / ours}
                kernel_rows.append(row)
                print(f"{out_f}x{in_f} {bits}-bit rows {rows}: {ours:.3f} ms ({row['ours_gb_s']:.1f} GB/s, "
                      f"{100 * row['dram_share']:.0f}% DRAM) | fp32 {fp32:.3f} bf16 {bf16:.3f} unpack {unpack:.2f} ms",
                      flush=True)
    return kernel_rows


def moe_layer_rows(hidden: int, ffn: int, experts: int, top_k: int, tokens: int, reps: int) -> list[dict]:
    """One Mixtral-shaped MoE expert layer (routing random per call), bf16/fp32 vs 4-bit and 3-bit experts."""
    out = []
    g = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) for _ in range(16)]
    w = torch.full((tokens, top_k), 1.0 / top_k)
    x = torch.randn(tokens, hidden)
    for label, dtype, bits in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                               ("4-bit", torch.float32, 4), ("3-bit", torch.float32, 3)):
        if bits is None:
            backend = ResidentExperts(experts, hidden, ffn)
            with torch.no_grad():
                backend.gate_up_proj.normal_(0, 0.02)
                backend.down_proj.normal_(0, 0.02)
            backend = backend.to(dtype)
        else:
            backend = QuantizedExperts([random_quantized(2 * ffn, hidden, bits) for _ in range(experts)],
                                       [random_quantized(hidden, ffn, bits) for _ in range(experts)])
        xin = x.to(dtype)
        with torch.no_grad():
            every = torch.arange(experts).unsqueeze(1).repeat(1, top_k)  # warm every expert (one-time repacking)
            backend(torch.randn(experts, hidden).to(dtype), every, torch.ones(experts, top_k, dtype=dtype))
            ms = time_fn(lambda i: backend(xin, i, w.to(dtype)), ids, reps=reps, warmup=2)
        out.append({"experts": label, "tokens": tokens, "ms": ms, "tokens_per_s": tokens / ms * 1e3})
        print(f"MoE layer {experts}x({hidden}->{ffn}) top-{top_k}, {tokens} token(s), {label} experts: {ms:.2f} ms",
              flush=True)
        del backend
    return out


def demo_decode_rows(new_tokens: int) -> list[dict]:
    """Demo model greedy decode tokens/s on the CPU: fp32 / bf16 weights vs 4-bit and 3-bit (HQQ) checkpoints."""
    rows = []
    prompt = [list(b"HAMLET. To be, or not to be")]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("fp32", DEMO_DIR, torch.float32), ("bf16", DEMO_DIR, torch.bfloat16)]
        for bits in (4, 3):
            path = Path(tmp) / f"q{bits}"
            quantize_checkpoint(DEMO_DIR, path, QuantConfig(bits=bits, group=64, method="hqq"), progress=False)
            variants.append((f"{bits}-bit", path, torch.float32))
        for label, path, dtype in variants:
            model = moeserve.load_model(path, device="cpu", dtype=dtype)
            generate(model, prompt, SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
            t = time.perf_counter()
            generate(model, prompt, params)
            s = time.perf_counter() - t
            rows.append({"weights": label, "new_tokens": new_tokens, "seconds": s, "tokens_per_s": new_tokens / s})
            print(f"demo decode, {label} weights: {new_tokens / s:.1f} tok/s", flush=True)
    return rows


def main() -> None:
    bench = start_cpu_bench(__doc__.splitlines()[0], 1 << 30)
    args, info, isa, tile, dram = bench.args, bench.info, bench.isa, bench.tile, bench.dram
    global ROTATE_BYTES
    if args.quick:
        ROTATE_BYTES = 16 << 20
    shapes = [(512, 1024)] if args.quick else [(4096, 14336), (14336, 4096)]
    reps = 3 if args.quick else 15
    record = result_record("cpu_kernels", {"quick": args.quick, "isa": isa, "tile_rows": tile[0],
                                           "tile_vectors": tile[1], "group": 64, "l1d_bytes": info.l1d_bytes,
                                           "rotate_bytes": ROTATE_BYTES}, device="cpu")
    record["floor_rates"] = {"dram_read": dram}
    record["gemv"] = gemv_rows(shapes, (1, 8), (2, 3, 4), dram["bytes_per_s"], reps)
    record["moe_layer"] = (moe_layer_rows(256, 512, 8, 2, 1, reps) if args.quick
                           else moe_layer_rows(4096, 14336, 8, 2, 1, 7))
    record["demo_decode"] = demo_decode_rows(8 if args.quick else 64)
    write_result(record, args.out)


if __name__ == "__main__":
    main()
