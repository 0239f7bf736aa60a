"""The engine thread in process: a step that raises fails only its requests; a full server refuses at submit."""

import queue

import pytest
import torch

import moeserve
from moeserve.engine.batching import ContinuousBatch
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
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


def test_a_request_whose_own_work_raises_fails_alone(monkeypatch, capsys):
    """Five requests in every step: one whose sampling raises, one whose logprobs raise (top_logprobs over the
    vocabulary), one at temperature 1e-38 (greedy: dividing logits by it overflows to inf) and two greedy ones (one
    with a stop string). The two that raise fail alone; the others finish with their solo text."""
    from moeserve.engine import batching

    model, tok = moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)
    real = batching.sample_next

    def sampler(logits, params, generator):
        if params.temperature == 0.7:
            raise RuntimeError("sampler broke")
        return real(logits, params, generator)

    monkeypatch.setattr(batching, "sample_next", sampler)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    stop_solo = generate(model, [tok.encode("QUEEN.")], greedy, tokenizer=tok)[0].text
    with_stop = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop_solo[5:7],))
    requests = [("KING.", greedy, None), ("QUEEN.", with_stop, None), ("HAMLET.", SamplingParams(
        max_new_tokens=12, temperature=0.7, seed=3), None), ("GHOST.", greedy, 10 ** 6),
                ("ROMEO.", SamplingParams(max_new_tokens=12, temperature=1e-38, ignore_eos=True), None)]
    metrics = Metrics("demo", 5)
    engine = Engine(ContinuousBatch(model, tok, slots=5, context=64), metrics, max_queue=0, threads=1)
    sinks = [queue.Queue() for _ in requests]
    for (prompt, params, top), sink in zip(requests, sinks):  # queued before the thread starts: one batch
        engine.submit(tok.encode(prompt), params, top, sink.put)
    engine.start()
    try:
        got = [updates_until_done(s) for s in sinks]
    finally:
        engine.stop()
    for i in (2, 3):
        assert isinstance(got[i][-1], EngineFailed) and len(got[i]) == 1
    assert "sampler broke" in str(got[2][-1]) and "RuntimeError: sampler broke" in capsys.readouterr().err
    for i, params in ((0, greedy), (1, with_stop), (4, greedy)):
        solo = generate(model, [tok.encode(requests[i][0])], params, tokenizer=tok)[0]
        assert "".join(u.text for u in got[i]) == solo.text and got[i][-1].finish_reason == solo.finish_reason
    assert got[1][-1].finish_reason == "stop"
    assert 'request_success_total{finished_reason="error",model_name="demo"} 2.0' in metrics.exposition().decode()
