"""Prefill + decode loop over a batch of prompts of different lengths, with streaming and stop rules.

Prompts are left-padded into one batch; positions count real tokens only, pad slots are never
attended to, so each sequence gets exactly the tokens it would get alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from moeserve.engine.cuda_graph import SegmentedDecoder, StaticDecoder, host_layers
from moeserve.engine.sampling import SamplingParams, sample_next
from moeserve.errors import MoeserveError
from moeserve.model.kv_cache import KVCache


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


def generate(model, prompts: list[list[int]], params: SamplingParams, tokenizer=None, eos_ids=None,
             on_text: Callable[[int, str], None] | None = None, cuda_graph: bool = True) -> list[Generation]:
    """Run to completion; `on_text(seq_index, new_text)` streams text as it becomes final.

    cuda_graph: replay decode steps as a CUDA graph where the model allows it (see engine/cuda_graph.py)."""
    results = None
    for results, _ in iterate(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph):
        pass
    return results


def iterate(model, prompts: list[list[int]], params: SamplingParams, tokenizer=None, eos_ids=None,
            on_text: Callable[[int, str], None] | None = None,
            cuda_graph: bool = True) -> Iterator[tuple[list[Generation], torch.Tensor]]:
    """Check the request now (errors before any output), then yield (generations, new_tokens [B]) per step."""
    check_request(model.spec, prompts, params, tokenizer)
    return _steps(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph)


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


def _decoder(model, kv: KVCache, batch: int, cuda_graph: bool) -> Callable:
    """The decode step (tokens, positions, valid [B, 1]) -> logits [B, 1, V]: on CUDA a replayed CUDA graph, or,
    where some layers' experts read the routing on the host, graphs of the segments between them; else the dynamic
    forward (attends over the filled slots only: cheaper without a graph)."""
    if cuda_graph and model.device.type == "cuda":
        layers = host_layers(model, batch)
        if not layers:
            return StaticDecoder(model, kv, graph=True)
        return SegmentedDecoder(model, kv, layers)
    return lambda tokens, positions, valid: model(tokens, positions, kv=kv, valid=valid, last_only=True)


def _steps(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph):
    spec, device = model.spec, model.device
    eos = set(spec.eos_token_ids if eos_ids is None else eos_ids)
    longest = max(len(p) for p in prompts)
    limits = token_limits(spec, prompts, params)
    B = len(prompts)
    tokens, valid, positions = (t.to(device) for t in left_padded(prompts, spec))  # [B, S] each
    kv = KVCache(spec, B, longest + max(limits), device, model.dtype)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    gens = [Generation(prompt_ids=list(p)) for p in prompts]
    streams = [TextStream(tokenizer.decode, params.stop) if tokenizer else None for _ in prompts]
    alive = torch.ones(B, dtype=torch.bool, device=device)
    with torch.inference_mode():
        logits = model(tokens, positions, kv=kv, valid=valid, last_only=True)  # [B, 1, V]
        next_pos = positions[:, -1:] + 1  # [B, 1]
        decode = _decoder(model, kv, B, cuda_graph)
        for step in range(max(limits)):
            new = sample_next(logits[:, -1], params, generator)  # [B]
            record_tokens(gens, streams, new, alive, eos, params, step, limits, on_text)
            yield gens, new
            if not alive.any():
                break
            model.before_step()
            logits = decode(new[:, None], next_pos, alive[:, None])
            next_pos = next_pos + 1


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
