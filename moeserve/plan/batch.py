"""`moeserve batch`: prompts from a JSONL file through the throughput pipeline, results appended to a JSONL file.

Resumable: a result line is written whole and flushed as soon as its request finishes; on a restart the ids
already in the output are skipped and a trailing partial line (a write cut short) is dropped first. Malformed
input lines (not UTF-8, not JSON, a bad id, a prompt too long for the model) are reported by line number, then
skipped or fatal, each decided on its own and never silently dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.plan.hardware import HardwareProfile, load_or_measure
from moeserve.plan.policy import ThroughputPolicy
from moeserve.plan.roofline import Candidates, Workload
from moeserve.plan.search import memory, search
from moeserve.progress import Progress

HOST_SHARE = 0.8  # of the host RAM the planner may fill (the rest: OS, Python, the tokenizer)


@dataclass(frozen=True)
class Request:
    id: str | int  # from the input ("id"), or the line number
    prompt: str
    line: int  # line number in the input file, for messages
    prompt_ids: tuple[int, ...] = ()  # filled by tokenize_requests


@dataclass(frozen=True)
class BadLines:
    """What to do with a malformed input line: report it by file and line number, then skip it (warn) or stop
    the run (stop=True raises MoeserveError)."""
    path: str
    stop: bool
    warn: Callable[[str], None]

    def report(self, number: int, problem: str) -> None:
        message = f"{self.path}:{number}: {problem}"
        if self.stop:
            raise MoeserveError(message)
        self.warn(f"{message}; skipped")


def read_requests(path: str | Path, bad: BadLines) -> list[Request]:
    """Requests of a JSONL file ({"id": ..., "prompt": "..."}, blank lines ignored). A malformed line (not UTF-8,
    bad JSON, no string "prompt", an id that is not a string or integer, a repeated id) goes to `bad`."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise MoeserveError(f"cannot read {path}: {e.strerror or e}") from None
    requests, seen = [], set()
    for number, raw in enumerate(data.split(b"\n"), 1):
        parsed = _parse_line(raw, number)
        if isinstance(parsed, Request) and _key(parsed.id) in seen:
            parsed = f"repeats id {parsed.id!r}"
        if isinstance(parsed, str):
            bad.report(number, parsed)
        elif parsed is not None:
            seen.add(_key(parsed.id))
            requests.append(parsed)
    return requests


def _parse_line(raw: bytes, number: int) -> Request | str | None:
    """One input line: its Request, what is wrong with it, or None for a blank line."""
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        return 'needs an object with a string "prompt"'
    request_id = obj.get("id", number)
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        return f"id must be a string or an integer, not {json.dumps(request_id)}"
    return Request(request_id, obj["prompt"], number)


def tokenize_requests(requests: list[Request], tokenizer, context: int, bad: BadLines) -> list[Request]:
    """The requests with their prompt ids; a prompt with no tokens, or too long to leave room for one new
    token in the model's context, goes to `bad` under its line number."""
    out = []
    for r in requests:
        ids = tokenizer.encode(r.prompt)
        if not ids:
            bad.report(r.line, "the prompt has no tokens")
        elif len(ids) >= context:
            bad.report(r.line, f"prompt of {len(ids)} tokens does not fit the model's context of {context} tokens")
        else:
            out.append(replace(r, prompt_ids=tuple(ids)))
    return out


def _key(request_id: str | int) -> str:
    """Ids compare as their JSON text, so 1 and "1" stay different."""
    return json.dumps(request_id)


def finished_ids(path: str | Path) -> set[str]:
    """Keys of the ids in an existing output file; a trailing partial line (a write cut short) is ignored.
    Reads only: a file that is not moeserve batch output raises before anything runs."""
    path = Path(path)
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keys = set()
    for number, line in enumerate(data[:data.rfind(b"\n") + 1].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            keys.add(_key(json.loads(line)["id"]))
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
            raise MoeserveError(f"{path}:{number}: not a result line of `moeserve batch`; give another --output") \
                from None
    return keys


def drop_partial_line(path: str | Path) -> None:
    """Cut a trailing partial line (a write cut short) off an output file, so appending starts a new line."""
    path = Path(path)
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)


def policy_for_budget(spec, policy: ThroughputPolicy, prompt_len: int, gen_len: int, dtype_bytes: int,
                      gpu_budget: int) -> ThroughputPolicy:
    """The policy with the largest resident weight fraction (steps of 0.05) whose GPU memory fits the budget,
    as the planner's memory model counts it."""
    wl = Workload(prompt_len, gen_len, weight_bytes=dtype_bytes, kv_bytes=dtype_bytes, act_bytes=dtype_bytes)
    for step in range(20, -1, -1):
        candidate = replace(policy, weights_gpu_fraction=step / 20)
        gpu, _ = memory(spec, wl, Candidates.of([candidate]))
        if sum(float(np.asarray(v).reshape(-1)[0]) for v in gpu.values()) <= gpu_budget:
            return candidate
    raise MoeserveError(f"GPU budget of {gpu_budget} bytes is too small for this policy even with all weights "
                        "streamed; lower the batch or micro-batch size")


def run_batch(pipeline, tokenizer, requests: list[Request], params: SamplingParams, output: str | Path,
              progress: bool = True) -> dict:
    """Generate every request (from tokenize_requests) not yet in `output`, batch_size requests at a time;
    returns counts and rates. progress: requests done on stderr (a bar on a terminal, else a line every few s)."""
    done = finished_ids(output)
    todo = [r for r in requests if _key(r.id) not in done]
    batch = pipeline.policy.batch_size
    tokens, t0 = 0, time.perf_counter()
    drop_partial_line(output)
    with open(output, "a", encoding="utf-8") as out, Progress(len(todo), "requests", "req", progress) as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            prompts = [list(r.prompt_ids) for r in chunk]
            written = set()
            for gens, _, _ in pipeline.generate(prompts, params, tokenizer=tokenizer):
                for b, g in enumerate(gens):
                    if g.finish_reason and b not in written:
                        written.add(b)
                        out.write(json.dumps({"id": chunk[b].id, "text": g.text, "finish_reason": g.finish_reason,
                                              "prompt_tokens": len(g.prompt_ids),
                                              "completion_tokens": len(g.token_ids)}) + "\n")
                        out.flush()
                        tokens += len(g.token_ids)
                        bar.update(1)
                bar.update(0, note=f"{tokens / (time.perf_counter() - t0):.1f} tok/s")
    seconds = time.perf_counter() - t0
    return {"requests": len(todo), "skipped": len(requests) - len(todo), "tokens": tokens, "seconds": seconds}


def auto_policy(spec, prompt_len: int, gen_len: int, dtype_bytes: int, gpu_budget: int | None,
                profile: str | None = None, host_weights: int | None = None) -> ThroughputPolicy:
    """The planner's choice for this workload on a hardware profile (a JSON file, or this machine's, cached);
    host_weights: the pinned bytes of the loaded model's layers (layer_weights.host_weight_bytes)."""
    hw = HardwareProfile.load(profile) if profile else load_or_measure()
    budget = gpu_budget or hw.gpu_memory_bytes
    if budget is None:
        raise MoeserveError("--auto needs a GPU (or --gpu-memory) to plan for")
    wl = Workload(prompt_len, gen_len, weight_bytes=dtype_bytes, kv_bytes=dtype_bytes, act_bytes=dtype_bytes)
    return search(spec, hw, wl, budget, HOST_SHARE * hw.ram_bytes, host_weights=host_weights).policy
