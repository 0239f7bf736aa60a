"""MoE block latency: moeserve MoEBlock vs transformers' sparse MoE block (eager and grouped_mm experts)
vs the floor, at Mixtral shape (D 4096, F 14336, E 8, top-2, bf16) and a DeepSeek/Qwen-like shape
(D 2048, F 1408, E 64, top-6; experts only, no shared expert).

Floor per token count = max(bytes, FLOPs):
  bytes: the distinct experts the routing actually hits (counted per input set), read once, plus the
         router weight, the input and the output, over the measured device copy bandwidth;
  FLOPs: 2 * T * k * 3 * D * F (+ router) over the measured dense matmul rate.
Intermediate activations (the [T*k, 2F] gate/up output) are not in the floor: a fused kernel keeps them on chip.

Low-bit experts (4-bit and 3-bit, group 64, random codes; QuantizedExperts -> Triton low-bit fused MoE on CUDA)
are timed for the decode token counts (<= 64) next to bf16, eager and, on CUDA, replaying a CUDA graph of the
whole block (captured once on a static input): at 1 token the eager block is bound by kernel launches.
Their floor counts the packed experts hit (weights + fp16 scale/zero) instead of bf16 ones.

    python bench/moe_block.py            # GPU (bf16), writes bench/results/moe_block-<device>-<date>.json
    python bench/moe_block.py --quick    # tiny shapes on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (measure_hbm_bandwidth, measure_matmul_flops, result_record, time_cuda_graph, time_fn,  # noqa: E402
                    write_result)
from kernels import random_layer  # noqa: E402

from moeserve.kernels.triton.configs import fused_max_tokens, gpu_name  # noqa: E402
from moeserve.model.experts import fused_moe_available, grouped_mm_available  # noqa: E402
from moeserve.model.moe import MoEBlock  # noqa: E402
from moeserve.quant.mxfp4 import stored_experts  # noqa: E402
from moeserve.quant.qlinear import QuantizedExperts  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

# name -> (HF family, E, k, D, F)
SHAPES = {
    "mixtral": ("mixtral", 8, 2, 4096, 14336),
    "deepseek_like": ("qwen3_moe", 64, 6, 2048, 1408),
}
QUICK_SHAPES = {
    "mixtral": ("mixtral", 8, 2, 256, 512),
    "deepseek_like": ("qwen3_moe", 16, 4, 128, 96),
}
TOKENS = (1, 16, 64, 256, 1024)
QUICK_TOKENS = (1, 8)
INPUT_SETS = 8  # rotating inputs per token count
QUICK_INPUT_SETS = 2
WEIGHT_STD = 0.02
LOWBIT = (4, 3)
LOWBIT_MAX_TOKENS = 64


@contextmanager
def default_device_dtype(device: torch.device, dtype: torch.dtype):
    """Build modules directly on `device` in `dtype` (no fp32 CPU copy of a 2.8 GB block)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def hf_and_ours_blocks(make_hf, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    """(transformers' MoE block from make_hf(), built on `device` in `dtype`; moeserve's MoEBlock of `spec` on the meta
    device, for load_state_dict(assign=True) of tensors made from the first), both in eval mode."""
    with default_device_dtype(device, dtype):
        hf = make_hf().eval()
        with torch.device("meta"):
            ours = MoEBlock(spec, 0).eval()
            ours.experts = stored_experts(spec, spec.moe.experts_at(0))  # MXFP4 kept packed where the spec says so
    return hf, ours


def our_spec(family: str, E: int, k: int, D: int, F: int) -> ModelSpec:
    return ModelSpec.of(family=family, vocab_size=8, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=D, max_position_embeddings=8, num_experts=E, top_k=k, expert_ffn=F,
                     norm_topk_prob=True, router_weights_fp32=(family == "mixtral"), moe_layers=(True,))


def hf_block(family: str, E: int, k: int, D: int, F: int):
    """transformers' sparse MoE block for the family: MixtralSparseMoeBlock or Qwen3MoeSparseMoeBlock."""
    import transformers

    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                         num_experts_per_tok=k)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                          num_experts_per_tok=k, norm_topk_prob=True)
    return Block(cfg).eval()


