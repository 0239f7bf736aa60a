"""Soak test of `moeserve serve`: many requests with random lengths, random client disconnects and random bad
requests against one server; checks that nothing is lost, duplicated or crossed, and that memory stays flat.

Each of --requests requests (default 2000) is, at random: a good completion, streamed or not (random prompt
length and max_tokens, greedy, ignore_eos); a streamed one whose client goes away after a few chunks; a
non-streamed one whose client times out; or a bad request (malformed JSON, a wrong type, a negative
max_tokens, a prompt over the context, an unknown model, a wrong API key). --clients tasks send them at once.
Checks, per request: a good one gets exactly one complete answer (status 200; streamed: one id, one finishing
chunk, then [DONE] once; exactly max_tokens tokens), every response id is distinct, and every greedy text is a
prefix of, or equal to, the text of the same prompt with more tokens (no crossed streams); a bad one gets its
4xx and an OpenAI error body. A 503 (queue full) is retried after a pause, as a client would, and counted. At
the end the server still answers and holds no request and no slot; its RSS (VmRSS of the process) is reported at
the start (after a warm-up), every tenth of the run and the end.

    python bench/serve_soak.py                      # 2000 requests against a CPU server on the demo
    python bench/serve_soak.py --requests 300 --clients 8 --threads 1
    python bench/serve_soak.py --quick              # 60 requests (smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, write_result  # noqa: E402
from serve import stream_completion  # noqa: E402

import moeserve  # noqa: E402
from moeserve.serve.process import ServerProcess  # noqa: E402

RETRIES, RETRY_PAUSE_S = 200, 0.05
KEY = "soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
KINDS = {"stream": 0.35, "whole": 0.3, "disconnect_stream": 0.1, "disconnect_whole": 0.05, "bad": 0.2}
BAD = {  # body (bytes), headers, expected status
    "malformed_json": (b'{"prompt": "x", "max_tokens": ', AUTH, 400),
    "wrong_type": (b'{"prompt": "x", "max_tokens": "ten"}', AUTH, 400),
    "negative_max_tokens": (b'{"prompt": "x", "max_tokens": -4}', AUTH, 400),
    "over_context": (json.dumps({"prompt": "x" * 600}).encode(), AUTH, 400),
    "unknown_model": (b'{"prompt": "x", "model": "gpt-5"}', AUTH, 404),
    "wrong_key": (b'{"prompt": "x"}', {"Authorization": "Bearer nope"}, 401),
}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def plan(n: int, seed: int, prompts: list[str]) -> list[dict]:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    out = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        item = {"i": i, "kind": kind}
        if kind == "bad":
            item["bad"] = rng.choice(sorted(BAD))
        else:
            item["prompt"] = rng.randrange(len(prompts))
            item["max_tokens"] = rng.randint(1, 48)
            item["disconnect_after"] = rng.randint(1, 4)
        out.append(item)
    return out


async def one(c: httpx.AsyncClient, item: dict, prompts: list[str]) -> dict:
    kind = item["kind"]
    if kind == "bad":
        body, headers, want = BAD[item["bad"]]
        r = await c.post("/v1/completions", content=body, headers={**headers, "Content-Type": "application/json"})
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        return {**item, "status": r.status_code, "ok": r.status_code in (want, 503) and bool(error.get("message"))}
    body = {"prompt": prompts[item["prompt"]], "max_tokens": item["max_tokens"], "temperature": 0,
            "ignore_eos": True}
    if kind == "stream":
        body.update(stream=True, stream_options={"include_usage": True})
        r = await stream_completion(c, body, AUTH)
        if r["status"] == 503:
            return {**item, "status": 503, "ok": True}
        ok = (r["status"] == 200 and r.get("done") and len(r["ids"]) == 1 and r.get("finish_reason") == "length"
              and r["usage"]["completion_tokens"] == item["max_tokens"])
        return {**item, "status": r["status"], "ok": bool(ok), "id": next(iter(r["ids"]), None), "text": r["text"]}
    if kind == "whole":
        r = await c.post("/v1/completions", json=body, headers=AUTH)
        if r.status_code != 200:
            return {**item, "status": r.status_code, "ok": r.status_code == 503}
        data = r.json()
        choice = data["choices"][0]
        ok = data["usage"]["completion_tokens"] == item["max_tokens"] and choice["finish_reason"] == "length"
        return {**item, "status": 200, "ok": ok, "id": data["id"], "text": choice["text"]}
    if kind == "disconnect_stream":
        body.update(stream=True, max_tokens=item["max_tokens"] + 40)
        seen = 0
        async with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            status = r.status_code
            lines = r.aiter_lines()
            if status == 200:
                async for line in lines:
                    seen += line.startswith("data: {")
                    if seen >= item["disconnect_after"]:
                        break
            await r.aclose()
        return {**item, "status": status, "ok": status in (200, 503)}
    try:  # disconnect_whole: give up before the answer comes
        body["max_tokens"] = item["max_tokens"] + 200
        r = await c.post("/v1/completions", json=body, headers=AUTH, timeout=0.05 * item["disconnect_after"])
        return {**item, "status": r.status_code, "ok": r.status_code in (200, 503)}
    except httpx.TimeoutException:
        return {**item, "status": None, "ok": True}


def crossed(results: list[dict]) -> list[str]:
    """Greedy texts of one prompt must be prefixes of each other (longer max_tokens, longer text)."""
    by_prompt: dict[int, list[dict]] = {}
    for r in results:
        if r.get("text") is not None:
            by_prompt.setdefault(r["prompt"], []).append(r)
    problems = []
    for p, rs in by_prompt.items():
        longest = max(rs, key=lambda r: r["max_tokens"])["text"]
        problems += [f"request {r['i']} (prompt {p}) is not a prefix of the longest answer" for r in rs
                     if not longest.startswith(r["text"])]
    return problems


async def one_retried(c: httpx.AsyncClient, item: dict, prompts: list[str]) -> dict:
    """one(), again after a short pause while the server answers 503 (full), as a client would; retries counted."""
    for retry in range(RETRIES):
        result = await one(c, item, prompts)
        if result["status"] != 503:
            return {**result, "retries": retry}
        await asyncio.sleep(RETRY_PAUSE_S)
    return {**result, "retries": RETRIES, "ok": False}


async def soak(url: str, items: list[dict], prompts: list[str], clients: int, pid: int | None,
               progress_every: int) -> tuple[list[dict], list[tuple[int, int]]]:
    todo = list(reversed(items))
    results, rss = [], []

    async def worker(c):
        while todo:
            item = todo.pop()
            results.append(await one_retried(c, item, prompts))
            if pid and len(results) % progress_every == 0:
                rss.append((len(results), rss_kib(pid)))
                print(f"  {len(results)} done, server RSS {rss[-1][1] / 1024:.0f} MiB", flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as c:
        await asyncio.gather(*(worker(c) for _ in range(clients)))
    return results, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests in all (default 2000)")
    ap.add_argument("--clients", type=int, default=16, help="requests in flight at once (default 16)")
    ap.add_argument("--device", default="cpu", help="the server's --device (default cpu)")
    ap.add_argument("--parallel", type=int, default=8, help="the server's --parallel (default 8)")
    ap.add_argument("--max-queue", type=int, default=6, help="the server's --max-queue (default 6: some 503s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="60 requests from 8 clients (smoke run)")
    add_run_args(ap)  # --threads: the server's; --out
    args = ap.parse_args()
    if args.quick:
        args.requests, args.clients = 60, 8
    text = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
    rng = random.Random(args.seed)
    prompts = [text[s:s + rng.randint(1, 300)] for s in (rng.randrange(len(text) - 400) for _ in range(40))]
    items = plan(args.requests, args.seed, prompts)
    server_args = ["--device", args.device, "--parallel", str(args.parallel), "--max-queue", str(args.max_queue), "--api-key", KEY,
                   "--metrics"] + (["--threads", str(args.threads)] if args.threads else [])
    with ServerProcess(*server_args) as server:
        asyncio.run(soak(server.url, plan(20, args.seed + 1, prompts), prompts, 4, None, 10**9))  # warm-up
        rss_start = rss_kib(server.pid)
        t0 = time.perf_counter()
        results, rss = asyncio.run(soak(server.url, items, prompts, args.clients, server.pid,
                                        max(args.requests // 10, 1)))
        seconds = time.perf_counter() - t0
        rss_end = rss_kib(server.pid)
        alive = server.proc.poll() is None and httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        load = {name: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                for name in ("num_requests_running", "num_requests_waiting", "kv_slots_used")
                if line.startswith(f"moeserve:{name}{{")}
    ids = [r["id"] for r in results if r.get("id")]
    failures = [r for r in results if not r["ok"]]
    problems = crossed(results) + [f"request {r['i']} ({r['kind']} {r.get('bad', '')}): status {r['status']}"
                                   for r in failures]
    if len(results) != len(items):
        problems.append(f"{len(items) - len(results)} requests lost")
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} duplicated response ids")
    if not alive or any(load.values()):
        problems.append(f"server alive {alive}, load at the end {load}")
    config = {k: getattr(args, k) for k in ("requests", "clients", "device", "parallel", "max_queue", "threads", "seed",
                                          "quick")}
    record = result_record("serve_soak", {**config, "kinds": KINDS}, device=args.device)
    record.update(seconds=round(seconds, 1), outcomes=dict(Counter((r["kind"], r["status"]) for r in results)),
                  retried_503=sum(r.get("retries", 0) for r in results), responses=len(ids),
                  distinct_ids=len(set(ids)), rss_kib_start=rss_start, rss_kib_end=rss_end,
                  rss_kib_samples=rss, server_alive=alive, load_at_end=load, problems=problems[:50],
                  passed=not problems)
    record["outcomes"] = {f"{k[0]}:{k[1]}": v for k, v in record["outcomes"].items()}
    summary = ("seconds", "outcomes", "retried_503", "responses", "distinct_ids", "rss_kib_start", "rss_kib_end",
               "server_alive", "load_at_end", "passed")
    print(json.dumps({k: record[k] for k in summary}, indent=1))
    for p in problems[:20]:
        print("PROBLEM:", p)
    print(f"wrote {write_result(record, args.out)}")
    sys.exit(0 if not problems else 1)


if __name__ == "__main__":
    main()
