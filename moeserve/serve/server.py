"""Start-up of `moeserve serve`: listen at once, load the model in the background, then serve.

The socket is bound before the model loads (a port in use is an error at once, and `--port 0` picks a free
port, which the first status line names); /health answers 503 until the engine thread runs. The caller (the CLI)
has checked the options and passes `load`, the same code path `moeserve generate` loads models with.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from moeserve.engine.batching import ContinuousBatch, WarmUp
from moeserve.errors import MoeserveError
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.batcher import Engine
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.metrics import Metrics


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6, as `host` resolves); MoeserveError when the address is taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise MoeserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def describe_decode(batch: ContinuousBatch, warm: WarmUp) -> str:
    """How decode steps run, for the ready line: graphs (and which batch sizes), or eager."""
    if not batch.decoder.use_graph:
        return "eager decode"
    eager = sorted(set(warm.decode_sizes) - set(warm.graphed_sizes))
    return (f"CUDA graphs for batch sizes {','.join(map(str, warm.graphed_sizes))}"
            + (f", eager at {','.join(map(str, eager))}" if eager else ""))


def run(args, spec, tokenizer, context: int, load: Callable[[], object]) -> int:
    """Serve until interrupted. args: the serve command's options (parallel, prefill_chunk, max_queue, ...)."""
    name = args.served_model_name or Path(args.model).resolve().name
    template = ChatTemplate.from_dir(args.model)
    metrics = Metrics(name, args.parallel)
    state = ServerState(tokenizer, template, name, context, spec.vocab_size, metrics, args.metrics, args.api_key)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3))
    failure: list[BaseException] = []

    def start() -> None:
        try:
            model = load()
            batch = ContinuousBatch(model, tokenizer, args.parallel, context, args.prefill_chunk,
                                    cuda_graph=not args.no_cuda_graph)
            if model.device.type == "cuda":
                print("[warming up: a decode step at every batch size, prefill passes]", file=sys.stderr,
                      flush=True)
            warm = batch.warm_up()
            engine = Engine(batch, metrics, args.max_queue, args.threads)
            engine.start()
            state.engine = engine
            graphs = describe_decode(batch, warm)
            print(f"[ready: {name} on {model.device.type} {str(model.dtype).removeprefix('torch.')}, "
                  f"{args.parallel} slots x {context} tokens, {graphs}]", file=sys.stderr, flush=True)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which reports it
            failure.append(e)
            server.should_exit = True

    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    template_note = "fallback chat template" if template.fallback else f"chat template from {template.origin}"
    print(f"[listening on {url}; {template_note}; loading {args.model}]", file=sys.stderr, flush=True)
    threading.Thread(target=start, name="moeserve-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if state.engine is not None:
            state.engine.stop()
    if failure:
        raise failure[0]
    return 0
