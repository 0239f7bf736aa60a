"""The HTTP app (FastAPI): OpenAI-compatible endpoints in front of the engine thread.

POST /v1/completions, POST /v1/chat/completions (stream: server-sent events ending `data: [DONE]`), POST
/v1/responses (serve/responses_api.py), GET /v1/models, GET /health (503 while the model loads), GET /metrics (unless --no-metrics), POST /tokenize,
POST /detokenize; the /v1 ones also without the prefix (/chat/completions: llama-server serves both). With --api-key, /v1/* and the tokenizer endpoints need `Authorization: Bearer KEY` (the scheme in
any case). With --allowed-origins, browsers on those origins may call it (CORS, preflights answered).
Every error is OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.

Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice "required" or a
named function) run under a grammar (engine/constraints.py), compiled off the event loop; when the prompt opens a
thinking section the grammar starts after its end (`</think>`), so the reasoning is free text. Chat answers are
split into reasoning_content, content and tool_calls by the template's formats (serve/chat_output.py).

`n` choices (completions: `best_of`, of which the n of highest cumulative logprob are answered) run as that many
engine requests of one prompt: the first reads it, the others copy its KV (engine/batching.py). Usage counts every
generated token of them, the prompt once, and as `cached_tokens` the prompt tokens whose KV was reused (the least
over the choices).
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
                                     ResponsesRequest, TokenizeRequest, choice_params, parse)
from moeserve.serve.reasoning import CLOSE, ThinkSplitter, opens_thinking, thinks
from moeserve.serve.responses import ChatFormat, Choice, CompletionFormat, Format, sse, usage
from moeserve.serve.responses_api import ResponsesFormat, responses_usage
from moeserve.serve.tool_formats import ToolFormat, detect, names

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
    """A chat conversation made ready to run: its prompt, the grammar each choice's answer follows (if any), how
    answers are split."""
    ids: list[int]
    constraints: list[TokenConstraint | None]  # one per choice
    thinking: bool | None  # None: no thinking section is split off; else whether the answer starts in one
    fmt: ToolFormat | None  # the tool-call format the template teaches (None: it writes no calls)
    functions: list[tuple[str, dict]] | None  # the tools shown, (name, parameters schema); None: answers are text

    def output(self) -> ChatOutput:
        """A fresh splitter for one choice's answer: its thinking section, then its format's calls."""
        thinking = None if self.thinking is None else ThinkSplitter(self.thinking)
        return self.fmt.output(thinking, self.functions) if self.fmt else ChatOutput(thinking)


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
        constraints = await _format_constraint(state, req.response_format, req.choices)
        fmt = CompletionFormat(state.tokenizer, state.model_name, state.fingerprint, req.include_usage)
        ranked = req.choices > req.n  # best_of: every choice's logprobs rank it
        return await _answer(state, request, fmt, ids, choice_params(params, req.choices),
                             0 if ranked and req.logprobs is None else req.logprobs, req.stream, constraints,
                             req.n, req.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _authorize(state, request)
        req = parse(ChatRequest, await request.body())
        _check_model(state, req.model)
        tools = [(t.function.name, t.function.parameters, t.as_dict()) for t in req.tools or []]
        chat = await prepare_chat(state, [m.as_dict() for m in req.messages], req.add_generation_prompt, tools,
                                  req.tool_mode, req.parallel_tool_calls, req.response_format,
                                  req.chat_template_kwargs or {}, req.n)
        params = _params(state, req, chat.ids, req.max_completion_tokens or req.max_tokens or
                         state.context - len(chat.ids))
        fmt = ChatFormat(state.tokenizer, state.model_name, state.fingerprint, req.include_usage, chat.output)
        return await _answer(state, request, fmt, chat.ids, choice_params(params, req.n), req.requested_logprobs,
                             req.stream, chat.constraints, req.n, req.requested_logprobs is not None)

    @app.post("/v1/responses")
    async def responses(request: Request):
        _authorize(state, request)
        req = parse(ResponsesRequest, await request.body())
        _check_model(state, req.model)
        tools = [(t.name, t.parameters, t.as_chat_tool()) for t in req.tools or []]
        chat = await prepare_chat(state, req.messages(), True, tools, req.tool_mode, req.parallel_tool_calls,
                                  req.response_format, req.template_kwargs)
        params = _params(state, req, chat.ids, req.max_output_tokens or state.context - len(chat.ids))
        settings = req.model_dump(include={"instructions", "max_output_tokens", "temperature", "top_p",
                                           "parallel_tool_calls"})
        settings |= {"tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                     "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else
                     req.tool_choice.model_dump() if req.tool_choice else "auto",
                     "text": {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)
                              if req.text and req.text.format else {"type": "text"}}}
        fmt = ResponsesFormat(state.model_name, settings, chat.output())
        jobs, updates = _submit(state, chat.ids, [params], None, chat.constraints)
        events = _events(state.engine, jobs, updates, None if req.stream else request)
        if req.stream:
            return StreamingResponse(_stream_response(fmt, events, jobs, len(chat.ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, sampled, finish = [], 0, None
        async for _, u in events:
            text.append(u.text)
            sampled, finish = sampled + 1, u.finish_reason
        if finish is None:
            return Response(status_code=499)
        return fmt.whole("".join(text), finish, responses_usage(len(chat.ids), sampled, cached_tokens(jobs)))

    # the same endpoints without /v1, for clients whose base URL has none (llama-server serves both)
    for path, endpoint, method in (("/models", models, "GET"), ("/completions", completions, "POST"),
                                   ("/chat/completions", chat_completions, "POST"), ("/responses", responses, "POST")):
        app.add_api_route(path, endpoint, methods=[method])
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
                       response_format: ResponseFormat | None, template_kwargs: dict, choices: int = 1) -> Chat:
    """A conversation rendered by the chat template, with its grammar (one per choice) and output split. tools:
    (name, parameters schema, the tool as the template reads it); tool_mode: none (tools not shown), auto, required
    or a function's name (those two forced by a grammar); parallel: several calls allowed. A prompt that opens a
    thinking section gets its grammar after the section's end: the reasoning is free, the content constrained."""
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
        constraints = await _grammar(state, "tool_choice",
                                     lambda g: g.structural_tag(fmt.grammar(forced, parallel)), choices)
    else:
        constraints = await _format_constraint(state, response_format, choices)
    splits = thinks(state.template.source)
    opened = splits and opens_thinking(prompt)
    if constraints[0] is not None and opened:  # free reasoning up to its end, then the grammar
        constraints = [state.grammars.after(CLOSE, c) for c in constraints]
    # a grammar from the answer's first token (no thinking section opened) leaves no thinking section to split off
    thinking = opened if splits and (constraints[0] is None or opened) else None
    functions = [(name, schema) for name, schema, _ in shown] if shown else None
    return Chat(state.template.tokens(prompt, state.tokenizer), constraints, thinking, fmt, functions)


