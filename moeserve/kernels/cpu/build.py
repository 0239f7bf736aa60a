"""Compile generated C at first use and load it with ctypes; compiled libraries are cached on disk.

The cache key is a hash of the source, the compiler flags and the compiler's version, so a changed
generator or compiler builds anew and an unchanged one loads in milliseconds. A compile (seconds) says so
once per process on stderr, so a first run that pauses to build its kernels does not look hung.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from moeserve.kernels.cpu.machine import ISAS

BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11")


class CompilerUnavailable(RuntimeError):
    """No working C compiler: callers fall back to the PyTorch path."""


def cache_dir() -> Path:
    root = os.environ.get("MOESERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moeserve")
    return Path(root) / "cpu_kernels"


@functools.cache
def compiler() -> tuple[str, str]:
    """(path, version line) of the C compiler: $CC, else cc / gcc / clang."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return path, out.stdout.splitlines()[0] if out.stdout else name
    raise CompilerUnavailable("no C compiler found (set CC or install gcc)")


def library_path(source: str, isa: str) -> Path:
    cc, version = compiler()
    flags = BASE_FLAGS + ISAS[isa][2]
    key = hashlib.sha256("\n".join([source, " ".join(flags), version]).encode()).hexdigest()[:20]
    return cache_dir() / f"qgemm-{isa}-{key}.so"


@functools.cache
def announce_compile(isa: str) -> None:
    """One progress line per ISA and process when kernels are compiled (not when they come from the cache)."""
    print(f"[compiling CPU kernels for {isa}: once, then cached in {cache_dir()}]", file=sys.stderr, flush=True)


def build(source: str, isa: str) -> Path:
    """Compile `source` for `isa` unless the cache has it; returns the shared library path."""
    lib = library_path(source, isa)
    if lib.is_file():
        return lib
    cc, _ = compiler()
    announce_compile(isa)
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "kernel.c", Path(tmp) / lib.name
        src.write_text(source)
        proc = subprocess.run([cc, *BASE_FLAGS, *ISAS[isa][2], str(src), "-o", str(out)], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise CompilerUnavailable(f"{cc} failed to build the {isa} kernel: {proc.stderr.strip()[-500:]}")
        os.replace(out, lib)  # atomic: concurrent builders never see half a file
    return lib


@functools.cache
def load(lib: Path) -> ctypes.CDLL:
    dll = ctypes.CDLL(str(lib))
    p, i = ctypes.c_void_p, ctypes.c_int
    dll.qgemm.argtypes = [p, i, i, i, p, p, p, i, p, i, i, i, i]
    dll.qgemm.restype = i
    dll.qgemm_batch.argtypes = [i, p, p, i, i, p, p, p, i, p, i, i, i, i]
    dll.qgemm_batch.restype = i
    f = ctypes.c_float
    moe = [i, i, p, p, p, i, p, i, i, p, p, p, i, i, p, p, p, i, i, i, p, p, i, f, f, p, i]
    dll.moe_layer.argtypes = moe
    dll.moe_layer.restype = i
    dll.moe_layer_start.argtypes = moe + [ctypes.POINTER(p)]
    dll.moe_layer_start.restype = i
    dll.moe_layer_finish.argtypes = [p]
    dll.moe_layer_finish.restype = None
    dll.link_start.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, ctypes.c_long]
    dll.link_start.restype = p
    dll.link_stop.argtypes = [p]
    dll.link_stop.restype = None
    dll.moeserve_set_pool.argtypes = [p, p, p]
    dll.moeserve_set_pool.restype = None
    return dll
