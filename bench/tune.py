"""Launch configs on a GPU with no stored ones: untuned defaults vs the tuning a first run does by itself vs the full
`moeserve tune` search, for 3-bit experts with rank-32 compensators, 4-bit experts and bf16 experts, at a
Mixtral-8x7B shape, one run.

For each kind of experts, on one model (random weights; the low-bit ones as bench/lowbit_decode.py builds them), the
phases --phases names (and, with `shipped`, first this GPU's shipped table as its users get it):
  (a) defaults: MOESERVE_TUNE=off, the shipped tables hidden, an empty tuning cache: the defaults made from the GPU's
      properties;
  (b) quick: MOESERVE_TUNE=quick, the same empty cache: the first decode (prompt and one-token buckets) and MoE-block
      calls tune by themselves; their wall time less the same calls' time once tuned is the tuning time;
  (c) full: the search `moeserve tune` runs (the same function), on the first layer's experts at 1/16/64 tokens, at
      most --full-budget seconds per token bucket; its wall time is the tuning time.
After each: decode tok/s (batch 1, CUDA graph) and the MoE block at 1/16/64 tokens (CUDA-graph GPU ms), each with its
HBM floor (weight bytes read over the measured copy bandwidth) and the fraction of it reached.

    python bench/tune.py                     # H200: the three kinds, JSON to bench/results/ (about 8 minutes)
    python bench/tune.py --quick             # smoke run: a small 2-layer shape, 1 and 16 tokens, short budgets
    python bench/tune.py --phases shipped,defaults   # this GPU's shipped table beside (a), no tuning (2-3 minutes)
    python bench/tune.py --write-shipped     # full search of the Mixtral shapes into the shipped table of this GPU
                                             # (moeserve/kernels/triton/configs/<gpu>.json), as `moeserve tune --out`
                                             # (21 searches of at most --full-budget 15 s: about 6 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import measure_hbm_bandwidth, result_record, time_cuda_graph, write_result  # noqa: E402
from lowbit_decode import bytes_per_token, decode_rate, lowbit_model  # noqa: E402
from offload import MIXTRAL, dense_model, model_spec  # noqa: E402

from moeserve.kernels.triton import autotune, configs, fused_moe  # noqa: E402
from moeserve.kernels.triton.lowbit import ops as lowbit_ops  # noqa: E402
from moeserve.tune import BF16, TOKENS, ExpertKind, format_rows, tune_model  # noqa: E402

KINDS = {"3": ExpertKind(3, 32), "4": ExpertKind(4, 0), "16": ExpertKind(BF16)}
SMALL = dict(MIXTRAL, num_layers=2, hidden_size=1024, num_heads=8, head_dim=128, expert_ffn=3584)  # --quick
BLOCK_TOKENS = (1, 16, 64)
PHASES = ("shipped", "defaults", "quick", "full")
SHIPPED_DIR = configs.CONFIG_DIR
INPUTS = 4  # rotating inputs per MoE-block timing
STD = 0.02


def bf16_model(spec, device):
    """Random bf16 weights, the routed experts too (ResidentExperts: the fused Triton MoE up to its token limit)."""
    model = dense_model(spec, device, torch.bfloat16)
    E, D, F = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * F, D, device=device, dtype=torch.bfloat16) * STD,
                                                  requires_grad=False)  # [E, 2F, D]
        experts.down_proj = torch.nn.Parameter(torch.randn(E, D, F, device=device, dtype=torch.bfloat16) * STD,
                                               requires_grad=False)  # [E, D, F]
    return model


def expert_bytes(block) -> int:
    """Bytes of one expert of an MoE block (packed codes, scales, zeros and compensators; or bf16 weights)."""
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):
        return (experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes)
    return sum(t.nbytes for m in (experts.gate_up[0], experts.down[0]) for t in m.buffers())


@torch.inference_mode()
def block_rows(block, D: int, tokens, bw: float) -> list[dict]:
    """The MoE block (router + experts) at each token count: CUDA-graph GPU ms over rotating inputs, and its floor:
    the distinct experts the inputs hit, read once, plus the router, over the copy bandwidth."""
    rows = []
    per_expert = expert_bytes(block)
    for T in tokens:
        xs = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(INPUTS)]
        distinct = statistics.mean(int(block.gate(x)[0].unique().numel()) for x in xs)
        ms = time_cuda_graph(block, xs)
        floor = (distinct * per_expert + block.gate.weight.nbytes) / bw * 1e3
        rows.append({"tokens": T, "ms": ms, "floor_ms": floor, "of_floor": floor / ms, "distinct_experts": distinct})
        print(f"    block T={T:3d}: {ms:.4f} ms, floor {floor:.4f} ms ({100 * floor / ms:.0f}%)", flush=True)
    return rows


def measure(model, spec, args, bw: float, per_token: int) -> dict:
    """Decode tok/s (CUDA graph) and the first layer's MoE block at the block token counts, each against its floor."""
    rate = decode_rate(model, spec, args, True, torch.device("cuda"))
    floor = bw / per_token
    rate["floor_tokens_per_s"], rate["of_floor"] = floor, rate["tokens_per_s"] / floor
    print(f"    decode {rate['tokens_per_s']:.1f} tok/s ({100 * rate['of_floor']:.0f}% of the {floor:.0f} tok/s floor)",
          flush=True)
    return {"decode": rate, "block": block_rows(model.model.layers[0].mlp, spec.hidden_size, args.block_tokens, bw)}


