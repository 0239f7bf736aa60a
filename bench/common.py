"""Helpers shared by the bench scripts: run records, timing, and the measured rates floors are built from.

Rules (docs: BENCHMARKS.md): floors first, ratios side by side in one run, medians, rotating inputs,
never zeros, one JSON per run with commit, device, versions, config, every figure and its floor.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"


# ---- run record ---------------------------------------------------------------------------------


def git_state() -> dict:
    """Commit of the checkout and whether tracked files differ from it. MOESERVE_GIT_COMMIT overrides
    (for copies of the tree without .git, e.g. on a remote GPU machine)."""
    override = os.environ.get("MOESERVE_GIT_COMMIT")
    if override:
        return {"commit": override, "dirty": None, "source": "MOESERVE_GIT_COMMIT"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True, timeout=10).stdout
        return {"commit": commit, "dirty": bool(status.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "source": "unavailable (no git checkout)"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device | str | None = None) -> str:
    """GPU name for a CUDA device (default: CUDA if available), else the CPU model."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken install: record that, don't crash the bench
        return None


def result_record(name: str, config: dict, device: torch.device | str | None = None) -> dict:
    """The fields every result JSON carries; the script adds its figures and floors."""
    now = _dt.datetime.now(_dt.timezone.utc)
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    return {
        "name": name,
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": git_state(),
        "device": device_name(dev),
        "device_type": dev.type,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "config": config,
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def write_result(record: dict, out_dir: str | Path | None = None) -> Path:
    """bench/results/<name>[-quick]-<device-slug>-<date>.json (out_dir overrides the folder)."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace("-", "").replace(":", "").replace("T", "-").rstrip("Z")
    name = record["name"] + ("-quick" if record.get("config", {}).get("quick") else "")
    path = out / f"{name}-{slug(record['device'])}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


# ---- timing -------------------------------------------------------------------------------------


def _rotating(fn: Callable, inputs: Sequence) -> Callable[[], object]:
    state = {"i": 0}

    def call():
        x = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        return fn(x)

    return call


def time_fn(fn: Callable, inputs: Sequence, device: torch.device | str = "cpu", reps: int = 20,
            warmup: int = 3) -> float:
    """Median milliseconds of fn(x), x cycling through `inputs` (so no single input sits in cache).

    CUDA: triton.testing.do_bench (median; it also flushes L2 between calls), CUDA events without
    triton. CPU: median of `reps` time.perf_counter runs after `warmup` calls.
    """
    call = _rotating(fn, inputs)
    if torch.device(device).type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            try:
                return float(do_bench(call, warmup=25, rep=100, return_mode="median"))
            except TypeError:  # a triton without return_mode: CUDA events below
                pass
        for _ in range(warmup):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_cuda_graph(fn: Callable, inputs: Sequence, reps: int = 20) -> float:
    """Median GPU milliseconds per fn(x) call with no host launch overhead: one CUDA graph holds a call per
    input (rotating inputs larger than L2 keep the cache from flattering), timed per replay."""
    graph = capture_graph(fn, inputs)
    return time_fn(lambda _: graph.replay(), [None], "cuda", reps=reps) / len(inputs)


def capture_graph(fn: Callable, inputs: Sequence) -> "torch.cuda.CUDAGraph":
    """One CUDA graph holding a call of fn per input, after a warm-up on a side stream (compilation, lazy
    allocations), as capturing requires: moeserve's one capture helper (kernels/cuda_graph.capture)."""
    from moeserve.kernels.cuda_graph import capture

    return capture(lambda: [fn(x) for x in inputs], 1, torch.device("cuda"))[0]


def add_run_args(ap) -> None:
    """--threads and --out, as every bench script takes them."""
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")


def add_tuner_args(ap, shapes: dict, tokens) -> None:
    """The kernel tuners' shared options: --shapes, --tokens, --workers, --no-write, --out."""
    ap.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated subset of {','.join(shapes)}")
    ap.add_argument("--tokens", default=",".join(map(str, tokens)), help="comma-separated token counts")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="processes that compile the candidates first (1: compile while timing)")
    ap.add_argument("--no-write", action="store_true", help="print and save results, leave the config JSON alone")
    ap.add_argument("--out", default=None, help="folder for the result JSON (default bench/results/)")


