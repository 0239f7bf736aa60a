"""Tool calls out of an answer's text: what every tool-call format shares (serve/tool_formats has one module per
format).

A `Call` is one parsed call (name, JSON arguments). A `CallParser` takes an answer's content piece by piece and
splits it into plain text and complete calls; `BlockParser` is the one of formats whose calls sit in blocks between
an opening and a closing marker (Hermes's <tool_call>, DeepSeek's <｜tool▁calls▁begin｜>, GLM's <tool_call>): text
from an opening marker (or what could be its start) on is held until the block closes, then `read` turns the
block's inside into calls; a block that holds none (not JSON, no name) is given back as text, and so is a block
still open when the answer ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

from moeserve.serve.reasoning import held

Function = tuple[str, dict]  # a tool the answer may call: its name and its parameters' JSON schema


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallParser(Protocol):
    calls: list[Call]  # the calls made so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        """The plain text and the calls that `text` (the next piece of content) makes final; final: the answer
        ended (nothing is held back)."""


def json_arguments(schema: dict) -> dict:
    """The structural-tag content of a call's arguments: one JSON value matching `schema`, at most one whitespace
    character in a row (a model under a grammar must not pad its JSON forever)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def call_sequence(tags: list[dict], separator: str, parallel: bool) -> dict:
    """The structural tag of one or more calls (one only unless parallel), each one of `tags`, joined by
    `separator`."""
    return {"type": "tags_with_separator", "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel, "tags": tags}


def tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def arguments_text(args) -> str:
    """A call's arguments as JSON text (a string is taken as JSON text already)."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class BlockParser:
    def __init__(self, open_: str, close: str, read: Callable[[str], list[Call] | None]):
        """open_, close: the markers around a block; read: a block's inside -> its calls, or None when it holds
        none."""
        self.open, self.close, self.read = open_, close, read
        self.buffer = ""
        self.calls: list[Call] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        """The plain text and the calls that `text` (the next piece of content) makes final; final: the answer
        ended (an open block is given back as text)."""
        self.buffer += text
        out, calls = "", []

        def plain(piece: str) -> str:  # text; once a call was made, blank text is the calls' separator
            return "" if (self.calls or calls) and not piece.strip() else piece

        while True:
            start = self.buffer.find(self.open)
            if start < 0:
                keep = 0 if final else held(self.buffer, self.open)
                out += plain(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(self.close, start + len(self.open))
            if end < 0:
                out += plain(self.buffer[:start])
                self.buffer = self.buffer[start:]
                if final:
                    out, self.buffer = out + self.buffer, ""
                break
            found = self.read(self.buffer[start + len(self.open):end])
            if not found:
                out += self.buffer[:end + len(self.close)]
            else:
                out += plain(self.buffer[:start])
                calls += found
            self.buffer = self.buffer[end + len(self.close):]
        self.calls += calls
        return out, calls
