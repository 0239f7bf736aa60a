"""An answer's text split into reasoning, content and tool calls, whole or piece by piece as it streams: the
thinking section first (serve/reasoning.py), then the calls out of the content (a tool-call format's parser,
serve/tool_formats). Harmony answers are split by their channels instead (serve/tool_formats/harmony.py), behind
the same three members: feed, thinks, called."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.serve.reasoning import ThinkSplitter
from moeserve.serve.tool_calls import Call, CallParser


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


class ChatOutput:
    def __init__(self, thinking: ThinkSplitter | None = None, tools: CallParser | None = None):
        """thinking: split a thinking section off (templates that write one); tools: parse tool calls (requests
        with tools)."""
        self.thinking, self.tools = thinking, tools

    @property
    def thinks(self) -> bool:
        return self.thinking is not None

    @property
    def called(self) -> bool:
        """Whether the answer so far made a tool call."""
        return bool(self.tools and self.tools.calls)

    def feed(self, text: str, final: bool = False) -> Piece:
        """What the next piece of text makes final; final: the answer ended (nothing is held back)."""
        reasoning, content = self.thinking.feed(text, final) if self.thinking else ("", text)
        if self.tools is None:
            return Piece(reasoning, content)
        content, calls = self.tools.feed(content, final)
        return Piece(reasoning, content, calls)
