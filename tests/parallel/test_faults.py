"""A rank of an expert-parallel launch that dies (SIGKILL) or hangs (SIGSTOP) mid-generation or mid-serve: the others
end within the collective timeout with one line on stderr, no traceback, and a streaming client gets an error.

The ranks are started as torchrun starts them (its environment variables) but without its agent, which would stop
the survivors itself on a local death: what is tested is what a rank does on its own, as on another node."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

REPO = str(Path(__file__).resolve().parents[2])
TIMEOUT_S = 5  # --collective-timeout of these launches
SLACK_S = 20  # a busy 2-core machine: tearing a rank down takes seconds
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`python -m moeserve ARGV` once per rank of a `world`-rank launch; each rank's stdout and stderr collected as
    they come (a context manager: every rank still running is killed on exit)."""

    def __init__(self, argv: list[str], world: int = 2, env: dict | None = None):
        port = free_port()
        self.procs, self.out, self.err = [], [], []
        for rank in range(world):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            proc = subprocess.Popen([sys.executable, "-m", "moeserve", *argv], env=rank_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
            self.procs.append(proc)
            for stream, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
                sink.append([])
                threading.Thread(target=self._drain, args=(stream, sink[-1]), daemon=True).start()

    @staticmethod
    def _drain(stream, chunks: list[bytes]) -> None:
        while chunk := stream.read1(4096):
            chunks.append(chunk)

    def text(self, sink: list, rank: int) -> str:
        return b"".join(sink[rank]).decode(errors="replace")

    def wait_for(self, sink: list, rank: int, pattern: str, timeout: float = 120) -> re.Match:
        """The first match of `pattern` in rank's output so far; fails when the rank ends or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text(sink, rank), re.DOTALL)
            if found:
                return found
            assert self.procs[rank].poll() is None, f"rank {rank} ended: {self.text(self.err, rank)[-2000:]}"
            time.sleep(0.05)
        raise AssertionError(f"rank {rank}: no {pattern!r} in {timeout} s: {self.text(self.err, rank)[-2000:]}")

    def ends_with_one_line(self, rank: int, within: float) -> str:
        """Rank's exit (nonzero, within `within` seconds) and its one-line error, the last line of its stderr."""
        try:
            code = self.procs[rank].wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {rank} still running {within} s after its peer stopped: "
                                 f"{self.text(self.err, rank)[-2000:]}") from None
        time.sleep(0.2)  # the reader threads take the last bytes
        err = self.text(self.err, rank)
        assert code == 2 and "Traceback" not in err, (code, err[-3000:])
        line = err.strip().splitlines()[-1]
        assert re.fullmatch(rf"moeserve: error: a peer rank stopped or stopped answering \(.+\); stopping rank "
                            rf"{rank} too", line), err[-3000:]
        return line

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # a stopped process dies of SIGKILL too
                proc.wait(timeout=30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("victim,how", [(1, signal.SIGKILL), (0, signal.SIGSTOP)])
def test_generate_ends_the_survivor_with_one_line(victim, how, device):
    """A killed peer fails the survivor's next collective at once under gloo (it sees the sockets close); a hung one,
    or any under NCCL, after --collective-timeout."""
    argv = ["generate", "--ep", "2", "--device", device, "--greedy", "--ignore-eos", "--max-new-tokens", "400",
            "--collective-timeout", str(TIMEOUT_S), "HAMLET."]  # the demo model: 400 tokens take far longer than a kill
    with Ranks(argv) as ranks:
        ranks.wait_for(ranks.out, 0, r"HAMLET\..")  # rank 0 streams: decoding has begun on both ranks
        os.kill(ranks.procs[victim].pid, how)
        t0 = time.monotonic()
        line = ranks.ends_with_one_line(1 - victim, TIMEOUT_S + SLACK_S)
        if how == signal.SIGSTOP:
            assert time.monotonic() - t0 >= TIMEOUT_S - 1 and "time" in line.lower(), line  # gloo: "timed out", or
            # "timeout caused pair closure" when the timeout struck another pair first


def test_serve_a_dead_follower_fails_the_stream_and_stops_the_server():
    argv = ["serve", "--ep", "2", "--device", "cpu", "--threads", "1", "--port", "0",
            "--collective-timeout", str(TIMEOUT_S)]
    with Ranks(argv) as ranks:
        url = ranks.wait_for(ranks.err, 0, r"listening on (http://\S+?);").group(1)
        ranks.wait_for(ranks.err, 0, r"\[ready")
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": "HAMLET.", "max_tokens": 400, "stream": True, "temperature": 0,
                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 2:  # tokens are flowing: every rank is in the step loop
                    os.kill(ranks.procs[1].pid, signal.SIGKILL)
        error = json.loads(events[-2])  # then [DONE]
        assert error["error"]["code"] == "engine_error" and "a peer rank stopped" in error["error"]["message"], events
        ranks.ends_with_one_line(0, TIMEOUT_S + SLACK_S)


def test_serve_a_dead_rank_0_stops_its_followers():
    argv = ["serve", "--ep", "2", "--device", "cpu", "--threads", "1", "--port", "0",
            "--collective-timeout", str(TIMEOUT_S)]
    with Ranks(argv) as ranks:
        ranks.wait_for(ranks.err, 0, r"\[ready")
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        ranks.ends_with_one_line(1, TIMEOUT_S + SLACK_S)


def test_backend_errors_become_one_line():
    from moeserve.parallel.faults import detail, from_backend

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:2957: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. Check the logs of the remote worker.\nmore")
    assert from_backend(gloo) and detail(gloo) == "Read error [127.0.0.1]:2957: Connection reset by peer"
    assert from_backend(RuntimeError("Application timeout caused pair closure"))
    assert not from_backend(RuntimeError("shape mismatch")) and not from_backend(ValueError("gloo"))


def test_collective_timeout_must_be_positive(capsys):
    from moeserve.cli import main

    assert main(["generate", "--collective-timeout", "0", "x"]) == 2
    assert capsys.readouterr().err == "moeserve: error: --collective-timeout 0 must be > 0 seconds\n"


class DyingMirror:
    """Rank 0's end of serve's mirror (serve/mirror.py) whose peer dies after `steps` steps: its broadcast then
    fails as gloo's does."""

    def __init__(self, steps: int):
        self.steps = steps

    def events(self, changes):
        self.steps -= 1
        if self.steps < 0:
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                               "[127.0.0.1]:2957: Connection reset by peer")
        return changes

    def tokens(self, tokens):
        return tokens


