"""What several commands share: input checks made before anything loads, and the run path's status lines."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from moeserve import runtime
from moeserve.build import Runtime, build, describe_hybrid
from moeserve.cli.options import DEFAULT_SERVE_CONTEXT
from moeserve.config import RunConfig
from moeserve.errors import MoeserveError
from moeserve.loader import resolve_device
from moeserve.spec import ModelSpec


def is_main_rank() -> bool:
    """Rank 0 of a torchrun launch, or a single process: the one that prints status lines."""
    return os.environ.get("RANK", "0") == "0"


def prepare(config: RunConfig, spec: ModelSpec, kv_batch: int, kv_tokens: int) -> runtime.RunPlan:
    """runtime.prepare, and on stderr (rank 0) what --gpu-memory limits without a GPU and the planner's one line
    when it chose the placement."""
    plan = runtime.prepare(config, spec, kv_batch, kv_tokens)
    if not is_main_rank():
        return plan
    if config.gpu_memory is not None and resolve_device(plan.device).type != "cuda":
        limits = ("host RAM for the expert cache's slots (planned after the dense weights and KV cache)"
                  if config.offload else "nothing: every part runs on the CPU, within the RAM available")
        print(no_gpu_budget_note(config.gpu_memory, limits), file=sys.stderr, flush=True)
    if plan.plan_line:
        print(plan.plan_line, file=sys.stderr, flush=True)
    return plan


def no_gpu_budget_note(size, limits: str) -> str:
    """The one line that says what --gpu-memory SIZE limits on a run without a GPU."""
    return f"moeserve: note: the run has no GPU, so --gpu-memory {size} limits {limits}"


def offload_line(run: Runtime) -> str | None:
    """An --offload run's cache in one line: its slots, where they are, and what a miss does. Mixed precision is
    offload's default and changes the output, so the line says so and names --all-high, which turns it off."""
    if run.cache is None:
        return None
    config, st = run.plan.config, run.cache.summary()
    where = "GPU memory" if run.model.device.type == "cuda" else "host RAM"
    budget = f", planned from --gpu-memory {config.gpu_memory}" if config.gpu_memory is not None else ""
    if config.cache.all_high:
        misses = "--all-high: every expert at full precision, the output equal to the resident model's"
    else:
        misses = (f"mixed precision (HOBBIT): by gate weight a missed expert may run its "
                  f"{run.plan.store.meta['low_bits']}-bit copy or be skipped, which changes the output; --all-high "
                  f"runs every expert at full precision")
    return (f"[offload: experts from {config.offload}, cached in {st['high_slots']} high + {st['low_slots']} low "
            f"slots in {where}{budget}, policy {st['policy']}; {misses}]")


def ctx_size(given: int | None, spec: ModelSpec) -> int:
    """Tokens of context a serve or chat run keeps: --ctx-size (between 2 and the model's context), else the model's
    context capped at DEFAULT_SERVE_CONTEXT."""
    context = spec.max_position_embeddings
    if given is not None and not 2 <= given <= context:
        raise MoeserveError(f"--ctx-size {given} must be between 2 and the model's context of {context} tokens")
    return min(context, DEFAULT_SERVE_CONTEXT) if given is None else given


def load(plan: runtime.RunPlan) -> Runtime:
    """build with progress; the hybrid placement's line on stderr; under --ep/--tp only rank 0 prints."""
    run = build(plan, progress=True)
    if plan.config.parallel.ranks > 1 and not is_main_rank():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one copy of the output, from rank 0
    for line in (describe_hybrid(run), offload_line(run)):
        if line and is_main_rank():
            print(line, file=sys.stderr, flush=True)
    return run


def check_output_path(path: str, flag: str) -> None:
    """A file the command will write: not a directory, in an existing writable directory, writable itself."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise MoeserveError(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise MoeserveError(f"cannot write {flag} {path}: {parent} {problem}")
    if not os.access(out if out.exists() else parent, os.W_OK):
        raise MoeserveError(f"cannot write {flag} {path}: permission denied")


def check_utf8(texts: list[str]) -> None:
    """Prompts from the command line hold undecodable bytes as surrogates (PEP 383); name the first one."""
    for n, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            char = ord(text[e.start])
            byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
            raise MoeserveError(f"prompt {n} is not valid UTF-8 ({byte} at position {e.start})") from None


def read_text(path: str | None, model: str, flag: str) -> tuple[Path, str]:
    """A UTF-8 text file, by default the model directory's heldout.txt."""
    text_path = Path(path) if path else Path(model) / "heldout.txt"
    if not text_path.is_file():
        raise MoeserveError(f"text file {str(text_path)!r} not found" + ("" if path else f"; pass {flag} FILE"))
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MoeserveError(f"{text_path} is not UTF-8 text") from None
    if not text.strip():
        raise MoeserveError(f"{text_path} is empty")
    return text_path, text


def token_counts(text: str) -> tuple[int, ...]:
    """--tokens: comma-separated positive token counts."""
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise MoeserveError(f"--tokens must be positive integers separated by commas, got {text!r}")
    return counts


def json_ready(value):
    """`value` with every non-finite float (a ratio over zero, an unbounded rate) as None: JSON has no Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
