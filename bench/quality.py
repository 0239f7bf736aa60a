"""Quantization quality: held-out perplexity, bytes and time of RTN / HQQ / MiLo on the demo model,
plus HQQ and MiLo speed on one Mixtral-size expert matrix (GPU).

    python bench/quality.py            # full: every method on the whole held-out text (GPU recommended)
    python bench/quality.py --quick    # a few methods on 4K tokens, CPU, seconds

Gap recovered = (ppl_hqq - ppl_milo) / (ppl_hqq - ppl_float) at the same bit width.
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
from moeserve.quant.compress import QuantConfig, quantize_checkpoint  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402

# (label, QuantConfig kwargs); the demo's matrices are 256 x 128..256, so ranks are scaled to that size
FULL = [
    ("rtn-4", dict(bits=4, method="rtn")), ("hqq-4", dict(bits=4, method="hqq")),
    ("rtn-3", dict(bits=3, method="rtn")), ("hqq-3", dict(bits=3, method="hqq")),
    ("milo-3 uniform:8", dict(bits=3, method="milo", ranks="uniform:8")),
    ("milo-3 dense=32", dict(bits=3, method="milo", ranks="dense=32")),
    ("milo-3 experts=8", dict(bits=3, method="milo", ranks="experts=8")),
    ("milo-3 dense=32,experts=kurtosis:8", dict(bits=3, method="milo", ranks="dense=32,experts=kurtosis:8")),
    ("milo-3 dense=32,experts=kurtosis:8 int8", dict(bits=3, method="milo", ranks="dense=32,experts=kurtosis:8",
                                                     compensator_bits=8)),
    ("milo-3 dense=32,experts=kurtosis:8 int3", dict(bits=3, method="milo", ranks="dense=32,experts=kurtosis:8",
                                                     compensator_bits=3)),
    ("milo-3 dense=64,experts=kurtosis:16", dict(bits=3, method="milo", ranks="dense=64,experts=kurtosis:16")),
    ("rtn-2", dict(bits=2, method="rtn")), ("hqq-2", dict(bits=2, method="hqq")),
    ("milo-2 dense=64,experts=kurtosis:16", dict(bits=2, method="milo", ranks="dense=64,experts=kurtosis:16")),
]
QUICK = [("hqq-3", dict(bits=3, method="hqq")), ("milo-3 uniform:8", dict(bits=3, method="milo", ranks="uniform:8"))]


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
        q = hqq.quantize_hqq(M, 3, 64)
        return q, hqq.dequantize(q)

    hqq_s = timed(lambda: hqq.quantize_hqq(W, 3, 64))
    milo_s = timed(lambda: milo.milo(W, rank, quantize, iters=iters))
    # Mixtral-8x7B: 32 layers x 8 experts x 3 matrices of 14336 x 4096 (+ attention, ~4% more)
    n = 32 * 8 * 3
    return {"shape": [14336, 4096], "hqq_s": hqq_s, "milo_s": milo_s, "milo_rank": rank, "milo_iters": iters,
            "mixtral_8x7b_expert_matrices": n, "mixtral_8x7b_milo_minutes_estimate": milo_s * n * 1.04 / 60,
            "mixtral_8x7b_hqq_minutes_estimate": hqq_s * n * 1.04 / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two methods, 4K tokens, CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=0, help="evaluate the first N held-out tokens (0 = all)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.quick else ("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    dtype = torch.float32
    max_tokens = 4096 if args.quick else args.max_tokens
    tok = load_tokenizer(DEMO_DIR)
    ids = tok.encode((DEMO_DIR / "heldout.txt").read_text())
    ids = ids[:max_tokens] if max_tokens else ids
    rows = []

    def evaluate(label, path, cfg, seconds):
        model = moeserve.load_model(path, device=device, dtype=dtype)
        r = perplexity(model, ids, 512, progress=False)
        row = {"label": label, **(cfg or {}), "perplexity": r["perplexity"], "bits_per_byte": r["bits_per_token"],
               "checkpoint_bytes": checkpoint_bytes(path), "compensator_bytes": compensator_bytes(model),
               "quantize_seconds": seconds}
        rows.append(row)
        print(f"{label:42s} ppl {r['perplexity']:.4f}  bytes {row['checkpoint_bytes']:>10,}  "
              f"comp {row['compensator_bytes']:>8,}  {seconds:6.1f} s", flush=True)

    evaluate("bf16 (reference)", DEMO_DIR, None, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for label, kw in (QUICK if args.quick else FULL):
            cfg = QuantConfig(group=64, **kw)
            out = Path(tmp) / label.replace(" ", "_").replace(":", "-").replace(",", "_").replace("=", "-")
            t = time.perf_counter()
            quantize_checkpoint(DEMO_DIR, out, cfg, device=device, progress=False)
            evaluate(label, out, kw, time.perf_counter() - t)
    ref = rows[0]["perplexity"]
    for bits in (2, 3, 4):
        base = next((r for r in rows if r["label"] == f"hqq-{bits}"), None)
        for r in rows:
            if base and r.get("bits") == bits and r.get("method") == "milo":
                r["gap_recovered_vs_hqq"] = (base["perplexity"] - r["perplexity"]) / (base["perplexity"] - ref)
                r["memory_added_vs_hqq"] = r["checkpoint_bytes"] / base["checkpoint_bytes"] - 1
    speed = None if args.quick else expert_matrix_speed(device)
    record = result_record("quality", {"quick": args.quick, "model": "demo", "group": 64, "eval_tokens": len(ids),
                                       "window": 512, "compute_dtype": "float32"}, device=device)
    record["rows"], record["expert_matrix_speed"] = rows, speed
    write_result(record, args.out)
    if speed:
        print(f"14336x4096 on {device}: HQQ {speed['hqq_s']:.2f} s, MiLo r{speed['milo_rank']} "
              f"{speed['milo_iters']} it {speed['milo_s']:.2f} s -> Mixtral-8x7B MiLo "
              f"~{speed['mixtral_8x7b_milo_minutes_estimate']:.1f} min")


if __name__ == "__main__":
    main()