def test_serve_engine_fails_every_job_when_a_peer_stops(tmp_path):
    """Rank 0's engine thread in process: the running and the waiting job end with the error, the server is told once,
    and a job submitted afterwards fails at once."""
    import queue

    import moeserve
    from moeserve.engine.batching import ContinuousBatch
    from moeserve.engine.params import SamplingParams
    from moeserve.serve.batcher import Engine, EngineFailed
    from moeserve.serve.metrics import Metrics
    from moeserve.tokenizer import load_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        model, tok = moeserve.load_model(moeserve.DEMO_MODEL), load_tokenizer(moeserve.DEMO_MODEL)
        told = []
        engine = Engine(ContinuousBatch(model, tok, slots=1, context=64), Metrics("demo", 1), max_queue=1, threads=1,
                        mirror=DyingMirror(steps=3), on_peer_stopped=told.append)
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        sinks = [queue.Queue(), queue.Queue()]  # one runs, one waits for the slot
        for sink in sinks:
            engine.submit(tok.encode("HAMLET."), params, None, sink.put)
        engine.start()
        for sink in sinks:
            while not isinstance(item := sink.get(timeout=60), EngineFailed):
                assert item.finish_reason is None, item  # tokens until the peer dies, never an end
            assert "a peer rank stopped or stopped answering (Read error [127.0.0.1]:2957" in str(item), item
        engine.stop()
        assert len(told) == 1 and told[0] is engine.stopped
        late = queue.Queue()
        engine.submit(tok.encode("x"), params, None, late.put)
        assert isinstance(late.get(timeout=5), EngineFailed)
    finally:
        dist.destroy_process_group()
