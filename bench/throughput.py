"""Batch throughput (MoE-Lightning): a Mixtral-8x7B-shaped model (32 layers, D 4096, F 14336, 8 experts top-2,
bf16, random weights) whose layer weights live in pinned host memory, under GPU memory budgets, per schedule
of the same executor (moeserve/plan/pipeline.py) and kernels:

  cgopipe   CPU attention over a host KV cache, micro-batches overlapping CPU attention with GPU work
  zero      DeepSpeed ZeRO-Inference style: one micro-batch, KV cache on the GPU, weights streamed per layer
  flexgen   FlexGen style: GPU attention, KV cache in host memory swapped in per layer, micro-batches
  planned   the planner's policy (moeserve.plan.search) for this machine's cached hardware profile

Each schedule runs at its own best batch: the largest N (powers of two up to --max-batch, or the N given by
--batch SCHEDULE=N) that fits both memories, then the largest resident weight fraction that fits. GPU: as the
planner's memory model counts it (zero's KV cache lives there, so its N stays small). Host: the pinned
layer weights plus the KV caches and staging buffers the pipeline pins for the batch (host-KV schedules),
each pinned block rounded up to a power of two as torch's allocator does, within 80% of the RAM. Every N
that does not fit is printed and recorded with the memory that is short.
Timing (after an untimed warm-up run): setup (allocating and pinning the KV caches), prefill of N prompts of
--prompt tokens, then --steps decode steps of which the first is not timed; the KV cache is sized for --gen
tokens. Throughput = generated tokens/s = N / decode step time, and the end-to-end estimate
N * gen / (prefill + gen * step). The planner's predicted decode tokens/s (roofline over the cached hardware
profile) is reported beside each measured one, and per budget cgopipe's ratio to each baseline and to the
better one, every schedule at its own N.
Host memory: 32 distinct bf16 layers (~94 GB) pinned next to the KV cache would crowd a 128 GiB host, so
`--distinct-layers` layers of random weights are made and layer i reads layer i mod that (every streamed
layer is still copied over PCIe; only the values repeat).

    python bench/throughput.py                              # GPU: budgets 16/24 GiB, N <= 256, JSON to bench/results/
    python bench/throughput.py --budgets 16 --batch cgopipe=256 --schedules cgopipe,zero
    python bench/throughput.py --quick                      # tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, run_device, sync, write_result  # noqa: E402
from offload import MIXTRAL, QUICK, STD, model_spec  # noqa: E402

from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.errors import MoeserveError  # noqa: E402
from moeserve.loader import set_tensor  # noqa: E402
from moeserve.model.layers import RotaryEmbedding  # noqa: E402
from moeserve.model.transformer import MoETransformer  # noqa: E402
from moeserve.plan.batch import HOST_SHARE, policy_for_budget  # noqa: E402
from moeserve.plan.hardware import load_or_measure, total_ram  # noqa: E402
from moeserve.plan.layer_weights import host_weight_bytes  # noqa: E402
from moeserve.plan.pipeline import SCHEDULES, Pipeline, host_kv_bytes  # noqa: E402
from moeserve.plan.policy import ThroughputPolicy  # noqa: E402
from moeserve.plan.roofline import Candidates, Rates, Workload, throughput  # noqa: E402
from moeserve.plan.search import memory, search  # noqa: E402
from moeserve.units import format_bytes  # noqa: E402

GiB = 1 << 30
MICRO_BATCHES = {"cgopipe": 4, "zero": 1, "flexgen": 4}  # micro-batches per batch, per schedule
BASELINES = ("zero", "flexgen")


def host_model(spec, distinct: int, dtype, cuda: bool) -> MoETransformer:
    """Random weights in (pinned) host memory; layer i shares the tensors of layer i mod `distinct`.
    Generated on the GPU when there is one (seconds instead of minutes for tens of GB of randn)."""
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
        set_tensor(model, name, tensors[key], False)
    model.rotary = RotaryEmbedding(spec)
    return model.eval()


def workload(args, dtype) -> Workload:
    return Workload(args.prompt, args.gen, weight_bytes=dtype.itemsize, kv_bytes=dtype.itemsize,
                    act_bytes=dtype.itemsize)


def fit_gpu(spec, policy: ThroughputPolicy, args, dtype, budget: int) -> tuple[ThroughputPolicy | None, str | None]:
    """(the policy with the largest resident weight fraction that fits the GPU budget, None), or (None, why it
    does not fit even with every layer streamed)."""
    try:
        return policy_for_budget(spec, policy, args.prompt, args.gen, dtype.itemsize, budget), None
    except MoeserveError:
        gpu, _ = memory(spec, workload(args, dtype), Candidates.of([policy]))
        parts = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in gpu.items()}
        terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v > 0)
        return None, f"GPU memory short: {format_bytes(sum(parts.values()))} ({terms}) > {format_bytes(budget)}"


def full_model_weight_bytes(model, pinned: bool) -> int:
    """Host bytes of the weights were every layer distinct (a real checkpoint): the bench shares the tensors of
    layers i and i mod --distinct-layers to fit this host, which streams the same bytes but holds fewer."""
    layers = model.model.layers
    return (host_weight_bytes(model, pinned) - host_weight_bytes(layers, pinned)
            + len(layers) * host_weight_bytes(layers[:1], pinned))


def host_shortage(spec, policy: ThroughputPolicy, args, dtype, host: dict) -> str | None:
    """Why the batch's pinned KV caches do not fit the host next to the pinned weights (None: they fit)."""
    kv = host_kv_bytes(spec, policy, args.prompt + args.gen, dtype.itemsize, host["pinned"])
    need = kv + host["weights"]
    if need <= host["budget"]:
        return None
    return (f"host memory short: KV caches + staging {format_bytes(kv)} + pinned weights "
            f"{format_bytes(host['weights'])} = {format_bytes(need)} > {format_bytes(host['budget'])} "
            f"({HOST_SHARE:.0%} of {format_bytes(host['ram'])} RAM)")


