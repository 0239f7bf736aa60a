"""Request bodies of the OpenAI-compatible API, validated strictly, and the errors the API answers with.

Bodies are read as JSON and checked by pydantic in strict mode: a field of the wrong type (a string for
`max_tokens`, a number for `stream`) is a 400 naming the field, not a silent conversion. `null` is the field's
default (the openai client sends it for an explicit None). Fields of the OpenAI API that this server does not
implement are accepted at their neutral values (penalties 0, no `logit_bias`, no `functions` or `function_call`,
the older names of tools) and refused otherwise, so no answer pretends to honour them; fields
it does not know are ignored, as OpenAI's own clients send some. `n` (and completions' `best_of`) run that many
choices of one prompt, at most MAX_CHOICES; a seeded request's choice i samples with seed + i (choice_params), so
the choices differ and a repeated request repeats them. Structured output (`response_format`), tools
(`tools`, `tool_choice`, `parallel_tool_calls`) and `chat_template_kwargs` are read into typed models here; what
they do is the app's (serve/app.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moeserve.engine.params import SEED_LIMIT, SamplingParams
from moeserve.errors import MoeserveError

MAX_LOGPROBS = 20
MAX_CHOICES = 16  # n and best_of: the choices one request may run
PYDANTIC_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {503: "unavailable_error"}  # else: invalid_request_error below 500, server_error from 500

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """A field given as null takes its default, as OpenAI's API reads it."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaSpec(Strict):
    """response_format.json_schema: the schema the answer must match (strict or not, the grammar holds it). The name
    is optional: nothing reads it, and clients written for llama-server leave it out."""
    name: str | None = Field(default=None, min_length=1)
    schema_: dict = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type 'json_schema'")
        return self


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef

    def as_dict(self) -> dict:
        """The tool as chat templates read it (OpenAI's shape, as transformers passes it)."""
        return self.model_dump(exclude_none=True, by_alias=True)


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class Sampling(Strict):
    """The fields completions and chat completions share."""
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM's -1 accepted)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens whatever the model says
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _implemented(self):
        """Options this server does not implement are accepted only at their neutral values."""
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False, "suffix": ""}
        for name, value in neutral.items():
            given = getattr(self, name, None)
            if given is not None and given != value:
                raise ValueError(f"{name} = {given!r} is not supported (only {value!r})")
        if self.ignore_eos and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("ignore_eos cannot be combined with a JSON response_format (the grammar ends the answer)")
        return self

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, value):
        if not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be in [1, {MAX_CHOICES}] (the choices one request may run), got {value}")
        return value

    @property
    def choices(self) -> int:
        """The choices the engine runs for this request (n; completions: best_of where given)."""
        return self.n

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters (max_tokens: this request's, or the endpoint's default)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                                  top_p=self.top_p, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)
        except MoeserveError as e:
            raise APIError(400, str(e), "invalid_value") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None  # run this many choices, answer the n of highest cumulative logprob
    suffix: str | None = None

    @model_validator(mode="after")
    def _best_of_holds_n(self):
        if self.best_of is None:
            return self
        if not 1 <= self.best_of <= MAX_CHOICES:
            raise ValueError(f"best_of must be in [1, {MAX_CHOICES}] (the choices one request may run), got "
                             f"{self.best_of}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.best_of > 1:
            raise ValueError("best_of cannot be combined with stream (the best choices are known only at the end)")
        return self

    @property
    def choices(self) -> int:
        return self.best_of or self.n

    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids: one per request (a list of one is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request, got {len(p)}", "invalid_value", "prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise APIError(400, "the prompt holds no tokens", "invalid_value", "prompt")
        return p


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(Strict):
    """A call an assistant message made, fed back in the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its thinking, for templates that show it again

    def as_dict(self) -> dict:
        """The message as a chat template reads it (as transformers and vLLM pass it): text parts joined into one
        string; a tool call's arguments as an object where they are JSON text of one (templates write them with
        tojson), else as given."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_object(c.function.arguments)}} for c in self.tool_calls]
        extra = {"name": self.name, "tool_call_id": self.tool_call_id, "reasoning_content": self.reasoning_content}
        return out | {k: v for k, v in extra.items() if v is not None}


def _json_object(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    functions: list | None = None  # the older name of tools
    function_call: str | dict | None = None  # the older name of tool_choice
    chat_template_kwargs: dict | None = None  # more variables for the chat template (enable_thinking: false)

    @field_validator("functions", "function_call")
    @classmethod
    def _older_names(cls, value):
        raise ValueError("the older function-call fields are not supported: use tools and tool_choice")

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        if self.ignore_eos and self.tool_mode not in ("none", "auto"):
            raise ValueError("ignore_eos cannot be combined with a forced tool call (the grammar ends the answer)")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the name of the function the answer must call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(Strict):
    """A Responses API message item (the openai client's easy form has no type)."""
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """A call the model made, fed back as input."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Strict):
    """A call's result."""
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(Strict):
    """A Responses API tool (the function's fields at the top level)."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        """The tool in chat completions' shape, as chat templates read it."""
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "name", "schema", ...}."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required with type 'json_schema'")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        spec = JsonSchemaSpec.model_validate({"name": self.name, "schema": self.schema_, "strict": self.strict})
        return ResponseFormat(type="json_schema", json_schema=spec)


