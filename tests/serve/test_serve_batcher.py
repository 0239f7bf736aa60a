"""The engine thread in process: a step that raises fails only its requests; a full server refuses at submit."""

import queue

import pytest
import torch

import moeserve
from moeserve.engine.batching import ContinuousBatch
from moeserve.engine.generate import generate
from moeserve.engine.sampling import SamplingParams
from moeserve.serve.batcher import Engine, EngineFailed, QueueFull
from moeserve.serve.metrics import Metrics
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture


def updates_until_done(sink: queue.Queue, limit: int = 1000) -> list:
    items = []
    for _ in range(limit):
        items.append(sink.get(timeout=60))
        if isinstance(items[-1], EngineFailed) or items[-1].finish_reason is not None:
            return items
    raise AssertionError("no end")


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(capsys):
    model, tok = moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)
    batch = ContinuousBatch(model, tok, slots=2, context=64)
    engine = Engine(batch, Metrics("demo", 2), max_queue=0, threads=1)
    decoder = batch.decoder

    def broken(*args):
        raise RuntimeError("device lost")

    batch.decoder = broken
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        sinks = [queue.Queue() for _ in range(2)]
        for s in sinks:
            engine.submit(tok.encode("KING."), params, None, s.put)
        with pytest.raises(QueueFull):
            engine.submit(tok.encode("QUEEN."), params, None, queue.Queue().put)
        for s in sinks:  # the first token comes from the prefill; the decode step then raises
            failed = updates_until_done(s)[-1]
            assert isinstance(failed, EngineFailed) and "device lost" in str(failed)
        assert "RuntimeError: device lost" in capsys.readouterr().err
        batch.decoder = decoder
        sink = queue.Queue()
        engine.submit(tok.encode("QUEEN."), params, None, sink.put)  # both slots and the count were freed
        got = updates_until_done(sink)
        assert got[-1].finish_reason == "length"
        solo = generate(model, [tok.encode("QUEEN.")], params)[0].token_ids
        assert [t for u in got for t in u.token_ids] == solo
    finally:
        engine.stop()


def test_a_slow_step_is_logged_with_what_it_computed(caplog, monkeypatch):
    """Every step over SLOW_STEP_S is logged at info with its shape: the prefill pass's rows and width, then the
    decode steps' rows."""
    from moeserve.serve import batcher

    monkeypatch.setattr(batcher, "SLOW_STEP_S", -1.0)  # every step is slow
    model, tok = moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)
    engine = Engine(ContinuousBatch(model, tok, slots=2, context=64), Metrics("demo", 2), max_queue=0, threads=1)
    prompt = tok.encode("KING. Speak.")
    with caplog.at_level("INFO", logger="moeserve.serve.batcher"):
        engine.start()
        try:
            sink = queue.Queue()
            engine.submit(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), None, sink.put)
            assert updates_until_done(sink)[-1].finish_reason == "length"
        finally:
            engine.stop()
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step: ")]
    assert steps[0].endswith(f" ms for prefill 1 x {len(prompt)} tokens")
    assert sum(s.endswith(" ms for decode 1 rows") for s in steps) == 2  # the tokens after the prefill's first
