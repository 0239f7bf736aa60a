"""Prefix reuse of `moeserve serve` on multi-turn chats: C clients, each a conversation of T turns that share one long
system prompt, each turn the previous answer and a new user message appended; run once with prefix reuse (the
default) and once with `--no-prefix-reuse`, the same conversations on a fresh server each.

Measured at the client, per turn: time to first token (request sent -> first chunk with text or reasoning) p50 and
p99; per run: prompt tokens, cached_tokens (usage.prompt_tokens_details: the prompt tokens whose KV was reused, not
computed) and their ratio (hit rate), generated tokens / wall time. The ratios compare the runs: TTFT and tok/s with
reuse over without. Greedy, exactly --gen new tokens per turn (ignore_eos). The system prompt is cut from the demo's
held-out text to about --system-tokens tokens (counted by the server's /tokenize); user messages are random spans of
it (seeded). Writes one JSON to bench/results.

    python bench/prefix_cache.py --quick                          # the demo on the CPU: 2 clients x 2 turns
    python bench/prefix_cache.py --device cuda --model D          # 64 clients x 4 turns, a 1,000-token system prompt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, write_result  # noqa: E402

import moeserve  # noqa: E402
from moeserve.serve.process import ServerProcess  # noqa: E402

TIMEOUT = httpx.Timeout(900.0, connect=30.0)
TEXT = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()


def system_prompt(url: str, tokens: int) -> str:
    """About `tokens` tokens of the held-out text (repeated as needed), measured by the server's tokenizer."""
    text = TEXT * (1 + 8 * tokens // len(TEXT))
    count = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=TIMEOUT).json()["count"]
    return text[:max(1, len(text) * tokens // count)]


def user_messages(clients: int, turns: int, length: int, seed: int) -> list[list[str]]:
    """Per client, per turn: a span of the held-out text of `length` characters (seeded)."""
    rng = random.Random(seed)
    return [[TEXT[s:s + length] for s in (rng.randrange(0, len(TEXT) - length) for _ in range(turns))]
            for _ in range(clients)]


async def turn(client: httpx.AsyncClient, messages: list[dict], gen: int) -> dict:
    """One streamed chat turn: TTFT (ms), the answer's content, usage."""
    body = {"messages": messages, "max_tokens": gen, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, content, use = time.perf_counter(), None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            use = chunk.get("usage") or use
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if (delta.get("content") or delta.get("reasoning_content")) and first is None:
                    first = time.perf_counter() - t0
                content.append(delta.get("content") or "")
    return {"ttft_ms": 1e3 * (first if first is not None else time.perf_counter() - t0), "content": "".join(content),
            "usage": use}


async def conversations(url: str, system: str, users: list[list[str]], gen: int) -> dict:
    """Every client's conversation at once -> per-turn results and the wall time."""
    limits = httpx.Limits(max_connections=len(users) + 4, max_keepalive_connections=len(users) + 4)
    results: list[list[dict]] = [[] for _ in users]

    async def chat(c: httpx.AsyncClient, i: int):
        messages = [{"role": "system", "content": system}]
        for text in users[i]:
            messages.append({"role": "user", "content": text})
            result = await turn(c, messages, gen)
            messages.append({"role": "assistant", "content": result["content"]})
            results[i].append(result)

    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(chat(c, i) for i in range(len(users))))
        wall = time.perf_counter() - t0
    return {"results": results, "wall_s": wall}


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summary(run: dict, turns: int) -> dict:
    results = [r for conv in run["results"] for r in conv]
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    per_turn = []
    for t in range(turns):
        ttft = [conv[t]["ttft_ms"] for conv in run["results"]]
        per_turn.append({"turn": t + 1, "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99),
                         "prompt_tokens": sum(conv[t]["usage"]["prompt_tokens"] for conv in run["results"]),
                         "cached_tokens": sum(conv[t]["usage"]["prompt_tokens_details"]["cached_tokens"]
                                              for conv in run["results"])})
    ttft = [r["ttft_ms"] for r in results]
    return {"requests": len(results), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0, "generated_tokens": generated,
            "wall_s": round(run["wall_s"], 3), "tok_per_s": generated / run["wall_s"],
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99), "turns": per_turn}


def server_args(args, reuse: bool) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--parallel", str(args.parallel or args.clients),
           "--max-queue", str(max(64, args.clients)), "--prefix-reuse" if reuse else "--no-prefix-reuse"]
    out += ["--dtype", args.dtype] if args.dtype else []
    out += ["--threads", str(args.threads)] if args.threads else []
    return out + args.server_args.split()


