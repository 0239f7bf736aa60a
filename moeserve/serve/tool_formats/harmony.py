"""GPT-OSS's harmony format. An answer is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>text<|return|>`; a call
is a commentary message to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS`
ended by <|call|> (the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`). Analysis bodies are reasoning_content, final (and commentary without a
recipient) bodies content, function messages calls; <|call|> and <|return|> are the model's stop tokens, so the
last message ends with the answer.

The prompt is the checkpoint's own template (GPT-OSS ships a Jinja template that renders harmony: tools as the
developer message's `functions` namespace, calls and their results as commentary messages), and the answer's text
is parsed here: the markers are tokens that decode to their text (tokenizer.py's `show`), so the text holds them.
"""

from __future__ import annotations

import json
import re

from moeserve.serve.chat_output import Piece
from moeserve.serve.reasoning import ThinkSplitter, held
from moeserve.serve.tool_calls import Call, Function, call_sequence, json_arguments, tag
from moeserve.serve.tool_formats.base import ToolFormat

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)  # what ends a message's body (START: the next message, unended)
HEADER_STARTS = (CHANNEL, START, " to=")
CHANNEL_NAME, RECIPIENT = re.compile(re.escape(CHANNEL) + r"\s*(\w+)"), re.compile(r"to=([^\s<]+)")


class HarmonyOutput:
    """Splits an answer, piece by piece, into reasoning, content and calls (ChatOutput's contract)."""

    thinks = True

    def __init__(self, tools: bool):
        """tools: the request shows tools (function messages are calls; else their bodies are content)."""
        self.tools = tools
        self.buffer = ""
        self.header: tuple[str, str] | None = None  # the open message's (channel, recipient); None between
        self.body = ""  # a call's arguments so far
        self.calls: list[Call] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, final: bool = False) -> Piece:
        """What the next piece of text makes final; final: the answer ended (nothing is held back)."""
        self.buffer += text
        piece = Piece()
        while True:
            if self.header is None:
                if not self.buffer:
                    break
                at = self.buffer.find(MESSAGE)
                if at < 0 and not final and self._could_be_header():
                    break
                if at < 0:  # not harmony: plain text
                    self.header = ("final", "")
                    continue
                head, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE):]
                channel, recipient = CHANNEL_NAME.search(head), RECIPIENT.search(head)
                self.header = (channel.group(1) if channel else "final", recipient.group(1) if recipient else "")
                continue
            ends = [(i, m) for m in ENDS if (i := self.buffer.find(m)) >= 0]
            if not ends:
                keep = 0 if final else max(held(self.buffer, m) for m in ENDS)
                self._body(piece, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                if final:
                    self._close(piece)
                break
            at, marker = min(ends)
            self._body(piece, self.buffer[:at])
            self.buffer = self.buffer[at + (0 if marker == START else len(marker)):]
            self._close(piece)
        return piece

    def _could_be_header(self) -> bool:
        text = self.buffer
        return any(text.startswith(h) or h.startswith(text) for h in HEADER_STARTS)

    def _is_call(self) -> bool:
        return self.tools and self.header[1].startswith("functions.")

    def _body(self, piece: Piece, text: str) -> None:
        if self._is_call():
            self.body += text
        elif self.header[0] == "analysis":
            piece.reasoning += text
        else:
            piece.content += text

    def _close(self, piece: Piece) -> None:
        """The open message ended: a call's arguments become a call (text when they are not JSON)."""
        if self._is_call():
            try:
                json.loads(self.body)
                call = Call(self.header[1].removeprefix("functions."), self.body.strip())
                piece.calls.append(call)
                self.calls.append(call)
            except json.JSONDecodeError:
                piece.content += self.body
        self.header, self.body = None, ""


class Harmony(ToolFormat):
    name = "harmony (GPT-OSS)"
    markers = (START, "<|end|>", MESSAGE, CHANNEL, CONSTRAIN, "<|call|>", "<|return|>")

    def detects(self, template_source: str) -> bool:
        return CHANNEL in template_source and MESSAGE in template_source

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        """One call (a harmony call ends the turn), its arguments ended by the model's stop token <|call|>."""
        return call_sequence([tag(f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}",
                                  json_arguments(schema), "") for name, schema in functions], "", False)

    def output(self, thinking: ThinkSplitter | None, functions: list[Function] | None) -> HarmonyOutput:
        """Every answer is split by its channels (a harmony template has no <think> section)."""
        return HarmonyOutput(functions is not None)
