"""Tool calls in the Hermes format that Qwen2 and Qwen3 (MoE included) templates teach:
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call.

`ToolCallParser` takes an answer's content piece by piece and splits it into plain text and complete calls: text
from a `<tool_call>` (or what could be its start) on is held until the block closes; a block whose inside is not a
call (not JSON, no name) is given back as text. `tags` gives the grammar pieces that force calls
(tool_choice "required" or a named function: engine/constraints.py's Grammars.tags).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from moeserve.engine.constraints import Tag
from moeserve.serve.reasoning import held

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEPARATOR = "\n"  # between blocks of parallel calls


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def knows_tools(template_source: str) -> bool:
    """Whether a chat template teaches this format (then tools are rendered, calls parsed): Qwen2, Qwen2.5, Qwen3
    and Hermes templates show the model the JSON shape, `{"name": <function-name>, "arguments": ...}`, inside
    <tool_call> tags. Templates whose <tool_call> blocks hold another shape (Qwen3-Coder's XML parameters,
    GLM-4.5's arg_key/arg_value pairs) show no <function-name> placeholder and are not taken for it."""
    return OPEN in template_source and "<function-name>" in template_source


def tags(functions: list[tuple[str, dict]]) -> list[Tag]:
    """One grammar tag per (name, parameters schema): a block calling that function with valid arguments."""
    return [Tag(f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', schema, f"}}\n{CLOSE}")
            for name, schema in functions]


def read_call(block: str) -> Call | None:
    """The call inside one block, or None when it holds none."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    def __init__(self):
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
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else held(self.buffer, OPEN)
                out += plain(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                out += plain(self.buffer[:start])
                self.buffer = self.buffer[start:]
                if final:
                    out, self.buffer = out + self.buffer, ""
                break
            call = read_call(self.buffer[start + len(OPEN):end])
            if call is None:
                out += self.buffer[:end + len(CLOSE)]
            else:
                out += plain(self.buffer[:start])
                calls.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]
        self.calls += calls
        return out, calls
