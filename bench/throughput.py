"""Batch throughput (MoE-Lightning): a Mixtral-8x7B-shaped model (32 layers, D 4096, F 14336, 8 experts top-2,
bf16, random weights) whose layer weights live in pinned host memory, under GPU memory budgets, per schedule
of the same executor (moeserve/plan/pipeline.py) and kernels:

  cgopipe   CPU attention over a host KV cache, micro-batches overlapping CPU attention with GPU work
  zero      DeepSpeed ZeRO-Inference style: one micro-batch, KV cache on the GPU, weights streamed per layer
  flexgen   FlexGen style: GPU attention, KV cache in host memory swapped in per layer, micro-batches
  planned   the planner's policy (moeserve.plan.search), when the planner is importable

Each schedule gets the largest batch N (powers of two up to --max-batch) whose GPU memory, as the planner's
memory model counts it, fits the budget, and the largest resident weight fraction that then fits.
Timing: prefill of N prompts of --prompt tokens, then --steps decode steps of which the first is not timed;
the KV cache is sized for --gen tokens. Throughput = generated tokens/s = N / decode step time, and the
end-to-end estimate N * gen / (prefill + gen * step). The planner's predicted decode tokens/s (roofline over
the cached hardware profile) is reported beside each measured one.
Host memory: 32 distinct bf16 layers (45 GiB) pinned next to the KV cache would crowd a 128 GiB host, so
`--distinct-layers` layers of random weights are made and layer i reads layer i mod that (every streamed
layer is still copied over PCIe; only the values repeat).

    python bench/throughput.py            # GPU: budgets 16/24 GiB, JSON to bench/results/
    python bench/throughput.py --quick    # tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, run_device, sync, write_result  # noqa: E402
from offload import MIXTRAL, QUICK, STD, model_spec  # noqa: E402

from moeserve.engine.sampling import SamplingParams  # noqa: E402
from moeserve.errors import MoeserveError  # noqa: E402
from moeserve.loader import _set_tensor  # noqa: E402
from moeserve.model.layers import RotaryEmbedding  # noqa: E402
from moeserve.model.transformer import MoETransformer  # noqa: E402
from moeserve.plan.batch import policy_for_budget  # noqa: E402
from moeserve.plan.pipeline import SCHEDULES, Pipeline  # noqa: E402
from moeserve.plan.policy import Policy  # noqa: E402

GiB = 1 << 30
MICRO_BATCHES = {"cgopipe": 4, "zero": 1, "flexgen": 4}  # micro-batches per batch, per schedule


def host_model(spec, distinct: int, dtype, cuda: bool) -> MoETransformer:
    """Random weights in (pinned) host memory; layer i shares the tensors of layer i mod `distinct`.
    Generated on the GPU when there is one (seconds instead of minutes for 45 GiB of randn)."""
    with torch.device("meta"):
        model = MoETransformer(spec)
    gen_device = "cuda" if cuda else "cpu"
    g = torch.Generator(gen_device).manual_seed(0)
    tensors = {}
    for name, p in list(model.named_parameters()):
        parts = name.split(".")
        key = ".".join(parts[:2] + [str(int(parts[2]) % distinct)] + parts[3:]) if parts[1] == "layers" else name
        if key not in tensors:
            t = (torch.ones(p.shape, dtype=dtype) if "norm" in name
                 else (torch.randn(p.shape, device=gen_device, dtype=dtype, generator=g) * STD).cpu())
            tensors[key] = t.pin_memory() if cuda else t
        _set_tensor(model, name, tensors[key], False)
    model.rotary = RotaryEmbedding(spec)
    return model.eval()


def fit_policy(spec, schedule: str, budget: int, args, dtype) -> Policy:
    """The largest N (then resident fraction) of this schedule that fits `budget` in the planner's memory model."""
    N = args.max_batch
    while N >= 1:
        n = max(N // MICRO_BATCHES[schedule], 1)
        try:
            return policy_for_budget(spec, Policy(N, n, weights_gpu_fraction=0.0, **SCHEDULES[schedule]), args.prompt,
                                     args.gen, dtype.itemsize, budget)
        except MoeserveError:
            N //= 2
    raise MoeserveError(f"{schedule} does not fit {budget / GiB:.0f} GiB even at batch 1")


def predicted(spec, policy: Policy, args, dtype, hw) -> float | None:
    """The roofline model's decode tokens/s for this policy (None without the planner or a GPU profile)."""
    if hw is None:
        return None
    from moeserve.plan.roofline import Candidates, Rates, Workload, throughput

    wl = Workload(args.prompt, args.gen, weight_bytes=dtype.itemsize, kv_bytes=dtype.itemsize,
                  act_bytes=dtype.itemsize)
    return float(throughput(spec, wl, Candidates.of([policy]), Rates.of(hw))["decode_tokens_per_s"][0])


def run(model, policy: Policy, device, args) -> dict:
    """Prefill N random prompts, decode args.steps steps; time the prefill and the steps after the first."""
    pipeline = Pipeline(model, policy, device)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.spec.vocab_size, (policy.batch_size, args.prompt), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.gen, temperature=0.0, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks = [time.perf_counter()]
    for step, _ in enumerate(pipeline.generate(prompts, params)):
        sync(device)
        marks.append(time.perf_counter())
        if step == args.steps:
            break
    pipeline.close()
    prefill, step_s = marks[1] - marks[0], (marks[-1] - marks[2]) / (len(marks) - 3)
    row = {"policy": policy.as_dict(), "prefill_s": prefill, "step_s": step_s,
           "decode_tokens_per_s": policy.batch_size / step_s,
           "tokens_per_s": policy.batch_size * args.gen / (prefill + args.gen * step_s),
           "bytes_streamed_per_step": pipeline.weights.bytes_streamed / (len(marks) - 1),
           "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    del pipeline
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    ap.add_argument("--budgets", default="16,24", help="GPU memory budgets in GiB (comma separated)")
    ap.add_argument("--schedules", default="cgopipe,zero,flexgen,planned", help="schedules to run (comma separated)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens the KV cache and the estimate are sized for")
    ap.add_argument("--steps", type=int, default=3, help="decode steps run (the first is not timed)")
    ap.add_argument("--max-batch", type=int, default=128, help="largest batch N tried")
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random weights in host memory")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    cuda = device.type == "cuda"
    if args.quick:
        args.prompt, args.gen, args.steps = 16, 8, 3
    spec = model_spec(QUICK if args.quick else MIXTRAL)
    try:
        from moeserve.plan.hardware import load_or_measure
        from moeserve.plan.search import search

        hw = load_or_measure() if cuda else None
    except ImportError:  # the planner is not there yet
        hw = search = None
    model = host_model(spec, min(args.distinct_layers, spec.num_layers), dtype, cuda)
    rows = []
    budgets = [None] if args.quick else [int(float(b) * GiB) for b in args.budgets.split(",")]
    for budget in budgets:
        for schedule in args.schedules.split(","):
            if args.quick:  # no GPU budget: half the layers resident, 2 micro-batches
                policy = Policy(4, 4 // MICRO_BATCHES[schedule] if schedule != "planned" else 2,
                                weights_gpu_fraction=0.5, **SCHEDULES.get(schedule, SCHEDULES["cgopipe"]))
            elif schedule == "planned":
                if search is None or hw is None:
                    continue
                from moeserve.plan.roofline import Workload

                wl = Workload(args.prompt, args.gen, weight_bytes=2.0, kv_bytes=2.0, act_bytes=2.0)
                policy = search(spec, hw, wl, budget, 0.8 * hw.ram_bytes, max_batch=args.max_batch).policy
            else:
                policy = fit_policy(spec, schedule, budget, args, dtype)
            source = "hand (--quick)" if args.quick else "planner" if schedule == "planned" else "fitted to budget"
            row = dict(schedule=schedule, budget_bytes=budget, policy_from=source, **run(model, policy, device, args))
            row["predicted_decode_tokens_per_s"] = predicted(spec, policy, args, dtype, hw)
            if row["predicted_decode_tokens_per_s"]:
                row["measured_over_predicted"] = row["decode_tokens_per_s"] / row["predicted_decode_tokens_per_s"]
            rows.append(row)
            p = policy
            print(f"{(budget or 0) / GiB:5.1f} GiB {schedule:8s} N={p.batch_size:4d} n={p.micro_batch:4d} "
                  f"w={p.weights_gpu_fraction:.2f} kv={p.kv_gpu_fraction:.2f}  {row['decode_tokens_per_s']:8.1f} "
                  f"decode tok/s  {row['tokens_per_s']:8.1f} tok/s end-to-end  prefill {row['prefill_s']:.1f} s  "
                  f"predicted {row['predicted_decode_tokens_per_s'] or 0:8.1f}", flush=True)
    for budget in budgets:
        by = {r["schedule"]: r["decode_tokens_per_s"] for r in rows if r["budget_bytes"] == budget}
        for base in ("zero", "flexgen"):
            if "cgopipe" in by and base in by:
                rows.append({"budget_bytes": budget, "ratio": f"cgopipe_over_{base}",
                             "value": by["cgopipe"] / by[base]})
    record = result_record("throughput", {"shape": QUICK if args.quick else MIXTRAL, "quick": args.quick,
                                          "prompt": args.prompt, "gen": args.gen, "steps": args.steps,
                                          "timed_steps": args.steps - 1, "max_batch": args.max_batch,
                                          "distinct_layers": args.distinct_layers, "dtype": str(dtype)}, device)
    record.update({"hardware": hw.as_dict() if hw is not None else None, "results": rows})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
