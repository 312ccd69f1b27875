"""The OpenAI API's wire format, the part the server speaks: what a client sends, what it gets back.

Requests are pydantic models that FastAPI publishes in /openapi.json (so schema-driven fuzzers and client
generators see them). Every field is either honoured with vLLM's semantics or refused with a 400 that
names it: types are strict (a number is not a string), unknown fields are refused, and the OpenAI fields
tinyvllm does not build (logit_bias, audio, ...) are refused when set (chat's tools are built: tools.py).
The schema says all of it, rules between fields included, except what depends on the model (the
vocabulary, the context window) and what JSON Schema cannot state: best_of == n, a named tool_choice's name
among the tools', tools' names all different, a tool call's arguments as JSON text of an object, and which
tool parameter schemas the compiler can enforce. Responses are plain dicts in OpenAI's shapes
(`text_completion`, `chat.completion`, their streaming `.chunk`s, usage, logprobs, errors); ApiError refuses
a request with one of those errors from anywhere on the API side.
"""
from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tinyvllm.engine.sampling import MAX_LOGPROBS, MAX_N, MIN_REPETITION_PENALTY, SamplingParams
from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.entrypoints import tools as tool_request
from tinyvllm.entrypoints.structured_request import (RESPONSE_FORMAT_SCHEMA, STRUCTURED_OUTPUTS_SCHEMA,
                                                     from_response_format, from_structured_outputs, structured_params)
from tinyvllm.errors import TinyVLLMError



def _whole_number(value):
    """JSON has one kind of number: 4.0 is the integer 4 (as JSON Schema's "integer" says), 4.5 is not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds):
    """A strict integer within bounds (ge=, le=): JSON's 1 and 1.0 are, "1" and 1.5 are not. The bounds sit in
    the integer's own Field so that /openapi.json publishes them (as minimum and maximum)."""
    return Annotated[int, Field(strict=True, **bounds), BeforeValidator(_whole_number)]


# Strict scalars: JSON's 1 is a number, "1" is not; NaN and infinities are not numbers either.
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Str = Annotated[str, Field(strict=True)]
Int64 = Int(ge=-2 ** 63, le=2 ** 63 - 1)   # seeds: any int64, as vLLM
TokenId = Int(ge=0)
Text = Annotated[str, Field(strict=True, min_length=1)]   # a prompt: empty text has no token to start from
MAX_TOOLS = 128   # OpenAI's limit on a request's tools

# OpenAI fields tinyvllm does not build: accepted only at the value that means "not used".
NOT_BUILT = {"functions": (None, []), "function_call": (None, "none"),
             "parallel_tool_calls": (None,), "logit_bias": (None, {}),
             "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
             "web_search_options": (None,), "reasoning_effort": (None,), "store": (None, False),
             "metadata": (None,), "service_tier": (None, "auto", "default")}
NO_TOOLS = {"tools": (None, []), "tool_choice": (None, "none")}   # the completions API's: chat honours them (tools.py)


def not_built(name: str, fields: dict = NOT_BUILT):
    """A NOT_BUILT field: typed loosely (so the 400 names it), its "not used" values published as the schema's enum."""
    return Field(default=None, json_schema_extra={"enum": list(fields[name])})


def refuse_unless_unused(value, name: str, fields: dict):
    if value not in fields[name]:
        raise ValueError(f"{name} is not supported by tinyvllm; leave it out")
    return value


def needs(field: str, value, when: dict) -> dict:
    """A rule between two fields, in JSON Schema's words: when `when` holds, `field` must be `value`."""
    return {"if": when, "then": {"properties": {field: {"const": value}}, "required": [field]}}


