"""OpenAI response objects for /v1/completions and /v1/chat/completions: whole, or as stream chunks.

One `Format` per request holds what every chunk of it shares (id, created, model, system_fingerprint) and what
differs between the two endpoints: object names, the shape of a choice (`text` or `message`/`delta`) and of
logprobs.
The engine's finish reasons map to OpenAI's: eos and stop -> "stop" ("tool_calls" for a chat answer that called a
tool), length and context -> "length".
"""

from __future__ import annotations

import json
import time
import uuid

from moeserve.engine.batching import TokenLogprob
from moeserve.serve.chat_output import ChatOutput

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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

    def response(self, text: str, logprobs: list[TokenLogprob] | None, finish: str, use: dict) -> dict:
        """The whole answer (stream: false); logprobs None when not asked for."""
        return self._envelope(self.object, [self._choice(text, logprobs, FINISH_REASONS[finish], final=True)],
                              usage=use)

    def chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish: str | None) -> dict:
        """One stream chunk: new text (and its tokens' logprobs), the finish reason on the last."""
        choice = self._choice(text, logprobs, FINISH_REASONS.get(finish), final=False)
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

    def start_chunk(self) -> dict | None:
        """A chunk sent before any token (chat: the role), or None."""
        return None

    def piece(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _choice(self, text, logprobs, finish, final) -> dict:
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer, model: str, fingerprint: str, include_usage: bool = False):
        super().__init__(tokenizer, model, fingerprint, include_usage)
        self.offset = 0  # characters of the completion before the next token (logprobs' text_offset)

    def _choice(self, text, logprobs, finish, final) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """Completions' logprobs: parallel lists of tokens, their logprobs, the top alternatives, text offsets."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.piece(e.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.piece(t)[0]: lp for t, lp in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


class ChatFormat(Format):
    """Chat answers: the text split by `output` (reasoning_content, content, tool_calls; finish reason
    "tool_calls" when the answer called a tool)."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokenizer, model: str, fingerprint: str, include_usage: bool = False,
                 output: ChatOutput | None = None):
        super().__init__(tokenizer, model, fingerprint, include_usage)
        self.output = output or ChatOutput()
        self.calls = 0  # tool calls streamed so far (a delta's tool call index)

    def start_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if self.include_usage else {}))

    def _choice(self, text, logprobs, finish, final) -> dict:
        lp = None if logprobs is None else {"content": [self._entry(e) for e in logprobs], "refusal": None}
        piece = self.output.feed(text, final or finish is not None)
        if finish == "stop" and self.output.called:
            finish = "tool_calls"
        if final:
            message = {"role": "assistant", "content": piece.content or (None if piece.calls else ""),
                       "refusal": None}
            if self.output.thinks:
                message["reasoning_content"] = piece.reasoning or None
            if piece.calls:
                message["tool_calls"] = [c.as_dict() for c in piece.calls]
            return {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}
        delta = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = [{"index": self.calls + i, **c.as_dict()} for i, c in enumerate(piece.calls)]
            self.calls += len(piece.calls)
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _entry(self, e: TokenLogprob) -> dict:
        text, raw = self.piece(e.token)
        top = [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in
               ((*self.piece(tok), lp) for tok, lp in e.top)]
        return {"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top}
