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


CPU_ROOT = Path("/sys/devices/system/cpu")
NODE_ROOT = Path("/sys/devices/system/node")


def physical_cores(cpu_root: Path = CPU_ROOT, allowed: list[int] | None = None) -> list[int]:
    """One logical CPU per physical core this process may run on (the lowest-numbered hyper-thread sibling of each
    core), from the /sys topology under cpu_root; every allowed CPU where the topology is not readable. allowed:
    the CPUs this process may run on (default: its affinity)."""
    if allowed is None:
        allowed = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else list(range(os.cpu_count() or 1)))
    seen, first = set(), []
    for cpu in allowed:
        topo = cpu_root / f"cpu{cpu}" / "topology"
        try:
            core = (topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()
        except OSError:
            return list(allowed)
        if core not in seen:
            seen.add(core)
            first.append(cpu)
    return first


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, its logical CPUs (cpulist) and its memory (meminfo's MemTotal)."""

    node: int
    cpus: tuple[int, ...]
    mem_bytes: int


def parse_cpulist(text: str) -> list[int]:
    """A sysfs CPU list ('0-3,8-11', '' for none) -> the CPUs in it."""
    out = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def numa_nodes(root: Path = NODE_ROOT) -> list[NumaNode]:
    """The host's NUMA nodes that have CPUs, by id, from sysfs under root (node<N>/cpulist, node<N>/meminfo's
    `Node N MemTotal: X kB`); [] where the kernel exposes none."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda d: int(d.name[4:])) if root.is_dir() else []:
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
            mem = next((int(line.split()[3]) * 1024 for line in (d / "meminfo").read_text().splitlines()
                        if "MemTotal:" in line), 0)
        except (OSError, ValueError, IndexError):
            continue
        if cpus:
            nodes.append(NumaNode(int(d.name[4:]), tuple(cpus), mem))
    return nodes


@dataclass(frozen=True)
class ExpertCores:
    """The cores the CPU experts' threads run on, one per physical core, and on a multi-socket host the NUMA node
    they share (node None: one node, or no topology)."""

    cpus: tuple[int, ...]
    node: int | None = None
    nodes: int = 1

    def describe(self) -> str | None:
        """`NUMA node 1 of 2` on a multi-node host, else None."""
        return None if self.node is None else f"NUMA node {self.node} of {self.nodes}"


def expert_cores(cpu_root: Path = CPU_ROOT, node_root: Path = NODE_ROOT,
                 allowed: list[int] | None = None) -> ExpertCores:
    """Where the CPU experts' threads go: the physical cores (physical_cores) of one NUMA node when they span
    several, so the threads share one memory controller and its caches rather than cross the socket link (the node
    with the most of them, the lowest id on a tie); every physical core on a single-node host. Memory is not bound:
    the experts' pages lie where the OS put them."""
    cores = physical_cores(cpu_root, allowed)
    nodes = [n for n in numa_nodes(node_root) if set(n.cpus) & set(cores)]
    if len(nodes) < 2:
        return ExpertCores(tuple(cores))
    best = max(nodes, key=lambda n: (len(set(n.cpus) & set(cores)), -n.node))
    return ExpertCores(tuple(c for c in cores if c in best.cpus), best.node, len(nodes))
