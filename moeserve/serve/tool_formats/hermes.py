"""The Hermes format that Qwen2, Qwen2.5 and Qwen3 (MoE included) templates teach:
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call, blocks on their own lines."""

from __future__ import annotations

import json

from moeserve.serve.tool_calls import BlockParser, Call, Function, arguments_text, call_sequence, json_arguments, tag
from moeserve.serve.tool_formats.base import ToolFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def read_call(block: str) -> list[Call] | None:
    """The call inside one block, or None when it holds none."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return [Call(obj["name"], arguments_text(obj.get("arguments", obj.get("parameters", {}))))]


class Hermes(ToolFormat):
    name = "Hermes/Qwen"

    def detects(self, template_source: str) -> bool:
        """Qwen and Hermes templates show the model the JSON shape, `{"name": <function-name>, "arguments": ...}`,
        inside <tool_call> tags; templates whose <tool_call> blocks hold another shape (Qwen3-Coder's XML
        parameters, GLM-4.5's arg_key/arg_value pairs) show no <function-name> placeholder."""
        return OPEN in template_source and "<function-name>" in template_source

    def parser(self, functions: list[Function]) -> BlockParser:
        return BlockParser(OPEN, CLOSE, read_call)

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        return call_sequence([tag(f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', json_arguments(schema),
                                  f"}}\n{CLOSE}") for name, schema in functions], "\n", parallel)
