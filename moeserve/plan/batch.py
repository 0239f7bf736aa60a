"""`moeserve batch`: prompts from a JSONL file through the throughput pipeline, results appended to a JSONL file.

Resumable: a result line is written whole and flushed as soon as its request finishes; on a restart the ids
already in the output are skipped and a trailing partial line (a write cut short) is dropped first. Malformed
input lines are reported by line number, then skipped or fatal, never silently dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moeserve.engine.sampling import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.plan.policy import Policy

HOST_SHARE = 0.8  # of the host RAM the planner may fill (the rest: OS, Python, the tokenizer)


@dataclass(frozen=True)
class Request:
    id: object  # from the input ("id"), or the line number
    prompt: str


def read_requests(path: str | Path, on_bad_line: str, warn: Callable[[str], None]) -> list[Request]:
    """Requests of a JSONL file ({"id": ..., "prompt": "..."}, blank lines ignored). A malformed line (bad JSON,
    no string "prompt", a repeated id) is reported through `warn` and skipped, or raises with on_bad_line="stop"."""
    requests, seen = [], set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MoeserveError(f"cannot read {path}: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        problem = None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problem = f"not JSON ({e.msg})"
        else:
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                problem = 'needs an object with a string "prompt"'
            elif _key(obj.get("id", number)) in seen:
                problem = f"repeats id {obj.get('id', number)!r}"
        if problem:
            message = f"{path}:{number}: {problem}"
            if on_bad_line == "stop":
                raise MoeserveError(message)
            warn(f"{message}; skipped")
            continue
        seen.add(_key(obj.get("id", number)))
        requests.append(Request(obj.get("id", number), obj["prompt"]))
    return requests


def _key(request_id) -> str:
    """Ids compare as their JSON text, so 1 and "1" stay different and any JSON value can be an id."""
    return json.dumps(request_id)


def finished_ids(path: str | Path) -> set[str]:
    """Keys of the ids in an existing output file, after cutting off a trailing partial line."""
    path = Path(path)
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(data))
    return {_key(json.loads(line)["id"]) for line in data.decode("utf-8").splitlines() if line.strip()}


def policy_for_budget(spec, policy: Policy, prompt_len: int, gen_len: int, dtype_bytes: int,
                      gpu_budget: int) -> Policy:
    """The policy with the largest resident weight fraction (steps of 0.05) whose GPU memory fits the budget,
    as the planner's memory model counts it."""
    from moeserve.plan.roofline import Candidates, Workload
    from moeserve.plan.search import memory

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
    """Generate every request not yet in `output`, batch_size requests at a time; returns counts and rates."""
    done = finished_ids(output)
    todo = [r for r in requests if _key(r.id) not in done]
    batch = pipeline.policy.batch_size
    tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="requests", unit="req", disable=not progress)
    with open(output, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            prompts = [tokenizer.encode(r.prompt) for r in chunk]
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
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s")
    bar.close()
    seconds = time.perf_counter() - t0
    return {"requests": len(todo), "skipped": len(requests) - len(todo), "tokens": tokens, "seconds": seconds}


def auto_policy(spec, prompt_len: int, gen_len: int, dtype_bytes: int, gpu_budget: int | None,
                profile: str | None = None, host_weights: int | None = None) -> Policy:
    """The planner's choice for this workload on a hardware profile (a JSON file, or this machine's, cached);
    host_weights: the pinned bytes of the loaded model's layers (layer_weights.host_weight_bytes)."""
    from moeserve.plan.hardware import HardwareProfile, load_or_measure
    from moeserve.plan.roofline import Workload
    from moeserve.plan.search import search

    hw = HardwareProfile.load(profile) if profile else load_or_measure()
    budget = gpu_budget or hw.gpu_memory_bytes
    if budget is None:
        raise MoeserveError("--auto needs a GPU (or --gpu-memory) to plan for")
    wl = Workload(prompt_len, gen_len, weight_bytes=dtype_bytes, kv_bytes=dtype_bytes, act_bytes=dtype_bytes)
    return search(spec, hw, wl, budget, HOST_SHARE * hw.ram_bytes, host_weights=host_weights).policy
