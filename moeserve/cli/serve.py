"""`moeserve serve`: the OpenAI-compatible HTTP server over the run path (checked and planned before it listens)."""

from __future__ import annotations

import importlib.util

from moeserve.cli.common import ctx_size, load, prepare
from moeserve.cli.options import SERVE_EXTRA
from moeserve.config import RunConfig, ServeConfig
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer


def run(args) -> int:
    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise MoeserveError(f"`moeserve serve` needs {', '.join(missing)}: pip install 'moeserve[serve]'")
    config = RunConfig.from_args(args, "serve")  # validated by cli.main
    spec, tok = ModelSpec.from_dir(config.model), load_tokenizer(config.model)  # config.json and the tokenizer
    serve = ServeConfig.from_args(args, ctx_size(args.ctx_size, spec)).validate()  # before any weight is read
    plan = prepare(config, spec, serve.parallel, serve.ctx_size)  # the store and RAM it needs: before listening
    from moeserve.serve.server import run as serve_until_stopped  # the web stack: only once the options are good

    return serve_until_stopped(config, serve, spec, tok, load=lambda: load(plan).model)
