"""The HTTP app (FastAPI): OpenAI-compatible endpoints in front of the engine thread.

POST /v1/completions, POST /v1/chat/completions (stream: server-sent events ending `data: [DONE]`), POST
/v1/responses (serve/responses_api.py), GET /v1/models, GET /health (503 while the model loads), GET /metrics (unless --no-metrics), POST /tokenize,
POST /detokenize. With --api-key, /v1/* and the tokenizer endpoints need `Authorization: Bearer KEY` (the scheme in
any case). With --allowed-origins, browsers on those origins may call it (CORS, preflights answered).
Every error is OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.

Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice "required" or a
named function) run under a grammar (engine/constraints.py), compiled off the event loop. Chat answers are split
into reasoning_content, content and tool_calls by the template's formats (serve/chat_output.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from moeserve import __version__
from moeserve.engine.batching import Update
from moeserve.engine.constraints import Grammars, TokenConstraint
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.serve.batcher import Engine, EngineFailed, Job, LoopSink, QueueFull
from moeserve.serve.chat_output import ChatOutput
from moeserve.serve.chat_template import ChatTemplate, TemplateError
from moeserve.serve.metrics import CONTENT_TYPE, Metrics
from moeserve.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, ResponseFormat,
                                     ResponsesRequest, TokenizeRequest, parse)
from moeserve.serve.reasoning import ThinkSplitter, opens_thinking, thinks
from moeserve.serve.responses import ChatFormat, CompletionFormat, Format, sse, usage
from moeserve.serve.responses_api import ResponsesFormat, responses_usage
from moeserve.serve.tool_formats import detect, names

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context leaves
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerState:
    tokenizer: object
    template: ChatTemplate
    model_name: str
    context: int
    vocab_size: int
    metrics: Metrics
    expose_metrics: bool = True
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from ("*": any); none: CORS off
    fingerprint: str = f"moeserve-{__version__}"  # system_fingerprint of every answer
    engine: Engine | None = None  # set once the model is loaded
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: Grammars | None = None  # built at the first request that needs one


@dataclass(frozen=True)
class Chat:
    """A chat conversation made ready to run: its prompt, the grammar its answer follows (if any), how its answer
    is split."""
    ids: list[int]
    constraint: TokenConstraint | None
    output: ChatOutput


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moeserve", docs_url=None, redoc_url=None, openapi_url=None)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        state.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown path, wrong method
        return JSONResponse(APIError(e.status_code, str(e.detail), code=str(e.status_code)).body(),
                            status_code=e.status_code, headers=e.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse(APIError(503, "the model is loading", "model_loading").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if not state.expose_metrics:
            raise APIError(404, "metrics are off: the server was started with --no-metrics", "not_found")
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "moeserve", "max_model_len": state.context}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _authorize(state, request)
        req = parse(TokenizeRequest, await request.body())
        _check_model(state, req.model)
        if req.messages is not None:
            ids = _chat_ids(state, req.messages, req.add_generation_prompt)
        else:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _authorize(state, request)
        req = parse(DetokenizeRequest, await request.body())
        _check_model(state, req.model)
        if any(not 0 <= t < state.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {state.vocab_size})", "invalid_value", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        _authorize(state, request)
        req = parse(CompletionRequest, await request.body())
        _check_model(state, req.model)
        prompt = req.one_prompt()
        ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = _params(state, req, ids, req.max_tokens or COMPLETION_MAX_TOKENS)
        constraint = await _format_constraint(state, req.response_format)
        fmt = CompletionFormat(state.tokenizer, state.model_name, state.fingerprint, req.include_usage)
        return await _answer(state, request, fmt, ids, params, req.logprobs, req.stream, constraint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _authorize(state, request)
        req = parse(ChatRequest, await request.body())
        _check_model(state, req.model)
        tools = [(t.function.name, t.function.parameters, t.as_dict()) for t in req.tools or []]
        chat = await prepare_chat(state, [m.as_dict() for m in req.messages], req.add_generation_prompt, tools,
                                  req.tool_mode, req.parallel_tool_calls, req.response_format,
                                  req.chat_template_kwargs or {})
        params = _params(state, req, chat.ids, req.max_completion_tokens or req.max_tokens or
                         state.context - len(chat.ids))
        fmt = ChatFormat(state.tokenizer, state.model_name, state.fingerprint, req.include_usage, chat.output)
        return await _answer(state, request, fmt, chat.ids, params, req.requested_logprobs, req.stream,
                             chat.constraint)

    @app.post("/v1/responses")
    async def responses(request: Request):
        _authorize(state, request)
        req = parse(ResponsesRequest, await request.body())
        _check_model(state, req.model)
        tools = [(t.name, t.parameters, t.as_chat_tool()) for t in req.tools or []]
        chat = await prepare_chat(state, req.messages(), True, tools, req.tool_mode, req.parallel_tool_calls,
                                  req.response_format, {})
        params = _params(state, req, chat.ids, req.max_output_tokens or state.context - len(chat.ids))
        settings = req.model_dump(include={"instructions", "max_output_tokens", "temperature", "top_p",
                                           "parallel_tool_calls"})
        settings |= {"tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                     "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else
                     req.tool_choice.model_dump() if req.tool_choice else "auto",
                     "text": {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)
                              if req.text and req.text.format else {"type": "text"}}}
        fmt = ResponsesFormat(state.model_name, settings, chat.output)
        job, updates = _submit(state, chat.ids, params, None, chat.constraint)
        events = _events(state.engine, job, updates, None if req.stream else request)
        if req.stream:
            return StreamingResponse(_stream_response(fmt, events, len(chat.ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, sampled, finish = [], 0, None
        async for u in events:
            text.append(u.text)
            sampled, finish = sampled + 1, u.finish_reason
        if finish is None:
            return Response(status_code=499)
        return fmt.whole("".join(text), finish, responses_usage(len(chat.ids), sampled))

    return app


def _authorize(state: ServerState, request: Request) -> None:
    """With --api-key: the request must carry `Authorization: Bearer KEY`, the scheme in any case (RFC 7235), the key
    compared in constant time."""
    if state.api_key:
        scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
        right_key = hmac.compare_digest(key.strip().encode(), state.api_key.encode())
        if not (right_key and scheme.lower() == "bearer"):
            raise APIError(401, "Incorrect API key provided: send `Authorization: Bearer KEY` with the server's "
                                "--api-key", "invalid_api_key")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`",
                       "model_not_found", "model")


def _chat_ids(state: ServerState, messages, add_generation_prompt: bool) -> list[int]:
    try:
        return state.template.encode([m.as_dict() for m in messages], state.tokenizer, add_generation_prompt)
    except TemplateError as e:
        raise APIError(400, str(e), "invalid_messages", "messages") from None


async def prepare_chat(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                       tools: list[tuple[str, dict, dict]], tool_mode: str, parallel: bool,
                       response_format: ResponseFormat | None, template_kwargs: dict) -> Chat:
    """A conversation rendered by the chat template, with its grammar and output split. tools: (name, parameters
    schema, the tool as the template reads it); tool_mode: none (tools not shown), auto, required or a function's
    name (those two forced by a grammar); parallel: several calls allowed."""
    shown = tools if tool_mode != "none" else []
    fmt = detect(state.template.source)
    if shown and fmt is None:
        raise APIError(400, f"tools: this model's chat template writes no tool calls moeserve reads ({names()}); "
                            f"send tool_choice 'none' or no tools", "invalid_value", "tools")
    forced = [(name, schema) for name, schema, _ in shown if tool_mode in ("required", name)]
    if forced and response_format is not None and response_format.type != "text":
        raise APIError(400, "response_format: a JSON format cannot be combined with a forced tool call "
                            "(tool_choice 'required' or a named function)", "invalid_value", "response_format")
    try:
        prompt = state.template.render(messages, add_generation_prompt, [t for _, _, t in shown], **template_kwargs)
    except TemplateError as e:
        raise APIError(400, str(e), "invalid_messages", "messages") from None
    if forced:
        constraint = await _grammar(state, "tool_choice", lambda g: g.structural_tag(fmt.grammar(forced, parallel)))
    else:
        constraint = await _format_constraint(state, response_format)
    # a grammar holds the whole answer from its first token: there is no thinking section to split off
    thinking = ThinkSplitter(opens_thinking(prompt)) if thinks(state.template.source) and not constraint else None
    functions = [(name, schema) for name, schema, _ in shown] if shown else None
    output = fmt.output(thinking, functions) if fmt else ChatOutput(thinking)
    return Chat(state.template.tokens(prompt, state.tokenizer), constraint, output)


async def _format_constraint(state: ServerState, fmt: ResponseFormat | None) -> TokenConstraint | None:
    """The grammar of a response_format (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return await _grammar(state, "response_format", lambda g: g.json_object())
    return await _grammar(state, "response_format", lambda g: g.json_schema(fmt.json_schema.schema_))


async def _grammar(state: ServerState, param: str, make) -> TokenConstraint:
    """make(the server's Grammars), run off the event loop (a compile takes up to tens of ms); a grammar that does
    not compile, or no grammar library, is a 400 naming `param`."""
    if state.engine is None:
        raise APIError(503, "the model is loading; try again when GET /health answers 200", "model_loading")

    def run():
        if state.grammars is None:
            state.grammars = Grammars(state.tokenizer, state.vocab_size, state.engine.batch.eos)
        return make(state.grammars)

    try:
        return await asyncio.to_thread(run)
    except MoeserveError as e:
        raise APIError(400, f"{param}: {e}", "invalid_value", param) from None


def _params(state: ServerState, req, ids: list[int], max_tokens: int) -> SamplingParams:
    """The request's sampling parameters, once its prompt is known to fit (400s before 503s: a bad request is bad
    whether or not the model is loaded)."""
    if len(ids) >= state.context:
        raise APIError(400, f"This model's maximum context length is {state.context} tokens; the prompt has "
                            f"{len(ids)} tokens, which leaves no room for a completion", "context_length_exceeded",
                       {ChatRequest: "messages", CompletionRequest: "prompt"}.get(type(req), "input"))
    params = req.sampling_params(max(max_tokens, 1))
    if state.engine is None:
        raise APIError(503, "the model is loading; try again when GET /health answers 200", "model_loading")
    try:
        state.engine.batch.check(ids, params)
    except MoeserveError as e:
        raise APIError(400, str(e), "invalid_value", "prompt") from None
    return params


async def _answer(state: ServerState, request: Request, fmt: Format, ids: list[int], params: SamplingParams,
                  top_logprobs: int | None, stream: bool, constraint: TokenConstraint | None = None):
    """Submit the request and answer: whole (JSON) or streamed (server-sent events)."""
    job, updates = _submit(state, ids, params, top_logprobs, constraint)
    events = _events(state.engine, job, updates, None if stream else request)
    logprobs = top_logprobs is not None
    if stream:
        return StreamingResponse(_stream(fmt, events, len(ids), logprobs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, entries, sampled, finish = [], [], 0, None
    async for u in events:
        text.append(u.text)
        entries += u.logprobs
        sampled, finish = sampled + 1, u.finish_reason
    if finish is None:  # the client went away: nobody reads this
        return Response(status_code=499)
    return fmt.response("".join(text), entries if logprobs else None, finish, usage(len(ids), sampled))


def _submit(state: ServerState, ids: list[int], params: SamplingParams, top_logprobs: int | None,
            constraint: TokenConstraint | None) -> tuple[Job, asyncio.Queue]:
    """Queue the request on the engine: its job and the queue its updates arrive in (a 503 when full)."""
    updates = asyncio.Queue()
    try:
        job = state.engine.submit(ids, params, top_logprobs, LoopSink(asyncio.get_running_loop(), updates),
                                  constraint)
    except QueueFull:
        raise APIError(503, f"the server is full ({state.engine.capacity} requests running or queued); try again "
                            f"later", "queue_full") from None
    return job, updates


async def _stream_response(fmt: ResponsesFormat, events: AsyncIterator[Update], prompt_tokens: int):
    """A Responses API stream: its typed events (an engine failure ends it with an `error` event)."""
    for e in fmt.start():
        yield e
    sampled = 0
    try:
        async for u in events:
            sampled += 1
            for e in fmt.feed(u.text, u.finish_reason):
                yield e
            if u.finish_reason is not None:
                for e in fmt.end(u.finish_reason, responses_usage(prompt_tokens, sampled)):
                    yield e
    except APIError as e:
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'code': e.code, 'message': e.message})}\n\n"


