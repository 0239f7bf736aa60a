"""The engine thread: the one thread that touches the model, running a ContinuousBatch for the HTTP handlers.

Handlers (on the event loop) submit jobs and cancel them; both only put a message in the thread's inbox. The
thread takes the messages between steps, so a request joins the running batch, or leaves it (a client that went
away frees its KV slot), at the next step. Each job's updates go back through its `sink`, a function the handler
gave that is safe to call from this thread. A handler's sink is a LoopSink (an asyncio queue on its event loop,
items tagged with the choice they belong to: the n choices of one API request share a queue): the updates of one
step for every LoopSink of a loop go over in one call, so the event loop wakes once a step, not once a token. The
n choices of a request are submitted together (submit_many): all of them fit in the server, or none is queued. The thread also keeps the metrics: time to first token, inter-token latency, tokens, running and
waiting requests, and logs (MOESERVE_LOG=info) every step slower than SLOW_STEP_S with what it computed. Under
torchrun it leads the other ranks' batches (serve/mirror.py): each step's changes go to them before the step, each
sampling's tokens after it; when a peer rank dies or hangs, every job fails with that error and the thread ends,
telling the server (`on_peer_stopped`), which then stops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeserve.engine.batching import ContinuousBatch, Request, Update
from moeserve.engine.constraints import TokenConstraint
from moeserve.engine.params import SamplingParams
from moeserve.parallel.faults import PeerStopped, peer_failure
from moeserve.serve.metrics import Metrics
from moeserve.serve.mirror import Added, Cancelled, StepMirror, Stop

log = logging.getLogger(__name__)
SLOW_STEP_S = 0.25  # a step longer than this is logged (MOESERVE_LOG=info) with what it computed

@dataclass(frozen=True, eq=False)
class LoopSink:
    """A job's updates into an asyncio queue that a handler on `loop` reads, as (index, item): index is the job's
    choice in its API request."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


def deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand each item to its queue."""
    for q, item in items:
        q.put_nowait(item)


class QueueFull(Exception):
    """Every slot is busy and the queue holds --max-queue requests."""


class EngineFailed(Exception):
    """This request's work in a step raised, or the step's shared forward pass did; the server goes on with the
    others."""


def engine_failed(error: Exception) -> EngineFailed:
    return EngineFailed(f"the engine failed on this request: {type(error).__name__}: {error}")


@dataclass(eq=False)
class Job:
    request: Request
    sink: Callable[[Update | Exception], None]
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    closed: bool = False  # finished, failed or cancelled: counted out of the server's load
    key: int = -1  # its name for the other ranks under torchrun (serve/mirror.py)


class Engine:
    def __init__(self, batch: ContinuousBatch, metrics: Metrics, max_queue: int, threads: int | None = None,
                 mirror: StepMirror | None = None, on_peer_stopped: Callable[[PeerStopped], None] | None = None):
        """threads: CPU threads for torch in the engine thread (an OpenMP setting is per thread: set it here);
        mirror: under torchrun, rank 0's end (serve/mirror.py): the other ranks step the same batch;
        on_peer_stopped: called from the engine thread, once, when a peer rank died or hung (the thread has ended)."""
        self.batch, self.metrics, self.threads, self.mirror = batch, metrics, threads, mirror
        self.on_peer_stopped = on_peer_stopped
        self.stopped: PeerStopped | None = None  # set when a peer rank is gone: no job can run any more
        if mirror is not None:
            batch.sync_tokens = mirror.tokens
        self._keys = itertools.count()  # each job's name for the other ranks
        self.capacity = batch.slots + max_queue  # requests in the server at once: running + waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._open = 0  # jobs submitted and not closed
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}  # a step's updates

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, prompt_ids: list[int], params: SamplingParams, top_logprobs: int | None,
               sink: Callable[[Update | Exception], None], constraint: TokenConstraint | None = None) -> Job:
        """Queue a checked request (batch.check) or raise QueueFull; constraint: the grammar its tokens follow
        (under torchrun rank 0 alone holds it: the other ranks take its tokens)."""
        return self.submit_many(prompt_ids, [params], top_logprobs, [sink], [constraint])[0]

    def submit_many(self, prompt_ids: list[int], params: list[SamplingParams], top_logprobs: int | None,
                    sinks: list[Callable[[Update | Exception], None]],
                    constraints: list[TokenConstraint | None]) -> list[Job]:
        """Queue one request per params (the choices of one prompt, in order: the first reads the prompt, the others
        copy its KV), each with its sink and constraint, or raise QueueFull when they do not all fit."""
        with self._lock:
            if self._open + len(params) > self.capacity:
                raise QueueFull
            self._open += len(params)
        jobs = [Job(Request(prompt_ids, p, self._on_update, top_logprobs, constraint=c), sink)
                for p, sink, c in zip(params, sinks, constraints, strict=True)]
        for job in jobs:
            job.request.tag = job
            if self.stopped is not None:  # a peer rank is gone and the engine thread has ended: answer here
                self._close(job, "error")
                job.sink(engine_failed(self.stopped))
            else:
                self._put(("add", job))
        return jobs

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job at the next step (nothing more is sent to it)."""
        self._put(("cancel", job))

    def _put(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _close(self, job: Job, reason: str | None) -> None:
        if job.closed:
            return
        job.closed = True
        with self._lock:
            self._open -= 1
        if reason:
            self.metrics.finished(reason)

    def _run(self) -> None:
        device = self.batch.model.device
        if device.type == "cuda":  # this thread's current device: where Triton launches go
            torch.cuda.set_device(device)
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            while not self._stop:
                self._wake.clear()
                changes = self._take_messages()
                if self.mirror is not None:
                    self.mirror.events(changes)
                busy = self._step()
                self._flush()
                self._update_load()
                if not busy:
                    self._wake.wait(timeout=1.0)
            if self.mirror is not None:
                self.mirror.events([Stop()])
        except Exception as e:  # noqa: BLE001 - under torchrun, a collective that failed because a peer is gone
            stopped = peer_failure(e) if self.mirror is not None else None
            if stopped is None:
                raise
            self._abandon(stopped)

    def _step(self) -> bool:
        """One step of the batch; whether it had work. A failed forward pass fails its requests, not the server;
        a peer rank that is gone (under torchrun) is raised."""
        start = time.perf_counter()
        try:
            busy = self.batch.step()
        except Exception as e:  # noqa: BLE001
            if self.mirror is not None and peer_failure(e) is not None:
                raise
            traceback.print_exc(file=sys.stderr)
            for r in self.batch.drop_active():
                self._fail(r.tag, e)
            return True
        if busy:
            self._check_time(time.perf_counter() - start)
        return busy

    def _abandon(self, stopped: PeerStopped) -> None:
        """A peer rank is gone: fail every job (running, waiting, or not yet taken from the inbox) with its error,
        then tell the server."""
        self.stopped = stopped
        for r in [*self.batch.drop_active(), *self.batch.waiting]:
            self._fail(r.tag, stopped)
        self.batch.waiting.clear()
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._fail(job, stopped)
        self._flush()
        self._update_load()
        if self.on_peer_stopped is not None:
            self.on_peer_stopped(stopped)

    def _check_time(self, seconds: float) -> None:
        """Log a step slower than SLOW_STEP_S with its shape: on a GPU such a step is most often a shape met for the
        first time (a kernel compiled, a library plan built), which the warm-up could run instead."""
        if seconds > SLOW_STEP_S:
            log.info("slow step: %.0f ms for %s", 1e3 * seconds, self.batch.last_step)

    def _take_messages(self) -> list:
        """Apply the requests added and cancelled since the last step; the changes, as the other ranks apply them."""
        changes = []
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                return changes
            if kind == "add":
                job.key = next(self._keys)
                self.batch.add(job.request)
                r = job.request
                changes.append(Added(job.key, r.prompt_ids, r.params, r.top_logprobs))
            elif not job.closed:
                self.batch.cancel(job.request)
                self._close(job, "abort")
                changes.append(Cancelled(job.key))

    def _send(self, job: Job, item: Update | Exception) -> None:
        """Give an item to the job's sink: at once, or with the step's other items for the same loop."""
        if isinstance(job.sink, LoopSink):
            self._pending.setdefault(job.sink.loop, []).append((job.sink.queue, (job.sink.index, item)))
        else:
            job.sink(item)

    def _flush(self) -> None:
        for loop, items in self._pending.items():
            loop.call_soon_threadsafe(deliver, items)
        self._pending = {}

    def _update_load(self) -> None:
        b = self.batch
        self.metrics.set_load(len(b.active), len(b.waiting), b.slots - len(b.free))

    def _fail(self, job: Job, error: Exception) -> None:
        """End a job with the engine's error: counted as `error`, its handler answers 500."""
        self._close(job, "error")
        self._send(job, engine_failed(error))

    def _on_update(self, request: Request, update: Update) -> None:
        """Called by the batch for every sampled token (timings, counts, then the job's sink) and for a request whose
        own work in a step raised (its traceback to stderr, the job failed)."""
        job, m, now = request.tag, self.metrics, time.perf_counter()
        if job.closed:
            return
        if update.error is not None:
            traceback.print_exception(update.error, file=sys.stderr)
            self._fail(job, update.error)
            return
        m.generation_tokens.inc()
        if job.last_token is None:
            m.ttft.observe(now - job.arrival)
            m.prompt_tokens.inc(len(request.prompt_ids))
            m.prompt_tokens_cached.inc(request.reused)
        else:
            m.itl.observe(now - job.last_token)
        job.last_token = now
        if update.finish_reason is not None:
            m.e2e.observe(now - job.arrival)
            self._close(job, "stop" if update.finish_reason in ("eos", "stop") else "length")
        self._send(job, update)
