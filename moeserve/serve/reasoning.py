"""Reasoning content: the thinking section of an answer (`<think>...</think>`, Qwen3 and DeepSeek-R1 style) split
from its content, whole or as it streams.

A template that opens the section itself (its prompt ends inside `<think>`) makes the answer start in it;
otherwise the answer is in it only if it starts with `<think>`. Text after `</think>` is content (the blank lines
that follow the tag dropped). Text that could still be the start of a tag is held back until the next piece tells.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template_source: str) -> bool:
    """Whether a chat template writes thinking sections (then answers are split)."""
    return CLOSE in template_source


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a thinking section (the answer starts in it)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ThinkSplitter:
    """Splits an answer's text, piece by piece, into (reasoning, content)."""

    def __init__(self, in_thinking: bool):
        self.state = "thinking" if in_thinking else "start"  # start: not yet known whether it opens with <think>
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that `text` (the next piece) makes final; final: the answer ended."""
        self.buffer += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer, self.state = stripped[len(OPEN):], "thinking"
                elif OPEN.startswith(stripped) and not final:
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "thinking":
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = 0 if final else held(self.buffer, CLOSE)
                    reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self.buffer[:end]
                self.buffer, self.state = self.buffer[end + len(CLOSE):], "after"
            elif self.state == "after":  # drop the blank lines between </think> and the content
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer and not final:
                    return reasoning, content
                self.state = "content"
            else:
                content += self.buffer
                self.buffer = ""
                return reasoning, content
