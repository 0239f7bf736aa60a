"""Constrained decoding: a request's tokens restricted, step by step, to those a grammar allows.

A `TokenConstraint` is one request's matcher: before each sampling it fills a packed bitmask of the tokens that
may come next (int32 words, bit t % 32 of word t // 32 for token t: the layout grammar libraries fill), after it
accepts the token drawn. ContinuousBatch._draw masks the constrained rows of the logits with it (greedy and
sampled alike), so a grammar holds whatever the model prefers; once the grammar is complete only the stop tokens
are allowed, which ends the request with "eos".

`AfterText` holds a grammar back until the answer's text holds a marker: a reasoning model thinks in free text up to
its end-of-thinking tag (`</think>`), and the grammar holds what follows.

`Grammars` compiles grammars for one tokenizer with xgrammar (the `structured` extra): JSON schemas, any JSON
object, and xgrammar structural tags (tool calls: fixed texts around their arguments, built per tool-call format
by serve/tool_formats). xgrammar was chosen
over llguidance by bench/structured_mask.py: per-token masks of 1-4 us against llguidance's 10-350 us (258 and
a synthetic 151k-token vocabulary, one CPU thread), for a compile of 1-75 ms that Grammars caches per grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Protocol

import torch

from moeserve.errors import MoeserveError

CACHED_GRAMMARS = 64  # compiled grammars kept per tokenizer (a compile of a JSON schema: 1-75 ms)


class TokenConstraint(Protocol):
    """One request's grammar state."""

    def fill(self, bits: torch.Tensor) -> None:
        """Write the tokens allowed next into bits (int32 [ceil(V / 32)], CPU): bit t % 32 of word t // 32."""

    def accept(self, token: int) -> None:
        """Advance past the token drawn; MoeserveError if the grammar does not allow it."""

    @property
    def done(self) -> bool:
        """Whether the grammar has ended (a stop token was accepted after a complete match)."""


def mask_words(vocab: int) -> int:
    """int32 words of a packed mask over `vocab` tokens."""
    return (vocab + 31) // 32


