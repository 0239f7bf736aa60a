"""The tool-call formats moeserve reads, and which one a chat template teaches.

A checkpoint's format is found from its chat template's text: the markers its calls are written with. The order
matters where two formats share a marker (GLM-4.5's <tool_call> blocks hold arg_key/arg_value pairs, Hermes's a
JSON object)."""

from __future__ import annotations

from moeserve.serve.tool_formats.base import ToolFormat
from moeserve.serve.tool_formats.deepseek import DeepSeek
from moeserve.serve.tool_formats.glm import Glm
from moeserve.serve.tool_formats.harmony import Harmony
from moeserve.serve.tool_formats.hermes import Hermes
from moeserve.serve.tool_formats.llama import Llama

FORMATS: tuple[ToolFormat, ...] = (Harmony(), DeepSeek(fenced=True), DeepSeek(fenced=False), Glm(), Hermes(),
                                   Llama())


def detect(template_source: str) -> ToolFormat | None:
    """The format a chat template teaches, or None (its answers are never read for calls)."""
    return next((f for f in FORMATS if f.detects(template_source)), None)


def names() -> str:
    """The formats, as an error lists them."""
    return ", ".join(f.name for f in FORMATS)