def is_set(field: str, schema: dict | None = None) -> dict:
    """JSON Schema: `field` is present, not null (and matches `schema`)."""
    return {"properties": {field: {"not": {"type": "null"}, **(schema or {})}}, "required": [field]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Field(strict=True)] = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Str | None = None                           # None: the one model this server serves
    max_tokens: Int(ge=1) | None = None
    temperature: Float | None = Field(default=None, ge=0, le=2)   # OpenAI's range; 0 is greedy; None: 1
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: Int(ge=-1) | None = None    # vLLM's extra field: 0 or -1 keeps all
    min_p: Float | None = Field(default=None, ge=0, le=1)   # vLLM's extra field
    seed: Int64 | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[TokenId] | None = None     # vLLM's extra field
    ignore_eos: Annotated[bool, Field(strict=True)] = False   # vLLM's extra field (benchmarks)
    n: Int(ge=1, le=MAX_N) = 1
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(default=None, ge=MIN_REPETITION_PENALTY)   # vLLM's extra field
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    user: Str | None = None                         # an end-user id: written to the access log only
    # refused unless at their "not used" value (NOT_BUILT); typed loosely so the 400 names the field
    functions: list | None = not_built("functions")
    function_call: str | dict | None = not_built("function_call")
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = not_built("parallel_tool_calls")
    response_format: dict | None = Field(None, json_schema_extra=RESPONSE_FORMAT_SCHEMA)  # text, json_object, json_schema
    structured_outputs: dict | None = Field(None, json_schema_extra=STRUCTURED_OUTPUTS_SCHEMA)  # vLLM's extra field
    logit_bias: dict | None = not_built("logit_bias")
    audio: dict | None = not_built("audio")
    modalities: list | None = not_built("modalities")
    prediction: dict | None = not_built("prediction")
    web_search_options: dict | None = not_built("web_search_options")
    reasoning_effort: str | None = not_built("reasoning_effort")
    store: Annotated[bool, Field(strict=True)] | None = not_built("store")
    metadata: dict | None = not_built("metadata")
    service_tier: str | None = not_built("service_tier")

    @field_validator(*NOT_BUILT)
    @classmethod
    def _refuse_what_is_not_built(cls, value, info: ValidationInfo):
        return refuse_unless_unused(value, info.field_name, NOT_BUILT)

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _constraint_compiles(cls, value, info: ValidationInfo):
        """A bad schema or regex is a 400 naming the field (it is parsed again for the engine: milliseconds)."""
        if value is None:
            return value
        if info.field_name == "structured_outputs" and info.data.get("response_format") not in (None, {"type": "text"}):
            raise ValueError("give response_format or structured_outputs, not both")
        try:
            (from_response_format if info.field_name == "response_format" else from_structured_outputs)(value)
        except TinyVLLMError as e:
            raise ValueError(str(e)) from None
        return value

    @field_validator("stream_options")   # fields are checked in order: `stream` is known here
    @classmethod
    def _options_need_a_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """vLLM's SamplingParams for this request; None fields keep vLLM's defaults."""
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty)
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=self.seed, n=self.n,
                              max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs,
                              structured_outputs=self.constraint())

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint on the output, or None (free text)."""
        return structured_params(self.response_format, self.structured_outputs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    # the rules between fields, published too (a client generated from the schema knows them)
    model_config = ConfigDict(json_schema_extra={"allOf": [
        needs("stream", True, is_set("stream_options")), needs("echo", False, is_set("logprobs"))]})
    # text, token ids, or a list of either: several prompts give choices prompt by prompt, n each
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Int(ge=1) | None = 16          # OpenAI's default for completions
    echo: Annotated[bool, Field(strict=True)] = False          # the prompt's text before the completion
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None   # top k per token, + the sampled one
    best_of: Int(ge=1) | None = None
    tools: list | None = not_built("tools", NO_TOOLS)
    tool_choice: str | dict | None = not_built("tool_choice", NO_TOOLS)

    @field_validator(*NO_TOOLS)
    @classmethod
    def _no_tools(cls, value, info: ValidationInfo):
        return refuse_unless_unused(value, info.field_name, NO_TOOLS)

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("echo"):
            raise ValueError("echo with logprobs needs the prompt's logprobs, which tinyvllm does not compute; "
                             "drop one of them")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n"):
            raise ValueError("best_of other than n is not supported by tinyvllm; leave it out")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Str
    arguments: Str   # JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, value):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except json.JSONDecodeError:
            pass
        raise ValueError(f"arguments must be the JSON text of an object, got {value!r:.60}")


class ToolCallItem(BaseModel):
    """A call the assistant made, sent back in the conversation."""
    model_config = ConfigDict(extra="forbid")
    id: Str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [   # _tool_fields_where_they_belong
        {"if": {"properties": {"role": {"const": "tool"}}}, "then": is_set("tool_call_id"),
         "else": {"properties": {"tool_call_id": {"type": "null"}}}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"tool_calls": {"type": "null"}}}}]})

    role: Literal["system", "user", "assistant", "tool"]   # a fixed set: a role is never text the template pastes in
    content: Str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None   # an assistant's calls
    tool_call_id: Str | None = None                # a tool's result: which call it answers

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """The message as templates read it: content as text (None for an assistant's calls without text)."""
        out = {"role": self.role, "content": None if self.tool_calls and not self.content else self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]   # OpenAI's rule for names
    description: Str | None = None
    parameters: dict | None = None   # a JSON schema; None: no parameters
    strict: Annotated[bool, Field(strict=True)] | None = None   # calls are always held to the schema when constrained


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionTool


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        needs("stream", True, is_set("stream_options")),
        needs("logprobs", True, is_set("top_logprobs", {"minimum": 1})),
        {"if": is_set("tool_choice", {"not": {"const": "none"}}), "then": is_set("tools", {"minItems": 1})},
        {"if": is_set("tool_choice", {"not": {"enum": ["none", "auto"]}}), "then": {"properties": {
            "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
            "structured_outputs": {"type": "null"}}}}]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = None  # the newer name for max_tokens
    logprobs: Annotated[bool, Field(strict=True)] = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: Annotated[bool, Field(strict=True)] = True   # vLLM's extra field
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # tools.py says what each does

    @field_validator("tools")
    @classmethod
    def _names_differ(cls, value):
        names = [tool.function.name for tool in value or []]
        repeated = next((name for name in names if names.count(name) > 1), None)
        if repeated is not None:
            raise ValueError(f"two tools are named {repeated!r}; give each its own name")
        return value

    @field_validator("tool_choice")   # fields are checked in order: tools and response_format are known here
    @classmethod
    def _tool_choice_fits_the_tools(cls, value, info: ValidationInfo):
        tools = info.data.get("tools")
        names = [tool.function.name for tool in tools or []]
        if value not in (None, "none") and not names:
            raise ValueError("tool_choice other than \"none\" needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"tool_choice names the function {value.function.name!r}, which is not in tools "
                             f"({', '.join(names)})")
        if value in ("none", "auto", None):
            return value
        if info.data.get("response_format") not in (None, {"type": "text"}) or info.data.get("structured_outputs"):
            raise ValueError("tool_choice \"required\" or a named function constrains the reply itself; drop "
                             "response_format or structured_outputs")
        try:   # the tools' schemas, parsed now: one the compiler cannot enforce is a 400 naming the tool
            tool_request.call_constraint([t.model_dump(exclude_none=True) for t in tools], dump(value))
        except TinyVLLMError as e:
            raise ValueError(str(e)) from None
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    @property
    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_choice_value(self) -> str | dict | None:
        return dump(self.tool_choice)

    def constraint(self) -> StructuredOutputsParams | None:
        return tool_request.call_constraint(self.tool_dicts, self.tool_choice_value) or super().constraint()

    @property
    def reply_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens   # None: up to the context window

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def dump(value):
    """A pydantic model as its JSON value; anything else as it is."""
    return value.model_dump() if isinstance(value, BaseModel) else value


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def response(request_id: str, object_: str, model: str, choices: list[dict], use: dict | None = None,
             created: int | None = None) -> dict:
    out = {"id": request_id, "object": object_, "created": created or int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_logprobs(token_ids: list[int], entries: list[dict], offset: int, tokenizer) -> dict:
    """The completions API's (legacy) logprobs: parallel lists, one item per generated token.
    `entries` are the engine's {token id: Logprob} dicts: the sampled token and the top k. text_offset: where
    each token's text starts in the completion, counted in characters of the text before it (a token that
    holds part of a character starts where that character does)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")   # holds a split character's first bytes
    for token, entry in zip(token_ids, entries):
        sampled = entry[token]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
        offsets.append(offset)
        offset += len(utf8.decode(tokenizer.decode_bytes([token])))   # whole characters only
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict], top_k: int, tokenizer) -> dict:
    """The chat API's logprobs: per generated token, its logprob and the top_k most likely tokens. `bytes`
    are the token's own bytes, which for a token holding part of a UTF-8 character its text cannot give."""
    def item(token: int, lp) -> dict:
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(tokenizer.decode_bytes([token]))}
    content = []
    for token, entry in zip(token_ids, entries):
        best = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top_k), key=lambda pair: pair[1].rank)
        content.append({**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in best]})
    return {"content": content}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every 4xx and 5xx body of the server."""
    error: ErrorDetail


# What /openapi.json documents for a /v1 route: the codes the server really answers (FastAPI's default 422 is
# never sent: a wrong field is a 400 naming it, as OpenAI answers).
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a field is wrong (the message and `param` name it)"), (401, "no valid API key"),
    (404, "unknown model"), (413, "body too large"), (415, "the body is not sent as JSON"),
    (429, "the waiting queue is full"))}


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """Refuse a request with an HTTP status and OpenAI's error object (server.py's handler sends it)."""
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error(message, type_, param, code), headers
