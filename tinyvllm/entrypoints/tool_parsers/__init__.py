"""Chapter 11: tool calls in a model's reply -> OpenAI's tool_calls, one module per format:

    llama3_json  Llama 3's JSON: {"name": ..., "parameters": {...}}, maybe after <|python_tag|>
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen; tinyvllm's choice for SmolLM2)

Each module has parse(text) -> (content or None, calls), content_end(text) (how much of a growing reply is
surely content: streaming holds back the rest), format_call(call) and instructions(tools) (a past call and
the tool list, written in its format, for a chat template that cannot take tools itself).
"""
from __future__ import annotations

from types import ModuleType

from tinyvllm.entrypoints.tool_parsers import hermes, llama3_json
from tinyvllm.entrypoints.tool_parsers.calls import ToolCall
from tinyvllm.formats.tokenizer import Tokenizer

PARSERS: dict[str, ModuleType] = {"llama3_json": llama3_json, "hermes": hermes}

__all__ = ["PARSERS", "ToolCall", "format_of", "parse"]


def format_of(tokenizer: Tokenizer) -> str:
    """The format a model writes calls in: Llama 3's when its tokenizer has <|python_tag|>, else Hermes'."""
    return "llama3_json" if llama3_json.PYTHON_TAG in tokenizer.special_tokens else "hermes"


def parse(text: str, format_: str) -> tuple[str | None, list[ToolCall]]:
    """The reply's content (None when it is all calls) and its tool calls, in the named format."""
    return PARSERS[format_].parse(text)
