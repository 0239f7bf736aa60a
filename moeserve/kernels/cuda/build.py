"""The CUDA kernels' PTX: built from the .cu sources by nvcc into the user's cache once per source (keyed by its
hash), or taken from the copy shipped beside the source when that copy was built from the same source. The driver
compiles PTX for the GPU at hand (driver.py), so one PTX (compute_80) serves every GPU from Ampere on.

    python -m moeserve.kernels.cuda.build   # rebuild the shipped copies (needs nvcc)
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCH = "compute_80"  # mma.sync m16n8k16 bf16: Ampere and later


def source_hash(source: Path, defines: tuple[str, ...] = ()) -> str:
    return hashlib.sha256(source.read_bytes() + "\0".join(defines).encode()).hexdigest()[:16]


def shipped(source: Path) -> Path:
    return source.with_suffix(".ptx.gz")


def compile_ptx(source: Path, defines: tuple[str, ...] = ()) -> str:
    """nvcc source -> PTX text (RuntimeError naming the problem when nvcc is missing or fails)."""
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if not nvcc or not os.path.exists(nvcc):
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.ptx"
        cmd = [nvcc, f"-arch={ARCH}", "-ptx", "-O3", *[f"-D{d}" for d in defines], str(source), "-o", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed on {source.name}: {run.stderr.strip().splitlines()[-1:]}")
        return out.read_text()


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "moeserve" / "ptx"


def ptx(source: Path, defines: tuple[str, ...] = ()) -> str:
    """The PTX of a .cu source: the shipped copy if built from this source, else the cache's, else nvcc's (cached).
    RuntimeError when none is possible."""
    key = source_hash(source, defines)
    ship = shipped(source)
    if not defines and ship.exists():
        with gzip.open(ship, "rt") as f:
            head, _, text = f.read().partition("\n")
        if head == f"// source {key}":
            return text
    cached = cache_dir() / f"{source.stem}-{key}.ptx"
    if cached.exists():
        return cached.read_text()
    text = compile_ptx(source, defines)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(cached)
    return text


def ship(source: Path) -> Path:
    """Write the shipped gzip copy of a source's PTX (its first line names the source's hash)."""
    text = compile_ptx(source)
    out = shipped(source)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(f"// source {source_hash(source)}\n{text}".encode())
    return out


if __name__ == "__main__":
    for cu in sorted(HERE.glob("*.cu")):
        print(ship(cu))
