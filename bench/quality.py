"""Quantization quality: held-out perplexity, bytes and time of RTN / HQQ / MiLo on an MoE checkpoint (the demo by
default), HOBBIT's mixed-precision perplexity cost on it, and HQQ / MiLo speed on one Mixtral-size expert matrix.

    python bench/quality.py --part quality --device cpu   # the demo's table (its matrices are tiny: CPU is fine)
    python bench/quality.py --part speed                  # 14336 x 4096 HQQ and MiLo seconds (GPU)
    python bench/quality.py --quick [--model DIR]         # two methods on 4K tokens, CPU, seconds

The second model, a standard MoE of 4x the demo's parameters (hidden 512, expert FFN 256, 6 layers of 8 experts,
top-2), trained and measured end to end on a GPU:

    python -m moeserve.train --arch moe-8 --scale 4x --texts .data/texts --steps 400 --minutes 0 --out /tmp/moe8-4x
    python bench/quality.py --model /tmp/moe8-4x --part quality --device cuda

Every model reads the demo's held-out text (Hamlet, which the trainer holds out of every model it trains) in its
own tokenizer. Any model's methods: RTN and HQQ at 4, 3 and 2 bits, and 3-bit MiLo with INT3 compensators in
+5% and +10% of the model's HQQ 3-bit checkpoint (quantized first to measure its bytes), spread over all weights,
the dense weights only, all weights by kurtosis, and half on the dense weights / half on the experts by routing
frequency. The demo runs its own list (FULL: absolute budgets, 146 KB being its 5%), then the +10% rows FULL
lacks. Gap recovered = (ppl_hqq - ppl_milo) / (ppl_hqq - ppl_float) at the same bit width; memory added is
relative to the HQQ checkpoint of the same bit width. Mixed precision: bench/mixed_precision.py (4-bit experts on
the CPU, the first --mixed-tokens held-out bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, write_result  # noqa: E402
from mixed_precision import HELDOUT, WINDOW as MIXED_WINDOW, mixed_precision_cost  # noqa: E402

import moeserve  # noqa: E402
from moeserve.cli import DEMO_DIR  # noqa: E402
from moeserve.evaluate import perplexity  # noqa: E402
from moeserve.quant import hqq, milo  # noqa: E402
from moeserve.compress import (QuantConfig, frequency_from_text, linear_tensors,  # noqa: E402
                                     quantize_checkpoint)
from moeserve.spec import ModelSpec  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402

GROUPS = (64, 32, 16)  # quantization groups, the first that divides every matrix's input width is the model's
WINDOW = 512  # tokens per perplexity window
COMPENSATORS = {16: "bf16", 8: "int8", 3: "int3"}  # compensator bits -> the label's name for them
SHARES = (0.05, 0.10)  # MiLo's compensator budgets, as shares of the model's HQQ 3-bit checkpoint
Method = tuple[str, QuantConfig]  # a row of the table: its label and the quantization it runs


def plain(method: str, bits: int) -> Method:
    """An RTN or HQQ row, labelled like `hqq-3`."""
    return f"{method}-{bits}", QuantConfig(bits=bits, method=method)


def milo_row(bits: int, ranks: str, compensator_bits: int = 3) -> Method:
    """A MiLo row, labelled like `milo-3 dense=146KB int3`."""
    return (f"milo-{bits} {ranks} {COMPENSATORS[compensator_bits]}",
            QuantConfig(bits=bits, method="milo", ranks=ranks, compensator_bits=compensator_bits))


# The demo's matrices are 128..256 x 256, so ranks are small and budgets are in KB: 146 KB is 5% of the
# 3-bit checkpoint. "all=300KB" is a uniform rank under that budget; dense/kurtosis splits use the same bytes.
FULL = [
    plain("rtn", 4), plain("hqq", 4), milo_row(4, "dense=146KB"),
    plain("rtn", 3), plain("hqq", 3),
    # ~5% memory (146 KB) under different signals
    milo_row(3, "all=146KB"), milo_row(3, "dense=146KB"), milo_row(3, "all=kurtosis:146KB"),
    milo_row(3, "dense=73KB,experts=frequency:73KB"),
    # equal memory (600 KB, ~20%): uniform vs dense-heavy vs kurtosis mixtures
    milo_row(3, "all=600KB"), milo_row(3, "dense=600KB"), milo_row(3, "dense=300KB,experts=kurtosis:300KB"),
    # compensator precision at fixed ranks
    milo_row(3, "dense=32", 16), milo_row(3, "dense=32", 8), milo_row(3, "dense=32"),
    milo_row(3, "dense=32,experts=kurtosis:16", 8), milo_row(3, "dense=32,experts=kurtosis:16"),
    # how far rank goes (memory no object)
    milo_row(3, "uniform:64", 8),
    plain("rtn", 2), plain("hqq", 2), milo_row(2, "dense=146KB"), milo_row(2, "uniform:64", 8),
]


def budget_kb(hqq3_bytes: int, share: float) -> int:
    """`share` of the HQQ 3-bit checkpoint in KB (1000 bytes), the unit of the rows' budgets."""
    return round(share * hqq3_bytes / 1e3)


