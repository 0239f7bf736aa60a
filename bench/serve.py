"""Serving throughput and latency of `moeserve serve` (continuous batching): C clients streaming at once vs the same
requests run one after another, over HTTP (asyncio + httpx), at C = 1, 4, 16, 64.

Per level: R = max(C, --min-requests) requests, prompts cut from the demo's held-out text at random lengths
(--prompt-min..--prompt-max bytes, seeded), greedy, exactly --gen new tokens each (ignore_eos). C client tasks
take requests from one list until it is empty (a closed loop). Measured at the client, per request: time to first
token (TTFT: request sent -> first chunk with text) and the gaps between later chunks (ITL: one token a chunk where
each token is a whole character, as with the demo and the random checkpoints; `tokens_per_chunk` says); per
level: generated tokens / wall time. The sequential baseline runs the same R requests one at a time (at most --sequential-max of them, the first ones: a request's time alone does not depend on R).
Ratios: speedup = concurrent / sequential tok/s; itl_p99_over_single = p99 ITL / the 1-client level's median ITL.
No physical floor is computed: the peer is the same server running one request at a time.

    python bench/serve.py                        # starts `moeserve serve` (the demo, --device cpu) itself
    python bench/serve.py --device cuda --model DIR --clients 1,4,16,64
    python bench/serve.py --url http://127.0.0.1:8000 --device-label "H200 demo"   # a server you started
    python bench/serve.py --device cuda --random-shape mixtral --random-layers 8   # Mixtral-8x7B-shaped, 4-bit
    python bench/serve.py --quick                # 1 and 4 clients, short requests (smoke run)

A warm-up round at the highest level (untimed) runs first. Clients are spread over processes (one per 16 clients)
so that the measuring side's event loop is not what limits the numbers. A server started here runs with
MOESERVE_LOG=info (unless set): the steps it logs as slow (serve/batcher.py) are kept per level (`slow_steps`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, write_result  # noqa: E402
from random_checkpoint import add_random_checkpoint_args, write_requested  # noqa: E402

import moeserve  # noqa: E402
from moeserve.serve.process import ServerProcess  # noqa: E402

TIMEOUT = httpx.Timeout(600.0, connect=30.0)


def make_requests(n: int, prompt_min: int, prompt_max: int, gen: int, seed: int) -> list[dict]:
    """n completion bodies: random spans of the demo's held-out text, greedy, exactly `gen` new tokens."""
    text = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(prompt_min, prompt_max)
        start = rng.randrange(0, len(text) - length)
        out.append({"prompt": text[start:start + length], "max_tokens": gen, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}})
    return out


async def stream_completion(client: httpx.AsyncClient, body: dict, headers: dict | None = None) -> dict:
    """One streamed completion: its chunks' arrival times, text, usage and id (status too, and the error body
    when it is not 200)."""
    t0 = time.perf_counter()
    times, text, ids, result = [], [], set(), {"status": None}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        result["status"] = r.status_code
        if r.status_code != 200:
            result["error"] = json.loads(await r.aread())
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[6:])
            ids.add(chunk.get("id"))
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    times.append(time.perf_counter() - t0)
                    text.append(choice["text"])
                if choice.get("finish_reason"):
                    result["finish_reason"] = choice["finish_reason"]
    result.update(times=times, text="".join(text), ids=ids, seconds=time.perf_counter() - t0)
    return result


async def client_results(url: str, requests: list[dict], clients: int, headers: dict | None) -> dict:
    """`clients` tasks of one process drain the request list: each request's result, and the start and end
    times (time.perf_counter: the system's monotonic clock, comparable between processes)."""
    queue = list(reversed(requests))
    results = []

    async def worker(c: httpx.AsyncClient):
        while queue:
            results.append(await stream_completion(c, queue.pop(), headers))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(clients)))
        t1 = time.perf_counter()
    return {"results": results, "start": t0, "end": t1}


def client_process(url: str, requests: list[dict], clients: int, headers: dict | None) -> dict:
    return asyncio.run(client_results(url, requests, clients, headers))


def run_level(url: str, requests: list[dict], clients: int, headers: dict | None, procs: int = 1) -> dict:
    """`clients` concurrent streaming clients over `procs` client processes (the requests and clients dealt
    round-robin), so that one client process's event loop does not limit what is measured -> tok/s, TTFT and
    ITL percentiles, wall time."""
    procs = max(1, min(procs, clients))
    if procs == 1:
        parts = [client_process(url, requests, clients, headers)]
    else:
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
            list(pool.map(abs, range(procs)))  # start the processes before the clock does
            parts = list(pool.map(client_process, [url] * procs, [requests[i::procs] for i in range(procs)],
                                  [clients // procs + (i < clients % procs) for i in range(procs)],
                                  [headers] * procs))
    results = [r for part in parts for r in part["results"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    bad = [r for r in results if r["status"] != 200 or not r.get("done")]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = [r["times"][0] * 1e3 for r in results if r["times"]]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["times"], r["times"][1:])]
    chunks = sum(len(r["times"]) for r in results)  # ITL is per chunk: per token where each chunk carries one
    return {"requests": len(results), "generated_tokens": tokens, "wall_s": round(wall, 3), "client_procs": procs,
            "tok_per_s": tokens / wall, "tokens_per_chunk": tokens / max(chunks, 1), **percentiles("ttft", ttft),
            **percentiles("itl", itl)}


def percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {f"{name}_p50_ms": statistics.median(values), f"{name}_p99_ms": q[98],
            f"{name}_mean_ms": statistics.fmean(values)}


def server_args(args, parallel: int) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--parallel", str(parallel),
           "--max-queue", str(max(64, parallel)), "--metrics"]
    out += ["--dtype", args.dtype] if args.dtype else []
    out += ["--threads", str(args.threads)] if args.threads else []
    return out + args.server_args.split()


