"""The `moeserve` command: one thin module per command (parse -> RunConfig -> the run path in moeserve.runtime).

Errors print one line and exit 2. A command's module is imported only after its options parse, so `moeserve
--help` and argument errors never load torch, and environment settings that must precede torch (OpenMP's wait
policy) are made first.
"""

from __future__ import annotations

import importlib
import os
import sys

from moeserve.cli.options import DEMO_DIR, sampling_params
from moeserve.cli.parser import build_parser
from moeserve.config import RunConfig
from moeserve.errors import MoeserveError
from moeserve.hub import resolve_model
from moeserve.spec import ModelSpec

COMMANDS = {"generate": "generate", "chat": "chat", "info": "info", "eval": "eval", "quantize": "quantize",
            "trace": "trace", "batch": "batch", "offload-prepare": "offload_prepare", "profile": "profile",
            "plan": "plan", "serve": "serve", "bench": "bench", "train": "train",
            "tune": "tune"}  # command -> module in moeserve.cli
RUNS = {"generate": "generate", "chat": "chat", "eval": "eval ppl", "serve": "serve",
        "bench": "bench"}  # commands with a RunConfig


def cpu_threads(args) -> None:
    """Torch's CPU threads, set before torch (and its OpenMP runtime) loads. Threads that finish a parallel region
    sleep rather than spin (OMP_WAIT_POLICY=PASSIVE unless the user set a wait policy or GOMP_SPINCOUNT): spinning
    threads take the cores from the process's other threads (the CPU experts' native helpers, the thread that drives
    the GPU) and from the machine's other work, and a spinning team whose threads lose their cores to another
    process slows every operation by an order of magnitude (bench/threads.py measures both). --threads N sets the
    team's size."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise MoeserveError(f"--threads {threads} must be >= 1")
        os.environ["OMP_NUM_THREADS"] = str(threads)


def check_before_torch(args) -> None:
    """What needs no torch is checked before it loads (a second or more; under torchrun every rank of a bad launch
    then says why at once): a hub name is resolved to its local snapshot, the run's options (RunConfig), the
    checkpoint's config.json and architecture, generate's sampling options."""
    if hasattr(args, "model"):
        args.model = resolve_model(args.model)
    if args.command in RUNS:
        RunConfig.from_args(args, RUNS[args.command]).validate()
    if hasattr(args, "model"):
        ModelSpec.from_dir(args.model)
    if args.command in ("generate", "chat"):
        sampling_params(args)


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
        cpu_threads(args)
        check_before_torch(args)
        command = importlib.import_module(f"moeserve.cli.{COMMANDS[args.command]}")
        if getattr(args, "threads", None) is not None and "torch" in sys.modules:  # loaded before main() ran too
            sys.modules["torch"].set_num_threads(args.threads)
        status = command.run(args)
        return status
    except MoeserveError as e:
        sys.stderr.write(f"moeserve: error: {e}\n")  # one write: ranks of a torchrun share the stream
        return 2
    except KeyboardInterrupt:
        print("\nmoeserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - resource failures get one line too
        if "torch.distributed" in sys.modules:  # under torchrun: a peer rank that died ends this one with one line
            from moeserve.parallel.faults import peer_failure  # torch is loaded by then

            stopped = peer_failure(e)
            if stopped is not None:
                sys.stderr.write(f"moeserve: error: {stopped}\n")
                return 2
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