def check_experts_implementation_api(block) -> None:
    """Fail with a clear message if this transformers spells the experts switch differently than 5.x does
    (`config._experts_implementation`, read at forward time by `@use_experts_implementation`)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise SystemExit(f"transformers {__import__('transformers').__version__}: no "
                         f"transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS ({e}); the experts implementation "
                         "switch this bench uses is missing") from None
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        raise SystemExit(f"transformers has no 'grouped_mm' experts implementation; it has: "
                         f"{sorted(ALL_EXPERTS_FUNCTIONS.keys())}")
    experts = block.experts
    if not (hasattr(experts, "config") and hasattr(experts.config, "_experts_implementation")
            and hasattr(experts, "is_transposed")):
        raise SystemExit(f"{type(experts).__name__} is not decorated with @use_experts_implementation or its config "
                         "has no `_experts_implementation`: cannot choose eager vs grouped_mm")
    names = getattr(getattr(type(experts).forward, "__code__", None), "co_names", ())  # the wrapper, not __wrapped__
    if "_experts_implementation" not in names:
        raise SystemExit(f"{type(experts).__name__}.forward does not read config._experts_implementation in this "
                         "transformers version: cannot choose eager vs grouped_mm")


def set_experts_implementation(block, name: str) -> None:
    block.experts.config._experts_implementation = name
    if block.experts.config._experts_implementation != name:
        raise SystemExit(f"setting config._experts_implementation = {name!r} did not stick")


def hf_grouped_kernel(x: torch.Tensor, block) -> str:
    """Which grouped GEMM transformers' grouped_mm experts will call for this input (the fallback loops)."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm

        w = block.experts.down_proj
        can = _can_use_grouped_mm(x, w, torch.zeros(w.shape[0], dtype=torch.int32, device=x.device))
    except Exception:  # a private helper: its name or signature may change between versions
        return "unknown"
    if not can:
        return "transformers grouped_mm_fallback (loop of mm)"
    return "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def floors(T: int, distinct: float, E: int, k: int, D: int, F: int, itemsize: int, bw: float, flops: float) -> dict:
    expert_bytes = 3 * D * F * itemsize
    nbytes = distinct * expert_bytes + E * D * itemsize + 2 * T * D * itemsize  # experts hit, router, x in, out
    nflop = 2 * T * k * 3 * D * F + 2 * T * D * E
    bytes_ms, flops_ms = nbytes / bw * 1e3, nflop / flops * 1e3
    return {"floor_ms": max(bytes_ms, flops_ms), "floor_bytes_ms": bytes_ms, "floor_flops_ms": flops_ms,
            "floor_bound": "bytes" if bytes_ms >= flops_ms else "flops", "bytes": nbytes, "flop": nflop}


