"""Greedy decode speed of a whole model: moeserve (its engine loop, as `generate` runs it) vs
transformers' `generate` (greedy, exactly as many new tokens), side by side, on the CPU and on CUDA.

Per device and batch size: prefill time (prompt -> first token) and decode tokens/s (the remaining
new_tokens - 1 steps). transformers' prefill is `generate(max_new_tokens=1)`; its decode time is
generate(new_tokens) minus that. Where the model allows it (CUDA, sync-free expert kernels), moeserve
decodes twice: eagerly (the dynamic forward) and as a CUDA graph (the static step, captured on the
first decode step and replayed); "steady" rates leave that first step (capture included) out.

Floor per decode step: ALL weight bytes read once (dense + every expert; for a small model at batch
8 nearly every expert is hit anyway), over the measured copy bandwidth of the device; KV-cache reads
and activations are left out. floor tokens/s = batch / floor step time.

    python bench/decode.py                   # the demo model (moeserve/demo/), CPU + CUDA if available
    python bench/decode.py --model DIR       # any supported checkpoint directory
    python bench/decode.py --random          # a random ~6M-parameter Mixtral (demo-like size), no files needed
    python bench/decode.py --quick           # tiny random Mixtral on the CPU (smoke run, seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import measure_hbm_bandwidth, result_record, sync, write_result  # noqa: E402

from moeserve.engine.cuda_graph import graph_safe  # noqa: E402
from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.loader import load_model  # noqa: E402

DEMO_DIR = Path(__import__("moeserve").__file__).resolve().parent / "demo"

# random models built in-process (transformers MixtralConfig kwargs)
QUICK_MODEL = dict(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                   bos_token_id=256, eos_token_id=257)
RANDOM_MODEL = dict(vocab_size=258, hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                    intermediate_size=320, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                    bos_token_id=256, eos_token_id=257)


def build_random_model(kwargs: dict, path: Path, seed: int = 0) -> Path:
    """Random Mixtral saved with save_pretrained. Every matrix ~N(0, 0.02), norms 1: HF's init leaves some
    weights constant (a zero router would send every token to experts 0 and 1)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    model.save_pretrained(path)
    return path


def resolve_model_dir(args, tmp: Path) -> tuple[Path, str]:
    if args.quick:
        return build_random_model(QUICK_MODEL, tmp / "quick"), "random tiny Mixtral (--quick)"
    if args.random:
        return build_random_model(RANDOM_MODEL, tmp / "random"), "random demo-size Mixtral (--random)"
    path = Path(args.model) if args.model else DEMO_DIR
    if not (path / "config.json").is_file():
        what = "the demo model directory" if args.model is None else "the model directory"
        raise SystemExit(f"decode.py: {what} {str(path)!r} has no config.json (is the demo model built?); "
                         "pass --model DIR, or --random for a random demo-size model, or --quick")
    return path, str(path)


def random_prompts(vocab: int, batch: int, length: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (batch, length), generator=g).to(device)  # [B, S], byte range


def ours_generate(model, prompt: torch.Tensor, new_tokens: int, graph: bool = False):
    """Greedy through the engine loop (engine/generate.iterate): prefill (incl. KV cache allocation) -> first token,
    then new_tokens - 1 decode steps, eager or (graph) as CUDA graphs. Returns tokens [B, n] and the seconds of
    prefill, of all decode steps and of the first decode step (the graph's capture)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sync(prompt.device)
    marks = [time.perf_counter()]
    for gens, _ in iterate(model, prompt.tolist(), params, cuda_graph=graph):  # a step's tokens are on the host
        marks.append(time.perf_counter())
    t0, t1, t_first, t2 = marks[0], marks[1], marks[min(2, len(marks) - 1)], marks[-1]
    return torch.tensor([g.token_ids for g in gens]), t1 - t0, t2 - t1, t_first - t1


@torch.inference_mode()
def hf_generate(model, prompt: torch.Tensor, new_tokens: int, pad_id: int):
    B, S = prompt.shape
    sync(prompt.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    sync(prompt.device)
    return out[:, S:], time.perf_counter() - t0


def paired_runs(ours, hf, vocab: int, B: int, S: int, n: int, modes: list[bool], repeats: int, pad_id: int, device):
    """A fresh prompt [B, S] each repeat through ours_generate (each graph mode in `modes`, eager first) and
    transformers, n new tokens. -> (runs {graph: [(prefill s, decode s, first step s)]}, transformers' total and
    prefill seconds per repeat, tokens matched with transformers, tokens matched graph vs eager)."""
    runs = {graph: [] for graph in modes}
    h_tot, h_pre, match, graph_match = [], [], [], []
    for r in range(repeats):
        prompt = random_prompts(vocab, B, S, r, device)
        tokens = {}
        for graph in modes:
            tokens[graph], *times = ours_generate(ours, prompt, n, graph)
            runs[graph].append(times)
        h_tok, tot = hf_generate(hf, prompt, n, pad_id)
        _, pre_h = hf_generate(hf, prompt, 1, pad_id)
        if h_tok.shape[1] != n:
            raise SystemExit(f"transformers generated {h_tok.shape[1]} tokens, expected {n}")
        h_tot.append(tot), h_pre.append(pre_h)
        match += matched_prefix(tokens[False], h_tok)
        if True in modes:
            graph_match += matched_prefix(tokens[True], tokens[False])
    return runs, h_tot, h_pre, match, graph_match


def matched_prefix(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per sequence: how many leading tokens two greedy outputs share."""
    same = (a.cpu() == b.cpu()).int()
    return [int(s.cumprod(0).sum()) for s in same]


