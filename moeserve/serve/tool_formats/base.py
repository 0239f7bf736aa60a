"""What a tool-call format is: how it is recognised in a chat template, how an answer's calls are parsed, and the
grammar that forces a call (tool_choice "required" or a named function)."""

from __future__ import annotations

from moeserve.serve.chat_output import ChatOutput
from moeserve.serve.reasoning import ThinkSplitter
from moeserve.serve.tool_calls import CallParser, Function


class ToolFormat:
    name = ""  # as errors and docs name it
    markers: tuple[str, ...] = ()  # texts of the tokens its answers are written with (kept in the decoded text)

    def detects(self, template_source: str) -> bool:
        """Whether a chat template teaches this format (its text holds the format's markers)."""
        raise NotImplementedError

    def parser(self, functions: list[Function]) -> CallParser:
        """A parser of one answer's calls of `functions` (output's; a format that splits answers its own way
        overrides output instead)."""
        raise NotImplementedError

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        """The xgrammar structural tag of an answer that is one or more calls (one unless parallel) of functions,
        and nothing else."""
        raise NotImplementedError

    def output(self, thinking: ThinkSplitter | None, functions: list[Function] | None) -> ChatOutput:
        """How one answer is split: its thinking section off (thinking), then calls of functions (None: the request
        shows no tools, its answer is text)."""
        return ChatOutput(thinking, None if functions is None else self.parser(functions))
