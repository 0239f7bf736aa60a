"""`moeserve bench`: llama-bench's two tests on a loaded model, whatever its placement, so users can measure their
own machine.

  pp<P>  prompt processing: one forward pass over P random tokens into an empty KV cache (batch 1)
  tg<N>  text generation: N greedy decode steps after a one-token prompt (batch 1), as `generate` runs them
         (a CUDA graph where the model allows one)

Each test runs once untimed (kernel compilation, graph capture, caches filling) and then `repetitions` times;
tok/s is reported as mean and standard deviation over the repetitions, with the peak GPU memory allocated during
the test and the process's peak resident host memory. Token ids are drawn from a generator seeded with `seed`.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moeserve.engine.generate import iterate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.model.kv_cache import KVCache
from moeserve.units import format_bytes


@dataclass(frozen=True)
class BenchResult:
    test: str  # "pp512" or "tg128"
    tokens: int  # tokens per repetition
    seconds: tuple[float, ...]  # wall time of each timed repetition
    gpu_peak_bytes: int | None  # peak GPU memory allocated during the test (None: the model is on the CPU)
    host_peak_bytes: int  # peak resident memory of the process so far

    @property
    def rates(self) -> list[float]:
        return [self.tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def std(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.mean, "tok_s_std": self.std}


def check_bench(spec, prompt_tokens: int, gen_tokens: int, repetitions: int) -> None:
    """One line for sizes no run can take: non-positive, or beyond the model's context."""
    if min(prompt_tokens, gen_tokens, repetitions) < 1:
        raise MoeserveError("-p, -n and -r must be >= 1")
    context = spec.max_position_embeddings
    if prompt_tokens > context or gen_tokens + 2 > context:  # tg: a one-token prompt, its token, N steps
        raise MoeserveError(f"-p {prompt_tokens} / -n {gen_tokens} do not fit the model's context of {context} tokens "
                            f"(-p at most {context}, -n at most {context - 2})")


def host_peak_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_pass(model, tokens: torch.Tensor) -> float:
    """Seconds of one forward pass over tokens [1, P] into a fresh KV cache of P slots."""
    kv = KVCache(model.spec, 1, tokens.shape[1], model.device, model.dtype)
    _sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(tokens, kv=kv, last_only=True)
    _sync(model.device)
    return time.perf_counter() - t0


def decode_steps(model, first: int, steps: int, cuda_graph: bool) -> float:
    """Seconds of `steps` greedy decode steps after the one-token prompt [first] (its prefill not counted)."""
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    t0 = None
    for _ in iterate(model, [[first]], params, cuda_graph=cuda_graph):  # a step's token is on the host
        t0 = time.perf_counter() if t0 is None else t0
    return time.perf_counter() - t0


def run_bench(model, prompt_tokens: int, gen_tokens: int, repetitions: int, seed: int = 0, cuda_graph: bool = True,
              on_run: Callable[[str, int, float], None] | None = None) -> list[BenchResult]:
    """[pp result, tg result]; on_run(test, repetition (0: the warm-up), seconds) after each run."""
    g = torch.Generator().manual_seed(seed)
    V, device = model.spec.vocab_size, model.device
    tests = (
        (f"pp{prompt_tokens}", prompt_tokens,
         lambda: prompt_pass(model, torch.randint(0, V, (1, prompt_tokens), generator=g).to(device))),
        (f"tg{gen_tokens}", gen_tokens,
         lambda: decode_steps(model, int(torch.randint(0, V, (1,), generator=g)), gen_tokens, cuda_graph)),
    )
    out = []
    for name, tokens, run in tests:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for rep in range(repetitions + 1):
            s = run()
            seconds += [s] if rep else []
            if on_run is not None:
                on_run(name, rep, s)
        gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out.append(BenchResult(name, tokens, tuple(seconds), gpu, host_peak_bytes()))
    return out


def table(results: list[BenchResult], model_name: str, placement: str) -> str:
    """A markdown table like llama-bench's: one row per test."""
    header = ("model", "placement", "test", "t/s", "GPU peak", "host peak RSS")
    rows = [(model_name, placement, r.test, f"{r.mean:,.2f} ± {r.std:,.2f}",
             "-" if r.gpu_peak_bytes is None else format_bytes(r.gpu_peak_bytes), format_bytes(r.host_peak_bytes))
            for r in results]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    right = {2, 3, 4, 5}

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
