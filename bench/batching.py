"""Continuous batching without HTTP: the requests of bench/serve.py run through a ContinuousBatch in this process,
so that the server's numbers have the engine's own beside them (what HTTP, the event loop and the engine thread
add is the difference).

Per level C: the same request bodies bench/serve.py makes (same seeds, prompt lengths and --gen), tokenized as the
server does; C requests run at once and each finished one is replaced by the next (a closed loop) until all are
done. Every step is timed (perf_counter around ContinuousBatch.step, which ends in a host sync: the sampled tokens
are read) and kept by its shape: decode-only steps per batch size, and steps with a prefill pass. Reported per
level: generated tok/s, decode-only step time p50 (the engine's ITL floor at that batch size), steps with a
prefill pass (count, p50, max), the gaps between a request's tokens (ITL p50/p99) and the slowest steps with their
shapes.

    python bench/batching.py --model DIR --device cuda                      # 1,4,16,64 clients
    python bench/batching.py --random-shape mixtral --random-layers 8 --device cuda --work /tmp
    python bench/batching.py --quick                                        # the demo on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, write_result  # noqa: E402
from random_checkpoint import add_random_checkpoint_args, write_requested  # noqa: E402
from serve import add_request_args, make_requests, percentiles  # noqa: E402

import moeserve  # noqa: E402
from moeserve.engine.batching import ContinuousBatch, Request  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402


def run_level(batch: ContinuousBatch, prompts: list[list[int]], gen: int, clients: int) -> dict:
    """`clients` requests at once from `prompts` (greedy, `gen` tokens each, EOS ignored) until all finish."""
    params = SamplingParams(max_new_tokens=gen, ignore_eos=True)
    todo = list(reversed(prompts))
    running, tokens = [0], [0]
    last: dict[int, float] = {}  # request -> when its last token came
    gaps: list[float] = []

    def on_update(request, update) -> None:
        now = time.perf_counter()
        tokens[0] += len(update.token_ids)
        if id(request) in last:
            gaps.append((now - last[id(request)]) * 1e3)
        last[id(request)] = now
        if update.finish_reason is not None:
            running[0] -= 1
            del last[id(request)]

    steps: list[tuple[object, float]] = []
    t0 = time.perf_counter()
    while todo or running[0]:
        while todo and running[0] < clients:
            batch.add(Request(todo.pop(), params, on_update))
            running[0] += 1
        start = time.perf_counter()
        batch.step()
        steps.append((batch.last_step, time.perf_counter() - start))
    wall = time.perf_counter() - t0
    decode: dict[int, list[float]] = defaultdict(list)
    with_prefill = []
    for shape, seconds in steps:
        (with_prefill if shape.prefill_rows else decode[shape.decode]).append(seconds * 1e3)
    slowest = sorted(steps, key=lambda s: -s[1])[:5]
    return {"requests": len(prompts), "generated_tokens": tokens[0], "wall_s": round(wall, 3),
            "tok_per_s": tokens[0] / wall, "steps": len(steps), **percentiles("itl", gaps),
            "decode_step_p50_ms": {b: statistics.median(v) for b, v in sorted(decode.items())},
            "prefill_steps": len(with_prefill),
            "prefill_step_p50_ms": statistics.median(with_prefill) if with_prefill else None,
            "prefill_step_max_ms": max(with_prefill) if with_prefill else None,
            "slowest": [f"{1e3 * s:.1f} ms: {shape}" for shape, s in slowest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=moeserve.DEMO_MODEL, help="checkpoint (default: the demo)")
    add_random_checkpoint_args(ap, "run")
    ap.add_argument("--device", default="cpu", help="device (default cpu)")
    ap.add_argument("--dtype", default=None, help="dtype (default: auto)")
    add_request_args(ap)
    ap.add_argument("--ctx-size", type=int, default=4096, help="tokens per KV slot (default 4096, as serve)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill token slots per pass (default: serve's)")
    ap.add_argument("--quick", action="store_true", help="1 and 4 clients, 16 new tokens (smoke run)")
    add_run_args(ap)  # --threads, --out
    args = ap.parse_args()
    if args.quick:
        args.clients, args.gen, args.min_requests, args.prompt_max, args.ctx_size = "1,4", 16, 4, 48, 256
    levels = [int(c) for c in args.clients.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        checkpoint = write_requested(args, work)
        record = measure(args, levels)
        record["config"]["random_checkpoint"] = checkpoint
    print(f"wrote {write_result(record, args.out)}")


def measure(args, levels: list[int]) -> dict:
    tokenizer = load_tokenizer(args.model)
    model = moeserve.load_model(args.model, device=args.device, dtype=args.dtype)
    extra = {} if args.prefill_chunk is None else {"prefill_tokens": args.prefill_chunk}
    batch = ContinuousBatch(model, tokenizer, max(levels), args.ctx_size, **extra)
    t0 = time.perf_counter()
    warm = batch.warm_up()
    config = {k: getattr(args, k) for k in ("min_requests", "prompt_min", "prompt_max", "gen", "seed", "quick",
                                            "model", "dtype", "threads", "ctx_size")}
    config.update(clients=levels, prefill_tokens=batch.prefill_tokens, warm_up_s=round(time.perf_counter() - t0, 1),
                  graphed_sizes=warm.graphed_sizes)
    record = result_record("batching", config, device=args.device)
    top = max(levels)
    warm_prompts = [tokenizer.encode(b["prompt"]) for b in make_requests(
        top, args.prompt_min, args.prompt_max, min(args.gen, 8), args.seed + 99)]
    run_level(batch, warm_prompts, min(args.gen, 8), top)  # untimed, as bench/serve.py's warm-up round
    rows = []
    for clients in levels:
        bodies = make_requests(max(clients, args.min_requests), args.prompt_min, args.prompt_max, args.gen,
                               args.seed + clients)
        row = {"clients": clients, **run_level(batch, [tokenizer.encode(b["prompt"]) for b in bodies], args.gen,
                                               clients)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    record["levels"] = rows
    return record


if __name__ == "__main__":
    main()
