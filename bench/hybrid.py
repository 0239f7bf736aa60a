"""Hybrid CPU/GPU experts at batch 1: decode (tg128) and 512-token prefill (pp512) tokens/s of a model whose 4-bit
experts do not fit the GPU budget, per placement, beside today's HOBBIT offload and the physical floor.

Shapes (random weights; Mixtral's layers unless said otherwise):
  mixtral  Mixtral-8x7B: 32 layers, D 4096, expert FFN 14336, 8 experts top-2, 12 GiB GPU budget
  qwen3    Qwen3-30B-A3B: 48 layers, D 2048, expert FFN 768, 128 experts top-8, 8 GiB GPU budget
  deepseek DeepSeek-V2-Lite: 27 layers (the first dense, FFN 10944), MLA (16 heads, latent 512 + rope 64, no q
           LoRA), D 2048, expert FFN 1408, 64 experts top-6 beside 2 shared ones (on the GPU), 5.5 GiB GPU budget
The llama.cpp side-by-side (bench/peer/) covers mixtral and qwen3 only.
Columns (experts 4-bit HQQ, group 64; CPU threads = --cpu-threads, default the physical cores):
  cpu             every MoE layer's experts on the CPU (--cpu-moe)
  hybrid          static: the first N MoE layers' experts on the CPU, the rest resident on the GPU, N the fewest
                  that fit the budget (--n-cpu-moe N)
  hybrid+cache    every layer on the CPU, the budget as GPU cache slots (--cpu-moe --gpu-cache-experts S; on the device
                  link the cache ranks experts by decayed use counts, kept between steps)
  hybrid+mixed    static, with HOBBIT's precision rule (4-bit experts: the low-weight ones are skipped); its
                  perplexity cost is measured on the demo model (held-out text, 4-bit experts on the CPU;
                  bench/mixed_precision.py, which bench/quality.py also runs on a trained model)
  hobbit-offload  today's offload (bench/offload.py's `hobbit`: bf16 + 4-bit cache, misses copied over PCIe)
Floor per column: max(CPU expert bytes / DRAM read bandwidth, GPU bytes / HBM bandwidth) per decode token, with
the bytes each column read in its timed steps (its measured hit rate); offload: its PCIe bytes / host->device.
Prefill: a prompt of --prefill tokens streams the CPU layers' experts to the GPU (hybrid/stream.py); its floor is
the bytes it copied / the measured host->device bandwidth. Every column with CPU layers keeps the streaming ring
(hybrid/memory.py ring_slots) inside its GPU budget.
Threshold sweep (--sweep): prompts of T tokens through the `cpu` column's model, the experts on the CPU and
streamed, per T: where streaming starts to pay is the measured threshold (STREAM_FROM, `--stream-from`).

Routing: Mixtral replays the demo model's routing of held-out text (bench/offload.py's DemoRouting: both have 8
experts, top-2); the Qwen3 and DeepSeek shapes' 128 and 64 experts cannot replay the demo's 8, so their random
routers pick (near uniform: the cache's worst case; DeepSeek's is its greedy softmax gate). The store holds
--distinct-layers layers of random experts and MoE layer i reads layer i mod that (as bench/offload.py: every
expert read still streams its bytes from DRAM or over PCIe).

    python bench/hybrid.py                    # GPU: every shape, JSON to bench/results/, a table on stdout
    python bench/hybrid.py --shapes deepseek  # GPU: one shape
    python bench/hybrid.py --quick            # tiny models on the CPU (RAM as the model device; a Mixtral-like
                                              # one and a DeepSeek-like one with MLA), seconds
    OMP_WAIT_POLICY=ACTIVE python bench/hybrid.py   # OpenMP threads spin between regions (default here: PASSIVE)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moeserve --cpu-moe` runs; before torch loads OpenMP
import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (add_run_args, measure_dram_read_bandwidth, measure_hbm_bandwidth, result_record,  # noqa: E402
                    run_device, sync, write_result)
from mixed_precision import mixed_precision_cost  # noqa: E402
from offload import (DEMO_DIR, DemoRouting, dense_model, model_spec, random_store,  # noqa: E402
                     replay_routing, run_method)

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.hybrid.memory import ring_slots  # noqa: E402
from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.kernels.cpu.machine import physical_cores  # noqa: E402
from moeserve.offload.host_compute import HostExperts  # noqa: E402
from moeserve.offload.transfer import measure_h2d_bandwidth  # noqa: E402
from moeserve.plan.footprint import WORKSPACE_SHARE, dense_bytes, kv_cache_bytes  # noqa: E402
from moeserve.quant.dense import quantize_dense  # noqa: E402

GiB = 1 << 30
SHAPES = {
    "mixtral": (dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     expert_ffn=14336, num_experts=8, top_k=2), 12 * GiB, "demo"),
    "qwen3": (dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                   expert_ffn=768, num_experts=128, top_k=8), 8 * GiB, "model"),
    # GPU budget: a third of the 26 MoE layers' 4-bit experts resident. bf16 dense part 2.44 GiB (embeddings and
    # head 0.78, MLA, the dense layer, the shared experts) + KV 0.02 GiB (MLA's latent: 576 values per token and
    # layer) + the streaming ring 0.25 GiB (55 experts of 4.6 MiB) + 8.7 layers x 0.29 GiB (64 experts) = 5.2 GiB,
    # over 1 - WORKSPACE_SHARE: 5.5 GiB, which leaves 8 MoE layers resident and 18 on the CPU
    "deepseek": (dict(family="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                      num_kv_heads=16, head_dim=192, rotary_dim=64, expert_ffn=1408, num_experts=64, top_k=6,
                      norm_topk_prob=False, dense_layers=1, dense_ffn=10944, shared_expert_ffn=2 * 1408,
                      rope=dict(interleave=True), router=dict(scoring="softmax", topk_method="greedy"),
                      mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128, softmax_scale=192 ** -0.5)), int(5.5 * GiB), "model"),
}
QUICK = {  # --quick: tiny shapes on the CPU, at quick_budget
    "quick": (dict(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                   expert_ffn=256, num_experts=8, top_k=2), None, "demo"),
    "quick-mla": (dict(family="deepseek_v2", vocab_size=258, hidden_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=4, head_dim=24, rotary_dim=8, expert_ffn=64, num_experts=8, top_k=2,
                       norm_topk_prob=False, dense_layers=1, dense_ffn=256, shared_expert_ffn=128,
                       rope=dict(interleave=True), router=dict(scoring="softmax", topk_method="greedy"),
                       mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, softmax_scale=24 ** -0.5)), None, "model"),
}
COLUMNS = ("cpu", "hybrid", "hybrid+cache", "hybrid+mixed", "hobbit-offload")
BITS, GROUP = 4, 64


def quick_budget(resident: int, kv: int, expert_bytes: int) -> int:
    """A tiny shape's GPU budget: the dense part and the KV cache with their workspace share, then 20 4-bit experts
    (2.5 layers of 8): about a layer's experts resident beside the streaming ring, and room for the experts
    hobbit-offload keeps in flight."""
    return int((resident + kv) / (1 - WORKSPACE_SHARE) + 20 * expert_bytes)


def placement_of(column: str, spec, room: int, expert_bytes: int, threads: int,
                 n_cpu_moe: int | None = None) -> HybridPlacement:
    """The column's placement for `room` bytes of GPU memory left for experts (and the streaming ring); n_cpu_moe:
    the static columns' CPU layers instead of the fewest that fit."""
    layers = spec.moe.layer_indices()
    room -= ring_slots(expert_bytes, spec.moe.num_experts) * expert_bytes
    if column == "hybrid+cache":
        return HybridPlacement.choose(layers, cpu_moe=True, cache_slots=max(room // expert_bytes, 0), threads=threads,
                                      bits=BITS, num_experts=spec.moe.num_experts)
    resident = 0 if column == "cpu" else min(max(room // (spec.moe.num_experts * expert_bytes), 0), len(layers))
    n = len(layers) - resident if column == "cpu" or n_cpu_moe is None else n_cpu_moe
    return HybridPlacement.choose(layers, n_cpu_moe=n, threads=threads, bits=BITS,
                                  mixed=column == "hybrid+mixed")


def run(model, spec, prompt_len: int, new_tokens: int, warmup: int, routing_tokens: int | None, device, stats,
        cuda_graph: bool = True, layers: list[int] | None = None):
    """(prefill seconds, decode seconds per step after warm-up, stats delta of the timed steps); layers: the CPU
    layers, which replay the demo's routing (routing_tokens of it)."""
    if routing_tokens:
        replay_routing(model, DemoRouting(routing_tokens), layers)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    marks, t0 = [], time.perf_counter()
    for _ in iterate(model, [prompt], params, cuda_graph=cuda_graph):
        sync(device)
        marks.append((time.perf_counter(), {**stats(), "page_faults": minor_faults()}))
    prefill = marks[0][0] - t0
    if new_tokens <= warmup + 1:
        return prefill, None, {}
    (ta, sa), (tb, sb) = marks[warmup], marks[-1]
    steps = len(marks) - 1 - warmup
    per_step = {k: (sb[k] - sa[k]) / steps for k in sb if isinstance(sb[k], (int, float))}
    times = sorted(b[0] - a[0] for a, b in zip(marks[warmup:], marks[warmup + 1:]))  # [steps] seconds
    per_step["step_ms_p10_p50_p90"] = [1e3 * times[int(q * (len(times) - 1))] for q in (0.1, 0.5, 0.9)]
    return prefill, (tb - ta) / steps, per_step


def minor_faults() -> int:
    """Page faults of this process so far (first touches of memory: costly on a VM whose RAM grows on use)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hybrid_column(column, spec, store, host, device, dtype, room, args, rates, resident_bytes) -> dict:
    expert_bytes = store.expert_bytes(True)
    placement = placement_of(column, spec, room, expert_bytes, args.cpu_threads, args.n_cpu_moe)
    model = dense_model(spec, device, dtype)
    if args.dense_bits != 16:
        quantize_dense(model, args.dense_bits)
    runtime = enable_hybrid(model, store, placement, host=host, warm=True)  # repacked once per shape, not timed
    demo = args.routing == "demo"
    stats = lambda: vars(runtime.totals())  # noqa: E731
    cpu_layers = list(placement.cpu_layers)
    _, step, per_token = run(model, spec, args.prompt, args.new_tokens + args.warmup, args.warmup,
                             args.prompt + args.new_tokens + args.warmup + 1 if demo else None, device, stats,
                             not args.no_cuda_graph, cpu_layers)
    # the prompt path at the timed length first: compiles, tunes (a first use of a token count) and sizes it
    run(model, spec, args.prefill, 1, 0, args.prefill if demo else None, device, stats, layers=cpu_layers)
    before = runtime.summary().get("bytes_streamed", 0)
    prefill, _, _ = run(model, spec, args.prefill, 1, 0, args.prefill if demo else None, device, stats,
                        layers=cpu_layers)
    streamed = runtime.summary().get("bytes_streamed", 0) - before
    sweep = threshold_sweep(model, spec, runtime, device, args) if column == "cpu" and args.sweep else None
    resident_layers = len(placement.moe_layers) - len(placement.cpu_layers)
    cpu_bytes = per_token["cpu_pairs"] * expert_bytes
    gpu_bytes = resident_bytes + (per_token["gpu_pairs"] + resident_layers * spec.moe.top_k) * expert_bytes
    floor = max(cpu_bytes / rates["dram"], gpu_bytes / rates["hbm"])
    row = {"column": column, "cpu_layers": len(placement.cpu_layers), "cache_slots": placement.cache_slots,
           "tg_tokens_per_s": 1 / step, "pp_tokens_per_s": args.prefill / prefill,
           "cpu_pairs_per_token": per_token["cpu_pairs"], "gpu_pairs_per_token": per_token["gpu_pairs"],
           "skipped_per_token": per_token["skipped"], "cpu_bytes_per_token": cpu_bytes,
           "gpu_bytes_per_token": gpu_bytes, "floor_tokens_per_s": 1 / floor, "of_floor": floor / step,
           "admitted": runtime.summary().get("admitted", 0), "page_faults_per_token": per_token["page_faults"],
           "step_ms_p10_p50_p90": per_token["step_ms_p10_p50_p90"], "pp_bytes_streamed": streamed,
           "pp_floor_tokens_per_s": args.prefill / (streamed / rates["h2d"]) if streamed and rates["h2d"] else None}
    if sweep:
        row["threshold_sweep"] = sweep
    runtime.close()
    del model, runtime
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def threshold_sweep(model, spec, runtime, device, args) -> list[dict]:
    """Prompts of each --sweep T through the model, its CPU layers' experts on the CPU (stream_from 0) and streamed
    (stream_from 1): seconds per prompt and per CPU layer of each."""
    out, placement = [], runtime.placement
    for T in (int(t) for t in args.sweep.split(",")):
        row = {"tokens": T}
        for name, stream_from in (("cpu", 0), ("stream", 1)):
            runtime.placement = dataclasses.replace(placement, stream_from=stream_from)
            run(model, spec, T, 1, 0, T if args.routing == "demo" else None, device, lambda: {})  # warm
            seconds, _, _ = run(model, spec, T, 1, 0, T if args.routing == "demo" else None, device, lambda: {})
            row[f"{name}_s"], row[f"{name}_ms_per_layer"] = seconds, 1e3 * seconds / len(placement.cpu_layers)
        print(f"  sweep T={T}: CPU {row['cpu_ms_per_layer']:.2f} ms/layer, streamed {row['stream_ms_per_layer']:.2f}",
              flush=True)
        out.append(row)
    runtime.placement = placement
    return out


def offload_column(spec, store, device, dtype, budget, args, bandwidth) -> dict:
    """bench/offload.py's `hobbit` method at this budget (decode only; --offload-tokens steps)."""
    opts = SimpleNamespace(prompt=args.prompt, new_tokens=args.offload_tokens + args.warmup, warmup=args.warmup)
    routing = DemoRouting(opts.prompt + opts.new_tokens + 1) if args.routing == "demo" else None
    row = run_method(spec, store, device, dtype, budget, "hobbit", opts, bandwidth, routing, args.dense_bits)
    return {"column": "hobbit-offload", "tg_tokens_per_s": row["tokens_per_s"], "hit_rate": row["hit_rate"],
            "floor_tokens_per_s": row["floor_tokens_per_s"], "of_floor": row["of_floor"],
            "high_slots": row["high_slots"], "low_slots": row["low_slots"]}


def print_table(shape: str, rows: list[dict], prefill: int) -> None:
    print(f"\n{shape}: batch 1, 4-bit experts")
    print(f"{'column':15s} {'tg tok/s':>9s} {'floor tok/s':>12s} {'of floor':>9s} {f'pp{prefill} tok/s':>12s} "
          f"{'pp floor':>9s} {'CPU layers':>11s} {'slots':>6s}")
    for r in rows:
        cells = [f"{r[key]:{fmt}}" if r.get(key) else f"{'-':>{width}s}" for key, fmt, width in (
            ("floor_tokens_per_s", "12.1f", 12), ("of_floor", "9.0%", 9), ("pp_tokens_per_s", "12.1f", 12),
            ("pp_floor_tokens_per_s", "9.1f", 9))]
        print(f"{r['column']:15s} {r['tg_tokens_per_s']:9.2f} {' '.join(cells)} {r.get('cpu_layers', '-'):>11} "
              f"{r.get('cache_slots', r.get('high_slots', '-')):>6}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models on the CPU, seconds")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)} (default: all; "
                                                  f"with --quick, of {','.join(QUICK)})")
    ap.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated subset of the columns")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the timed decode")
    ap.add_argument("--new-tokens", type=int, default=128, help="timed decode steps (tg)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run (pp)")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--offload-tokens", type=int, default=32, help="timed decode steps of hobbit-offload")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="decode eagerly (default: the GPU work between the CPU layers as CUDA graphs)")
    ap.add_argument("--cpu-threads", type=int, default=len(physical_cores()), help="threads for the CPU experts")
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random experts in the store")
    ap.add_argument("--dense-bits", type=int, default=16, choices=(16, 8),
                    help="the dense part's linear layers: 16 (the compute dtype) or 8 (HQQ copies, --dense-bits 8)")
    ap.add_argument("--n-cpu-moe", type=int, default=None,
                    help="CPU layers of the hybrid and hybrid+mixed columns (default: the fewest that fit the budget; "
                         "e.g. llama.cpp's own fit, or 0: every expert resident, the budget ignored)")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="held-out demo tokens for the mixed-precision cost")
    ap.add_argument("--sweep", default="8,16,32,64,128",
                    help="prompt lengths of the streaming threshold sweep (cpu column; empty: none)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    table = QUICK if args.quick else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)
    if not set(names) <= set(table):
        ap.error(f"--shapes {args.shapes}: choose from {','.join(table)}")
    shapes = {s: table[s] for s in names}
    device, dtype = run_device(args)
    if args.quick:
        args.new_tokens, args.warmup, args.prompt, args.prefill, args.offload_tokens = 6, 2, 4, 32, 4
        args.ppl_tokens, args.cpu_threads, args.sweep = 512, args.threads or 1, "4,8"
    torch.set_num_threads(args.cpu_threads)
    rates = {"dram": measure_dram_read_bandwidth(256 << 20 if args.quick else 1 << 30)["bytes_per_s"],
             "hbm": measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]}
    bandwidth = measure_h2d_bandwidth(device) if device.type == "cuda" else None
    rates["h2d"] = bandwidth
    results = {}
    for name, (shape, budget, routing) in shapes.items():
        spec = model_spec(shape)
        args.routing = routing
        store = random_store(spec, min(args.distinct_layers, len(spec.moe.layer_indices())), device, dtype, BITS,
                             32 if args.quick else GROUP)
        resident = dense_bytes(spec, dtype.itemsize, args.dense_bits)
        kv = kv_cache_bytes(spec, 1, args.prefill + args.new_tokens + args.warmup + args.prompt, dtype.itemsize)
        budget = budget or quick_budget(resident, kv, store.expert_bytes(True))
        room = int(budget * (1 - WORKSPACE_SHARE)) - resident - kv
        rows, host = [], HostExperts(store, dtype)  # the CPU's view of the store, shared by the columns
        for column in args.columns.split(","):
            if column == "hobbit-offload":
                rows.append(offload_column(spec, store, device, dtype, budget, args, bandwidth))
            else:
                rows.append(hybrid_column(column, spec, store, host, device, dtype, room, args, rates, resident))
            print(f"{name} {column}: {rows[-1]['tg_tokens_per_s']:.2f} tok/s", flush=True)
        print_table(name, rows, args.prefill)
        results[name] = {"shape": shape, "budget_bytes": budget, "dense_bytes": resident, "kv_bytes": kv,
                         "expert_bytes_4bit": store.expert_bytes(True), "rows": rows}
        del store, host
        gc.collect()
    ppl = mixed_precision_cost(DEMO_DIR, list((DEMO_DIR / "heldout.txt").read_bytes()[:args.ppl_tokens]), BITS)
    print(f"\nmixed precision on the demo (4-bit experts on the CPU): perplexity {ppl['4bit']:.3f} -> "
          f"{ppl['4bit+mixed']:.3f} ({ppl['mixed_ppl_cost']:+.2%}), {ppl['4bit+mixed_skipped_share']:.1%} skipped")
    record = result_record("hybrid", {"quick": args.quick, "bits": BITS, "group": GROUP, "prompt": args.prompt,
                                      "new_tokens": args.new_tokens, "prefill": args.prefill, "warmup": args.warmup,
                                      "offload_tokens": args.offload_tokens, "cpu_threads": args.cpu_threads,
                                      "distinct_layers": args.distinct_layers, "dtype": str(dtype),
                                      "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                                      "cuda_graph": not args.no_cuda_graph, "dense_bits": args.dense_bits,
                                      "n_cpu_moe": args.n_cpu_moe}, device)
    record.update({"rates": {"dram_read_bytes_per_s": rates["dram"], "hbm_bytes_per_s": rates["hbm"],
                             "h2d_bytes_per_s": bandwidth}, "shapes": results, "demo_mixed_precision": ppl})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
