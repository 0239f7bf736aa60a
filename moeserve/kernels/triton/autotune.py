"""Launch configs found on the GPU the first time they are needed, then kept in the user's tuning cache.

A kernel family asks `choose` for the config of a call (its section, shape and token count). Where this GPU's
tables (shipped or cached) hold an entry for the call's token bucket (the power of two at or below its count), or
where tuning is off, the family's lookup answers (a stored entry, else the default from the GPU's properties).
Otherwise a bounded search times the family's candidates (spaces.py) against that answer, with one progress line on
stderr, and stores the winner in the cache (tune_cache.py) so later runs and processes start with it.

MOESERVE_TUNE=off|quick|full (default quick) sets the search; off: defaults and stored entries only. A CUDA-graph
capture never includes a search: while the current stream is capturing, the lookup answers (logged) and the bucket is
tuned at the next eager call; the engine's warm-up runs before each capture are eager, so they tune.

The search is coordinate-wise over an MoE's two projections: gate_up's candidates with down at the default, then
down's with the best gate_up, each timed as the whole experts call (search; the timer is injected, so the search,
budget and caching logic run without a GPU in the tests)."""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeserve.errors import MoeserveError
from moeserve.kernels.cuda_graph import capture
from moeserve.kernels.triton import tune_cache
from moeserve.kernels.triton.configs import ExpertsConfig, clear_lookups, stored, write_sections
from moeserve.kernels.triton.device import DeviceInfo

log = logging.getLogger(__name__)

MODES = ("off", "quick", "full")
BUDGET_S = {"quick": 20.0, "full": 90.0}  # seconds of search per (section, shape, bucket); compiles included
AUTO_MAX_TOKENS = 64  # buckets tuned by themselves: decode and batch decode (`moeserve tune --tokens` for more)
PARTS = ("gate_up", "down")


def tune_mode() -> str:
    """MOESERVE_TUNE, checked: off, quick (default) or full."""
    mode = os.environ.get("MOESERVE_TUNE", "quick").strip().lower() or "quick"
    if mode not in MODES:
        raise MoeserveError(f"MOESERVE_TUNE must be off, quick or full, got {os.environ['MOESERVE_TUNE']!r}")
    return mode


def bucket(tokens: int) -> int:
    """The token count a call's config is tuned and stored at: the largest power of two <= tokens."""
    return 1 << (max(tokens, 1).bit_length() - 1)


@dataclass(frozen=True)
class Problem:
    """What one search tunes: a table section, a shape key in it, a token bucket."""

    section: str  # "lowbit_moe" or "fused_moe"
    shape: str
    tokens: int

    def __str__(self) -> str:
        return f"{self.section} {self.shape} at {self.tokens} token{'s' if self.tokens > 1 else ''}"


@dataclass(frozen=True)
class Outcome:
    """A search's result: the winner and its time, the starting config's time, what was timed and how long it took."""

    config: ExpertsConfig
    ms: float
    default_ms: float
    timed: int  # candidates timed (compiled and run), the default included
    failed: int  # candidates that did not run here (shared memory, registers): skipped
    seconds: float
    complete: bool  # False: the budget ran out before the last candidate

    @property
    def speedup(self) -> float:
        return self.default_ms / self.ms if self.ms > 0 and math.isfinite(self.default_ms) else 1.0