@torch.inference_mode()
def bench_shape(name, family, E, k, D, F, tokens, device, dtype, bw, flops, reps, input_sets, seed=0) -> dict:
    print(f"\n== {name}: {family}, E={E} k={k} D={D} F={F} {str(dtype).removeprefix('torch.')} on {device}")
    gen = torch.Generator(device=device).manual_seed(seed)
    with default_device_dtype(device, dtype):
        ours = MoEBlock(our_spec(family, E, k, D, F)).eval()
        for p in ours.parameters():
            p.normal_(0.0, WEIGHT_STD, generator=gen)
        hf = hf_block(family, E, k, D, F)
    check_experts_implementation_api(hf)
    hf.gate.weight.copy_(ours.gate.weight)
    hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)  # [E, 2F, D], gate rows then up rows
    hf.experts.down_proj.copy_(ours.experts.down_proj)  # [E, D, F]
    itemsize = torch.tensor([], dtype=dtype).element_size()

    # correctness, once per shape: at the middle token count, ours and HF grouped_mm against HF eager
    T_check = tokens[len(tokens) // 2]
    x = torch.randn(T_check, D, device=device, dtype=dtype, generator=gen)
    set_experts_implementation(hf, "eager")
    ref = hf(x[None])[0]
    set_experts_implementation(hf, "grouped_mm")
    hf_grouped = hf(x[None])[0]
    correctness = {"tokens": T_check, "ours_vs_hf_eager_rel_err": rel_err(ours(x), ref),
                   "hf_grouped_vs_hf_eager_rel_err": rel_err(hf_grouped, ref)}
    print(f"correctness at {T_check} tokens: ours vs HF eager rel err {correctness['ours_vs_hf_eager_rel_err']:.2e}, "
          f"HF grouped_mm vs HF eager {correctness['hf_grouped_vs_hf_eager_rel_err']:.2e}")
    if correctness["ours_vs_hf_eager_rel_err"] > (1e-4 if dtype == torch.float32 else 2e-2):
        print("WARNING: ours and transformers disagree more than rounding explains")
    path = "grouped_mm" if grouped_mm_available(x, D, F) else "looped"
    if fused_moe_available(x, 1, ours.experts.gate_up_proj):
        path = f"Triton fused MoE up to {fused_max_tokens(gpu_name(x.device.index or 0), E, D, F)} tokens, then {path}"
    info = {"ours_path": path,
            "hf_grouped_kernel": hf_grouped_kernel(x, hf), "hf_block": type(hf).__name__,
            "hf_experts_switch": "config._experts_implementation = 'eager' | 'grouped_mm'"}

    rows = []
    for T in tokens:
        xs = [torch.randn(T, D, device=device, dtype=dtype, generator=gen) for _ in range(input_sets)]
        x3 = [v[None] for v in xs]  # HF blocks take [B, S, D]
        distinct = [int(ours.gate(v)[0].unique().numel()) for v in xs]
        fl = floors(T, statistics.mean(distinct), E, k, D, F, itemsize, bw, flops)
        ours_ms = time_fn(ours, xs, device, reps=reps)
        set_experts_implementation(hf, "eager")
        eager_ms = time_fn(hf, x3, device, reps=reps)
        set_experts_implementation(hf, "grouped_mm")
        grouped_ms = time_fn(hf, x3, device, reps=reps)
        row = {"tokens": T, "distinct_experts": distinct, "ours_ms": ours_ms, "hf_eager_ms": eager_ms,
               "hf_grouped_mm_ms": grouped_ms, **fl,
               "ours_over_floor": ours_ms / fl["floor_ms"], "ours_over_hf_grouped_mm": ours_ms / grouped_ms,
               "ours_over_hf_eager": ours_ms / eager_ms}
        rows.append(row)
        print(f"T={T:5d}  distinct experts {statistics.mean(distinct):5.2f}  ours {ours_ms:8.3f} ms  "
              f"HF eager {eager_ms:8.3f}  HF grouped_mm {grouped_ms:8.3f}  floor {fl['floor_ms']:8.3f} "
              f"({fl['floor_bound']})")
        del xs, x3
    lowbit = lowbit_rows(ours, [t for t in tokens if t <= LOWBIT_MAX_TOKENS], E, D, F, device, dtype, bw, reps, gen)
    del ours, hf, ref, hf_grouped, x
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": name, "family": family, "num_experts": E, "top_k": k, "hidden": D, "ffn": F,
            "dtype": str(dtype).removeprefix("torch."), "correctness": correctness, **info, "rows": rows,
            "lowbit": lowbit}


def graph_time(block, x: torch.Tensor, device, reps: int) -> float | None:
    """Median ms of replaying a CUDA graph of block(x) (static input; routing has no host sync). None on a CPU."""
    return time_cuda_graph(block, [x.clone()], reps) if device.type == "cuda" else None