async def _format_constraint(state: ServerState, fmt: ResponseFormat | None,
                             choices: int = 1) -> list[TokenConstraint | None]:
    """The grammar of a response_format for each of `choices` choices (None for text)."""
    if fmt is None or fmt.type == "text":
        return [None] * choices
    if fmt.type == "json_object":
        return await _grammar(state, "response_format", lambda g: g.json_object(), choices)
    return await _grammar(state, "response_format", lambda g: g.json_schema(fmt.json_schema.schema_), choices)


async def _grammar(state: ServerState, param: str, make, choices: int = 1) -> list[TokenConstraint]:
    """make(the server's Grammars) once per choice (a matcher each; the grammar is compiled once), run off the
    event loop (a compile takes up to tens of ms); a grammar that does not compile, or no grammar library, is a 400
    naming `param`."""
    if state.engine is None:
        raise APIError(503, "the model is loading; try again when GET /health answers 200", "model_loading")

    def run():
        if state.grammars is None:
            state.grammars = Grammars(state.tokenizer, state.vocab_size, state.engine.batch.eos)
        return [make(state.grammars) for _ in range(choices)]

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
    choices = getattr(req, "choices", 1)
    if choices > state.engine.capacity:
        name = "best_of" if choices > getattr(req, "n", 1) else "n"
        raise APIError(400, f"{name} = {choices} is more than this server holds at once ({state.engine.capacity} "
                            f"requests running or queued)", "invalid_value", name)
    try:
        state.engine.batch.check(ids, params)
    except MoeserveError as e:
        raise APIError(400, str(e), "invalid_value", "prompt") from None
    return params


