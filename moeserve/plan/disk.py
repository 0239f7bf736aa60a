"""Disk read bandwidth of an expert store, for the planner's disk-tier estimates (a store larger than the RAM given
to its experts: offload/disk_cache.py reads the misses from it).

Measured once per block device by reading the store's layer files the way the disk tier does: O_DIRECT where the
filesystem takes it (the page cache would serve a re-read at RAM speed), else buffered reads of pages dropped first
(posix_fadvise DONTNEED). The figure is cached as JSON beside the hardware profile (<moeserve cache>/hardware/
disk-<major>-<minor>.json), keyed by the device the store lies on. Only the standard library: the planner reads it
without torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import mmap
import os
import time
from pathlib import Path

from moeserve.errors import MoeserveError

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers
BLOCK = 8 << 20  # bytes per read (the disk tier reads one expert part at a time: MiBs)
READ_BYTES = 256 << 20  # bytes read per measurement (less when the store is smaller)


def store_files(store_dir: str | Path) -> list[Path]:
    """The store's layer files (offload/store.py names them experts-layer-NNNNN.safetensors), largest first."""
    files = sorted(Path(store_dir).glob("experts-layer-*.safetensors"), key=lambda f: -f.stat().st_size)
    if not files:
        raise MoeserveError(f"{store_dir} holds no expert store layer files; give --offload STORE from "
                            f"`moeserve offload-prepare`, or --disk-bandwidth")
    return files


def _open(path: Path, direct: bool) -> int | None:
    """A descriptor of path opened with O_DIRECT (None where the filesystem refuses it), or buffered."""
    if not direct:
        return os.open(path, os.O_RDONLY)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None


def read_bandwidth(files: list[Path], nbytes: int = READ_BYTES) -> tuple[float, bool]:
    """(bytes per second, whether O_DIRECT) reading up to `nbytes` of `files` in BLOCK reads, the page cache
    bypassed (O_DIRECT) or emptied of those pages first."""
    buf = mmap.mmap(-1, BLOCK)  # page-aligned
    direct = hasattr(os, "O_DIRECT")
    done, seconds = 0, 0.0
    try:
        for path in files:
            fd = _open(path, direct)
            if fd is None:
                direct, fd = False, _open(path, False)
            try:
                size = os.fstat(fd).st_size // ALIGN * ALIGN
                if not direct and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                offset = 0
                while offset < size and done < nbytes:
                    n = min(BLOCK, size - offset)
                    t0 = time.perf_counter()
                    try:
                        got = os.preadv(fd, [memoryview(buf)[:n]], offset)
                    except OSError:
                        if not direct:
                            raise
                        direct = False  # a filesystem that opens O_DIRECT but refuses its reads
                        os.close(fd)
                        fd = _open(path, False)
                        continue
                    seconds += time.perf_counter() - t0
                    if got <= 0:
                        break
                    offset, done = offset + got, done + got
            finally:
                os.close(fd)
            if done >= nbytes:
                break
    finally:
        buf.close()
    if done == 0 or seconds <= 0:
        raise MoeserveError(f"could not read {files[0].parent} to measure its disk bandwidth; give --disk-bandwidth")
    return done / seconds, direct


def device_key(path: str | Path) -> str:
    """The block device a path lies on, as `major-minor`."""
    st = os.stat(path)
    return f"{os.major(st.st_dev)}-{os.minor(st.st_dev)}"


def cache_path(store_dir: str | Path) -> Path:
    """Where the bandwidth of the store's device is cached."""
    from moeserve.kernels.cpu.build import cache_dir  # inside: it loads torch, which the planner does without

    return cache_dir().parent / "hardware" / f"disk-{device_key(store_dir)}.json"


def store_read_bandwidth(store_dir: str | Path, refresh: bool = False) -> float:
    """Bytes per second the disk tier reads from the store's device: cached, else measured (read_bandwidth) and
    stored."""
    path = cache_path(store_dir)
    if path.is_file() and not refresh:
        try:
            return float(json.loads(path.read_text())["read_bytes_per_s"])
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache: measure again
    rate, direct = read_bandwidth(store_files(store_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"read_bytes_per_s": rate, "direct": direct, "measured_on": str(store_dir),
                                "measured": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")},
                               indent=2) + "\n")
    return rate