def tuner_shapes(args, shapes: dict, tool: str) -> list[str]:
    """The shape names --shapes chose; exits with one line without a CUDA GPU or for an unknown shape."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs a CUDA GPU (it times Triton kernels)")
    chosen = args.shapes.split(",")
    unknown = set(chosen) - set(shapes)
    if unknown:
        sys.exit(f"unknown shape(s) {sorted(unknown)}; choose from {sorted(shapes)}")
    return chosen


def run_device(args) -> tuple[torch.device, torch.dtype]:
    """Apply --threads; (device, dtype): bf16 on a GPU unless --quick, else fp32 on the CPU."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.quick
    return torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- measured rates (for floors) ----------------------------------------------------------------


def measure_hbm_bandwidth(device: torch.device | str = "cuda", nbytes: int | None = None) -> dict:
    """Memory bandwidth of a large copy on `device`, bytes read + written per second.

    Default size: 1 GiB on a GPU (far beyond L2), 256 MiB on a CPU (beyond any last-level cache).
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    n = nbytes // 4
    src = [torch.rand(n, device=device), torch.rand(n, device=device)]  # two sources: rotate, never zeros
    dst = torch.empty(n, device=device)
    ms = time_fn(lambda s: dst.copy_(s), src, device, reps=10, warmup=2)
    nbytes = n * 4
    return {"bytes_per_s": 2 * nbytes / (ms * 1e-3), "copy_bytes": nbytes, "ms": ms,
            "method": "device-to-device copy, read+write counted"}


def measure_dram_read_bandwidth(nbytes: int = 1 << 30) -> dict:
    """CPU memory read bandwidth: a float32 sum over two rotating buffers of `nbytes` each (far beyond
    the last-level cache), with torch's current thread count. The floor for weight-streaming GEMV."""
    n = nbytes // 4
    bufs = [torch.rand(n), torch.rand(n)]
    ms = time_fn(lambda b: b.sum(), bufs, "cpu", reps=7, warmup=2)
    return {"bytes_per_s": n * 4 / (ms * 1e-3), "bytes": n * 4, "ms": ms, "threads": torch.get_num_threads(),
            "method": "float32 sum of a buffer beyond the last-level cache, read bytes counted"}


def measure_matmul_flops(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                         n: int | None = None) -> dict:
    """Dense n x n x n matmul rate in FLOP/s (8192 on a GPU, 1024 on a CPU by default)."""
    device = torch.device(device)
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    a = [torch.randn(n, n, device=device, dtype=dtype) for _ in range(2)]
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_fn(lambda x: x @ b, a, device, reps=5, warmup=1)
    return {"flop_per_s": 2 * n ** 3 / (ms * 1e-3), "n": n, "dtype": str(dtype).removeprefix("torch."), "ms": ms}


@dataclass
class CpuBench:
    """What a CPU kernel bench starts from: its options (--quick, --threads, --out), the CPU, its best ISA, the
    kernels' register tile for it and the measured DRAM read bandwidth (a record, measure_dram_read_bandwidth's)."""
    args: argparse.Namespace
    info: object
    isa: str
    tile: tuple[int, int]
    dram: dict


def start_cpu_bench(description: str, dram_bytes: int) -> CpuBench:
    """Parse a CPU kernel bench's options, set torch's threads, and print the machine line (dram_bytes: the DRAM
    measurement's buffer; --quick uses 64 MiB)."""
    from moeserve.kernels.cpu import gemv
    from moeserve.kernels.cpu.machine import cpu_info

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: all cores)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = cpu_info()
    isa = info.isas[0]
    tile = gemv.tile_for(isa)
    dram = measure_dram_read_bandwidth(64 << 20 if args.quick else dram_bytes)
    print(f"{info.model}: {torch.get_num_threads()} threads, ISA {isa}, tile {tile}, "
          f"DRAM read {dram['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    return CpuBench(args, info, isa, tile, dram)