async def _answer(state: ServerState, request: Request, fmt: Format, ids: list[int], params: list[SamplingParams],
                  top_logprobs: int | None, stream: bool, constraints: list[TokenConstraint | None], keep: int,
                  logprobs: bool):
    """Submit one engine request per params (the choices) and answer: whole (JSON) or streamed (server-sent
    events). keep: the choices answered (fewer than run: best_of, the highest cumulative logprob first);
    logprobs: whether the answer shows them (top_logprobs may be asked of the engine for best_of alone)."""
    jobs, updates = _submit(state, ids, params, top_logprobs, constraints)
    events = _events(state.engine, jobs, updates, None if stream else request)
    if stream:
        return StreamingResponse(_stream(fmt, events, jobs, len(ids), logprobs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts, entries = [[] for _ in jobs], [[] for _ in jobs]
    finish: list[str | None] = [None] * len(jobs)
    sampled = 0
    async for i, u in events:
        texts[i].append(u.text)
        entries[i] += u.logprobs
        sampled, finish[i] = sampled + 1, u.finish_reason
    if None in finish:  # the client went away: nobody reads this
        return Response(status_code=499)
    choices = [Choice("".join(t), e, f) for t, e, f in zip(texts, entries, finish)]
    if keep < len(choices):  # a stable sort: ties keep their order
        choices = sorted(choices, key=lambda c: -c.cumulative_logprob)[:keep]
    if not logprobs:
        choices = [Choice(c.text, None, c.finish) for c in choices]
    return fmt.response(choices, usage(len(ids), sampled, cached_tokens(jobs)))


def cached_tokens(jobs: list[Job]) -> int:
    """The prompt tokens whose KV every choice reused (read once the choices have their first token)."""
    return min(job.request.reused for job in jobs)


def _submit(state: ServerState, ids: list[int], params: list[SamplingParams], top_logprobs: int | None,
            constraints: list[TokenConstraint | None]) -> tuple[list[Job], asyncio.Queue]:
    """Queue one engine request per params: the jobs and the queue their (choice, update) items arrive in (a 503
    when they do not all fit)."""
    updates, loop = asyncio.Queue(), asyncio.get_running_loop()
    try:
        jobs = state.engine.submit_many(ids, params, top_logprobs, [LoopSink(loop, updates, i) for i in
                                                                    range(len(params))], constraints)
    except QueueFull:
        raise APIError(503, f"the server is full ({state.engine.capacity} requests running or queued); try again "
                            f"later", "queue_full") from None
    return jobs, updates


async def _stream_response(fmt: ResponsesFormat, events: AsyncIterator[tuple[int, Update]], jobs: list[Job],
                           prompt_tokens: int):
    """A Responses API stream: its typed events (an engine failure ends it with an `error` event)."""
    for e in fmt.start():
        yield e
    sampled = 0
    try:
        async for _, u in events:
            sampled += 1
            for e in fmt.feed(u.text, u.finish_reason):
                yield e
            if u.finish_reason is not None:
                for e in fmt.end(u.finish_reason, responses_usage(prompt_tokens, sampled, cached_tokens(jobs))):
                    yield e
    except APIError as e:
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'code': e.code, 'message': e.message})}\n\n"


async def _events(engine: Engine, jobs: list[Job], updates: asyncio.Queue,
                  watch: Request | None) -> AsyncIterator[tuple[int, Update]]:
    """The jobs' (choice, update) items, as they come, until every job finished. The jobs still running are
    cancelled (their slots freed at the next step) if the consumer stops early or one job fails: a streaming client
    that disconnects cancels the response task, and `watch` (the request of a non-streaming answer) is polled for a
    disconnect."""
    running, checked = set(range(len(jobs))), float("-inf")
    try:
        while running:
            if watch is not None and time.monotonic() - checked > DISCONNECT_POLL_S:
                if await watch.is_disconnected():
                    return
                checked = time.monotonic()
            try:
                index, item = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S) if watch else \
                    await updates.get()
            except asyncio.TimeoutError:
                continue
            if isinstance(item, EngineFailed):
                running.discard(index)
                raise APIError(500, str(item), "engine_error")
            yield index, item
            if item.finish_reason is not None:
                running.discard(index)
    finally:
        for i in running:
            engine.cancel(jobs[i])


async def _stream(fmt: Format, events: AsyncIterator[tuple[int, Update]], jobs: list[Job], prompt_tokens: int,
                  logprobs: bool):
    for start in fmt.start_chunks(len(jobs)):
        yield sse(start)
    sampled = 0
    try:
        async for i, u in events:
            sampled += 1
            if u.text or u.finish_reason or (logprobs and u.logprobs):
                chunk = fmt.chunk(i, u.text, u.logprobs if logprobs else None, u.finish_reason)
                if not fmt.empty(chunk):
                    yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    if fmt.include_usage:
        yield sse(fmt.usage_chunk(usage(prompt_tokens, sampled, cached_tokens(jobs))))
    yield sse("[DONE]")
