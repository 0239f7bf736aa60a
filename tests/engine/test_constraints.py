"""Constrained decoding: packed masks, vocabularies as bytes, and grammars held by ContinuousBatch's sampling
(greedy and sampled) whatever the model prefers; a constraint that fails fails its request alone."""

import json
import random
import sys

import jsonschema
import pytest
import torch

import moeserve
from moeserve.engine.batching import ContinuousBatch, Request
from moeserve.engine.constraints import AfterText, Grammars, constrain, mask_words, pack_mask, unpack_mask
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.tokenizer import ByteTokenizer, load_tokenizer
from hf_models import random_words, save_tokenizer
from json_schemas import random_schema

pytest.importorskip("xgrammar")
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def tiny(byte_model_dir):
    """A tiny random model with the demo's byte vocabulary: it rambles, so only the grammar ends its JSON."""
    return moeserve.load_model(byte_model_dir, dtype=torch.float32), load_tokenizer(byte_model_dir)


def test_unpack_mask_matches_bit_by_bit_reference():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 258, 1000):
        bits = torch.randint(-2 ** 31, 2 ** 31, (3, mask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
        want = torch.tensor([[(int(bits[b, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for b in range(3)])
        assert torch.equal(unpack_mask(bits, vocab), want)
        assert all(torch.equal(pack_mask(want[b]), bits[b]) for b in range(3) if vocab % 32 == 0)


class Forced:
    """A constraint allowing exactly the next token of `ids`, then only `stop`."""

    def __init__(self, ids: list[int], stop: int):
        self.ids, self.stop, self.n = ids, stop, 0

    def fill(self, bits):
        t = self.ids[self.n] if self.n < len(self.ids) else self.stop
        bits[t // 32] = torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, token):
        if token != (self.ids[self.n] if self.n < len(self.ids) else self.stop):
            raise MoeserveError(f"token {token} not allowed")
        self.n += 1

    @property
    def done(self):
        return self.n > len(self.ids)


class Broken(Forced):
    def fill(self, bits):
        raise RuntimeError("broken grammar")


def run(batch, requests):
    updates = {id(r): [] for r in requests}
    for r in requests:
        r.on_update = lambda req, u: updates[id(req)].append(u)
        batch.add(r)
    for _ in range(MAX_STEPS):
        if not batch.step():
            return updates
    raise AssertionError("the batch did not finish")


def test_constraint_forces_text_greedy_and_sampled_and_fails_alone(tiny):
    model, tok = tiny
    batch = ContinuousBatch(model, tok, slots=4, context=256)
    target = "Zounds! 42 {}"
    prompt = tok.encode("HAMLET.")
    forced = [Request(prompt, SamplingParams(max_new_tokens=40, temperature=t, seed=3), None,
                      constraint=Forced(list(target.encode()), tok.eos_id)) for t in (0.0, 1.3)]
    free = Request(prompt, SamplingParams(max_new_tokens=8), None)
    broken = Request(prompt, SamplingParams(max_new_tokens=8), None, constraint=Broken([], tok.eos_id))
    updates = run(batch, forced + [free, broken])
    for r in forced:
        assert "".join(u.text for u in updates[id(r)]) == target and updates[id(r)][-1].finish_reason == "eos"
        assert r.constraint.done
    alone = generate(model, [prompt], free.params, tokenizer=tok)[0]  # unconstrained rows: as if alone
    assert [t for u in updates[id(free)] for t in u.token_ids] == alone.token_ids and len(alone.token_ids) == 8
    assert updates[id(broken)][-1].finish_reason == "error" and "broken" in str(updates[id(broken)][-1].error)


def test_missing_grammar_library_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if not installed
    with pytest.raises(MoeserveError, match=r"^structured output and tool calls need xgrammar: pip install "
                                            r"'moeserve\[structured\]'$"):
        Grammars(ByteTokenizer(), 258, {257})


def test_constrain_masks_its_rows_and_keeps_the_input():
    logits = torch.randn(3, 70, dtype=torch.float64)
    before = logits.clone()
    errors = {}
    out = constrain(logits, [1, 2], [Forced([5], 0), Forced([], 69)], errors)  # [2, V]
    assert torch.equal(logits, before) and out.shape == (2, 70) and not errors
    assert out[0].argmax() == 5 and torch.isinf(out[0]).sum() == 69 and out[0, 5] == before[1, 5]
    assert out[1].argmax() == 69 and out[1, 69] == before[2, 69]
    constrain(logits, [0], [Broken([], 0)], errors)
    assert "broken" in str(errors[0])


def test_vocab_bytes_spell_the_text(tmp_path):
    assert ByteTokenizer().vocab_bytes()[:3] == [b"\x00", b"\x01", b"\x02"] and ByteTokenizer().vocab_bytes()[-1] == b""
    rng = random.Random(1)
    tok = load_tokenizer(save_tokenizer(tmp_path, random_words(rng, 80)))
    table = tok.vocab_bytes()
    assert len(table) == tok.vocab_size and table[4] == b""  # <|im_end|>: special
    for text in (random_words(rng, 12), "héllo wörld ✓ {\"a\": [1, 2]}", "日本語"):
        assert b"".join(table[i] for i in tok.encode(text, add_special_tokens=False)) == text.encode()


def test_json_schemas_hold_on_a_rambling_model(tiny):
    """8 random schemas at once, sampled: every output parses and validates, and ends by the grammar (eos)."""
    model, tok = tiny
    grammars = Grammars(tok, model.spec.vocab_size, {tok.eos_id})
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(8)]
    batch = ContinuousBatch(model, tok, slots=8, context=512)
    requests = [Request(tok.encode("KING."), SamplingParams(max_new_tokens=400, temperature=1.0, seed=i), None,
                        constraint=grammars.json_schema(s)) for i, s in enumerate(schemas)]
    updates = run(batch, requests)
    for r, schema in zip(requests, schemas):
        got = updates[id(r)]
        assert got[-1].finish_reason == "eos", got[-1]
        jsonschema.validate(json.loads("".join(u.text for u in got)), schema)


def test_structural_tag_and_json_object(tiny):
    model, tok = tiny
    grammars = Grammars(tok, model.spec.vocab_size, {tok.eos_id})
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"]}
    call = {"type": "tag", "begin": '<tool_call>\n{"name": "find", "arguments": ', "end": "}\n</tool_call>",
            "content": {"type": "json_schema", "json_schema": schema}}
    batch = ContinuousBatch(model, tok, slots=2, context=512)
    requests = [Request(tok.encode("KING."), SamplingParams(max_new_tokens=300, temperature=1.0, seed=1), None,
                        constraint=grammars.structural_tag(call)),
                Request(tok.encode("KING."), SamplingParams(max_new_tokens=1500, temperature=1.0, seed=2), None,
                        constraint=grammars.json_object())]
    updates = run(batch, requests)
    assert [updates[id(r)][-1].finish_reason for r in requests] == ["eos", "eos"]
    call, obj = ("".join(u.text for u in updates[id(r)]) for r in requests)
    assert call.startswith('<tool_call>\n{"name": "find", "arguments": ') and call.endswith("}\n</tool_call>")
    jsonschema.validate(json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"],
                        schema)
    assert isinstance(json.loads(obj), dict)
    with pytest.raises(MoeserveError, match="cannot compile"):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrain_on_cuda_matches_cpu():
    """The masks unpacked on the GPU mask the GPU's logits as the CPU's do (fresh random logits and masks)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 151_000, generator=g)
    tokens = torch.randint(0, 151_000, (3,), generator=g).tolist()
    constraints = lambda: [Forced([t], 0) for t in tokens]  # noqa: E731
    cpu = constrain(logits, [0, 3, 7], constraints(), {})
    gpu = constrain(logits.cuda(), [0, 3, 7], constraints(), {})
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    assert cpu.argmax(-1).tolist() == tokens


class Digits:
    """A constraint of digits only, recording what it accepts."""

    def __init__(self, vocab: int):
        self.allowed = torch.zeros(vocab, dtype=torch.bool)
        self.allowed[ord("0"):ord("9") + 1] = True
        self.accepted = []

    def fill(self, bits):
        bits.copy_(pack_mask(self.allowed))

    def accept(self, token):
        assert self.allowed[token]
        self.accepted.append(token)

    @property
    def done(self):
        return len(self.accepted) == 2


def test_after_text_is_free_until_the_marker_then_holds_the_grammar():
    """Before the marker every token but the stop tokens may come (a marker split over tokens counts); from the token
    after it the inner grammar's mask and acceptance hold."""
    vocab, stop = 260, 257
    table = [bytes([i]) for i in range(256)] + [b"</think>", b"", b"", b""]
    free = torch.ones(vocab, dtype=torch.bool)
    free[stop] = False
    inner = Digits(vocab)
    c = AfterText(inner, b"</think>", table, pack_mask(free))
    bits = torch.zeros(mask_words(vocab), dtype=torch.int32)
    for token in b"hmm </thi":
        c.fill(bits)
        assert torch.equal(unpack_mask(bits[None], vocab)[0], free) and not c.done
        c.accept(token)
    c.accept(ord("n"))
    c.accept(ord("k"))
    assert not c.started
    c.accept(ord(">"))  # "</think>" over four tokens
    c.fill(bits)
    assert torch.equal(unpack_mask(bits[None], vocab)[0], inner.allowed)
    c.accept(ord("4"))
    c.accept(ord("2"))
    assert c.done and inner.accepted == [ord("4"), ord("2")]
    whole = AfterText(Digits(vocab), b"</think>", table, pack_mask(free))
    whole.accept(256)  # the marker as one token
    assert whole.started