async def _events(engine: Engine, job: Job, updates: asyncio.Queue, watch: Request | None) -> AsyncIterator[Update]:
    """The job's updates until it finishes. The job is cancelled (its slot freed at the next step) if the
    consumer stops early: a streaming client that disconnects cancels the response task, and `watch` (the
    request of a non-streaming answer) is polled for a disconnect."""
    finished, checked = False, float("-inf")
    try:
        while True:
            if watch is not None and time.monotonic() - checked > DISCONNECT_POLL_S:
                if await watch.is_disconnected():
                    return
                checked = time.monotonic()
            try:
                item = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S) if watch else await updates.get()
            except asyncio.TimeoutError:
                continue
            if isinstance(item, EngineFailed):
                finished = True
                raise APIError(500, str(item), "engine_error")
            yield item
            if item.finish_reason is not None:
                finished = True
                return
    finally:
        if not finished:
            engine.cancel(job)


async def _stream(fmt: Format, events: AsyncIterator[Update], prompt_tokens: int, logprobs: bool):
    start = fmt.start_chunk()
    if start:
        yield sse(start)
    sampled = 0
    try:
        async for u in events:
            sampled += 1
            if u.text or u.finish_reason or (logprobs and u.logprobs):
                chunk = fmt.chunk(u.text, u.logprobs if logprobs else None, u.finish_reason)
                if not fmt.empty(chunk):
                    yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    if fmt.include_usage:
        yield sse(fmt.usage_chunk(usage(prompt_tokens, sampled)))
    yield sse("[DONE]")
