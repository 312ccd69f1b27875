"""The OpenAI API's wire format, the part the server speaks: what a client sends, what it gets back.

Requests are pydantic models, so a wrong field becomes a 400 that names it; responses are plain dicts in
OpenAI's shapes (`text_completion`, `chat.completion`, their streaming `.chunk`s, `usage`, errors).
Fields a client may send that tinyvllm does not use are ignored, as vLLM does.
"""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.errors import TinyVLLMError
from tinyvllm.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None                       # None: the one model this server serves
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)       # OpenAI's range; 0 is greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)           # not OpenAI's: vLLM's extra field (0 or -1 keeps all)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)          # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              max_tokens=max_tokens, stop=self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]   # text, or token ids; a list must hold one prompt
    max_tokens: int | None = Field(default=16, ge=1)          # OpenAI's default for completions

    def prompt_ids(self, tokenizer) -> list[int]:
        """Raw text is encoded as is (no chat template), as LLM.generate does."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise TinyVLLMError(f"got {len(prompt)} prompts; send one prompt per request")
            prompt = prompt[0]
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None       # a string, or parts like [{"type": "text", "text": ...}]

    def text(self) -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise TinyVLLMError("only text content parts are supported (type 'text')")
        return "".join(part.get("text", "") for part in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name for max_tokens

    def prompt_ids(self, tokenizer) -> list[int]:
        """The conversation through the model's chat template, as LLM.chat does."""
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in self.messages])

    @property
    def reply_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens   # None: up to the context window


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request_id: str, model: str, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_completion(request_id: str, model: str, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
