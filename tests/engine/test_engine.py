"""Sampling filters against plain reference implementations; stop strings, streaming, seeds."""

import pytest
import torch

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.sequence import TextStream
from moeserve.engine.params import SamplingParams
from moeserve.engine.sampling import filter_logits, sample_next
from moeserve.errors import MoeserveError
from moeserve.tokenizer import ByteTokenizer


def reference_filter(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Indices kept, computed the slow obvious way on one row."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if top_k:
        order = order[:top_k]
    probs = torch.softmax(torch.tensor([row[i] for i in order], dtype=torch.float64), 0).tolist()
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        kept.append(i)
        mass += p
        if mass >= top_p:
            break
    return set(kept)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (5, 1.0), (7, 0.8), (1, 0.3), (0, 0.999)])
def test_filter_matches_reference(top_k, top_p):
    logits = torch.randn(6, 40, dtype=torch.float64) * 3
    out = filter_logits(logits, top_k, top_p)
    for b in range(6):
        assert set(torch.isfinite(out[b]).nonzero().flatten().tolist()) == reference_filter(logits[b].tolist(),
                                                                                             top_k, top_p)


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    logits = torch.randn(1, 5)
    params = SamplingParams(temperature=1.0, seed=1)
    draws = [int(sample_next(logits, params, torch.Generator().manual_seed(9))) for _ in range(3)]
    assert len(set(draws)) == 1
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([sample_next(logits, params, g) for _ in range(4000)]).flatten(),
                            minlength=5)
    assert torch.allclose(counts / 4000, torch.softmax(logits[0], 0), atol=0.03)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                dict(max_new_tokens=0), dict(temperature=float("nan")), dict(stop=("",))])
def test_invalid_sampling_values(kw):
    with pytest.raises(MoeserveError):
        SamplingParams(**kw)


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    tok = ByteTokenizer()
    stream = TextStream(tok.decode, stop=("END",))
    ids = list("héllo EN".encode())
    pieces = []
    for n in range(1, len(ids) + 1):
        text, hit = stream.text(ids[:n])
        assert not hit
        pieces.append(stream.delta(text, final=False))
    assert "".join(pieces) == "héllo "  # "EN" could start "END": held back
    ids += list(b"D tail")
    text, hit = stream.text(ids)
    assert hit and text == "héllo "


@pytest.fixture(scope="module")
def byte_model(byte_model_dir):
    return moeserve.load_model(byte_model_dir), ByteTokenizer()


def test_streamed_text_equals_final_text_and_stops(byte_model):
    model, tok = byte_model
    prompts = [tok.encode("ab"), tok.encode("xyz!")]
    free = generate(model, prompts, SamplingParams(max_new_tokens=30, temperature=1.0, seed=5), tokenizer=tok)
    stop = free[0].text[3:5]  # a stop string that this seeded run is known to produce
    streamed = {0: "", 1: ""}
    res = generate(model, prompts, SamplingParams(max_new_tokens=30, temperature=1.0, seed=5, stop=(stop,)),
                   tokenizer=tok, on_text=lambda i, d: streamed.__setitem__(i, streamed[i] + d))
    assert res[0].finish_reason == "stop" and stop not in res[0].text
    assert free[0].text.startswith(res[0].text)
    assert streamed[0] == res[0].text and streamed[1] == res[1].text


def test_eos_and_length_and_context_limits(byte_model):
    model, tok = byte_model
    g = generate(model, [tok.encode("a")], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert g.finish_reason == "length" and len(g.token_ids) == 5
    first = g.token_ids[0]
    g = generate(model, [tok.encode("a")], SamplingParams(max_new_tokens=5), eos_ids=[first])[0]
    assert g.finish_reason == "eos" and g.token_ids == []
    long = generate(model, [[1] * 60], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(long.token_ids) == 4 and long.finish_reason == "context"  # capped by the 64-token context
    short = [5, 6, 7]
    alone = generate(model, [short], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    both = generate(model, [[1] * 60, short], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [g.finish_reason for g in both] == ["context", "length"]  # each sequence keeps its own room
    assert both[1].token_ids == alone.token_ids and len(both[0].token_ids) == 4
    with pytest.raises(MoeserveError, match="context"):
        generate(model, [[1] * 64], SamplingParams())
    with pytest.raises(MoeserveError, match="vocabulary"):
        generate(model, [[999]], SamplingParams())
