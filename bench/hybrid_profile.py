"""Where a hybrid decode step spends its host time, per layer: attention, router, the routing's trip to the host,
the CPU experts' wait, the cached experts' pass, the cache's bookkeeping; beside the same model with every expert
resident on the GPU (eager and as one CUDA graph), so the host overhead of the hybrid path is visible on its own.

    python bench/hybrid_profile.py --shape qwen3 --layers 8        # GPU; a table per column, JSON to bench/results/
    python bench/hybrid_profile.py --quick                          # tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moeserve --cpu-moe` runs; before torch loads OpenMP
import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, run_device, sync, write_result  # noqa: E402
from hybrid import BITS, GROUP, QUICK, SHAPES  # noqa: E402
from offload import dense_model, model_spec, random_store  # noqa: E402

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.hybrid import experts as hybrid_experts  # noqa: E402
from moeserve.offload.slot_cache import SlotCache  # noqa: E402
from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.kernels.cpu.machine import physical_cores  # noqa: E402
from moeserve.model.layers import Attention  # noqa: E402
from moeserve.model.mla import MLAttention  # noqa: E402
from moeserve.offload.host_compute import HostExperts  # noqa: E402
from moeserve.offload.slot_compute import SlotExperts  # noqa: E402

COLUMNS = ("resident", "cpu", "cache")


class Stages:
    """Host seconds per named stage, summed while `on`."""

    def __init__(self):
        self.seconds, self.calls, self.on = defaultdict(float), defaultdict(int), False

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        setattr(owner, name, timed)
        return fn


def instrument(stages: Stages) -> list:
    """Patch the stage functions (returns what to restore)."""
    targets = [(Attention, "forward", "attention"), (MLAttention, "forward", "attention"),
               (hybrid_experts, "routing_to_host", "routing_to_host"),
               (hybrid_experts.HybridExperts, "forward", "hybrid_experts(all)"),
               (SlotExperts, "compute", "cached_pass"), (SlotCache, "account", "cache_account"),
               (SlotCache, "where", "cache_where"), (HostExperts, "run_layer", "cpu_run_layer(worker)")]
    return [(owner, name, stages.wrap(owner, name, label)) for owner, name, label in targets]


def placement(column: str, spec, threads: int, slots: int) -> HybridPlacement:
    layers = spec.moe.layer_indices()
    if column == "resident":
        return HybridPlacement.choose(layers, n_cpu_moe=0, threads=threads, bits=BITS)
    if column == "cpu":
        return HybridPlacement.choose(layers, cpu_moe=True, threads=threads, bits=BITS)
    return HybridPlacement.choose(layers, cpu_moe=True, cache_slots=slots, threads=threads, bits=BITS,
                                  num_experts=spec.moe.num_experts)


def decode_seconds(model, spec, steps: int, warmup: int, cuda_graph: bool, device, stages: Stages | None) -> float:
    prompt = torch.randint(0, spec.vocab_size, (8,)).tolist()
    params = SamplingParams(max_new_tokens=steps + warmup, temperature=0.0, ignore_eos=True)
    marks = []
    for i, _ in enumerate(iterate(model, [prompt], params, cuda_graph=cuda_graph)):
        sync(device)
        marks.append(time.perf_counter())
        if stages is not None:
            stages.on = i >= warmup
    return (marks[-1] - marks[warmup]) / (len(marks) - 1 - warmup)


def cprofile_table(model, spec, device, steps: int, warmup: int) -> str:
    """cProfile of the host's Python over `steps` decode steps as CUDA graphs (after `warmup`): where the time
    between the GPU's segments and the CPU experts goes, by function (own time, then cumulative)."""
    import cProfile
    import io
    import pstats

    prompt = torch.randint(0, spec.vocab_size, (8,)).tolist()
    params = SamplingParams(max_new_tokens=steps + warmup, temperature=0.0, ignore_eos=True)
    prof = cProfile.Profile()
    for i, _ in enumerate(iterate(model, [prompt], params, cuda_graph=True)):
        sync(device)
        if i == warmup:
            prof.enable()
    prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def profile_table(model, spec, device, steps: int) -> str:
    """torch.profiler's top host ops of a few eager decode steps."""
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(0, spec.vocab_size, (8,)).tolist()
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in iterate(model, [prompt], params, cuda_graph=False):
            sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if device.type == "cuda":
        table += prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    return table


