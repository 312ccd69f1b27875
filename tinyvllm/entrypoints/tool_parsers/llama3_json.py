"""Llama 3.1/3.2's JSON tool calls: the whole reply is {"name": ..., "parameters": {...}} (several are joined
by ";"), maybe after <|python_tag|>. Meta's template asks for it in these words; the constrained modes
(tool_choice "required" or a named function) write this shape too, whatever the model."""
from __future__ import annotations

import json

from tinyvllm.entrypoints.tool_parsers.calls import ToolCall, call_from_json, marker_start

PYTHON_TAG = "<|python_tag|>"   # a special token: decoded text leaves it out, text written by hand may hold it
ARGUMENTS_KEYS = ("parameters", "arguments")   # Meta's name, and the one some fine-tunes write


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    head, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        if not text.lstrip().startswith("{"):
            return text, []
        head, body = "", text
    calls = decode_calls(body.strip())
    if calls is None:
        return text, []
    return head.strip() or None, calls


def decode_calls(body: str) -> list[ToolCall] | None:
    """One or more call objects separated by ";" or blanks; None when anything else is there."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = call_from_json(value, ARGUMENTS_KEYS)
        if call is None:
            return None
        calls.append(call)
        while at < len(body) and body[at] in "; \t\n":
            at += 1
    return calls or None


def content_end(text: str) -> int:
    """How much of the text so far is surely content: none of it once it may be a call (it starts with "{")."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith("{"):
        return 0
    return marker_start(text, PYTHON_TAG)


def format_call(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


def instructions(tools: list[dict]) -> str:
    """Meta's words for JSON tool calling (Llama 3.2's template), for a template that cannot take tools."""
    listing = "".join(json.dumps(tool, ensure_ascii=False, indent=4) + "\n\n" for tool in tools)
    return ("Given the following functions, please respond with a JSON for a function call with its proper arguments "
            "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
            "dictionary of argument name and its value}. Do not use variables.\n\n" + listing).rstrip()