def fit_policy(spec, schedule: str, budget: int, args, dtype, host: dict) -> tuple[ThroughputPolicy, list[dict]]:
    """(the policy of this schedule at the largest N that fits both memories, the larger N tried and why each
    does not fit). --batch SCHEDULE=N tries that N only."""
    forced = args.batch.get(schedule)
    sizes = [forced] if forced else [1 << e for e in range(args.max_batch.bit_length() - 1, -1, -1)]
    rejected = []
    for N in sizes:
        policy = ThroughputPolicy(N, max(N // MICRO_BATCHES[schedule], 1), weights_gpu_fraction=0.0,
                                  **SCHEDULES[schedule])
        fitted, why = fit_gpu(spec, policy, args, dtype, budget)
        why = why or host_shortage(spec, policy, args, dtype, host)
        if why is None:
            return fitted, rejected
        print(f"{budget / GiB:5.1f} GiB {schedule:8s} N={N:4d} does not fit: {why}", flush=True)
        rejected.append({"batch_size": N, "reason": why})
    raise MoeserveError(f"{schedule} does not fit {budget / GiB:.0f} GiB at N={sizes[-1]}: {rejected[-1]['reason']}")


def predicted(spec, policy: ThroughputPolicy, args, dtype, hw) -> float | None:
    """The roofline model's decode tokens/s for this policy (None without the planner or a GPU profile)."""
    if hw is None:
        return None
    figures = throughput(spec, workload(args, dtype), Candidates.of([policy]), Rates.of(hw))
    return float(figures["decode_tokens_per_s"][0])


def pinned_bytes_now() -> int | None:
    """Bytes torch's page-locked allocator holds now (None where this torch does not tell)."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    return stats().get("allocated_bytes.current") if stats is not None else None


def release_pinned_cache() -> None:
    """Return the page-locked blocks of finished runs to the OS where this torch can (so the next run's host
    check holds); otherwise torch keeps them cached for reuse."""
    release = getattr(torch.accelerator, "empty_host_cache", None)
    if release is not None:
        release()


def run(model, policy: ThroughputPolicy, device, args, steps: int | None = None) -> dict:
    """Set up and prefill N random prompts, decode `steps` (default args.steps) steps; time the setup, the
    prefill and the steps after the first."""
    steps = args.steps if steps is None else steps
    pipeline = Pipeline(model, policy, device)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.spec.vocab_size, (policy.batch_size, args.prompt), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.gen, temperature=0.0, ignore_eos=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    batch = pipeline.generate(prompts, params)  # allocates the KV caches
    pinned = pinned_bytes_now() if cuda else None
    marks = [time.perf_counter()]
    for step, _ in enumerate(batch):
        sync(device)
        marks.append(time.perf_counter())
        if step == steps:
            break
    batch.close()
    pipeline.close()
    prefill, step_s = marks[1] - marks[0], (marks[-1] - marks[2]) / (len(marks) - 3)
    row = {"batch_size": policy.batch_size, "policy": policy.as_dict(), "setup_s": marks[0] - t0,
           "prefill_s": prefill, "step_s": step_s, "decode_tokens_per_s": policy.batch_size / step_s,
           "tokens_per_s": policy.batch_size * args.gen / (prefill + args.gen * step_s),
           "bytes_streamed_per_step": pipeline.weights.bytes_streamed / (len(marks) - 1),
           "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "pinned_host_bytes": pinned}
    del pipeline, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        release_pinned_cache()
    return row


def ratios(rows: list[dict], budgets: list) -> list[dict]:
    """Per budget: cgopipe's decode tokens/s over each baseline's and over the better one, each at its own N."""
    out = []
    for budget in budgets:
        by = {r["schedule"]: r for r in rows if "schedule" in r and r["budget_bytes"] == budget}
        if "cgopipe" not in by:
            continue
        ours = by["cgopipe"]["decode_tokens_per_s"]
        bases = [b for b in BASELINES if b in by]
        for base in bases:
            predicted = [by[s].get("predicted_decode_tokens_per_s") for s in ("cgopipe", base)]
            out.append({"budget_bytes": budget, "ratio": f"cgopipe_over_{base}",
                        "value": ours / by[base]["decode_tokens_per_s"],
                        # the model's ratio: at equal N vs flexgen, (streamed weights + swapped KV) / weights
                        "predicted": predicted[0] / predicted[1] if all(predicted) else None,
                        "batch_sizes": {"cgopipe": by["cgopipe"]["batch_size"], base: by[base]["batch_size"]}})
        if bases:
            best = max(bases, key=lambda b: by[b]["decode_tokens_per_s"])
            out.append({"budget_bytes": budget, "ratio": "cgopipe_over_best_baseline", "baseline": best,
                        "value": ours / by[best]["decode_tokens_per_s"]})
    return out


def parse_batches(text: str) -> dict[str, int]:
    """'cgopipe=256,flexgen=128' -> {'cgopipe': 256, 'flexgen': 128}."""
    pairs = [item.split("=") for item in text.split(",") if item]
    if any(len(p) != 2 or p[0] not in SCHEDULES or not p[1].isdigit() or int(p[1]) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--batch takes SCHEDULE=N[,...] with a schedule of {sorted(SCHEDULES)}")
    return {name: int(n) for name, n in pairs}


def schedule_policy(spec, schedule: str, budget, args, dtype, host: dict, hw) -> tuple[ThroughputPolicy, list[dict]]:
    """(this schedule's policy under the budget, the larger batches tried and why they do not fit); raises
    MoeserveError when nothing fits."""
    if args.quick:  # no GPU budget: half the layers resident, 2 micro-batches
        return ThroughputPolicy(4, 4 // MICRO_BATCHES[schedule] if schedule != "planned" else 2,
                                weights_gpu_fraction=0.5, **SCHEDULES.get(schedule, SCHEDULES["cgopipe"])), []
    if schedule == "planned":
        policy = search(spec, hw, workload(args, dtype), budget, HOST_SHARE * hw.ram_bytes,
                        max_batch=args.max_batch, host_weights=host["weights"]).policy
        why = host_shortage(spec, policy, args, dtype, host)
        if why:
            raise MoeserveError(f"the planner's N={policy.batch_size} does not fit: {why}")
        return policy, []
    return fit_policy(spec, schedule, budget, args, dtype, host)


def measured_row(model, spec, schedule: str, budget, policy: ThroughputPolicy, rejected: list[dict], args, dtype,
                 host: dict, hw, device) -> dict:
    """Run the policy; its result row (timings, host memory, the larger N rejected, the prediction), printed."""
    source = "hand (--quick)" if args.quick else "planner" if schedule == "planned" else "fitted to budget"
    row = dict(schedule=schedule, budget_bytes=budget, policy_from=source, **run(model, policy, device, args))
    kv = host_kv_bytes(spec, policy, args.prompt + args.gen, dtype.itemsize, host["pinned"])
    row["host_bytes_needed"] = host["weights"] + kv
    row["host_bytes_full_model"] = host["weights_full_model"] + kv  # what a real checkpoint would pin
    row["fits_host_with_full_model"] = row["host_bytes_full_model"] <= host["budget"]
    row["larger_batches_rejected"] = rejected
    row["predicted_decode_tokens_per_s"] = predicted(spec, policy, args, dtype, hw)
    if row["predicted_decode_tokens_per_s"]:
        row["measured_over_predicted"] = row["decode_tokens_per_s"] / row["predicted_decode_tokens_per_s"]
    p = policy
    print(f"{(budget or 0) / GiB:5.1f} GiB {schedule:8s} N={p.batch_size:4d} n={p.micro_batch:4d} "
          f"w={p.weights_gpu_fraction:.2f} kv={p.kv_gpu_fraction:.2f}  {row['decode_tokens_per_s']:8.1f} "
          f"decode tok/s  {row['tokens_per_s']:8.1f} tok/s end-to-end  setup {row['setup_s']:.1f} s  "
          f"prefill {row['prefill_s']:.1f} s  predicted {row['predicted_decode_tokens_per_s'] or 0:8.1f}"
          + ("" if row["fits_host_with_full_model"] else
             f"  (a real checkpoint would need {format_bytes(row['host_bytes_full_model'])} of host memory)"),
          flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    ap.add_argument("--budgets", default="16,24", help="GPU memory budgets in GiB (comma separated)")
    ap.add_argument("--schedules", default="cgopipe,zero,flexgen,planned", help="schedules to run (comma separated)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens the KV cache and the estimate are sized for")
    ap.add_argument("--steps", type=int, default=3, help="decode steps run (the first is not timed)")
    ap.add_argument("--max-batch", type=int, default=256, help="largest batch N tried (and the planner's cap)")
    ap.add_argument("--batch", type=parse_batches, default={},
                    help="SCHEDULE=N[,...]: run that schedule at batch N only (reported as not run if it does not fit)")
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random weights in host memory")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    cuda = device.type == "cuda"
    if args.quick:
        args.prompt, args.gen, args.steps = 16, 8, 3
    spec = model_spec(QUICK if args.quick else MIXTRAL)
    hw = load_or_measure() if cuda else None
    model = host_model(spec, min(args.distinct_layers, spec.num_layers), dtype, cuda)
    ram = total_ram()
    host = {"ram": ram, "budget": HOST_SHARE * ram, "weights": host_weight_bytes(model, cuda), "pinned": cuda,
            "weights_full_model": full_model_weight_bytes(model, cuda)}
    if cuda:  # CUDA context, cuBLAS and Triton kernels, the first pinned blocks: not in any timed run
        run(model, ThroughputPolicy(8, 4, weights_gpu_fraction=0.0, **SCHEDULES["cgopipe"]), device, args, steps=2)
    rows = []
    budgets = [None] if args.quick else [int(float(b) * GiB) for b in args.budgets.split(",")]
    for budget in budgets:
        for schedule in args.schedules.split(","):
            try:
                policy, rejected = schedule_policy(spec, schedule, budget, args, dtype, host, hw)
            except MoeserveError as e:
                print(f"{budget / GiB:5.1f} GiB {schedule:8s} not run: {e}", flush=True)
                rows.append({"budget_bytes": budget, "not_run": schedule, "reason": str(e)})
                continue
            rows.append(measured_row(model, spec, schedule, budget, policy, rejected, args, dtype, host, hw, device))
    for r in ratios(rows, budgets):
        by_model = f" (model: {r['predicted']:.2f})" if r.get("predicted") else ""
        print(f"{(r['budget_bytes'] or 0) / GiB:5.1f} GiB {r['ratio']}: {r['value']:.2f}{by_model}", flush=True)
        rows.append(r)
    record = result_record("throughput", {"shape": QUICK if args.quick else MIXTRAL, "quick": args.quick,
                                          "prompt": args.prompt, "gen": args.gen, "steps": args.steps,
                                          "timed_steps": args.steps - 1, "max_batch": args.max_batch,
                                          "batch": args.batch, "distinct_layers": args.distinct_layers,
                                          "dtype": str(dtype), "host": host}, device)
    record.update({"hardware": hw.as_dict() if hw is not None else None, "results": rows})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
