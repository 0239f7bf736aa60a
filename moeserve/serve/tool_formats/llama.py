"""Llama's JSON format (Llama-3.1 to Llama-4 templates): the answer is the calls, JSON objects
`{"name": "f", "parameters": {...}}` one after another (Llama-4 may wrap them in <|python_start|> ...
<|python_end|>), and nothing else; an answer that is not calls is text."""

from __future__ import annotations

import json

from moeserve.serve.tool_calls import Call, Function, arguments_text, call_sequence, json_arguments, tag
from moeserve.serve.tool_formats.base import ToolFormat

SKIPPED = ("<|python_start|>", "<|python_end|>", ";")  # around and between calls
TAUGHT = '"parameters": dictionary of argument name'  # the templates' instruction: {"name": function name, ...}


def read_call(obj) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments"))
    return Call(obj["name"], arguments_text(args)) if isinstance(args, (dict, str)) else None


class LlamaParser:
    """Each JSON object of the answer is a call once it closes; the answer is text from the first thing that is
    not a call (held back while it could still become one: an object still open, a marker's start)."""

    def __init__(self):
        self.buffer = ""
        self.calls: list[Call] = []
        self.text = False  # the answer turned out to be text: everything passes

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        if self.text:
            return text, []
        self.buffer += text
        calls = []
        while True:
            rest = self.buffer.lstrip()
            skipped = next((m for m in SKIPPED if rest.startswith(m)), None)
            if skipped:
                self.buffer = rest[len(skipped):]
                continue
            if not rest:
                held = not (final or self.calls or calls)
                break
            if rest.startswith("{"):
                try:
                    obj, end = json.JSONDecoder().raw_decode(rest)
                except json.JSONDecodeError:
                    held = not final
                    break
                call = read_call(obj)
                if call is not None:
                    calls.append(call)
                    self.buffer = rest[end:]
                    continue
            held = not final and any(m.startswith(rest) for m in SKIPPED)
            break
        self.calls += calls
        if held or (self.calls and not self.buffer.strip()):
            if final:
                self.buffer = ""
            return "", calls
        out, self.buffer, self.text = self.buffer, "", True
        return out, calls


class Llama(ToolFormat):
    name = "Llama-3.1/4 JSON"

    def detects(self, template_source: str) -> bool:
        return TAUGHT in template_source

    def parser(self, functions: list[Function]) -> LlamaParser:
        return LlamaParser()

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        return call_sequence([tag(f'{{"name": {json.dumps(name)}, "parameters": ', json_arguments(schema), "}")
                              for name, schema in functions], "", parallel)