def measure(args, reuse: bool) -> tuple[dict, str | None]:
    """One run on a fresh server: a warm-up conversation (untimed, its own system prompt), then the timed ones."""
    with ServerProcess(*server_args(args, reuse)) as server:
        system = system_prompt(server.url, args.system_tokens)
        users = user_messages(args.clients, args.turns, args.user_chars, args.seed)
        asyncio.run(conversations(server.url, "warm-up. " + system[:len(system) // 4], users[:1], args.gen))
        run = conversations(server.url, system, users, args.gen)
        result = summary(asyncio.run(run), args.turns)
        ready = next((line.strip() for line in server.log if line.startswith("[ready")), None)
    print(f"prefix reuse {'on ' if reuse else 'off'}: {result['tok_per_s']:8.1f} tok/s, TTFT p50 "
          f"{result['ttft_p50_ms']:.0f} ms p99 {result['ttft_p99_ms']:.0f}, cached {result['cached_tokens']} of "
          f"{result['prompt_tokens']} prompt tokens ({100 * result['hit_rate']:.0f}%)", flush=True)
    return result, ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=moeserve.DEMO_MODEL, help="checkpoint of the servers (default: the demo)")
    ap.add_argument("--device", default="cpu", help="device of the servers (default cpu)")
    ap.add_argument("--dtype", default=None, help="dtype of the servers (default: auto)")
    ap.add_argument("--server-args", default="", metavar="ARGS", help="more options of the servers")
    ap.add_argument("--clients", type=int, default=64, help="conversations at once (default 64)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt (default 1000)")
    ap.add_argument("--user-chars", type=int, default=200, help="characters of each user message (default 200)")
    ap.add_argument("--gen", type=int, default=64, help="new tokens per turn (default 64)")
    ap.add_argument("--parallel", type=int, default=None, help="the servers' KV slots (default: --clients)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="2 clients x 2 turns, a 120-token system prompt, 8 new tokens (a smoke run on the demo)")
    add_run_args(ap)  # --threads: of the servers; --out
    args = ap.parse_args()
    if args.quick:
        args.clients, args.turns, args.system_tokens, args.user_chars, args.gen = 2, 2, 120, 40, 8
    config = {k: getattr(args, k) for k in ("model", "device", "dtype", "server_args", "clients", "turns",
                                            "system_tokens", "user_chars", "gen", "parallel", "seed", "quick",
                                            "threads")}
    record = result_record("prefix_cache", config, device=args.device)
    reuse, ready = measure(args, True)
    baseline, _ = measure(args, False)
    record["config"]["server"] = ready
    record["runs"] = {"prefix_reuse": reuse, "no_prefix_reuse": baseline}
    record["ratios"] = {"tok_per_s": reuse["tok_per_s"] / baseline["tok_per_s"],
                        "ttft_p50": reuse["ttft_p50_ms"] / baseline["ttft_p50_ms"],
                        "ttft_p99": reuse["ttft_p99_ms"] / baseline["ttft_p99_ms"]}
    print(f"with reuse / without: {record['ratios']['tok_per_s']:.2f}x tok/s, TTFT p50 "
          f"{record['ratios']['ttft_p50']:.2f}x", flush=True)
    print(f"wrote {write_result(record, args.out)}")


if __name__ == "__main__":
    main()
