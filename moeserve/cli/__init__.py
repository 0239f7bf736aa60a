"""The `moeserve` command: one thin module per command (parse -> RunConfig -> the run path in moeserve.runtime).

Errors print one line and exit 2. A command's module is imported only after its options parse, so `moeserve
--help` and argument errors never load torch, and environment settings that must precede torch (OpenMP's wait
policy) are made first.
"""

from __future__ import annotations

import importlib
import os
import sys

from moeserve.cli.options import DEMO_DIR
from moeserve.cli.parser import build_parser
from moeserve.config import RunConfig
from moeserve.errors import MoeserveError

COMMANDS = {"generate": "generate", "info": "info", "eval": "eval", "quantize": "quantize", "trace": "trace",
            "batch": "batch", "offload-prepare": "offload_prepare", "profile": "profile", "plan": "plan",
            "serve": "serve", "bench": "bench", "train": "train", "tune": "tune"}  # command -> module in moeserve.cli
RUNS = {"generate": "generate", "eval": "eval ppl", "serve": "serve", "bench": "bench"}  # commands with a RunConfig


def cpu_wait_policy(args) -> None:
    """Runs that may put experts on the CPU: torch's OpenMP threads that finish a parallel region sleep rather than
    spin (OMP_WAIT_POLICY=PASSIVE unless the user set it). The experts' native helper threads (kernels/cpu/pool.py),
    torch's own ops and the thread that drives the GPU share the cores, and OpenMP threads spinning process-wide take
    them from the others. Must be set before torch (and its OpenMP runtime) loads."""
    hybrid = getattr(args, "cpu_moe", False) or getattr(args, "n_cpu_moe", None) is not None
    planned = getattr(args, "memory", None) is not None and not getattr(args, "offload", None)
    if hybrid or planned:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def configure_logging(level: str) -> None:
    """MOESERVE_LOG=debug|info|warning: log records of moeserve's modules on stderr (debug: each layer's path)."""
    if not level:
        return
    import logging  # only when MOESERVE_LOG asks for it

    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise MoeserveError(f"MOESERVE_LOG must be debug, info, warning or error, got {level!r}")
    logging.basicConfig(format="moeserve: %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("moeserve").setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status = 1
    try:
        configure_logging(os.environ.get("MOESERVE_LOG", ""))
        cpu_wait_policy(args)
        if args.command in RUNS:  # before torch loads: each rank of a bad torchrun launch says why, at once
            RunConfig.from_args(args, RUNS[args.command]).validate()
        command = importlib.import_module(f"moeserve.cli.{COMMANDS[args.command]}")
        status = command.run(args)
        return status
    except MoeserveError as e:
        sys.stderr.write(f"moeserve: error: {e}\n")  # one write: ranks of a torchrun share the stream
        return 2
    except KeyboardInterrupt:
        print("\nmoeserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - resource failures get one line too
        if type(e).__name__ == "OutOfMemoryError":
            print("moeserve: error: out of GPU memory; try --device cpu, a smaller batch or --dtype bfloat16",
                  file=sys.stderr)
            return 2
        raise
    finally:
        if "torch.distributed" in sys.modules:  # only runs under torchrun initialise it
            from moeserve.parallel.launch import shutdown  # torch is loaded by then

            shutdown(wait_for_peers=status == 0)


__all__ = ["DEMO_DIR", "build_parser", "main"]