def cpu_micro(spec, host: HostExperts, layer: int, reps: int = 30) -> dict:
    """One token's CPU experts of MoE layer `layer` (top-k distinct random experts): run_layer whole, and its two
    batched native calls alone, medians in ms, beside the DRAM time of the bytes they read at --dram-gbs."""
    from moeserve.kernels.cpu.gemv import quantized_linear_batch
    from moeserve.offload.host_compute import CpuPairs

    k, D = spec.moe.top_k, spec.hidden_size
    x = torch.randn(1, D, dtype=torch.bfloat16)
    times = defaultdict(list)
    for r in range(reps + 3):
        ids = torch.randperm(spec.moe.num_experts)[:k].reshape(1, k)
        pairs = CpuPairs(ids, torch.rand(1, k), None, True)
        t = time.perf_counter()
        host.run_layer(layer, x, pairs)
        t1 = time.perf_counter()
        mods = [host.low(layer, int(e)) for e in ids[0]]
        xs = x.float().expand(k, D).contiguous()
        t2 = time.perf_counter()
        h = quantized_linear_batch([g for g, _ in mods], xs, [1] * k)
        t3 = time.perf_counter()
        quantized_linear_batch([d for _, d in mods], h[:, :spec.moe.expert_ffn].contiguous(), [1] * k)
        t4 = time.perf_counter()
        if r >= 3:
            times["run_layer"].append(t1 - t)
            times["gate_up_call"].append(t3 - t2)
            times["down_call"].append(t4 - t3)
    out = {name: 1e3 * sorted(v)[len(v) // 2] for name, v in times.items()}
    out["bytes"] = k * host.store.expert_bytes(True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--slots-share", type=float, default=0.5, help="cache slots as a share of all experts")
    ap.add_argument("--cpu-threads", type=int, default=len(physical_cores()))
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top host ops per column")
    ap.add_argument("--cpu-micro", action="store_true", help="also time one layer's CPU experts alone")
    ap.add_argument("--cprofile", action="store_true", help="also print a cProfile of graph decode steps per column")
    ap.add_argument("--no-cudnn-attention", action="store_true", help="SDPA without its cuDNN backend")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    shape = dict(QUICK["quick"][0] if args.quick else SHAPES[args.shape][0])
    shape["num_layers"] = args.layers if not args.quick else shape["num_layers"]
    if args.quick:
        args.steps, args.warmup, args.cpu_threads = 4, 1, args.threads or 1
    torch.set_num_threads(args.cpu_threads)
    spec = model_spec(shape)
    store = random_store(spec, min(4, len(spec.moe.layer_indices())), device, dtype, BITS,
                         32 if args.quick else GROUP)
    host = HostExperts(store, dtype)
    slots = int(args.slots_share * len(spec.moe.layer_indices()) * spec.moe.num_experts)
    rows = {}
    if args.cpu_micro:
        first = spec.moe.layer_indices()[0]
        host.warm([first], True)
        rows["cpu_micro"] = micro = cpu_micro(spec, host, first)
        print("cpu micro (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in micro.items() if k != "bytes")
              + f"; {micro['bytes'] / 1e6:.1f} MB read")
    for column in [c for c in args.columns.split(",") if c]:
        model = dense_model(spec, device, dtype)
        runtime = enable_hybrid(model, store, placement(column, spec, args.cpu_threads, slots), host=host, warm=True)
        row = {}
        if device.type == "cuda":  # one graph (resident) or graphs between the CPU layers (SegmentedDecoder)
            row["graph_step_ms"] = 1e3 * decode_seconds(model, spec, args.steps, args.warmup, True, device, None)
        stages = Stages()
        restore = instrument(stages)
        try:
            row["eager_step_ms"] = 1e3 * decode_seconds(model, spec, args.steps, args.warmup, False, device, stages)
        finally:
            for owner, name, fn in restore:
                setattr(owner, name, fn)
        per_step = {k: 1e3 * v / args.steps for k, v in stages.seconds.items()}
        row["stages_ms_per_step"] = per_step
        row["per_layer_ms"] = row["eager_step_ms"] / spec.num_layers
        row["summary"] = runtime.summary()
        print(f"\n{column}: eager step {row['eager_step_ms']:.2f} ms ({row['per_layer_ms']:.3f} ms/layer)"
              + (f", graph step {row['graph_step_ms']:.2f} ms" if "graph_step_ms" in row else ""))
        for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v:8.3f} ms/step {v / spec.num_layers:7.3f} ms/layer")
        if args.profile:
            print(profile_table(model, spec, device, 6))
        if args.cprofile:
            print(cprofile_table(model, spec, device, args.steps, args.warmup))
        rows[column] = row
        runtime.close()
        del model, runtime
        gc.collect()
    record = result_record("hybrid_profile", {"shape": args.shape, "layers": spec.num_layers, "steps": args.steps,
                                              "cpu_threads": args.cpu_threads, "slots": slots, "quick": args.quick,
                                              "omp_wait_policy": os.environ["OMP_WAIT_POLICY"]},
                           device)
    record["columns"] = rows
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
