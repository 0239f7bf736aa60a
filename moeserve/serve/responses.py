"""OpenAI response objects for /v1/completions and /v1/chat/completions: whole, or as stream chunks.

One `Format` per request holds what every chunk of it shares (id, created, model, system_fingerprint), what
differs between the two endpoints (object names, the shape of a choice: `text` or `message`/`delta`, and of
logprobs) and each choice's own state (n > 1: choices are numbered by `index`, a stream's chunks carry one choice
each, interleaved as their tokens come).
The engine's finish reasons map to OpenAI's: eos and stop -> "stop" ("tool_calls" for a chat answer that called a
tool), length and context -> "length".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.engine.batching import TokenLogprob
from moeserve.serve.chat_output import ChatOutput

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage: cached_tokens are the prompt tokens whose KV was reused, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    """One choice's answer, gathered from its updates."""
    text: str
    logprobs: list[TokenLogprob] | None  # None: not asked for
    finish: str  # the engine's finish reason

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs (best_of ranks choices by it)."""
        return sum(e.logprob for e in self.logprobs or [])


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: {json}` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Format:
    object = chunk_object = id_prefix = ""

    def __init__(self, tokenizer, model: str, fingerprint: str, include_usage: bool = False):
        """fingerprint: the server's system_fingerprint (what it serves, and with which moeserve)."""
        self.tokenizer, self.model, self.fingerprint, self.include_usage = tokenizer, model, fingerprint, include_usage
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def response(self, choices: list[Choice], use: dict) -> dict:
        """The whole answer (stream: false): its choices, numbered in order."""
        return self._envelope(self.object, [self._choice(i, c.text, c.logprobs, FINISH_REASONS[c.finish], final=True)
                                            for i, c in enumerate(choices)], usage=use)

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None, finish: str | None) -> dict:
        """One stream chunk of choice `index`: new text (and its tokens' logprobs), the finish reason on its last."""
        choice = self._choice(index, text, logprobs, FINISH_REASONS.get(finish), final=False)
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if self.include_usage else {}))

    @staticmethod
    def empty(chunk: dict) -> bool:
        """Whether a stream chunk says nothing (its text is held back: a possible stop string or tag)."""
        choice = chunk["choices"][0]
        return choice["finish_reason"] is None and not choice["logprobs"] and not (choice.get("delta") or
                                                                                   choice.get("text"))

    def usage_chunk(self, use: dict) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return self._envelope(self.chunk_object, [], usage=use)

    def start_chunks(self, choices: int) -> list[dict]:
        """The chunks sent before any token (chat: each choice's role)."""
        return []

    def piece(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _choice(self, index, text, logprobs, finish, final) -> dict:
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer, model: str, fingerprint: str, include_usage: bool = False):
        super().__init__(tokenizer, model, fingerprint, include_usage)
        self.offsets: dict[int, int] = {}  # choice -> characters before its next token (logprobs' text_offset)

    def _choice(self, index, text, logprobs, finish, final) -> dict:
        return {"index": index, "text": text, "logprobs": self._logprobs(index, logprobs), "finish_reason": finish}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict | None:
        """Completions' logprobs: parallel lists of tokens, their logprobs, the top alternatives, text offsets."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.piece(e.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.piece(t)[0]: lp for t, lp in e.top})
            out["text_offset"].append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return out


class ChatFormat(Format):
    """Chat answers: each choice's text split by its own ChatOutput (reasoning_content, content, tool_calls; finish
    reason "tool_calls" when the answer called a tool)."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokenizer, model: str, fingerprint: str, include_usage: bool = False,
                 outputs: Callable[[], ChatOutput] = ChatOutput):
        """outputs: makes a choice's ChatOutput (how its answer is split)."""
        super().__init__(tokenizer, model, fingerprint, include_usage)
        self.make_output = outputs
        self.outputs: dict[int, ChatOutput] = {}  # choice -> its splitter
        self.calls: dict[int, int] = {}  # choice -> tool calls streamed so far (a delta's tool call index)

    def start_chunks(self, choices: int) -> list[dict]:
        return [self._envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}],
                               **({"usage": None} if self.include_usage else {})) for i in range(choices)]

    def _choice(self, index, text, logprobs, finish, final) -> dict:
        lp = None if logprobs is None else {"content": [self._entry(e) for e in logprobs], "refusal": None}
        output = self.outputs.setdefault(index, self.make_output())
        piece = output.feed(text, final or finish is not None)
        if finish == "stop" and output.called:
            finish = "tool_calls"
        if final:
            message = {"role": "assistant", "content": piece.content or (None if piece.calls else ""),
                       "refusal": None}
            if output.thinks:
                message["reasoning_content"] = piece.reasoning or None
            if piece.calls:
                message["tool_calls"] = [c.as_dict() for c in piece.calls]
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
        delta = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.calls:
            streamed = self.calls.get(index, 0)
            delta["tool_calls"] = [{"index": streamed + i, **c.as_dict()} for i, c in enumerate(piece.calls)]
            self.calls[index] = streamed + len(piece.calls)
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _entry(self, e: TokenLogprob) -> dict:
        text, raw = self.piece(e.token)
        top = [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in
               ((*self.piece(tok), lp) for tok, lp in e.top)]
        return {"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top}