def client_procs(args, clients: int) -> int:
    """Client processes of a level: --client-procs, or one per 16 clients."""
    return args.client_procs or -(-clients // 16)


def add_request_args(ap) -> None:
    """The options that say which requests a level runs (bench/batching.py runs the same ones)."""
    ap.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrency levels (default 1,4,16,64)")
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level at least (default 8)")
    ap.add_argument("--prompt-min", type=int, default=16, help="shortest prompt in bytes (default 16)")
    ap.add_argument("--prompt-max", type=int, default=160, help="longest prompt in bytes (default 160)")
    ap.add_argument("--gen", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one for the run)")
    ap.add_argument("--model", default=moeserve.DEMO_MODEL, help="checkpoint for the server started here (the demo)")
    add_random_checkpoint_args(ap, "serve")
    ap.add_argument("--device", default="cpu", help="device of the server started here (default cpu)")
    ap.add_argument("--dtype", default=None, help="dtype of the server started here (default: auto)")
    ap.add_argument("--device-label", default=None, help="device name for the result with --url")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more options of the server started here, e.g. '--cpu-moe' or '--offload STORE --high-slots 16 "
                         "--all-high' (a placement)")
    ap.add_argument("--api-key", default=None, help="the running server's --api-key")
    add_request_args(ap)
    ap.add_argument("--client-procs", type=int, default=None,
                    help="client processes per level (default: one per 16 clients)")
    ap.add_argument("--sequential-max", type=int, default=16, help="requests of the sequential baseline (default 16)")
    ap.add_argument("--quick", action="store_true", help="1 and 4 clients, 16 new tokens (smoke run)")
    add_run_args(ap)  # --threads: of the server started here; --out
    args = ap.parse_args()
    if args.quick:
        args.clients, args.gen, args.min_requests, args.sequential_max, args.prompt_max = "1,4", 16, 4, 4, 48
    levels = [int(c) for c in args.clients.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        checkpoint = None if args.url else write_requested(args, work)
        record = measure(args, levels, headers)
        record["config"]["random_checkpoint"] = checkpoint
    print(f"wrote {write_result(record, args.out)}")


def slow_steps(server: ServerProcess | None, since: int) -> list[str]:
    """The slow steps (serve/batcher.py's SLOW_STEP_S) a server started here logged from line `since` of its log."""
    lines = server.log[since:] if server else []
    return [line.split("slow step: ", 1)[1].strip() for line in lines if "slow step: " in line]


def measure(args, levels: list[int], headers: dict | None) -> dict:
    """Start the server (unless --url), warm it up with one untimed round at the highest level, then time each
    level: concurrent, then the same requests one after another."""
    config = {k: getattr(args, k) for k in ("clients", "min_requests", "sequential_max", "prompt_min", "prompt_max",
                                            "gen", "seed", "quick", "model", "dtype", "threads", "client_procs",
                                            "server_args")}
    config["clients"] = levels
    os.environ.setdefault("MOESERVE_LOG", "info")  # the server started here logs its slow steps (serve/batcher.py)
    server = None if args.url else ServerProcess(*server_args(args, max(levels)))
    url = args.url or server.url
    try:
        ready = next((line.strip() for line in (server.log if server else []) if line.startswith("[ready")), None)
        record = result_record("serve", {**config, "server": ready or args.url},
                               device=None if args.url else args.device)
        if args.device_label:
            record["device"] = args.device_label
        top = max(levels)
        run_level(url, make_requests(top, args.prompt_min, args.prompt_max, min(args.gen, 8), args.seed + 99), top,
                  headers, client_procs(args, top))  # warm-up: prompt shapes, connections, client processes
        rows = []
        for clients in levels:
            requests = make_requests(max(clients, args.min_requests), args.prompt_min, args.prompt_max, args.gen,
                                     args.seed + clients)
            mark = len(server.log) if server else 0
            concurrent = run_level(url, requests, clients, headers, client_procs(args, clients))
            concurrent["slow_steps"] = slow_steps(server, mark)
            mark = len(server.log) if server else 0
            sequential = run_level(url, requests[:args.sequential_max], 1, headers)
            sequential["slow_steps"] = slow_steps(server, mark)
            row = {"clients": clients, "concurrent": concurrent, "sequential": sequential,
                   "speedup": concurrent["tok_per_s"] / sequential["tok_per_s"]}
            rows.append(row)
            print(f"{clients:>3} clients: {concurrent['tok_per_s']:8.1f} tok/s ({row['speedup']:.2f}x sequential "
                  f"{sequential['tok_per_s']:.1f}), TTFT p50 {concurrent['ttft_p50_ms']:.0f} ms p99 "
                  f"{concurrent['ttft_p99_ms']:.0f}, ITL p50 {concurrent['itl_p50_ms']:.1f} ms p99 "
                  f"{concurrent['itl_p99_ms']:.1f}", flush=True)
            for kind in ("concurrent", "sequential"):
                if row[kind]["slow_steps"]:
                    print(f"    {kind}: slow steps {'; '.join(row[kind]['slow_steps'])}", flush=True)
        single = next((r["concurrent"]["itl_p50_ms"] for r in rows if r["clients"] == 1), None)
        for r in rows:
            r["itl_p99_over_single"] = r["concurrent"]["itl_p99_ms"] / single if single else None
        record["levels"] = rows
    finally:
        if server:
            server.stop()
    return record


if __name__ == "__main__":
    main()
