"""GLM-4.5's format: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`, one
block per call. A value is written as it is when a string, as JSON otherwise (GLM's template: `v | tojson if v is
not string`), so reading it back needs the parameter's schema: a string parameter's value is taken as it stands, any
other is read as JSON (as it stands where it is not JSON)."""

from __future__ import annotations

import json
import re

from moeserve.serve.tool_calls import BlockParser, Call, Function, call_sequence, tag
from moeserve.serve.tool_formats.base import ToolFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def is_string(schema) -> bool:
    """Whether a parameter's schema takes strings only (its values are written bare)."""
    if not isinstance(schema, dict):
        return False
    if "enum" in schema and "type" not in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


def value(text: str, schema) -> object:
    if is_string(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class GlmParser(BlockParser):
    def __init__(self, functions: list[Function]):
        super().__init__(OPEN, CLOSE, self.read_call)
        self.schemas = {name: schema for name, schema in functions}

    def read_call(self, block: str) -> list[Call] | None:
        """The call inside one block, or None when it holds none (no name, text outside the pairs)."""
        head, _, _ = block.partition("<arg_key>")
        name = head.strip()
        if not NAME.fullmatch(name):
            return None
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        args, rest = {}, block[len(head):]
        for m in PAIR.finditer(rest):
            args[m.group(1).strip()] = value(m.group(2).strip(), properties.get(m.group(1).strip()))
        if PAIR.sub("", rest).strip():
            return None
        return [Call(name, json.dumps(args, ensure_ascii=False))]


class Glm(ToolFormat):
    name = "GLM-4.5"
    # special tokens in GLM-4.5's tokenizer, its thinking tags among them
    markers = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>")

    def detects(self, template_source: str) -> bool:
        return OPEN in template_source and "<arg_key>" in template_source

    def parser(self, functions: list[Function]) -> GlmParser:
        return GlmParser(functions)

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        """Each call's pairs as xgrammar's GLM XML style writes a schema's properties (strings bare, the rest
        JSON)."""
        return call_sequence([tag(f"{OPEN}{name}\n", {"type": "json_schema", "json_schema": schema,
                                                       "style": "glm_xml", "max_whitespace_cnt": 1}, CLOSE)
                              for name, schema in functions], "\n", parallel)
