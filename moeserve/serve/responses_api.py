"""OpenAI Responses API objects for POST /v1/responses: the response, and its stream of typed events.

An answer's text is split as chat answers are (serve/chat_output.py) into output items: a `reasoning` item (its
thinking), a `message` item (its text, one output_text part) and a `function_call` item per tool call, in the
order they appear. Streaming sends response.created and response.in_progress, then per item
response.output_item.added, its deltas (response.reasoning_text.delta, response.output_text.delta, a call's
arguments whole in response.function_call_arguments.delta) and its done events, and last response.completed (or
response.incomplete when max_output_tokens cut it short). Each event is `event: TYPE` and `data: JSON`, numbered
by sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid

from moeserve.serve.chat_output import ChatOutput
from moeserve.serve.tool_calls import Call


def responses_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The Responses API's usage: cached_tokens are the input tokens whose KV was reused, not computed."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def event(kind: str, data: dict) -> str:
    """One server-sent event of the Responses API."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    def __init__(self, model: str, settings: dict, output: ChatOutput):
        """settings: what the response echoes of its request (instructions, max_output_tokens, temperature, top_p,
        tools, tool_choice, parallel_tool_calls, text); output: how the answer's text is split."""
        self.model, self.settings, self.output = model, settings, output
        self.id, self.created = item_id("resp"), int(time.time())
        self.items: list[dict] = []  # the output items so far; the last one may still be open
        self.open: str | None = None  # the kind of the open item: reasoning or message
        self.sequence = 0

    def response(self, status: str, use: dict | None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "model": self.model, "output": self.items, "usage": use,
                "metadata": {}, **self.settings}

    def whole(self, text: str, finish: str, use: dict) -> dict:
        """The response to a non-streaming request."""
        list(self._add(self.output.feed(text, final=True)))  # builds the items (the events go unsent)
        self._close()
        return self.response(self._status(finish), use)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response("in_progress", None)),
                self._event("response.in_progress", response=self.response("in_progress", None))]

    def feed(self, text: str, finish: str | None) -> list[str]:
        """The events for the next piece of the answer (finish: set on its last)."""
        return list(self._add(self.output.feed(text, final=finish is not None)))

    def end(self, finish: str, use: dict) -> list[str]:
        events = self._close()
        status = self._status(finish)
        return events + [self._event(f"response.{status}", response=self.response(status, use))]

    def _status(self, finish: str) -> str:
        return "incomplete" if finish in ("length", "context") else "completed"

    def _event(self, kind: str, **data) -> str:
        self.sequence += 1
        return event(kind, {**data, "sequence_number": self.sequence - 1})

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _add(self, piece):
        if piece.reasoning:
            yield from self._text("reasoning", piece.reasoning)
        if piece.content:
            yield from self._text("message", piece.content)
        for call in piece.calls:
            yield from self._close()
            yield from self._call(call)

    def _text(self, kind: str, text: str):
        if self.open != kind:
            yield from self._close()
            self.open = kind
            if kind == "reasoning":
                self.items.append({"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [],
                                   "status": "in_progress"})
                yield self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.items[-1], content=[]))
                self.items[-1]["content"].append({"type": "reasoning_text", "text": ""})
            else:
                self.items.append({"type": "message", "id": item_id("msg"), "status": "in_progress",
                                   "role": "assistant", "content": []})
                yield self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.items[-1], content=[]))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.items[-1]["content"].append(part)
                yield self._event("response.content_part.added", **self._where(), content_index=0, part=dict(part))
        self.items[-1]["content"][0]["text"] += text
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        else:
            yield self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                              logprobs=[])

    def _close(self) -> list[str]:
        """Finish the open reasoning or message item: its done events."""
        if self.open is None:
            return []
        item, kind = self.items[-1], self.open
        self.open = None
        item["status"] = "completed"
        part = item["content"][0]
        if kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **self._where(), content_index=0, text=part["text"])]
        else:
            events = [self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", **self._where(), content_index=0, part=part)]
        return events + [self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _call(self, call: Call):
        item = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        yield self._event("response.output_item.added", output_index=len(self.items) - 1,
                          item=dict(item, arguments="", status="in_progress"))
        yield self._event("response.function_call_arguments.delta", **self._where(), delta=call.arguments)
        yield self._event("response.function_call_arguments.done", **self._where(), name=call.name,
                          arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)