def search(default: ExpertsConfig, candidates: dict[str, Sequence], measure: Callable[[ExpertsConfig], float],
           budget_s: float, clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """Coordinate-wise search from `default`: each of gate_up's candidates with the best down so far, then each of
    down's with the best gate_up; measure(config) -> ms of the whole experts call (an exception: the candidate does
    not run here, skipped). Stops starting candidates once budget_s has passed; the default always competes."""
    start = clock()
    timed = failed = 0

    def timing(config: ExpertsConfig) -> float:
        nonlocal timed, failed
        try:
            ms = float(measure(config))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (resources, compile): not a winner
            failed += 1
            log.debug("tuning: %s failed: %s: %s", config.as_dict(), type(e).__name__, str(e)[:200])
            return math.inf
        timed += 1
        return ms

    best, best_ms = default, timing(default)
    default_ms = best_ms
    complete = True
    for part in PARTS:
        for cfg in candidates.get(part, ()):
            if clock() - start > budget_s:
                complete = False
                break
            trial = ExpertsConfig(**{p: cfg if p == part else getattr(best, p) for p in PARTS})
            if trial == best:
                continue
            ms = timing(trial)
            if ms < best_ms:
                best, best_ms = trial, ms
    return Outcome(best, best_ms, default_ms, timed, failed, clock() - start, complete)


def gpu_ms(fn: Callable[[object], object], items: Sequence, replays: int = 10) -> float:
    """Median GPU ms per call of fn over the rotating items: a CUDA graph holding one call per item, replayed (decode
    replays graphs, and eager times of 20-us kernels are host noise); CUDA events around eager calls where the
    capture fails."""
    try:
        run = capture(lambda: [fn(item) for item in items], 1, torch.device("cuda"))[0].replay
    except RuntimeError:  # a launch that cannot be captured: eager calls, host time included
        def run():
            for item in items:
                fn(item)
    times = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(items))
    return statistics.median(times[2:])


def store(device: DeviceInfo, problem: Problem, config: ExpertsConfig) -> None:
    """Write a winner into the user's tuning cache of this GPU (merged with what other processes wrote)."""
    entry = {part: getattr(config, part).replace(ms=None).as_dict() for part in PARTS}
    write_sections(device.name, {"hardware": device.as_dict(),
                                 problem.section: {problem.shape: {str(problem.tokens): entry}}},
                   tune_cache.table_file(device.slug, device.capability))


def tune(device: DeviceInfo, problem: Problem, default: ExpertsConfig, candidates: dict[str, Sequence],
         measure: Callable[[ExpertsConfig], float], mode: str, budget_s: float | None = None,
         quiet: bool = False) -> Outcome:
    """Search (mode "quick" or "full", at most budget_s, default BUDGET_S[mode]) and store the winner; one progress
    line on stderr unless quiet."""
    budget = BUDGET_S[mode] if budget_s is None else budget_s
    if not quiet:
        print(f"moeserve: tuning {problem} on {device.name} ({mode}, at most {budget:.0f} s; stored in "
              f"{tune_cache.tuning_dir()}) ...", end="", file=sys.stderr, flush=True)
    outcome = search(default, candidates, measure, budget)
    if math.isfinite(outcome.ms):
        store(device, problem, outcome.config)
    if not quiet:
        print(f" {outcome.default_ms:.4f} -> {outcome.ms:.4f} ms ({outcome.timed} configs in {outcome.seconds:.0f} s"
              f"{'' if outcome.complete else ', budget reached'})", file=sys.stderr, flush=True)
    return outcome


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no search may run then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_chosen: dict[tuple, ExpertsConfig] = {}  # (GPU, section, shape, tokens) -> the config calls get, this process


def choose(device: DeviceInfo, section: str, shape: str, tokens: int, lookup: Callable[[int], ExpertsConfig],
           candidates: Callable[[str, int], dict[str, Sequence]],
           timer: Callable[[int], Callable[[ExpertsConfig], float]]) -> ExpertsConfig:
    """The config of a call at `tokens` tokens: lookup(tokens) (stored entry or default), after tuning its bucket
    where nothing is stored for it, tuning is on and no CUDA graph is being captured. candidates(mode, bucket) and
    timer(bucket) -> measure are the family's search space and timing, made only when a search runs."""
    key = (device.name, section, shape, tokens)
    if key in _chosen:
        return _chosen[key]
    size = bucket(tokens)
    mode = tune_mode()
    if mode != "off" and size <= AUTO_MAX_TOKENS and not stored(device.name, section, shape, size):
        if capturing():
            log.info("not tuning %s during a CUDA-graph capture: the default config for now", Problem(section, shape,
                                                                                                       size))
            return lookup(tokens)
        tune(device, Problem(section, shape, size), lookup(size), candidates(mode, size), timer(size), mode)
    _chosen[key] = config = lookup(tokens)
    return config


def forget() -> None:
    """Forget the configs chosen in this process and every table read (after MOESERVE_TUNE or the tables changed)."""
    _chosen.clear()
    clear_lookups()
