"""Quantization quality: held-out perplexity, bytes and time of RTN / HQQ / MiLo on the demo model,
and HQQ / MiLo speed on one Mixtral-size expert matrix.

    python bench/quality.py --part quality --device cpu   # the table (demo matrices are tiny: CPU is fine)
    python bench/quality.py --part speed                  # 14336 x 4096 HQQ and MiLo seconds (GPU)
    python bench/quality.py --quick                       # two methods on 4K tokens, seconds

Gap recovered = (ppl_hqq - ppl_milo) / (ppl_hqq - ppl_float) at the same bit width; memory added is
relative to the HQQ checkpoint of the same bit width.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, write_result  # noqa: E402

import moeserve  # noqa: E402
from moeserve.cli import DEMO_DIR  # noqa: E402
from moeserve.evaluate import perplexity  # noqa: E402
from moeserve.quant import hqq, milo  # noqa: E402
from moeserve.quant.compress import QuantConfig, frequency_from_text, quantize_checkpoint  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402

# The demo's matrices are 128..256 x 256, so ranks are small and budgets are in KB: 146 KB is 5% of the
# 3-bit checkpoint. "all=300KB" is a uniform rank under that budget; dense/kurtosis splits use the same bytes.
FULL = [
    ("rtn-4", dict(bits=4, method="rtn")), ("hqq-4", dict(bits=4, method="hqq")),
    ("milo-4 dense=146KB int3", dict(bits=4, method="milo", ranks="dense=146KB", compensator_bits=3)),
    ("rtn-3", dict(bits=3, method="rtn")), ("hqq-3", dict(bits=3, method="hqq")),
    # ~5% memory (146 KB) under different signals
    ("milo-3 all=146KB int3", dict(bits=3, method="milo", ranks="all=146KB", compensator_bits=3)),
    ("milo-3 dense=146KB int3", dict(bits=3, method="milo", ranks="dense=146KB", compensator_bits=3)),
    ("milo-3 all=kurtosis:146KB int3", dict(bits=3, method="milo", ranks="all=kurtosis:146KB", compensator_bits=3)),
    ("milo-3 dense=73KB,experts=frequency:73KB int3",
     dict(bits=3, method="milo", ranks="dense=73KB,experts=frequency:73KB", compensator_bits=3)),
    # equal memory (600 KB, ~20%): uniform vs dense-heavy vs kurtosis mixtures
    ("milo-3 all=600KB int3", dict(bits=3, method="milo", ranks="all=600KB", compensator_bits=3)),
    ("milo-3 dense=600KB int3", dict(bits=3, method="milo", ranks="dense=600KB", compensator_bits=3)),
    ("milo-3 dense=300KB,experts=kurtosis:300KB int3",
     dict(bits=3, method="milo", ranks="dense=300KB,experts=kurtosis:300KB", compensator_bits=3)),
    # compensator precision at fixed ranks
    ("milo-3 dense=32 bf16", dict(bits=3, method="milo", ranks="dense=32", compensator_bits=16)),
    ("milo-3 dense=32 int8", dict(bits=3, method="milo", ranks="dense=32", compensator_bits=8)),
    ("milo-3 dense=32 int3", dict(bits=3, method="milo", ranks="dense=32", compensator_bits=3)),
    ("milo-3 dense=32,experts=kurtosis:16 int8",
     dict(bits=3, method="milo", ranks="dense=32,experts=kurtosis:16", compensator_bits=8)),
    ("milo-3 dense=32,experts=kurtosis:16 int3",
     dict(bits=3, method="milo", ranks="dense=32,experts=kurtosis:16", compensator_bits=3)),
    # how far rank goes (memory no object)
    ("milo-3 uniform:64 int8", dict(bits=3, method="milo", ranks="uniform:64", compensator_bits=8)),
    ("rtn-2", dict(bits=2, method="rtn")), ("hqq-2", dict(bits=2, method="hqq")),
    ("milo-2 dense=146KB int3", dict(bits=2, method="milo", ranks="dense=146KB", compensator_bits=3)),
    ("milo-2 uniform:64 int8", dict(bits=2, method="milo", ranks="uniform:64", compensator_bits=8)),
]
QUICK = [("hqq-3", dict(bits=3, method="hqq")),
         ("milo-3 dense=32 int3", dict(bits=3, method="milo", ranks="dense=32", compensator_bits=3))]


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


def quality_rows(configs, device: torch.device, max_tokens: int) -> tuple[list[dict], int]:
    tok = load_tokenizer(DEMO_DIR)
    text = (DEMO_DIR / "heldout.txt").read_text()
    ids = tok.encode(text)
    ids = ids[:max_tokens] if max_tokens else ids
    rows = []

    def evaluate(label, path, cfg, seconds):
        model = moeserve.load_model(path, device=device, dtype=torch.float32)
        r = perplexity(model, ids, 512, progress=False)
        row = {"label": label, **(cfg or {}), "perplexity": r["perplexity"], "bits_per_byte": r["bits_per_token"],
               "checkpoint_bytes": checkpoint_bytes(path), "compensator_bytes": compensator_bytes(model),
               "quantize_seconds": seconds}
        rows.append(row)
        print(f"{label:48s} ppl {r['perplexity']:.4f}  bytes {row['checkpoint_bytes']:>10,}  "
              f"comp {row['compensator_bytes']:>8,}  {seconds:6.1f} s", flush=True)

    evaluate("bf16 (reference)", DEMO_DIR, None, 0.0)
    frequency = None
    with tempfile.TemporaryDirectory() as tmp:
        for n, (label, kw) in enumerate(configs):
            if "frequency" in kw.get("ranks", "") and frequency is None:
                frequency = frequency_from_text(DEMO_DIR, text, device)  # measured on the held-out text
            out = Path(tmp) / f"q{n}"
            t = time.perf_counter()
            quantize_checkpoint(DEMO_DIR, out, QuantConfig(group=64, **kw), device=device, frequency=frequency,
                                progress=False)
            evaluate(label, out, kw, time.perf_counter() - t)
    ref = rows[0]["perplexity"]
    for r in rows[1:]:
        base = next((b for b in rows if b["label"] == f"hqq-{r['bits']}"), None)
        if base and r["method"] == "milo":
            r["gap_recovered_vs_hqq"] = (base["perplexity"] - r["perplexity"]) / (base["perplexity"] - ref)
            r["memory_added_vs_hqq"] = r["checkpoint_bytes"] / base["checkpoint_bytes"] - 1
    return rows, len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("quality", "speed", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="two methods, 4K tokens, CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=0, help="evaluate the first N held-out tokens (0 = all)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.quick else ("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    record = result_record("quality", {"quick": args.quick, "part": args.part, "model": "demo", "group": 64,
                                       "window": 512, "compute_dtype": "float32"}, device=device)
    if args.part in ("quality", "all"):
        record["rows"], record["config"]["eval_tokens"] = quality_rows(
            QUICK if args.quick else FULL, device, 4096 if args.quick else args.max_tokens)
    if args.part in ("speed", "all") and not args.quick:
        speed = record["expert_matrix_speed"] = expert_matrix_speed(device)
        print(f"14336x4096 on {device}: HQQ {speed['hqq_s']:.2f} s, MiLo r{speed['milo_rank']} "
              f"{speed['milo_iters']} it {speed['milo_s']:.2f} s -> Mixtral-8x7B MiLo "
              f"~{speed['mixtral_8x7b_milo_minutes_estimate']:.1f} min")
    write_result(record, args.out)


if __name__ == "__main__":
    main()
