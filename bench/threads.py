"""The demo's CPU decode on a machine shared with other work: OpenMP's wait policy and thread count.

Per setting, `moeserve bench --device cpu` (tg and pp tokens/s of the demo) with every process pinned to the same
--cores CPUs (taskset), idle and beside --busy CPU-bound processes (Python loops, one per busy process):
  spin      libgomp's own default (threads spin ~300k iterations after a parallel region, then sleep):
            GOMP_SPINCOUNT=300000, what moeserve ran with before it chose a wait policy
  passive   moeserve's default (OMP_WAIT_POLICY=PASSIVE: threads sleep at once)
  1 thread  --threads 1
The issue's bar: with one busy process, the default's decode within 2x of its idle figure.

    python bench/threads.py                       # 2 cores, 1 busy process; JSON to bench/results/
    python bench/threads.py --cores 0-3 --busy 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, write_result  # noqa: E402

SETTINGS = {"spin": ({"GOMP_SPINCOUNT": "300000"}, []), "passive": ({}, []), "1 thread": ({}, ["--threads", "1"])}
BUSY = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    sum(range(10000))\n"


def bench(cores: str, env: dict, extra: list[str], args) -> dict:
    """tg/pp tokens/s of one `moeserve bench` run pinned to `cores`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "moeserve", "bench", "--device", "cpu", "-p", str(args.prompt),
           "-n", str(args.gen), "-r", str(args.reps), "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**clean, **env}, timeout=600, check=True)
    return {r["test"]: round(r["tok_s"], 2) for r in json.loads(out.stdout)["results"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", default="0-1", help="CPUs every process is pinned to (taskset list; default 0-1)")
    ap.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the bench (default 1)")
    ap.add_argument("--prompt", type=int, default=64, help="pp tokens (default 64)")
    ap.add_argument("--gen", type=int, default=32, help="tg tokens (default 32)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per test (default 2)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    rows = {}
    for load in ("idle", "busy"):
        procs = [subprocess.Popen(["taskset", "-c", args.cores, sys.executable, "-c", BUSY])
                 for _ in range(args.busy if load == "busy" else 0)]
        try:
            for name, (env, extra) in SETTINGS.items():
                rows[f"{name}, {load}"] = bench(args.cores, env, extra, args)
                print(f"{name:>8}, {load}: {rows[f'{name}, {load}']}", flush=True)
        finally:
            for p in procs:
                p.kill()
    record = result_record("threads", {**vars(args), "settings": {k: v[0] | {"args": v[1]} for k, v in
                                                                  SETTINGS.items()}}, "cpu")
    record["rates"] = rows
    tg = next(k for k in rows["passive, idle"] if k.startswith("tg"))
    record["default_busy_over_idle"] = round(rows["passive, busy"][tg] / rows["passive, idle"][tg], 3)
    print(f"default decode, busy / idle: {record['default_busy_over_idle']:.2f} -> {write_result(record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
