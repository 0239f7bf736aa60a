"""Joining a torchrun launch: process group from the environment torchrun sets, this rank's device."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from moeserve.errors import MoeserveError
from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S


def init_from_env(device: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """(rank, world size, device of this rank); NCCL on GPUs, gloo on CPUs. timeout_s bounds every wait for a peer
    in a collective (--collective-timeout): a peer that hung fails the others then instead of hanging them (one that
    died fails gloo's at once), see faults.py."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise MoeserveError("tensor and expert parallelism (--tp, --ep) run under torchrun: "
                            "torchrun --nproc-per-node N -m moeserve generate --tp N ...")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, dev


def shutdown(wait_for_peers: bool) -> None:
    """Leave a torchrun launch cleanly: after a success, wait for the peers; then tear the process group
    down (exiting with it still open can abort a rank whose peer has already gone). After an error the
    peers may never arrive, so there is no wait."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