def lowbit_rows(block, tokens, E, D, F, device, dtype, bw, reps, gen) -> list[dict]:
    """The block with bf16 experts, then with 4-bit and 3-bit ones: eager and CUDA-graph ms vs the byte floor."""
    out = []
    if D % 64 or F % 64:  # random_layer's group of 64 must divide both input dimensions
        return out
    bf16_experts = block.experts
    for bits in (16, *LOWBIT):
        if bits != 16:
            block.experts = QuantizedExperts([random_layer(2 * F, D, bits, device) for _ in range(E)],
                                             [random_layer(D, F, bits, device) for _ in range(E)])
        expert_bytes = (3 * D * F * 2 if bits == 16 else
                        sum(t.numel() * t.element_size() for m in (block.experts.gate_up[0], block.experts.down[0])
                            for t in (m.qweight, m.scale, m.zero)))
        for T in tokens:
            xs = [torch.randn(T, D, device=device, dtype=dtype, generator=gen) for _ in range(2)]
            distinct = statistics.mean(int(block.gate(v)[0].unique().numel()) for v in xs)
            eager = time_fn(block, xs, device, reps=reps)
            graph = graph_time(block, xs[0], device, reps)
            floor = (distinct * expert_bytes + E * D * 2) / bw * 1e3
            out.append({"experts": "bf16" if bits == 16 else f"{bits}-bit", "tokens": T, "eager_ms": eager,
                        "cuda_graph_ms": graph, "floor_ms": floor, "distinct_experts": distinct,
                        "expert_bytes": expert_bytes, "path": type(block.experts).__name__})
            print(f"  {out[-1]['experts']:>6} T={T:3d}: eager {eager:.3f} ms, CUDA graph "
                  f"{'-' if graph is None else f'{graph:.3f}'} ms, floor {floor:.3f} ms", flush=True)
    block.experts = bf16_experts
    return out


def print_table(shapes: list[dict]) -> None:
    for s in shapes:
        print(f"\n{s['shape']} (E={s['num_experts']}, k={s['top_k']}, D={s['hidden']}, F={s['ffn']}, {s['dtype']}; "
              f"ours: {s['ours_path']}, HF grouped: {s['hf_grouped_kernel']})")
        print(f"{'tokens':>6} {'ours ms':>9} {'HF eager':>9} {'HF grouped':>10} {'floor ms':>9} "
              f"{'ours/floor':>10} {'ours/HF-grouped':>15}")
        for r in s["rows"]:
            print(f"{r['tokens']:>6} {r['ours_ms']:>9.3f} {r['hf_eager_ms']:>9.3f} {r['hf_grouped_mm_ms']:>10.3f} "
                  f"{r['floor_ms']:>9.3f} {r['ours_over_floor']:>10.2f} {r['ours_over_hf_grouped_mm']:>15.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke run, seconds)")
    ap.add_argument("--out", default=None, help="folder for the result JSON (default bench/results/)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; --quick: cpu)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = {n: shapes[n] for n in args.shapes.split(",")}
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (QUICK_TOKENS if args.quick else TOKENS)
    reps = 3 if args.quick else 20  # CPU medians (CUDA uses do_bench's own count)
    input_sets = QUICK_INPUT_SETS if args.quick else INPUT_SETS

    # floors first
    bw = measure_hbm_bandwidth(device, nbytes=(32 << 20) if args.quick else None)
    mm = measure_matmul_flops(device, dtype, n=256 if args.quick else None)
    print(f"{device} ({torch.get_num_threads()} threads): copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul {mm['flop_per_s'] / 1e12:.2f} TFLOP/s ({mm['dtype']}, n={mm['n']})")

    config = {"quick": args.quick, "dtype": str(dtype).removeprefix("torch."), "tokens": list(tokens),
              "input_sets": input_sets, "weight_std": WEIGHT_STD, "input_std": 1.0,
              "shapes": {n: dict(zip(("family", "num_experts", "top_k", "hidden", "ffn"), s)) for n, s in shapes.items()},
              "timing": "triton.testing.do_bench median (L2 flushed)" if device.type == "cuda"
              else f"median of {reps} perf_counter runs after 3 warm-up calls"}
    record = result_record("moe_block", config, device)
    record["floor_rates"] = {"copy_bandwidth": bw, "matmul": mm}
    record["shapes"] = [bench_shape(n, *s, tokens, device, dtype, bw["bytes_per_s"], mm["flop_per_s"], reps,
                                    input_sets)
                        for n, s in shapes.items()]
    print_table(record["shapes"])
    print(f"\nwrote {write_result(record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
