"""DeepSeek's format (V3, R1 and V3.1 templates): the answer's calls in one block,
`<｜tool▁calls▁begin｜>CALL...<｜tool▁calls▁end｜>`, each call
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>` on its own line (V3, R1)
or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` back to back (V3.1, V3.2-Exp: no type word, no
fence). The parser reads both; the grammar writes the one the template teaches."""

from __future__ import annotations

import json
import re

from moeserve.serve.tool_calls import BlockParser, Call, Function, call_sequence, json_arguments, tag
from moeserve.serve.tool_formats.base import ToolFormat

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_BEGIN, FENCE_END = "\n```json\n", "\n```"
CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(SEP) + "(.*?)" + re.escape(CALL_END), re.S)
FENCED = re.compile(r"([^\n]+)\n```json\n(.*)\n```", re.S)  # NAME, ARGS of a V3 call's body


def read_calls(block: str) -> list[Call] | None:
    """The calls of one <｜tool▁calls▁begin｜> block, or None when it holds anything else."""
    calls, rest = [], block
    for m in CALL.finditer(block):
        head, body = m.group(1).strip(), m.group(2)
        fenced = FENCED.fullmatch(body.strip("\n")) if head == "function" else None
        name, args = (fenced.group(1).strip(), fenced.group(2)) if fenced else (head, body)
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        calls.append(Call(name, args.strip()))
        rest = rest.replace(m.group(0), "", 1)
    return calls if calls and not rest.strip() else None


class DeepSeek(ToolFormat):
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self, fenced: bool):
        """fenced: V3 and R1's calls (type word, JSON in a ```json fence, one a line); else V3.1's."""
        self.fenced = fenced
        self.name = "DeepSeek-V3" if fenced else "DeepSeek-V3.1"

    def detects(self, template_source: str) -> bool:
        return CALLS_BEGIN in template_source and (FENCE_BEGIN.strip() in template_source) == self.fenced

    def parser(self, functions: list[Function]) -> BlockParser:
        return BlockParser(CALLS_BEGIN, CALLS_END, read_calls)

    def grammar(self, functions: list[Function], parallel: bool) -> dict:
        if self.fenced:
            calls = [tag(f"{CALL_BEGIN}function{SEP}{name}{FENCE_BEGIN}", json_arguments(schema),
                         f"{FENCE_END}{CALL_END}") for name, schema in functions]
        else:
            calls = [tag(f"{CALL_BEGIN}{name}{SEP}", json_arguments(schema), CALL_END) for name, schema in functions]
        return tag(CALLS_BEGIN, call_sequence(calls, "\n" if self.fenced else "", parallel), CALLS_END)
