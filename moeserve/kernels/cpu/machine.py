"""What this CPU offers the kernel generator: SIMD ISA, vector registers, cache sizes, model name."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from moeserve.errors import MoeserveError

# ISA -> (lanes of float32 per vector, vector registers, compiler flags); best first
ISAS = {
    "avx512": (16, 32, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma")),
    "avx2": (8, 16, ("-mavx2", "-mfma", "-mf16c")),
    "portable": (8, 16, ()),  # GCC/Clang vector extensions: any CPU, the compiler picks the instructions
    # int8 activations on VNNI's u8 x s8 dots (codegen_int8.py): an opt-in arithmetic, never chosen by `isas`
    "avx512_vnni": (16, 32, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma")),
}
INT8_ISA = "avx512_vnni"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    l1d_bytes: int
    l2_bytes: int
    cores: int

    @property
    def isas(self) -> list[str]:
        """ISAs this CPU can run, best first."""
        out = []
        if {"avx512f", "avx512bw", "avx512vl"} <= self.flags:
            out.append("avx512")
        if {"avx2", "fma", "f16c"} <= self.flags:
            out.append("avx2")
        return out + ["portable"]

    @property
    def int8_dots(self) -> bool:
        """Whether this CPU runs the int8-activation kernels (INT8_ISA: AVX-512 with VNNI)."""
        return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= self.flags


def check_int8_dots() -> None:
    """A one-line MoeserveError unless this CPU has the int8 dot instructions of the int8-activation kernels."""
    info = cpu_info()
    if not info.int8_dots:
        raise MoeserveError(f"--cpu-int8 needs a CPU with AVX512-VNNI int8 dots, which {info.model} lacks (leave "
                            "--cpu-int8 out: the exact float kernels)")


def _cache_size(level: int, kind: str, default: int) -> int:
    """Per-core cache size from /sys (e.g. '48K'); `default` where the kernel does not say."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.is_dir() else []:
        try:
            if int((index / "level").read_text()) == level and (index / "type").read_text().strip() in kind:
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1024, "M": 1024 ** 2}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return default


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return CpuInfo(model=model, flags=frozenset(flags), l1d_bytes=_cache_size(1, ("Data", "Unified"), 32 * 1024),
                   l2_bytes=_cache_size(2, ("Unified", "Data"), 1024 * 1024), cores=os.cpu_count() or 1)


def physical_cores() -> list[int]:
    """One logical CPU per physical core this process may run on (the lowest-numbered hyper-thread sibling of each
    core), from the /sys topology; every allowed CPU where the topology is not readable."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen, first = set(), []
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = (topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()
        except OSError:
            return allowed
        if core not in seen:
            seen.add(core)
            first.append(cpu)
    return first
