"""HardwareProfile: the rates the throughput planner needs, measured once per machine and cached.

Each figure comes from a short measurement (a few hundred ms): matmul FLOP/s, copy bandwidth of each
memory, and the host<->device link at several chunk sizes (the pipeline streams weights in pages, and
small copies do not reach the link's peak). GPU fields are None on a machine without CUDA. The profile
is stored as JSON under the moeserve cache (`MOESERVE_CACHE`, else ~/.cache/moeserve) keyed by the GPU
and CPU names; `from_dict` takes a hand-written profile (e.g. another machine's figures) as well.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeserve.errors import MoeserveError
from moeserve.timing import link_bandwidth, seconds_per_call

# torch, the CPU-kernel modules and the pipeline are imported inside the functions that measure: the planner
# (roofline.py, search.py; `moeserve plan` on a stored profile) reads this module without loading torch.

MIB = 1 << 20
CHUNK_MIB = (1, 4, 16, 64)  # link chunk sizes measured


@dataclass(frozen=True)
class HardwareProfile:
    cpu_name: str
    cpu_cores: int
    cpu_fp32_flops: float  # FLOP/s, fp32 matmul with all cores
    cpu_bf16_flops: float  # FLOP/s, bf16 matmul with all cores
    dram_bandwidth: float  # B/s, host memory copy (read + write counted)
    ram_bytes: int
    gpu_name: str | None = None
    gpu_flops: float | None = None  # FLOP/s, bf16 matmul
    hbm_bandwidth: float | None = None  # B/s, device memory copy (read + write counted)
    gpu_memory_bytes: int | None = None
    h2d_bandwidth: float | None = None  # B/s, pinned host -> device, large copy
    d2h_bandwidth: float | None = None  # B/s, device -> pinned host, large copy
    h2d_pageable_bandwidth: float | None = None  # B/s, pageable host -> device
    h2d_chunk_bandwidth: dict[int, float] = field(default_factory=dict)  # chunk MiB -> B/s (pinned)
    d2h_chunk_bandwidth: dict[int, float] = field(default_factory=dict)  # chunk MiB -> B/s (pinned)
    micro_batch_overhead: float = 0.0  # s per (micro-batch, layer) of the CGOPipe executor beyond its work
    measured: str | None = None  # ISO date of the measurement; None for hand-written profiles

    @property
    def has_gpu(self) -> bool:
        return self.gpu_flops is not None and self.hbm_bandwidth is not None and self.h2d_bandwidth is not None

    @property
    def cpu_flops(self) -> float:
        """The CPU's matmul peak: kernels use whichever of fp32 / bf16 this CPU runs faster."""
        return max(self.cpu_fp32_flops, self.cpu_bf16_flops)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise MoeserveError(f"unknown hardware profile field(s): {', '.join(unknown)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise MoeserveError(f"hardware profile lacks the field(s): {', '.join(missing)}")
        data = dict(data)
        for key in ("h2d_chunk_bandwidth", "d2h_chunk_bandwidth"):  # JSON object keys are strings
            data[key] = {int(k): float(v) for k, v in (data.get(key) or {}).items()}
        return cls(**data)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise MoeserveError(f"cannot read hardware profile {str(path)!r}: {e.strerror}") from None
        except ValueError as e:
            raise MoeserveError(f"hardware profile {str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise MoeserveError(f"hardware profile {str(path)!r} must hold a JSON object")
        return cls.from_dict(data)


# ---- measurement ---------------------------------------------------------------------------


def _matmul_flops(torch, device: str, dtype, n: int, sync, budget_s: float) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / seconds_per_call(lambda: a @ b, sync, budget_s)


def _copy_bandwidth(torch, device: str, nbytes: int, sync, budget_s: float) -> float:
    """Bytes read + written per second by a large copy within one memory."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), sync, budget_s)


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def machine_names() -> tuple[str | None, str]:
    """(GPU name or None, CPU model): the key of the cached profile."""
    import torch

    from moeserve.kernels.cpu.machine import cpu_info

    return (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None), cpu_info().model


def measure(quick: bool | None = None) -> HardwareProfile:
    """Measure this machine. `quick` (default: env MOESERVE_PROFILE_QUICK=1) uses small sizes for tests."""
    import torch

    quick = os.environ.get("MOESERVE_PROFILE_QUICK") == "1" if quick is None else quick
    budget = 0.02 if quick else 0.2  # seconds per figure
    gpu_name, cpu_name = machine_names()
    cpu = dict(cpu_name=cpu_name, cpu_cores=os.cpu_count() or 1, ram_bytes=total_ram())

    def no_sync():
        return None

    cpu_n = 256 if quick else 1024
    cpu.update(cpu_fp32_flops=_matmul_flops(torch, "cpu", torch.float32, cpu_n, no_sync, budget),
               cpu_bf16_flops=_matmul_flops(torch, "cpu", torch.bfloat16, cpu_n, no_sync, budget),
               dram_bandwidth=_copy_bandwidth(torch, "cpu", (16 if quick else 256) * MIB, no_sync, budget))
    gpu = _measure_gpu(torch, budget) if gpu_name is not None else {}
    # the executor's overhead only matters to the planner, which needs a GPU profile
    overhead = micro_batch_overhead("cuda", steps=2 if quick else 6) if gpu_name is not None else 0.0
    return HardwareProfile(**cpu, gpu_name=gpu_name, **gpu, micro_batch_overhead=overhead,
                           measured=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def micro_batch_overhead(device: str, steps: int = 6, micro_batches: int = 4) -> float:
    """Seconds the CGOPipe executor spends per micro-batch and layer beyond the work itself (launches, copies,
    hand-offs to the CPU-attention worker, Python): decode steps of the shipped demo model (a Mixtral layer
    of a few MFLOP, so the time is nearly all overhead), one sequence per micro-batch, CPU attention,
    weights resident; the warm-up steps are not timed."""
    from moeserve.engine.params import SamplingParams
    from moeserve.loader import load_model
    from moeserve.plan.pipeline import Pipeline
    from moeserve.plan.policy import ThroughputPolicy

    model = load_model(Path(__file__).parent.parent / "demo", device="cpu")
    policy = ThroughputPolicy(batch_size=micro_batches, micro_batch=1, attention_on_gpu=False, ffn_on_gpu=True,
                              weights_gpu_fraction=1.0, kv_gpu_fraction=0.0)
    pipe = Pipeline(model, policy, device)
    try:
        prompts = [[(7 * r + i) % 256 for i in range(8)] for r in range(micro_batches)]
        passes = pipe.generate(prompts, SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
        next(passes), next(passes)  # prefill and the first decode step: warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            next(passes)
        elapsed = time.perf_counter() - t0
    finally:
        pipe.close()
    return elapsed / steps / (micro_batches * model.spec.num_layers)


def _measure_gpu(torch, budget: float) -> dict:
    """CUDA figures: bf16 matmul, HBM copy, pinned/pageable link in both directions and per chunk size."""
    sync = torch.cuda.synchronize
    size = 256 * MIB
    host = torch.rand(size // 4).pin_memory()
    pageable = torch.rand(size // 4)
    dev = torch.empty(size // 4, device="cuda")
    h2d = {c: link_bandwidth(host, dev, c * MIB, sync, budget) for c in CHUNK_MIB}
    d2h = {c: link_bandwidth(dev, host, c * MIB, sync, budget) for c in CHUNK_MIB}
    return dict(
        gpu_flops=_matmul_flops(torch, "cuda", torch.bfloat16, 8192, sync, budget),
        hbm_bandwidth=_copy_bandwidth(torch, "cuda", 1 << 30, sync, budget),
        gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        h2d_bandwidth=link_bandwidth(host, dev, size, sync, budget),
        d2h_bandwidth=link_bandwidth(dev, host, size, sync, budget),
        h2d_pageable_bandwidth=link_bandwidth(pageable, dev, size, sync, budget),
        h2d_chunk_bandwidth=h2d, d2h_chunk_bandwidth=d2h,
    )


# ---- cache ---------------------------------------------------------------------------------


def _slug(text: str | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (text or "no-gpu").lower()).strip("-") or "unknown"


def profile_path() -> Path:
    """Cache file of this machine's profile: <moeserve cache>/hardware/<gpu>--<cpu>.json."""
    from moeserve.kernels.cpu.build import cache_dir

    gpu, cpu = machine_names()
    return cache_dir().parent / "hardware" / f"{_slug(gpu)}--{_slug(cpu)}.json"


def load_or_measure(refresh: bool = False) -> HardwareProfile:
    """The cached profile of this machine, measured (and stored) when absent or when `refresh`."""
    path = profile_path()
    if path.is_file() and not refresh:
        try:
            return HardwareProfile.load(path)
        except MoeserveError:
            pass  # a stale or damaged cache: measure again
    profile = measure()
    profile.save(path)
    return profile
