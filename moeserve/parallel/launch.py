"""Joining a torchrun launch: process group from the environment torchrun sets, this rank's device."""

from __future__ import annotations

import datetime
import os

import torch

from moeserve.errors import MoeserveError

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a peer that died fails the others instead of hanging


def init_from_env(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device of this rank); NCCL on GPUs, gloo on CPUs."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise MoeserveError("expert parallelism runs under torchrun: "
                            "torchrun --nproc-per-node N -m moeserve generate --ep N ...")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return rank, world, dev
