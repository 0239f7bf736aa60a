"""Serving under torchrun (`--ep`/`--tp`): every rank steps the same continuous batch, rank 0 serving HTTP.

A parallel model's forward is collective: each rank must run the same passes over the same rows in the same order.
So every rank owns a ContinuousBatch of the same slots, and rank 0's engine leads it:

- before each step, rank 0 broadcasts what changed since the last one (requests added, with their prompt and
  sampling parameters; requests cancelled), or nothing; the other ranks apply the same changes and step too, so
  rows, prefill chunks and decode batches match pass for pass;
- each sampled token comes from rank 0 (a broadcast after every sampling), so a request ends on every rank at the
  same step whatever each rank's own sampling drew;
- a stop from rank 0 ends the others' loops. An idle engine still steps (and broadcasts) about once a second,
  which keeps the others within the process group's timeout (--collective-timeout).

A rank that died or hung fails the next collective of the others (parallel/faults.py): rank 0 fails its requests
and stops serving, the others stop following; each ends with one line.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.engine.batching import ContinuousBatch, Request, Update
from moeserve.parallel.faults import peer_failure


@dataclass(frozen=True)
class Added:
    key: int  # rank 0's name of the request
    prompt_ids: list[int]
    params: object  # SamplingParams
    top_logprobs: int | None


@dataclass(frozen=True)
class Cancelled:
    key: int


@dataclass(frozen=True)
class Stop:
    pass


class StepMirror:
    """One rank's end of the mirror (the process group torchrun set up)."""

    def __init__(self, device: torch.device):
        """device: where token broadcasts go (NCCL needs the rank's GPU; gloo takes CPU tensors)."""
        self.rank = dist.get_rank()
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def events(self, changes: list | None = None) -> list:
        """Rank 0: broadcast this step's changes (and return them); the others: receive them."""
        box = [changes if self.leads else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def tokens(self, tokens: list[int]) -> list[int]:
        """The tokens rank 0 sampled for this sampling's requests (every rank samples the same requests)."""
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [B]
        dist.broadcast(t, src=0)
        return t.tolist()


def follow(batch: ContinuousBatch, mirror: StepMirror) -> None:
    """The loop of a rank other than 0: apply rank 0's changes, step, until rank 0 stops."""
    batch.sync_tokens = mirror.tokens
    requests: dict[int, Request] = {}

    def finished(request: Request, update: Update) -> None:
        if update.finish_reason is not None:
            requests.pop(request.tag, None)

    while True:
        for change in mirror.events():
            if isinstance(change, Stop):
                return
            if isinstance(change, Added):
                r = Request(change.prompt_ids, change.params, finished, change.top_logprobs, tag=change.key)
                requests[change.key] = r
                batch.add(r)
            elif change.key in requests:
                batch.cancel(requests.pop(change.key))
        try:
            batch.step()
        except Exception as e:  # noqa: BLE001 - rank 0 failed the same step: it drops its running requests, so do
            # the same; a peer rank that is gone ends this loop
            stopped = peer_failure(e)
            if stopped is not None:
                raise stopped from None
            traceback.print_exc(file=sys.stderr)
            for r in batch.drop_active():
                requests.pop(r.tag, None)
