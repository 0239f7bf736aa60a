"""`moeserve plan`: rate the placements of a model for --gpu-memory (decode), or choose `moeserve batch`'s policy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moeserve.cli.common import json_ready, print_table
from moeserve.cli.options import DEFAULT_PLAN_PROMPT
from moeserve.errors import MoeserveError
from moeserve.plan.disk import store_read_bandwidth
from moeserve.plan.hardware import HardwareProfile, load_or_measure
from moeserve.plan.placement import PlanRequest, check_dense_budget, rate_placements
from moeserve.plan.roofline import Workload, operator_table, plot_roofline, turning_points
from moeserve.plan.search import search
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes, parse_bytes

def _budget(text: str | None, flag: str, default: float | None, what: str) -> float:
    if text is None:
        if not default:
            raise MoeserveError(f"the hardware profile does not give the {what}; pass {flag} SIZE")
        return 0.9 * default
    size = parse_bytes(text)
    if size is None:
        raise MoeserveError(f"{flag} {text!r} is not a size like 16GiB")
    return size


def _workload_lengths(prompt_len: int | None, gen_len: int, context: int) -> tuple[int, int]:
    """(prompt, generated) tokens of the planned workload, which the model must be able to run: both positive,
    together within its context. No --prompt-len: 512, or what the context leaves after gen_len."""
    if gen_len < 1 or (prompt_len is not None and prompt_len < 1):
        raise MoeserveError("--prompt-len and --gen-len must be positive")
    if prompt_len is None:
        if gen_len >= context:
            raise MoeserveError(f"--gen-len {gen_len} leaves no room for a prompt in the model's context of "
                                f"{context} tokens")
        return min(DEFAULT_PLAN_PROMPT, context - gen_len), gen_len
    if prompt_len + gen_len > context:
        raise MoeserveError(f"--prompt-len {prompt_len} + --gen-len {gen_len} = {prompt_len + gen_len} tokens exceed "
                            f"the model's context of {context} tokens")
    return prompt_len, gen_len


def run(args) -> int:
    if args.plan_for == "decode":
        return _plan_decode(args)
    for flag, value in (("--experts-bits", args.experts_bits), ("--dense-bits", args.dense_bits),
                        ("--offload", args.offload), ("--disk-bandwidth", args.disk_bandwidth)):
        if value is not None:
            raise MoeserveError(f"{flag} rates placements: give it with --for decode")
    return _plan_batch(args)


def _disk_bandwidth(args) -> tuple[float | None, str]:
    """(the disk tier's read bytes per second, where the figure comes from): --disk-bandwidth, else measured on
    --offload STORE's device (cached); (None, "") with neither."""
    if args.disk_bandwidth is not None:
        rate = parse_bytes(args.disk_bandwidth)
        if not rate:
            raise MoeserveError(f"--disk-bandwidth {args.disk_bandwidth!r} is not a size per second like 3GB")
        return float(rate), "--disk-bandwidth"
    if args.offload is not None:
        if not Path(args.offload).is_dir():
            raise MoeserveError(f"--offload {args.offload}: no such expert store directory")
        return store_read_bandwidth(args.offload), f"measured on {args.offload}'s device"
    return None, ""


def _plan_decode(args) -> int:
    """`moeserve plan --for decode`: every placement in the budget, rated (plan/placement.py), as a table or JSON."""
    for flag, value in (("--max-batch", args.max_batch), ("--plot", args.plot)):
        if value is not None:
            raise MoeserveError(f"{flag} belongs to the throughput plan: give it with --for batch")
    spec = ModelSpec.from_dir(args.model)
    prompt_len, gen_len = _workload_lengths(args.prompt_len, args.gen_len, spec.max_position_embeddings)
    hw = HardwareProfile.load(args.profile) if args.profile else load_or_measure()
    gpu = _budget(args.gpu_memory, "--gpu-memory", hw.gpu_memory_bytes, "GPU memory") if hw.has_gpu else None
    host = _budget(args.cpu_memory, "--cpu-memory", hw.ram_bytes, "host memory")
    dtype_bytes = 2 if gpu is not None else 4  # bf16 on a GPU, fp32 on a CPU (the commands' auto dtype)
    disk, disk_source = _disk_bandwidth(args)
    req = PlanRequest(None if gpu is None else int(gpu), int(host), dtype_bytes,
                      "bfloat16" if dtype_bytes == 2 else "float32", 1, prompt_len + gen_len, prompt_len, gen_len,
                      bits=args.experts_bits, dense_bits=args.dense_bits, disk_bandwidth=disk)
    check_dense_budget(spec, req, req.least_dense_bits)
    plan = rate_placements(spec, hw, req)
    cands, chosen = plan.candidates, plan.chosen
    if args.json:
        print(json.dumps(json_ready({
            "model": args.model, "device": hw.gpu_name or hw.cpu_name, "gpu_budget": req.budget, "host_budget": req.host_ram,
            "prompt_len": prompt_len, "gen_len": gen_len, "candidates": [c.as_dict() for c in cands],
            "chosen": None if chosen is None else cands.index(chosen), "dense_reason": plan.dense_reason,
            "disk_bandwidth": disk, "disk_bandwidth_source": disk_source or None}), indent=2,
            allow_nan=False))
        return 0
    budgets = (f"GPU budget {format_bytes(req.budget)}, " if req.budget is not None else "no GPU, ") + \
        f"host {format_bytes(host)}"
    print(f"{args.model} ({spec.family}, {spec.num_layers} layers, {spec.moe.num_experts} experts "
          f"top-{spec.moe.top_k}) on "
          f"{hw.gpu_name or 'no GPU'} + {hw.cpu_name}; {budgets}; batch 1, estimated from the hardware profile")
    header = ("", "where the experts live", "dense", "GPU", "host", f"tg{gen_len} t/s", f"pp{prompt_len} t/s", "fits")
    rows = [("*" if c is chosen else "", c.where(), c.dense_precision, format_bytes(c.gpu_bytes),
             format_bytes(c.host_bytes), f"{c.decode_tok_s:,.1f}", f"{c.prefill_tok_s:,.0f}",
             ("yes" if c.fits else f"no: {c.problem}") + (" (needs --offload STORE)" if c.kind == "offload" else "")
             + (f" (disk tier: {format_bytes(c.disk_bytes)} read a token)" if c.disk_cache else ""))
            for c in cands]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.rjust(w) if 3 <= i <= 6 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    if disk is not None:
        print(f"\ndisk tier: the store read at {format_bytes(disk)}/s ({disk_source}); where the CPU layers' experts "
              f"exceed the host budget they stay on disk, the budget's rest a RAM cache (hit rate cache / store), "
              f"and each token's misses add their bytes over that speed to tg (the rows that say so)")
    if chosen is None:
        print("\nno placement fits; give more --gpu-memory or --cpu-memory")
    else:
        runs = ("the disk tier's fastest placement: generate|eval ppl|serve|bench run it with the flags below"
                if chosen.disk_cache else "what generate|eval ppl|serve|bench --gpu-memory SIZE runs")
        print(f"\n*: {runs}"
              + (f" (dense part 8-bit, {plan.dense_reason})" if plan.dense_reason else "")
              + f"; by hand: {' '.join(chosen.flags()) or 'no placement flags'}")
        print_footprint(chosen.footprint)
    return 0


def print_footprint(need) -> None:
    """The chosen placement's bytes per device and part (plan/footprint.py), a row each."""
    rows = [(device, part, format_bytes(n)) for device, part, n in need.table()]
    width = max(len(part) for _, part, _ in rows)
    print("\nmemory of *:")
    for device, part, size in rows:
        print(f"  {device:<5} {part:<{width}}  {size:>10}")


def _plan_batch(args) -> int:
    spec = ModelSpec.from_dir(args.model)
    prompt_len, gen_len = _workload_lengths(args.prompt_len, args.gen_len, spec.max_position_embeddings)
    hw = HardwareProfile.load(args.profile) if args.profile else load_or_measure()
    gpu = _budget(args.gpu_memory, "--gpu-memory", hw.gpu_memory_bytes, "GPU memory")
    host = _budget(args.cpu_memory, "--cpu-memory", hw.ram_bytes, "host memory")
    max_batch = 4096 if args.max_batch is None else args.max_batch
    if max_batch < 1:
        raise MoeserveError("--max-batch must be positive")
    wl = Workload(prompt_len=prompt_len, gen_len=gen_len)
    plan = search(spec, hw, wl, gpu, host, max_batch=max_batch)
    rows = operator_table(spec, wl, hw, plan.policy)
    if args.plot:
        plot_roofline(rows, hw, args.plot, title=f"{Path(args.model).name}: N={plan.policy.batch_size}, "
                                                 f"n={plan.policy.micro_batch}, {plan.tokens_per_s:.0f} tokens/s")
    if args.json:
        report = {"policy": plan.policy.as_dict(), **{k: v for k, v in dataclasses.asdict(plan).items()
                                                      if k != "policy"},
                  "operators": rows, "turning_points": turning_points(hw), "device": hw.gpu_name}
        print(json.dumps(json_ready(report), indent=2, allow_nan=False))
        return 0
    p = plan.policy
    print_table([
        ("model", f"{args.model} ({spec.family}, {spec.num_layers} layers)"),
        ("hardware", f"{hw.gpu_name} + {hw.cpu_name}; budgets GPU {format_bytes(gpu)}, host {format_bytes(host)}"),
        ("policy", f"batch N={p.batch_size}, micro-batch n={p.micro_batch}, attention on "
                   f"{'GPU' if p.attention_on_gpu else 'CPU'}, FFN on {'GPU' if p.ffn_on_gpu else 'CPU'}, "
                   f"{p.weights_gpu_fraction:.0%} of weights and {p.kv_gpu_fraction:.0%} of KV on the GPU"),
        ("predicted", f"{plan.tokens_per_s:,.1f} tokens/s ({plan.decode_tokens_per_s:,.1f} in decode; step "
                      f"{plan.step_s * 1e3:.1f} ms, prefill {plan.prefill_s:.2f} s)"),
        ("bottleneck", plan.bottleneck),
        ("GPU memory", f"{format_bytes(sum(plan.gpu_bytes.values()))}: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.gpu_bytes.items() if v)),
        ("host memory", f"{format_bytes(sum(plan.host_bytes.values()))}: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.host_bytes.items() if v)),
        ("search", f"{plan.evaluated:,} candidates, {plan.feasible:,} fit, {plan.seconds * 1e3:.0f} ms"),
    ])
    print(f"\n{'operator (decode, per micro-batch)':<36}{'device':>7}{'GFLOP':>9}{'MB mem':>9}{'MB link':>9}"
          f"{'FLOP/B':>8}{'TFLOP/s':>9}{'ms':>8}  bound")
    for r in rows:
        print(f"{r['operator']:<36}{r['device']:>7}{r['flops'] / 1e9:>9.2f}{r['mem_bytes'] / 1e6:>9.1f}"
              f"{r['link_bytes'] / 1e6:>9.2f}{r['intensity']:>8.1f}{r['flop_per_s'] / 1e12:>9.2f}"
              f"{r['seconds'] * 1e3:>8.3f}  {r['bound']}")
    if args.plot:
        print(f"\nroofline plot: {args.plot}")
    return 0
