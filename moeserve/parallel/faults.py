"""A peer rank that died or stopped answering, told apart from other errors, as one line.

A collective whose peer is gone raises from inside torch.distributed: gloo as soon as the peer's sockets close (a
killed process) or after the process group's timeout (a hung one), NCCL after the timeout. Those errors are
RuntimeErrors (or torch's DistError) with a multi-line message naming a C++ file; a rank that gets one cannot go on,
since every later collective would fail too. `peer_failure` recognises them by where they were raised (a frame of
torch.distributed at the top of the traceback) or, for an asynchronous collective whose handle's wait() raised in
moeserve's code, by the backend's words, and turns them into the one-line MoeserveError every rank ends with.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch.distributed as dist

from moeserve.errors import MoeserveError

DISTRIBUTED_DIR = Path(dist.__file__).resolve().parent
BACKEND_WORDS = re.compile(r"gloo|NCCL|[Cc]onnection (reset|closed|refused)|pair closure|Timed out waiting|"
                           r"[Bb]roken pipe")  # what gloo's and NCCL's transport errors say


class PeerStopped(MoeserveError):
    """A peer rank of this launch died or stopped answering; this rank stops too."""


def from_backend(error: BaseException) -> bool:
    """Whether `error` is a collective's failure: torch's DistError, or a RuntimeError raised by torch.distributed's
    code (the innermost frame of its traceback) or in the backend's words (a Work.wait() called elsewhere)."""
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return (bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(DISTRIBUTED_DIR)
            or BACKEND_WORDS.search(str(error)) is not None)


def detail(error: BaseException) -> str:
    """The useful part of a backend error's first line: without the C++ source path in brackets and the advice
    gloo appends ("This is typically caused by ...")."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return first.split(" This is typically")[0].rstrip(". ")


def peer_failure(error: BaseException) -> PeerStopped | None:
    """The one-line error for a collective that failed because a peer rank died or timed out, or None when `error`
    is something else (or no process group is running)."""
    if isinstance(error, PeerStopped):
        return error
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not from_backend(error):
        return None
    return PeerStopped(f"a peer rank stopped or stopped answering ({detail(error)}); stopping rank "
                       f"{dist.get_rank()} too")
