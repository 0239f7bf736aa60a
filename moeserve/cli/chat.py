"""`moeserve chat`: a conversation on the command line, each answer streamed, through the checkpoint's chat template.

Messages are read a line at a time from stdin (a `> ` prompt on a terminal), so a pipe or a test drives it as a user
does. The whole conversation is rendered each turn; when it no longer fits --ctx-size with room for an answer, the
oldest exchanges are dropped (a system message stays).
"""

from __future__ import annotations

import dataclasses
import sys

from moeserve.cli.common import ctx_size, load, prepare
from moeserve.cli.options import sampling_params
from moeserve.config import RunConfig
from moeserve.engine.generate import generate
from moeserve.serve.chat_template import ChatTemplate
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer

EXIT, RESET = ("/exit", "/quit"), "/reset"


def run(args) -> int:
    params = sampling_params(args)
    config = RunConfig.from_args(args, "chat")  # validated by cli.main
    spec, tok = ModelSpec.from_dir(config.model), load_tokenizer(config.model)
    context = ctx_size(args.ctx_size, spec)
    template = ChatTemplate.from_dir(config.model)
    model = load(prepare(config, spec, 1, context)).model
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    terminal = sys.stdin.isatty()
    while True:
        if terminal:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        text = line.strip()
        if not line or text in EXIT:
            return 0
        if text == RESET:
            messages = list(start)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = fit(template, tok, messages, len(start), context - min(params.max_new_tokens, context // 2))
        if ids is None:
            messages.pop()
            print(f"moeserve: that message does not fit the context of {context} tokens", file=sys.stderr)
            continue
        turn = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, context - len(ids)))
        answer = generate(model, [ids], turn, tokenizer=tok, on_text=lambda _, piece: print(piece, end="", flush=True))[0]
        print(flush=True)
        messages.append({"role": "assistant", "content": answer.text})


def fit(template: ChatTemplate, tok, messages: list[dict], kept: int, budget: int) -> list[int] | None:
    """The conversation's token ids within `budget` tokens, its oldest exchanges (after the first `kept` messages)
    dropped from `messages` as needed; None when the last message alone does not fit."""
    while True:
        ids = template.encode(messages, tok)
        if len(ids) <= budget:
            return ids
        if len(messages) - kept <= 1:
            return None
        del messages[kept:kept + 2 if len(messages) - kept > 2 else kept + 1]
