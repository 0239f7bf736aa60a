"""Chat templates: the checkpoint's Jinja template rendered as transformers renders it, or a plain fallback.

The template comes from `chat_template.jinja` beside the weights, else `chat_template.json`, else the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates: "default" is used).
It is rendered in jinja2's immutable sandbox with trim_blocks, lstrip_blocks and loop controls, the
`raise_exception` and `strftime_now` globals, transformers' `tojson` filter, and the special tokens of
`tokenizer_config.json` (bos_token, eos_token, ...). The rendered text holds the special tokens the template
writes, so it is encoded without adding the tokenizer's own, as transformers' apply_chat_template encodes it. A
checkpoint with no template (the demo) gets FALLBACK: each message as a speaker heading and its lines, as the
demo's plays are written, encoded with the tokenizer's special tokens (the demo's: a BOS).

A tool call's arguments reach the template as `Arguments`: a mapping (Qwen's and Llama's `tojson`, GLM's
`.items()`) that is its JSON text where a template joins it to a string (DeepSeek's `'...' + arguments`) or
prints it, so every family's published template renders calls fed back as OpenAI sends them. A template that tells
an assistant turn of calls by its content being none (DeepSeek-V3's and R1's: `message['content'] is none`) gets
None there when the message has calls and no text, whether the client sent null or "".
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError as JinjaError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeserve.errors import MoeserveError
from moeserve.tokenizer import read_json_object

FALLBACK = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}[{{ message['content'] }}]\n\n"
    "{% else %}{{ message['role'] | capitalize }}.\n{{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant.\n{% endif %}"
)
NONE_CONTENT = re.compile(r"content(?:'\])?\s+is\s+none")  # a template testing a message's content against none
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """A template refused the conversation (raise_exception) or failed while rendering it."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, fallback: bool = False,
                 origin: str = "fallback"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
            self.source = source  # its text: what it can write (thinking sections, tool-call blocks)
            self.none_content = bool(NONE_CONTENT.search(source))
        except JinjaError as e:
            raise MoeserveError(f"cannot read the chat template in {origin}: {e}") from None
        self.special_tokens = special_tokens or {}
        self.fallback, self.origin = fallback, origin

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """The template stored with a checkpoint, or FALLBACK when it has none."""
        path = Path(path)
        config = read_json_object(path / "tokenizer_config.json") or {}
        special = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if _token_text(config.get(k))}
        if (path / "chat_template.jinja").is_file():
            return cls((path / "chat_template.jinja").read_text(encoding="utf-8"), special,
                       origin=str(path / "chat_template.jinja"))
        for file in ("chat_template.json", "tokenizer_config.json"):
            source = _named_template((read_json_object(path / file) or {}).get("chat_template"))
            if source:
                return cls(source, special, origin=str(path / file))
        return cls(FALLBACK, special, fallback=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **extra) -> str:
        """The conversation as the model reads it; TemplateError when the template refuses it. tools: OpenAI's
        tool objects, as transformers' apply_chat_template passes them; extra: more template variables (a request's
        chat_template_kwargs: enable_thinking), which never replace the conversation, its tools or the special
        tokens."""
        variables = {**extra, **self.special_tokens, "messages": [_for_template(m, self.none_content) for m in messages],
                     "add_generation_prompt": add_generation_prompt, "tools": tools or None, "documents": None}
        try:
            return self.template.render(**variables)
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure inside the user's template is a bad conversation
            raise TemplateError(f"the chat template failed on these messages: {e}") from None

    def encode(self, messages: list[dict], tokenizer, add_generation_prompt: bool = True, **render) -> list[int]:
        """Token ids of the rendered conversation (render: render()'s tools and extra variables)."""
        return self.tokens(self.render(messages, add_generation_prompt, **render), tokenizer)

    def tokens(self, text: str, tokenizer) -> list[int]:
        """Token ids of a rendered conversation (special tokens added only for the fallback, which writes none)."""
        return tokenizer.encode(text, add_special_tokens=self.fallback)


class Arguments(dict):
    """A tool call's arguments object, which is its JSON text in string contexts (printed, joined with +)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other

    def __radd__(self, other):
        return other + str(self)


def _for_template(message, none_content: bool):
    """The message with each tool call's arguments object as Arguments, and (none_content) None for the content of
    an assistant turn of calls alone; other messages as they are."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message

    def wrap(call):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("arguments"), dict)):
            return call
        return {**call, "function": {**function, "arguments": Arguments(function["arguments"])}}

    out = {**message, "tool_calls": [wrap(c) for c in calls]}
    if none_content and calls and not message.get("content"):
        out["content"] = None
    return out


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: unlike jinja2's, it does not escape HTML characters."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _named_template(entry) -> str | None:
    """tokenizer_config's chat_template: a string, or [{"name": ..., "template": ...}] ("default" chosen)."""
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) and entry else None