def budget_rows(hqq3_bytes: int, share: float) -> list[Method]:
    """3-bit MiLo with INT3 compensators in `share` of the HQQ 3-bit checkpoint: over all weights, the dense ones
    only, all by kurtosis, and half on the dense weights / half on the experts by routing frequency."""
    kb, half = budget_kb(hqq3_bytes, share), budget_kb(hqq3_bytes, share / 2)
    return [milo_row(3, f"all={kb}KB"), milo_row(3, f"dense={kb}KB"), milo_row(3, f"all=kurtosis:{kb}KB"),
            milo_row(3, f"dense={half}KB,experts=frequency:{half}KB")]


def relative_methods(hqq3_bytes: int) -> list[Method]:
    """Any model's rows: RTN and HQQ at 4, 3 and 2 bits, 3-bit MiLo at each budget share."""
    budgets = [m for share in SHARES for m in budget_rows(hqq3_bytes, share)]
    return [plain("rtn", 4), plain("hqq", 4), plain("rtn", 3), plain("hqq", 3), *budgets, plain("rtn", 2),
            plain("hqq", 2)]


def table_methods(model_dir: Path, hqq3_bytes: int, quick: bool) -> list[Method]:
    """The rows to run. --quick: HQQ 3-bit and MiLo 3-bit on the dense weights at the first share (dense: few
    matrices, seconds on a CPU). The demo: FULL, then the rows of the relative list FULL lacks (its 5% rows are
    FULL's). Another model: the relative list."""
    if quick:
        return [plain("hqq", 3), milo_row(3, f"dense={budget_kb(hqq3_bytes, SHARES[0])}KB")]
    relative = relative_methods(hqq3_bytes)
    if not is_demo(model_dir):
        return relative
    have = {label for label, _ in FULL}
    return FULL + [m for m in relative if m[0] not in have]


def is_demo(model_dir: Path) -> bool:
    """The built-in demo checkpoint, whose table is FULL and whose record names it `demo`."""
    return model_dir.resolve() == DEMO_DIR.resolve()


def quant_group(model_dir: Path) -> int:
    """The model's quantization group: 64 unless a tiny model has narrower inputs (the --quick trainer's FFN is 32)."""
    widths = {t.shape[1] for t in linear_tensors(ModelSpec.from_dir(model_dir))}
    return next((g for g in GROUPS if all(w % g == 0 for w in widths)), GROUPS[0])


def config_fields(cfg: QuantConfig) -> dict:
    """A row's record of its quantization: bits and method, and a MiLo row's ranks and compensator bits."""
    fields = {"bits": cfg.bits, "method": cfg.method}
    if cfg.method == "milo":
        fields.update(ranks=cfg.ranks, compensator_bits=cfg.compensator_bits)
    return fields


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def compensator_bytes(model) -> int:
    from moeserve.quant.qlinear import QuantizedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.rank:
            total += sum(b.numel() * b.element_size() for n, b in m.named_buffers()
                         if n not in ("qweight", "scale", "zero"))
    return total


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


def hqq3_checkpoint_bytes(model_dir: Path, group: int, device: torch.device) -> int:
    """Bytes of the model's HQQ 3-bit checkpoint, quantized to measure them: what the MiLo budgets are shares of."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hqq-3"
        quantize_checkpoint(model_dir, out, replace(plain("hqq", 3)[1], group=group), device=device, progress=False)
        return checkpoint_bytes(out)


def heldout_ids(model_dir: Path, max_tokens: int) -> list[int]:
    """The held-out text in the model's tokens (BOS first), its first `max_tokens` (0: all)."""
    ids = load_tokenizer(model_dir).encode(HELDOUT.read_text())
    return ids[:max_tokens] if max_tokens else ids


def evaluate(label: str, path: Path, fields: dict, seconds: float, device: torch.device, ids: list[int]) -> dict:
    """One row of the table: held-out perplexity of the checkpoint at `path` (fp32 compute), its bytes and its
    compensators' bytes; printed as it comes."""
    model = moeserve.load_model(path, device=device, dtype=torch.float32)
    r = perplexity(model, ids, WINDOW, progress=False)
    row = {"label": label, **fields, "perplexity": r["perplexity"], "bits_per_byte": r["bits_per_token"],
           "checkpoint_bytes": checkpoint_bytes(path), "compensator_bytes": compensator_bytes(model),
           "quantize_seconds": seconds}
    print(f"{label:48s} ppl {r['perplexity']:.4f}  bytes {row['checkpoint_bytes']:>10,}  "
          f"comp {row['compensator_bytes']:>8,}  {seconds:6.1f} s", flush=True)
    return row