def first_calls(model, spec, args) -> float:
    """Seconds of the calls that trigger tuning: one short decode (its prompt bucket and one token) and the first
    layer's MoE block at each block token count, eagerly."""
    start = time.perf_counter()
    short = argparse.Namespace(**{**vars(args), "new_tokens": 4})
    decode_rate(model, spec, short, False, torch.device("cuda"))
    with torch.inference_mode():
        for T in args.block_tokens:
            model.model.layers[0].mlp(torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def full_search(model, spec, kind: ExpertKind, args) -> float:
    """The `moeserve tune` search on the first layer's experts at the block token counts; its wall seconds."""
    experts = model.model.layers[0].mlp.experts
    E, D, F = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn
    start = time.perf_counter()
    for T in args.block_tokens:
        if kind.bits == BF16 and T > configs.fused_max_tokens(torch.cuda.get_device_name(), E, D, F):
            continue  # grouped GEMMs there, not the fused kernels
        if kind.bits == BF16:
            fused_moe.tune_experts(experts.gate_up_proj, experts.down_proj, T, spec.moe.top_k, "full", args.full_budget)
        else:
            lowbit_ops.tune_experts(*experts.stacked(torch.bfloat16), T, spec.moe.top_k, "full", torch.bfloat16,
                                    args.full_budget)
    return time.perf_counter() - start


def phases(kind: ExpertKind, spec, args, bw: float) -> dict:
    """The phases of args.phases (shipped, (a), (b), (c)) for one kind of experts on one model."""
    print(f"\n== {kind}", flush=True)
    dev = torch.device("cuda")
    model = (bf16_model(spec, dev) if kind.bits == BF16 else
             lowbit_model(spec, kind.bits, kind.group, kind.rank, dev, torch.bfloat16))
    per_token = bytes_per_token(model, spec)
    out = {"experts": str(kind), "weight_bytes_per_token": per_token}
    hidden = configs.CONFIG_DIR  # (a)'s: no shipped table
    for phase, tables, title in (("shipped", SHIPPED_DIR, "shipped table"), ("defaults", hidden, "(a) defaults")):
        if phase in args.phases:  # nothing tuned on the way (shipped: what a user of this GPU gets)
            os.environ["MOESERVE_TUNE"] = "off"
            configs.CONFIG_DIR = tables
            autotune.forget()
            print(f"  {title}", flush=True)
            out[phase] = measure(model, spec, args, bw, per_token)
    configs.CONFIG_DIR = hidden
    if "quick" in args.phases:
        os.environ["MOESERVE_TUNE"] = "quick"
        autotune.forget()
        print("  (b) tuned by the first calls (quick)", flush=True)
        tuning = first_calls(model, spec, args)
        again = first_calls(model, spec, args)
        out["quick"] = {"tune_s": tuning - again, "first_calls_s": tuning, "tuned_calls_s": again,
                        **measure(model, spec, args, bw, per_token)}
        print(f"    quick tuning took {tuning - again:.1f} s", flush=True)
    if "full" in args.phases:
        print("  (c) moeserve tune (full)", flush=True)
        seconds = full_search(model, spec, kind, args)
        autotune.forget()
        out["full"] = {"tune_s": seconds, **measure(model, spec, args, bw, per_token)}
        print(f"    full search took {seconds:.1f} s", flush=True)
    del model
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: small 2-layer shape, short budgets")
    ap.add_argument("--kinds", default="3,4,16", help="expert kinds: 3 (3-bit + rank 32), 4 (4-bit), 16 (bf16)")
    ap.add_argument("--phases", default="defaults,quick,full",
                    help=f"comma-separated phases, in this order: {','.join(PHASES)} (shipped: this GPU's shipped "
                         "table with MOESERVE_TUNE=off, what its users get; default defaults,quick,full)")
    ap.add_argument("--full-budget", type=float, default=15.0, help="seconds of (c)'s search per token bucket")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of the decode runs")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--write-shipped", action="store_true",
                    help="instead: the full search of the Mixtral shapes (--kinds, 1..64 tokens, --full-budget seconds "
                         "each) into this GPU's shipped table, as `moeserve tune --out` writes it")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/tune.py needs a CUDA GPU")
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        sys.exit(f"--kinds takes some of {','.join(KINDS)}, got {args.kinds!r}")
    args.batch = 1  # the decode runs: one sequence (lowbit_decode's decode_rate reads it)
    args.phases = args.phases.split(",")
    if not args.phases or set(args.phases) - set(PHASES):
        sys.exit(f"--phases takes some of {','.join(PHASES)}, got {','.join(args.phases)!r}")
    cache = tempfile.mkdtemp(prefix="moeserve-tune-bench-")
    os.environ["MOESERVE_CACHE"] = cache  # an empty tuning cache: this GPU untuned
    if args.write_shipped:
        return write_shipped_table(args)
    configs.CONFIG_DIR = Path(cache) / "no-shipped-tables"  # (a)'s defaults: no shipped table serves either
    args.block_tokens = (1, 16) if args.quick else BLOCK_TOKENS
    if args.quick:
        args.full_budget, args.new_tokens = min(args.full_budget, 4.0), 8
        autotune.BUDGET_S["quick"] = 4.0
    spec = model_spec(SMALL if args.quick else MIXTRAL)
    bw = measure_hbm_bandwidth("cuda")["bytes_per_s"]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    results = {}
    for name in args.kinds.split(","):
        try:
            results[name] = phases(KINDS[name], spec, args, bw)
        except Exception as e:  # noqa: BLE001 - keep the other kinds' figures; the record says what failed
            traceback.print_exc()
            results[name] = {"experts": str(KINDS[name]), "error": f"{type(e).__name__}: {str(e)[:500]}"}
            torch.cuda.empty_cache()
    record = result_record("tune", {"shape": "small" if args.quick else "mixtral-8x7b", "quick": args.quick,
                                    "kinds": args.kinds, "phases": args.phases,
                                    "block_tokens": list(args.block_tokens),
                                    "full_budget_s": args.full_budget, "quick_budget_s": autotune.BUDGET_S["quick"],
                                    "prompt": args.prompt, "new_tokens": args.new_tokens,
                                    "timing": "decode: CUDA graph, wall clock; block: CUDA graph replay"}, "cuda")
    record.update({"hbm_bytes_per_s": bw, "results": results})
    print_summary(results)
    print(f"wrote {write_result(record, args.out)}")
    return 0


