"""One sequence's record and rules, shared by every engine loop (engine/batching.py, plan/pipeline.py): what it
generated (Generation), its text made final as it streams (TextStream), the checks a request must pass, how many
tokens it may add, and when it finishes (EOS, a stop string, its token limit or the model's context).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output (cut at a stop string); empty without a tokenizer
    finish_reason: str | None = None  # "eos" | "stop" | "length" (max_new_tokens) | "context" (the model's context)


class TextStream:
    """Incremental detokenisation: yields only text that is final (whole UTF-8 characters, not a possible
    start of a stop string)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0

    def text(self, ids: list[int]) -> tuple[str, bool]:
        """Full text so far (cut at the first stop string) and whether a stop string was hit."""
        text = self.decode(ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def delta(self, text: str, final: bool) -> str:
        end = len(text) if final else max(self.emitted, len(text.rstrip("\ufffd")) - self.hold)
        out, self.emitted = text[self.emitted:end], max(self.emitted, end)
        return out


def check_request(spec, prompts: list[list[int]], params: SamplingParams, tokenizer=None,
                  context: int | None = None) -> None:
    """Raise MoeserveError for a batch no engine can run: empty prompts, too long (for `context` tokens, default
    the model's), ids outside the vocabulary."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise MoeserveError("every prompt needs at least one token")
    if params.stop and tokenizer is None:
        raise MoeserveError("stop strings need a tokenizer")
    longest = max(len(p) for p in prompts)
    context = context or spec.max_position_embeddings
    if longest >= context:
        whose = "the model's context" if context == spec.max_position_embeddings else "the context"
        raise MoeserveError(f"prompt of {longest} tokens does not fit {whose} of {context} tokens")
    for b, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= spec.vocab_size:
            raise MoeserveError(f"prompt {b} holds a token id outside the vocabulary [0, {spec.vocab_size})")


def left_padded(prompts: list[list[int]], spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, valid, positions [B, S] (CPU) of prompts left-padded to the longest; positions count real
    tokens only, so each sequence gets the positions it would have alone."""
    longest = max(len(p) for p in prompts)
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0
    tokens = torch.full((len(prompts), longest), pad, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, longest - len(p):] = torch.tensor(p)
        valid[b, longest - len(p):] = True
    return tokens, valid, (valid.long().cumsum(-1) - 1).clamp(min=0)


def token_limits(spec, prompts: list[list[int]], params: SamplingParams, context: int | None = None) -> list[int]:
    """How many tokens each sequence may add: max_new_tokens, or fewer where the context (`context` tokens, default
    the model's) ends first (positions count a sequence's own tokens, so a short prompt in a batch keeps its own
    room)."""
    return [min(params.max_new_tokens, (context or spec.max_position_embeddings) - len(p)) for p in prompts]


def limit_reason(params: SamplingParams, limit: int) -> str:
    """The finish reason of a sequence that used all `limit` tokens token_limits gave it."""
    return "length" if limit == params.max_new_tokens else "context"


def record_tokens(gens: list[Generation], streams: list, new: torch.Tensor, alive: torch.Tensor, eos: set[int],
                  params: SamplingParams, step: int, limits: list[int], on_text=None) -> None:
    """Append each live sequence's new token [B] of decode step `step`; sequences that finish (limits from
    token_limits) are marked dead in alive [B]."""
    for b in alive.nonzero().flatten().tolist():
        last = limit_reason(params, limits[b]) if step == limits[b] - 1 else None
        append_token(gens[b], streams[b], int(new[b]), eos, params, last=last, on_text=on_text, index=b)
        if gens[b].finish_reason:
            alive[b] = False


def append_token(gen: Generation, stream: TextStream | None, token: int, eos: set[int], params: SamplingParams,
                 last: str | None, on_text, index: int) -> None:
    """Record one new token and decide whether this sequence is finished (last: the finish reason if this is its
    last allowed token)."""
    if token in eos and not params.ignore_eos:
        gen.finish_reason = "eos"
    else:
        gen.token_ids.append(token)
    if stream is not None:
        gen.text, hit = stream.text(gen.token_ids)
        if hit:
            gen.finish_reason = "stop"
    if last and gen.finish_reason is None:
        gen.finish_reason = last
    if stream is not None and on_text is not None:
        delta = stream.delta(gen.text, final=gen.finish_reason is not None)
        if delta:
            on_text(index, delta)
