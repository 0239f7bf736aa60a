#!/usr/bin/env python3
"""Stands in for llama.cpp's `llama-server` binary so that llama.cpp's own server test harness
(tools/server/tests/utils.py ServerProcess, which runs $LLAMA_SERVER_BIN_PATH with llama-server's flags) starts
`moeserve serve` instead.

Its flags are mapped to `moeserve serve` options (map_flags, a pure function). The model is always one local tiny
random checkpoint, $LLAMA_SUITE_MODEL (bench/llama_suite.py builds it): the harness's hub GGUF names (--hf-repo,
--hf-file, --model) cannot be downloaded here and would only be random to these tests anyway. A chat template
(--chat-template-file, or --chat-template chatml) is served by a copy of that checkpoint, in $LLAMA_SUITE_WORK,
whose chat_template.jinja is the template's text; without one, the checkpoint gets a plain ChatML template (what
llama-server falls back to for a GGUF without a template). A flag with no moeserve counterpart stops the adapter
with one line naming it. The process execs into `python -m moeserve serve`, so the harness's kill() ends the
server itself."""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_CONTEXT = 2048  # tokens: the tiny checkpoint's max_position_embeddings (llama_suite.py builds it)

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
NAMED_TEMPLATES = {"chatml": CHATML}

PASSED_ON = {"--host": "--host", "--port": "--port", "--api-key": "--api-key",
             "--alias": "--served-model-name"}  # llama-server flag -> moeserve serve option, one value
THREADS = ("--threads", "-t")
PARALLEL = ("--parallel", "-np")
CTX = ("--ctx-size", "-c")
MODEL = ("--model", "-m", "--hf-repo", "-hf", "-hfr", "--hf-file", "-hff")
TEMPLATE_FILE = ("--chat-template-file",)
TEMPLATE_NAME = ("--chat-template",)
IGNORED_VALUES = {  # sampling defaults and llama.cpp's batch sizes: moeserve takes these per request or has none
    "--temp", "--seed", "--batch-size", "-b", "--ubatch-size", "-ub", "--n-predict", "-n", "--reasoning-format",
    "--reasoning-budget", "--n-gpu-layers", "-ngl"}
IGNORED_SWITCHES = {  # always so in moeserve (Jinja templates, continuous batching) or without a meaning here
    "--jinja", "--no-jinja", "--no-slots", "--offline", "--verbose", "--cont-batching", "--no-webui"}
SWITCHES = {"--metrics": "--metrics"}


class AdapterError(Exception):
    """A llama-server flag the adapter cannot map (the message is one line naming it)."""


@dataclass
class Launch:
    """What map_flags reads from llama-server's flags: moeserve serve's options and the chat template to serve."""

    serve_args: list[str] = field(default_factory=list)
    template: str | None = None  # template text; None: the plain ChatML one
    models: list[str] = field(default_factory=list)  # the model names asked for (all served by the tiny checkpoint)


def map_flags(argv: list[str], read_file=lambda p: Path(p).read_text()) -> Launch:
    """llama-server's command line -> a Launch. llama-server's --ctx-size is the whole KV cache, shared by its
    --parallel slots; moeserve's --ctx-size is per slot, so it is ctx // parallel, capped at MODEL_CONTEXT."""
    launch, ctx, parallel, threads = Launch(), None, 1, "1"
    i = 0
    while i < len(argv):
        flag = argv[i]
        takes_value = flag in PASSED_ON or flag in IGNORED_VALUES or flag in THREADS + PARALLEL + CTX + MODEL \
            + TEMPLATE_FILE + TEMPLATE_NAME
        if takes_value and i + 1 >= len(argv):
            raise AdapterError(f"llama-server flag {flag} needs a value")
        value = argv[i + 1] if takes_value else None
        if flag in THREADS:
            threads = value
        elif flag in PASSED_ON:
            launch.serve_args += [PASSED_ON[flag], value]
        elif flag in PARALLEL:
            parallel = int(value)
        elif flag in CTX:
            ctx = int(value)
        elif flag in MODEL:
            launch.models.append(value)
        elif flag in TEMPLATE_FILE:
            launch.template = read_file(value)
        elif flag in TEMPLATE_NAME:
            if value not in NAMED_TEMPLATES:
                raise AdapterError(f"llama-server built-in template {value!r} has no moeserve counterpart "
                                   f"(known: {', '.join(NAMED_TEMPLATES)})")
            launch.template = NAMED_TEMPLATES[value]
        elif flag in SWITCHES:
            launch.serve_args.append(SWITCHES[flag])
        elif flag not in IGNORED_VALUES and flag not in IGNORED_SWITCHES:
            raise AdapterError(f"llama-server flag {flag} has no moeserve counterpart")
        i += 2 if takes_value else 1
    per_slot = MODEL_CONTEXT if ctx is None or ctx <= 0 else min(MODEL_CONTEXT, ctx // parallel)
    launch.serve_args += ["--parallel", str(parallel), "--ctx-size", str(per_slot), "--threads", threads,
                          "--device", "cpu", "--dtype", "float32"]
    return launch


def checkpoint_for(template: str, base: Path, work: Path) -> Path:
    """A directory serving `base`'s weights and tokenizer with `template` as its chat template (files linked, one
    directory per template text)."""
    path = work / ("template-" + hashlib.sha1(template.encode()).hexdigest()[:12])
    if not path.is_dir():
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.mkdir(parents=True)
        for f in base.iterdir():
            if f.name != "chat_template.jinja":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "chat_template.jinja").write_text(template)
        tmp.rename(path)
    return path


def main(argv: list[str]) -> int:
    try:
        launch = map_flags(argv)
    except AdapterError as e:
        print(f"llama_server_adapter: {e}", file=sys.stderr)
        return 2
    base, work = Path(os.environ["LLAMA_SUITE_MODEL"]), Path(os.environ["LLAMA_SUITE_WORK"])
    model = checkpoint_for(CHATML if launch.template is None else launch.template, base, work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "moeserve", "serve", "--model", str(model), *launch.serve_args]
    print("llama_server_adapter: " + " ".join(args[1:]), file=sys.stderr, flush=True)
    os.execve(sys.executable, args, env)
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