def write_shipped_table(args) -> int:
    """The full search of the Mixtral shapes at 1..64 tokens, written as this GPU's shipped table."""
    spec_dir = Path(tempfile.mkdtemp(prefix="moeserve-mixtral-config-"))
    spec = model_spec(MIXTRAL)
    (spec_dir / "config.json").write_text(spec_json(spec))
    out = configs.table_path(torch.cuda.get_device_name())
    kinds = [KINDS[name] for name in args.kinds.split(",")]
    start = time.perf_counter()
    rows = tune_model(spec_dir, list(TOKENS), kinds, "full", args.full_budget, out)
    print("\n".join(format_rows(rows)))
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return 0


def spec_json(spec) -> str:
    """A Mixtral config.json for the shape (`moeserve tune` reads a checkpoint directory's config)."""
    return json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                       "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
                       "intermediate_size": spec.moe.expert_ffn, "num_hidden_layers": spec.num_layers,
                       "num_attention_heads": spec.attention.num_heads,
                       "num_key_value_heads": spec.attention.num_kv_heads,
                       "num_local_experts": spec.moe.num_experts, "num_experts_per_tok": spec.moe.top_k,
                       "max_position_embeddings": spec.max_position_embeddings})


def print_summary(results: dict) -> None:
    print("\nexperts                          phase     tune s  decode tok/s  % floor  " +
          "  ".join(f"block T={T} ms (% floor)" for T in BLOCK_TOKENS))
    for r in results.values():
        for phase in PHASES:
            if phase not in r:
                continue
            p = r[phase]
            blocks = "  ".join(f"{b['ms']:.4f} ({100 * b['of_floor']:.0f}%)" for b in p["block"])
            print(f"{r['experts']:<32} {phase:<8} {p.get('tune_s', 0):7.1f}  {p['decode']['tokens_per_s']:12.1f}  "
                  f"{100 * p['decode']['of_floor']:6.0f}%  {blocks}")


if __name__ == "__main__":
    sys.exit(main())
