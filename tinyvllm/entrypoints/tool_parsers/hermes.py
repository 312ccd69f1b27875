"""Hermes-style tool calls, as Hermes and Qwen 2.5 write them (vLLM's "hermes" parser):
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, after text or not, one tag per call. The chat template
shipped with SmolLM2-135M-Instruct says nothing of tools, so this format is tinyvllm's choice for it (and for any
model without <|python_tag|>): the system prompt below lists the tools in <tools></tools> and asks for it."""
from __future__ import annotations

import json
import re

from tinyvllm.entrypoints.tool_parsers.calls import ToolCall, call_from_json, marker_start

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)   # the last tag may be cut off by the stop token
ARGUMENTS_KEYS = ("arguments", "parameters")


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    if OPEN not in text:
        return text, []
    calls = []
    for match in CALL.finditer(text):
        try:
            call = call_from_json(json.loads(match.group(1)), ARGUMENTS_KEYS)
        except json.JSONDecodeError:
            call = None
        if call is None:   # a malformed call: the whole reply is text, as vLLM's parser answers
            return text, []
        calls.append(call)
    return CALL.sub("", text).strip() or None, calls


def content_end(text: str) -> int:
    """How much of the text so far is surely content: up to the first <tool_call> (or what may become one)."""
    return marker_start(text, OPEN)


def format_call(call: ToolCall) -> str:
    return f"{OPEN}\n{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}\n{CLOSE}"


def instructions(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to assist with the user query. You are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\nFor each function call, "
            f"return a json object with function name and arguments within {OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')