def unpack_mask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed masks [B, W] int32 -> allowed [B, vocab] bool (on bits' device)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)  # [32]
    allowed = ((bits[:, :, None] >> shifts) & 1).bool()  # [B, W, 32]
    return allowed.reshape(bits.shape[0], -1)[:, :vocab]


def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [V] bool -> the packed mask int32 [ceil(V / 32)] (unpack_mask's inverse)."""
    padded = torch.zeros(mask_words(allowed.shape[0]) * 32, dtype=torch.int64)
    padded[:allowed.shape[0]] = allowed.long()
    words = (padded.view(-1, 32) << torch.arange(32)).sum(-1)  # [W], bits 0-31 of an int64
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def constrain(logits: torch.Tensor, rows: list[int], constraints: list[TokenConstraint],
              errors: dict[int, Exception]) -> torch.Tensor:
    """The rows `rows` of logits [B, V] masked by their constraints (disallowed tokens at -inf): [len(rows), V], a
    new tensor (logits stay as the model gave them: logprobs report the model's own, and no [B, V] copy is made). A
    constraint that raises, or allows no token, fails its row alone: the exception goes into errors under the
    row."""
    vocab = logits.shape[-1]
    bits = torch.zeros(len(rows), mask_words(vocab), dtype=torch.int32)  # [n, W]
    for j, (row, c) in enumerate(zip(rows, constraints)):
        try:
            c.fill(bits[j])
        except Exception as e:  # noqa: BLE001 - reported for this request only
            errors[row] = e
    for j in (bits == 0).all(-1).nonzero().flatten().tolist():
        errors.setdefault(rows[j], MoeserveError("the request's grammar allows no token here"))
    allowed = unpack_mask(bits.to(logits.device, non_blocking=True), vocab)  # [n, V]
    return logits[rows].masked_fill(~allowed, float("-inf"))


def require_xgrammar():
    """The xgrammar module, or a one-line error naming the extra that installs it."""
    try:
        import xgrammar  # the structured extra: only requests with a grammar need it
    except ImportError:
        raise MoeserveError("structured output and tool calls need xgrammar: pip install 'moeserve[structured]'") \
            from None
    return xgrammar


class GrammarConstraint:
    """A TokenConstraint over an xgrammar matcher of one compiled grammar, and `keep` (packed int32 [W]): the tokens
    JSON text may hold at all."""

    def __init__(self, compiled, keep: torch.Tensor):
        xgr = require_xgrammar()
        self.matcher, self.keep = xgr.GrammarMatcher(compiled), keep

    def fill(self, bits: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(bits[None], 0)
        bits &= self.keep

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise MoeserveError(f"token {token} breaks the request's grammar")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


class AfterText:
    """A TokenConstraint that lets the answer run free until its text holds `marker`, then holds it to `inner` from
    the next token on (the grammar sees none of the text up to and with the marker's token). While free, any token of
    the vocabulary may come but the stop tokens: an answer that stopped before the marker would skip its grammar."""

    def __init__(self, inner: TokenConstraint, marker: bytes, table: list[bytes], free: torch.Tensor):
        """table: each token id's bytes; free: packed int32 [W], the tokens allowed before the marker."""
        self.inner, self.marker, self.table, self.free = inner, marker, table, free
        self.tail = b""  # the last bytes of the free text (the start of a marker split over tokens)
        self.started = False  # the marker came: the grammar holds

    def fill(self, bits: torch.Tensor) -> None:
        if self.started:
            self.inner.fill(bits)
        else:
            bits.copy_(self.free)

    def accept(self, token: int) -> None:
        if self.started:
            self.inner.accept(token)
            return
        if not 0 <= token < len(self.table):
            raise MoeserveError(f"token {token} is outside the vocabulary")
        text = self.tail + self.table[token]
        self.started = self.marker in text
        self.tail = text[max(0, len(text) - len(self.marker) + 1):]

    @property
    def done(self) -> bool:
        return self.started and self.inner.done


class Grammars:
    """Grammars compiled for one tokenizer and model vocabulary (padded vocabularies: the extra ids never allowed),
    cached by their text; each new constraint is a fresh matcher of a cached grammar. Safe to use from several
    threads (the server compiles off its event loop)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        """tokenizer: moeserve's (vocab_bytes); vocab_size: the model's logits width; stop_ids: the tokens that end
        a request (allowed once the grammar is complete)."""
        xgr = require_xgrammar()
        info = xgr.TokenizerInfo(tokenizer.vocab_bytes(), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # xgrammar lets JSON strings hold raw control characters, which JSON forbids: tokens holding any but a
        # newline (the tool-call tags' separator; JSON strings take none from xgrammar) are never allowed
        table = tokenizer.vocab_bytes() + [b""] * (vocab_size - tokenizer.vocab_size)
        self.keep = pack_mask(torch.tensor([not any(b < 0x20 and b != 0x0A for b in t) for t in table[:vocab_size]]))
        self.table = table[:vocab_size]
        stops = set(stop_ids)  # free text (AfterText): every token of the tokenizer's but the stop tokens
        self.free = pack_mask(torch.tensor([i < tokenizer.vocab_size and i not in stops for i in range(vocab_size)]))
        self.cache: OrderedDict[str, object] = OrderedDict()
        self.lock = threading.Lock()

    def json_schema(self, schema: dict) -> GrammarConstraint:
        """Output that is one JSON value matching `schema` (JSON Schema; strict: no properties beyond it)."""
        return self._make(("schema", schema), lambda: self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True))

    def json_object(self) -> GrammarConstraint:
        """Output that is one JSON object."""
        return self.json_schema({"type": "object"})

    def structural_tag(self, fmt: dict) -> GrammarConstraint:
        """Output that follows `fmt`, an xgrammar structural-tag format (tags, sequences, JSON schemas, their XML
        styles), and nothing else."""
        return self._make(("structural_tag", fmt), lambda: self.compiler.compile_structural_tag(
            {"type": "structural_tag", "format": fmt}))

    def after(self, marker: str, inner: TokenConstraint) -> AfterText:
        """`inner` from the token after the answer's text holds `marker` (free text up to it)."""
        return AfterText(inner, marker.encode("utf-8"), self.table, self.free)

    def _make(self, key, compile_fn) -> GrammarConstraint:
        text = json.dumps(key, sort_keys=True)
        with self.lock:
            compiled = self._compiled(text, compile_fn)
        return GrammarConstraint(compiled, self.keep)

    def _compiled(self, text: str, compile_fn):
        compiled = self.cache.get(text)
        if compiled is None:
            try:
                compiled = compile_fn()
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for a bad schema
                raise MoeserveError(f"cannot compile the grammar: {str(e).splitlines()[0] if str(e) else e!r}") \
                    from None
            self.cache[text] = compiled
            while len(self.cache) > CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        self.cache.move_to_end(text)
        return compiled
