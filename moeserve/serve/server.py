"""Start-up of `moeserve serve`: listen at once, load the model in the background, then serve.

The socket is bound before the model loads (a port in use is an error at once, and `--port 0` picks a free
port, which the first status line names); /health answers 503 until the engine thread runs. The caller (the CLI)
has checked the options and planned the run, and passes `load`: the run path every command loads models with
(moeserve/runtime.py). Under torchrun (`--ep`/`--tp`) only rank 0 listens; the other ranks step the batch it
leads (serve/mirror.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import uvicorn

from moeserve import __version__
from moeserve.checkpoint import validate_safetensors
from moeserve.config import RunConfig, ServeConfig
from moeserve.engine.batching import ContinuousBatch, WarmUp
from moeserve.errors import MoeserveError
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.batcher import Engine
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.tool_formats import detect
from moeserve.serve.metrics import Metrics
from moeserve.serve.mirror import StepMirror, follow

def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6, as `host` resolves); MoeserveError when the address is taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise MoeserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def describe_decode(batch: ContinuousBatch, warm: WarmUp) -> str:
    """How decode steps run, for the ready line: graphs (and which batch sizes; in segments where experts read the
    routing on the host), or eager."""
    if not batch.decoder.use_graph:
        return "eager decode"
    eager = sorted(set(warm.decode_sizes) - set(warm.graphed_sizes))
    cut = batch.decoder.cut_sizes()
    return (f"CUDA graphs for batch sizes {','.join(map(str, warm.graphed_sizes))}"
            + (" (in segments between the layers whose experts run on the host)" if cut else "")
            + (f", eager at {','.join(map(str, eager))}" if eager else ""))


def system_fingerprint(model_dir: str | Path) -> str:
    """`moeserve-VERSION-HASH`: the same while the moeserve version and the checkpoint stay the same. HASH: 12 hex
    digits of sha256 over the checkpoint's JSON files (config, tokenizer, quantization records) and each safetensors
    file's name, size and header (tensor names, shapes, offsets, metadata), not its weights: read in milliseconds."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix == ".json":
            h.update(path.name.encode() + path.read_bytes())
        elif path.suffix == ".safetensors":
            header = json.dumps(validate_safetensors(path), sort_keys=True)
            h.update(path.name.encode() + str(path.stat().st_size).encode() + header.encode())
    return f"moeserve-{__version__}-{h.hexdigest()[:12]}"


def serving_batch(config: RunConfig, serve: ServeConfig, model, tokenizer) -> ContinuousBatch:
    """The continuous batch the serve options describe (every rank builds the same one)."""
    return ContinuousBatch(model, tokenizer, serve.parallel, serve.ctx_size, serve.prefill_chunk,
                           cuda_graph=config.cuda_graph, prefix_reuse=serve.prefix_reuse)


def follow_rank_0(config: RunConfig, serve: ServeConfig, tokenizer, load: Callable[[], object]) -> int:
    """A rank other than 0 under torchrun: no socket; load this rank's part of the model, warm up as rank 0 does,
    then step the batch rank 0 leads (serve/mirror.py) until it stops. Signals are left to rank 0 (torchrun sends
    them to every rank): this rank ends on rank 0's stop, not before it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    model = load()
    batch = serving_batch(config, serve, model, tokenizer)
    batch.warm_up()
    if serve.threads:
        torch.set_num_threads(serve.threads)
    follow(batch, StepMirror(model.device))
    return 0


def run(config: RunConfig, serve: ServeConfig, spec, tokenizer, load: Callable[[], object]) -> int:
    """Serve until interrupted; `load` builds the model the run config places (moeserve.build). Under torchrun rank 0
    serves and leads; the other ranks follow (follow_rank_0)."""
    ranks = config.parallel.ranks
    if ranks > 1 and os.environ.get("RANK", "0") != "0":
        return follow_rank_0(config, serve, tokenizer, load)
    name = serve.served_model_name or Path(config.model).resolve().name
    template = ChatTemplate.from_dir(config.model)
    tool_format = detect(template.source)
    if tool_format is not None:  # its special tokens are read from the answers' text
        tokenizer.show(tool_format.markers)
    metrics = Metrics(name, serve.parallel)
    context = serve.ctx_size
    state = ServerState(tokenizer, template, name, context, spec.vocab_size, metrics, serve.metrics, serve.api_key,
                        serve.allowed_origins, system_fingerprint(config.model))
    sock = listen(serve.host, serve.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3))
    failure: list[BaseException] = []

    def stop_serving(error: BaseException) -> None:
        """The model cannot run any more (under torchrun, a peer rank is gone): end the server with `error`."""
        failure.append(error)
        server.should_exit = True

    def start() -> None:
        try:
            model = load()
            batch = serving_batch(config, serve, model, tokenizer)
            if model.device.type == "cuda":
                print("[warming up: a decode step at every batch size, prefill passes]", file=sys.stderr,
                      flush=True)
            warm = batch.warm_up()
            mirror = StepMirror(model.device) if ranks > 1 else None
            engine = Engine(batch, metrics, serve.max_queue, serve.threads, mirror, on_peer_stopped=stop_serving)
            engine.start()
            state.engine = engine
            graphs = describe_decode(batch, warm)
            across = f", {ranks} ranks (rank 0 serving)" if ranks > 1 else ""
            print(f"[ready: {name} on {model.device.type} {str(model.dtype).removeprefix('torch.')}, "
                  f"{serve.parallel} slots x {context} tokens, {graphs}{across}]", file=sys.stderr, flush=True)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which reports it
            stop_serving(e)

    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    template_note = "fallback chat template" if template.fallback else f"chat template from {template.origin}"
    print(f"[listening on {url}; {template_note}; loading {config.model}]", file=sys.stderr, flush=True)
    threading.Thread(target=start, name="moeserve-load", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down on SIGTERM, then raises it again for the handler it found: with the default one the
        # process would die there, before the engine (and under torchrun the other ranks) are stopped
        signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        if state.engine is not None:
            state.engine.stop()
    if failure:
        raise failure[0]
    return 0
