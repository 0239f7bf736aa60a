"""The user's cache of tuned launch configs: one JSON table per GPU, in the format of the shipped tables
(kernels/triton/configs/*.json), under <moeserve cache>/tuning/<gpu-slug>-sm<major><minor>.json.

Several processes may tune at once (a server and a benchmark, ranks of a torchrun): every write takes an exclusive
lock on a sibling `.lock` file, reads what is there, merges its entries over it, writes a temporary file of its own
and renames it over the table, so readers never see half a file and no process drops another's entries. A file that
does not parse as a table is ignored with a warning (the next write replaces it)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from moeserve.kernels.cpu.build import cache_dir

try:
    import fcntl  # POSIX; elsewhere writes are still atomic, but two writers at once may drop each other's entries
except ImportError:
    fcntl = None


def tuning_dir() -> Path:
    """<moeserve cache>/tuning (MOESERVE_CACHE, else $XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve)."""
    return cache_dir().parent / "tuning"


def table_file(slug: str, capability: tuple[int, int]) -> Path:
    return tuning_dir() / f"{slug}-sm{capability[0]}{capability[1]}.json"


def table_files(slug: str) -> list[Path]:
    """This GPU's cached tables (one per compute capability the name was seen with: in practice one)."""
    return sorted(tuning_dir().glob(f"{slug}-sm*.json"))


def merged(old, new, depth: int):
    """new over old, dicts merged `depth` levels deep."""
    if depth == 0 or not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: merged(old.get(k), v, depth - 1) for k, v in new.items()}}


def read_table(path: Path, check: Callable[[dict, str], object]) -> dict:
    """The table stored at `path` ({} when absent); a file that is not JSON, not an object, or that `check`
    (table, file name) rejects with ValueError is ignored with a warning."""
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            raise ValueError("not a JSON object")
        check(table, path.name)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"moeserve: ignoring the tuning cache {path} ({str(e).splitlines()[0][:200]}); it will be "
                      "rewritten", stacklevel=2)
        return {}
    return table


@contextlib.contextmanager
def locked(path: Path, lock: bool = True):
    """An exclusive lock on `path`.lock for the duration (none when not `lock`, or where fcntl is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None or not lock:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_merged(path: Path, update: dict, check: Callable[[dict, str], object], depth: int = 3,
                 lock: bool = True) -> dict:
    """Merge `update` into the table at `path` (entries `depth` levels deep: section, shape, count) under the lock
    (unless not `lock`), check the result, and replace the file atomically; returns the table written."""
    with locked(path, lock):
        table = merged(read_table(path, check), update, depth)
        check(table, path.name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
    return table
