"""The OpenAI API's wire format, the part the server speaks: what a client sends, what it gets back.

Requests are pydantic models that FastAPI publishes in /openapi.json (so schema-driven fuzzers and client
generators see them). Every field is either honoured with vLLM's semantics or refused with a 400 that
names it: types are strict (a number is not a string), unknown fields are refused, and the OpenAI fields
tinyvllm does not build (tools, structured output, ...) are refused when set. Responses are plain dicts
in OpenAI's shapes (`text_completion`, `chat.completion`, their streaming `.chunk`s, usage, logprobs,
errors).
"""
from __future__ import annotations

import codecs

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tinyvllm.engine.sampling import MAX_LOGPROBS, MAX_N, MIN_REPETITION_PENALTY, SamplingParams

# Strict scalars: JSON's 1 is a number, "1" is not; NaN and infinities are not numbers either.
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Str = Annotated[str, Field(strict=True)]
Int64 = Annotated[int, Field(strict=True, ge=-2 ** 63, le=2 ** 63 - 1)]   # seeds: any int64, as vLLM
TokenId = Annotated[int, Field(strict=True, ge=0)]

# OpenAI fields tinyvllm does not build: accepted only at the value that means "not used".
NOT_BUILT = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
             "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
             "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
             "web_search_options": (None,), "reasoning_effort": (None,), "store": (None, False),
             "metadata": (None,), "service_tier": (None, "auto", "default")}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Field(strict=True)] = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Str | None = None                           # None: the one model this server serves
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0, le=2)   # OpenAI's range; 0 is greedy; None: 1
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=-1)    # vLLM's extra field: 0 or -1 keeps all
    min_p: Float | None = Field(default=None, ge=0, le=1)   # vLLM's extra field
    seed: Int64 | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[TokenId] | None = None     # vLLM's extra field
    ignore_eos: Annotated[bool, Field(strict=True)] = False   # vLLM's extra field (benchmarks)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(default=None, ge=MIN_REPETITION_PENALTY)   # vLLM's extra field
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    user: Str | None = None                         # an end-user id: written to the access log only
    # refused unless at their "not used" value (NOT_BUILT); typed loosely so the 400 names the field
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    audio: dict | None = None
    modalities: list | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    store: Annotated[bool, Field(strict=True)] | None = None
    metadata: dict | None = None
    service_tier: str | None = None

    @field_validator(*NOT_BUILT)
    @classmethod
    def _refuse_what_is_not_built(cls, value, info: ValidationInfo):
        if value not in NOT_BUILT[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by tinyvllm; leave it out")
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
                              ignore_eos=self.ignore_eos, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    # text, token ids, or a list of either: several prompts give choices prompt by prompt, n each
    prompt: Str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Str], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Int | None = Field(default=16, ge=1)          # OpenAI's default for completions
    echo: Annotated[bool, Field(strict=True)] = False          # the prompt's text before the completion
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # top k per token, + the sampled one
    best_of: Int | None = Field(default=None, ge=1)

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]   # a fixed set: a role is never text the template pastes in
    content: Str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)  # the newer name for max_tokens
    logprobs: Annotated[bool, Field(strict=True)] = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Annotated[bool, Field(strict=True)] = True   # vLLM's extra field

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def reply_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens   # None: up to the context window

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


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
