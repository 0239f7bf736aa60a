"""HOBBIT's mixed-precision perplexity cost of one checkpoint, shared by bench/hybrid.py (the demo) and
bench/quality.py (any model): held-out perplexity with every MoE layer's experts low-bit on the CPU (the hybrid
backend), without and with HOBBIT's precision rule (the low-weight experts of a token are skipped).

The text is given as token ids: the caller's held-out text in the model's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import moeserve
from moeserve.evaluate import perplexity
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import build_store, enable_hybrid

EXPERT_BITS = 4  # HOBBIT's experts: 4-bit, the mixed rule skips the low-weight ones
WINDOW = 256  # tokens per perplexity window


def mixed_precision_cost(model_dir: Path, ids: list[int], bits: int = EXPERT_BITS) -> dict:
    """Perplexity of `ids` with the experts `bits`-bit on the CPU ("4bit"), and with the mixed rule
    ("4bit+mixed"), each with the share of expert pairs skipped; "mixed_ppl_cost" is the relative perplexity
    increase the rule costs."""
    out = {}
    for name, mixed in (("4bit", False), ("4bit+mixed", True)):
        model = moeserve.load_model(model_dir, device="cpu", dtype="float32", routed_experts=False)
        placement = HybridPlacement.choose(model.spec.moe.layer_indices(), cpu_moe=True, bits=bits, mixed=mixed)
        runtime = enable_hybrid(model, build_store(model_dir, placement, model.dtype, model.device, progress=False),
                                placement)
        out[name] = perplexity(model, ids, WINDOW, progress=False)["perplexity"]
        totals = runtime.totals()
        out[f"{name}_skipped_share"] = totals.skipped / max(totals.cpu_pairs + totals.skipped, 1)
        runtime.close()
    out["mixed_ppl_cost"] = out["4bit+mixed"] / out["4bit"] - 1
    return out