class TextConfig(Strict):
    format: TextFormat | None = None


class ReasoningConfig(Strict):
    """reasoning: effort "none" turns a thinking template's section off; other efforts are not supported (the
    template decides how much the model thinks)."""
    effort: Literal["none"] | None = None


class ResponsesRequest(Strict):
    """POST /v1/responses: one answer to `input` (a string, or message and function-call items) after
    `instructions` (a system message). Nothing is stored: previous_response_id and conversation are refused."""
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = None  # nothing is stored, whatever it says
    metadata: dict | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool = False
    reasoning: ReasoningConfig | None = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _not_kept(cls, value):
        raise ValueError("is not supported (this server keeps no responses): send the whole conversation as input")

    @property
    def template_kwargs(self) -> dict:
        """The chat template's variables: reasoning effort "none" writes no thinking section (enable_thinking
        false)."""
        return {"enable_thinking": False} if self.reasoning and self.reasoning.effort == "none" else {}

    @field_validator("background")
    @classmethod
    def _foreground(cls, value):
        if value:
            raise ValueError("background responses are not supported")
        return value

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        names = [t.name for t in self.tools or []]
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the name of the function the answer must call."""
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def response_format(self) -> ResponseFormat | None:
        return self.text.format.response_format() if self.text and self.text.format else None

    def messages(self) -> list[dict]:
        """The conversation as chat templates read it: instructions as the system message, function calls as an
        assistant message's tool_calls, their outputs as tool messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        for item in [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input:
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": _json_object(item.arguments)}})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p)
        except MoeserveError as e:
            raise APIError(400, str(e), "invalid_value") from None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True  # with a prompt: those the tokenizer adds (the demo's: a BOS)
    add_generation_prompt: bool = True  # with messages

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def parse(model: type[Strict], body: bytes) -> Strict:
    """A request body as `model`, or a 400 saying what is wrong with it."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path = [str(x) for x in err["loc"] if not (isinstance(x, str) and x.split("[")[0] in PYDANTIC_TAGS)]
        field = ".".join(path)
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{field}: {message}" if field else message, "invalid_value",
                       path[0] if path else None) from None


def choice_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """The sampling parameters of each of `count` choices: choice i of a seeded request samples with seed + i
    (modulo 2**64), so choices differ, choice 0 is what n = 1 gives, and the same request repeats its choices."""
    if params.seed is None:
        return [params] * count
    return [replace(params, seed=(params.seed + i) % SEED_LIMIT) for i in range(count)]