def add_gaps(rows: list[dict]) -> None:
    """Each MiLo row's share of the HQQ gap it recovers and the memory it adds, against HQQ at its bit width (rows[0]
    is the float reference)."""
    ref = rows[0]["perplexity"]
    for r in rows[1:]:
        base = next((b for b in rows if b["label"] == f"hqq-{r['bits']}"), None)
        if base and r["method"] == "milo":
            r["gap_recovered_vs_hqq"] = (base["perplexity"] - r["perplexity"]) / (base["perplexity"] - ref)
            r["memory_added_vs_hqq"] = r["checkpoint_bytes"] / base["checkpoint_bytes"] - 1


def quality_rows(model_dir: Path, methods: list[Method], group: int, device: torch.device,
                 ids: list[int]) -> list[dict]:
    """The float model, then each method quantized from it (in groups of `group` inputs) and evaluated on `ids`."""
    rows = [evaluate("bf16 (reference)", model_dir, {}, 0.0, device, ids)]
    frequency = None
    with tempfile.TemporaryDirectory() as tmp:
        for n, (label, cfg) in enumerate(methods):
            if cfg.method == "milo" and "frequency" in cfg.ranks and frequency is None:
                frequency = frequency_from_text(model_dir, HELDOUT.read_text(), device)  # on the held-out text
            out = Path(tmp) / f"q{n}"
            t = time.perf_counter()
            quantize_checkpoint(model_dir, out, replace(cfg, group=group), device=device, frequency=frequency,
                                progress=False)
            rows.append(evaluate(label, out, config_fields(cfg), time.perf_counter() - t, device, ids))
    add_gaps(rows)
    return rows


def model_record(model_dir: Path) -> dict:
    """The model the table is of, for its title: name, shape, parameters, context (perplexity windows are cut to
    it), and the trainer's architecture, scale and steps when its training.json names them."""
    spec = ModelSpec.from_dir(model_dir)
    info = {"name": "demo" if is_demo(model_dir) else model_dir.resolve().name, "family": spec.family,
            "layers": spec.num_layers, "hidden_size": spec.hidden_size, "expert_ffn": spec.moe.expert_ffn,
            "experts": spec.moe.num_experts, "top_k": spec.moe.top_k, "parameters": spec.parameter_counts()["total"],
            "context": spec.max_position_embeddings}
    training = model_dir / "training.json"
    if training.is_file():
        trained = json.loads(training.read_text())
        info.update({key: trained[key] for key in ("architecture", "scale", "steps") if key in trained})
    return info


def mixed_precision_record(model_dir: Path, tokens: int) -> dict:
    """HOBBIT's mixed-precision cost on the model, printed."""
    cost = mixed_precision_cost(model_dir, tokens)
    print(f"mixed precision (4-bit experts on the CPU, {tokens} held-out bytes): perplexity {cost['4bit']:.4f} -> "
          f"{cost['4bit+mixed']:.4f} ({cost['mixed_ppl_cost']:+.2%}), {cost['4bit+mixed_skipped_share']:.1%} of the "
          "expert pairs skipped", flush=True)
    return cost


def pick_device(args: argparse.Namespace) -> torch.device:
    """--quick: the CPU; --device auto: a GPU when there is one."""
    if args.quick:
        return torch.device("cpu")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def add_quality(record: dict, model_dir: Path, device: torch.device, args: argparse.Namespace) -> None:
    """The model's rows (quantized and evaluated on `device`) and its mixed-precision cost (on the CPU), into the
    run's record."""
    c = record["config"]
    hqq3_bytes = hqq3_checkpoint_bytes(model_dir, c["group"], device)
    ids = heldout_ids(model_dir, 4096 if args.quick else args.max_tokens)
    c.update(eval_tokens=len(ids), hqq3_checkpoint_bytes=hqq3_bytes, budget_shares=SHARES)
    methods = table_methods(model_dir, hqq3_bytes, args.quick)
    record["rows"] = quality_rows(model_dir, methods, c["group"], device, ids)
    record["mixed_precision"] = mixed_precision_record(model_dir, c["mixed_tokens"])


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
    ap.add_argument("--quick", action="store_true", help="two methods, 4K tokens, CPU")
    ap.add_argument("--device", default="auto", help="where to quantize and evaluate: cpu, cuda or auto")
    ap.add_argument("--max-tokens", type=int, default=0, help="evaluate the first N held-out tokens (0 = all)")
    ap.add_argument("--mixed-tokens", type=int, default=4096,
                    help="held-out bytes of the mixed-precision cost (on the CPU; default 4096, --quick 512)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    device, model_dir = pick_device(args), Path(args.model)
    model, mixed_tokens = model_record(model_dir), 512 if args.quick else args.mixed_tokens
    record = result_record("quality", {"quick": args.quick, "part": args.part, "model": model["name"],
                                       "group": quant_group(model_dir), "window": min(WINDOW, model["context"]),
                                       "compute_dtype": "float32", "mixed_tokens": mixed_tokens,
                                       "mixed_window": min(MIXED_WINDOW, model["context"])}, device=device)
    record["model"] = model
    if args.part in ("quality", "all"):
        add_quality(record, model_dir, device, args)
    if args.part in ("speed", "all") and not args.quick:
        add_speed(record, device)
    write_result(record, args.out)


if __name__ == "__main__":
    main()