def decode_figures(runs: list[tuple[float, float, float]], batch: int, new_tokens: int) -> dict:
    """Medians over repeats of ours_generate's (prefill s, decode s, first decode step s)."""
    med = statistics.median
    pre, dec, first = (med(t) for t in zip(*runs))
    steady = max(dec - first, 1e-9)
    return {"prefill_ms": pre * 1e3, "decode_s": dec, "decode_tok_s": batch * (new_tokens - 1) / dec,
            "first_step_ms": first * 1e3, "steady_decode_tok_s": batch * max(new_tokens - 2, 1) / steady,
            "total_s": pre + dec}


def bench_device(path: Path, device: torch.device, args) -> list[dict]:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = load_model(path, device, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    spec = ours.spec
    if args.prompt_len + args.new_tokens > spec.max_position_embeddings:
        raise SystemExit(f"decode.py: prompt {args.prompt_len} + {args.new_tokens} new tokens exceed the model's "
                         f"context of {spec.max_position_embeddings}")
    pad_id = spec.pad_token_id if spec.pad_token_id is not None else (spec.eos_token_ids or (0,))[0]
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    bw = measure_hbm_bandwidth(device, nbytes=(32 << 20) if args.quick else None)
    step_floor_s = weight_bytes / bw["bytes_per_s"]
    hf_experts = getattr(hf.config, "_experts_implementation", None)
    print(f"\n== {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"{torch.get_num_threads()} threads), {str(dtype).removeprefix('torch.')}: weights {weight_bytes / 1e6:.1f} MB, "
          f"copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s -> floor {step_floor_s * 1e3:.4f} ms/step; "
          f"HF experts implementation: {hf_experts}")

    results = []
    n, S = args.new_tokens, args.prompt_len
    for B in args.batch_sizes:
        use_graph = graph_safe(ours, B)
        modes = [False, True] if use_graph else [False]
        # warm-up all (kernels, allocator, HF generation config), a few tokens
        warm = random_prompts(spec.vocab_size, B, S, 999, device)
        for graph in modes:
            ours_generate(ours, warm, min(4, n), graph)
        hf_generate(hf, warm, min(4, n), pad_id)
        runs, h_tot, h_pre, match, graph_match = paired_runs(ours, hf, spec.vocab_size, B, S, n, modes,
                                                             args.repeats, pad_id, device)
        med = statistics.median
        hf_dec_s = max(med(h_tot) - med(h_pre), 1e-9)
        steps = n - 1
        floor_tok_s = B / step_floor_s
        row = {
            "device": device.type, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "batch": B, "prompt_len": S, "new_tokens": n, "repeats": args.repeats,
            "ours": decode_figures(runs[False], B, n),
            "ours_graph": decode_figures(runs[True], B, n) if use_graph else None,
            "hf": {"prefill_ms": med(h_pre) * 1e3, "decode_s": hf_dec_s, "decode_tok_s": B * steps / hf_dec_s,
                   "total_s": med(h_tot), "experts_implementation": hf_experts},
            "floor": {"weight_bytes": weight_bytes, "bytes_per_s": bw["bytes_per_s"], "step_ms": step_floor_s * 1e3,
                      "decode_tok_s": floor_tok_s, "what": "all weight bytes once per step / copy bandwidth"},
            "greedy_match_prefix": {"min": min(match), "mean": statistics.mean(match), "of": n},
        }
        row["ours_decode_over_hf_decode_speed"] = row["ours"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
        row["ours_step_over_floor"] = floor_tok_s / row["ours"]["decode_tok_s"]
        row["hf_step_over_floor"] = floor_tok_s / row["hf"]["decode_tok_s"]
        graph_note = ""
        if use_graph:
            g, e = row["ours_graph"], row["ours"]
            row["graph_over_eager_steady_decode_speed"] = g["steady_decode_tok_s"] / e["steady_decode_tok_s"]
            row["graph_decode_over_hf_decode_speed"] = g["decode_tok_s"] / row["hf"]["decode_tok_s"]
            row["graph_steady_step_over_floor"] = floor_tok_s / g["steady_decode_tok_s"]
            row["graph_vs_eager_greedy_match_prefix"] = {"min": min(graph_match),
                                                         "mean": statistics.mean(graph_match), "of": n}
            graph_note = (f" | graph decode {g['decode_tok_s']:.0f} tok/s (steady {g['steady_decode_tok_s']:.0f}, "
                          f"capture step {g['first_step_ms']:.1f} ms)")
        results.append(row)
        print(f"B={B}: ours prefill {row['ours']['prefill_ms']:.1f} ms, decode {row['ours']['decode_tok_s']:.0f} tok/s"
              f"{graph_note} | HF prefill {row['hf']['prefill_ms']:.1f} ms, decode {row['hf']['decode_tok_s']:.0f} "
              f"tok/s | floor {floor_tok_s:.0f} tok/s | greedy match min {min(match)}/{n}")
    del ours, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def print_table(rows: list[dict]) -> None:
    print(f"\n{'device':>6} {'B':>3} {'ours pre ms':>11} {'HF pre ms':>9} {'ours tok/s':>10} {'graph tok/s':>11} "
          f"{'HF tok/s':>9} {'floor tok/s':>11} {'ours/HF':>7} {'graph/eager':>11} {'ours/floor':>10} {'match':>7}")
    for r in rows:
        g = r["ours_graph"]
        graph_tok_s, graph_ratio = ((f"{g['steady_decode_tok_s']:.0f}", f"{r['graph_over_eager_steady_decode_speed']:.2f}")
                                    if g else ("-", "-"))
        print(f"{r['device']:>6} {r['batch']:>3} {r['ours']['prefill_ms']:>11.2f} {r['hf']['prefill_ms']:>9.2f} "
              f"{r['ours']['decode_tok_s']:>10.0f} {graph_tok_s:>11} {r['hf']['decode_tok_s']:>9.0f} "
              f"{r['floor']['decode_tok_s']:>11.0f} {r['ours_decode_over_hf_decode_speed']:>7.2f} "
              f"{graph_ratio:>11} {r['ours_step_over_floor']:>10.1f} "
              f"{r['greedy_match_prefix']['min']:>3}/{r['new_tokens']}")
    print("(ours: eager decode; graph: CUDA-graph decode, steady state (capture step left out); ours/HF: decode "
          "speed ratio, >1 = ours faster; graph/eager: steady decode speed ratio; ours/floor: step time over the "
          "floor step time; match: shortest common greedy prefix with transformers)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"checkpoint directory (default: the demo, {DEMO_DIR})")
    ap.add_argument("--random", action="store_true", help="random demo-size Mixtral built in-process")
    ap.add_argument("--quick", action="store_true", help="tiny random model on the CPU, few tokens (smoke run)")
    ap.add_argument("--devices", default=None, help="comma-separated, e.g. cpu,cuda (default: cpu, + cuda if available)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy new tokens (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per setting, median (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", default=None, help="folder for the result JSON (default bench/results/)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if q else "1,8")).split(",")]
    args.prompt_len = args.prompt_len or (16 if q else 64)
    args.new_tokens = args.new_tokens or (8 if q else 128)
    args.repeats = args.repeats or (1 if q else 3)
    devices = args.devices.split(",") if args.devices else (
        ["cpu"] if q or not torch.cuda.is_available() else ["cpu", "cuda"])
    devices = [torch.device(d) for d in devices]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        raise SystemExit("decode.py: --devices names cuda but no CUDA GPU is available")

    with tempfile.TemporaryDirectory() as tmp:
        path, source = resolve_model_dir(args, Path(tmp))
        config = {"quick": q, "model": source, "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
                  "new_tokens": args.new_tokens, "repeats": args.repeats, "devices": [str(d) for d in devices],
                  "greedy": True, "prompts": "random byte-range tokens, a fresh prompt per repeat",
                  "timing": "wall clock (perf_counter, CUDA synchronised) of whole generations, median of repeats",
                  "floor": "all weight bytes once per decode step / measured copy bandwidth (no KV cache, no "
                           "activations)",
                  "cuda_graph": "where graph_safe (CUDA, sync-free experts): the static decode step captured on the "
                                "first decode step and replayed; steady = the remaining steps"}
        if q or args.random:
            config["model_config"] = QUICK_MODEL if q else RANDOM_MODEL
        main_device = next((d for d in devices if d.type == "cuda"), devices[0])
        record = result_record("decode", config, main_device)
        rows = []
        for d in devices:
            rows += bench_device(path, d, args)
    record["results"] = rows
    print_table(rows)
    print(f"\nwrote {write_result(record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
