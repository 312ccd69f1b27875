"""Chapter 11: OpenAI's `tools` and `tool_choice` on the chat endpoint, served as vLLM serves them.

    tool_choice "none"       the tools are left out of the prompt; the reply is text
    tool_choice "auto"       (the default with tools) the model may answer or call; its reply is parsed in the
                             model's format (tool_parsers/): calls become tool_calls
    tool_choice "required"   the reply is constrained, by the structured-output automaton, to a call of one of
    {"type": "function",     the tools (or of the named one): {"name": ..., "parameters": {...}} valid for that
     "function": {"name"}}   tool's schema — Llama 3's format, parsed as such whatever the model

The tools reach the model through its chat template when the template reads `tools` (Llama 3.2's does); a
template that does not (SmolLM2's) gets a system message listing them in the model's format, and past calls
written as that format's text, so a multi-turn conversation of calls and "tool" results renders either way.
"""
from __future__ import annotations

import json

from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.entrypoints.tool_parsers import PARSERS, ToolCall, format_of
from tinyvllm.entrypoints.tool_parsers.llama3_json import ARGUMENTS_KEYS as CONSTRAINED_KEYS
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.tokenizer import Tokenizer

CONSTRAINED_FORMAT = "llama3_json"   # what "required" and a named tool_choice make the model write
NO_PARAMETERS = {"type": "object", "additionalProperties": False}   # OpenAI: a tool without parameters takes none


def choice_mode(tools: list[dict] | None, tool_choice: str | dict | None) -> str | dict:
    """OpenAI's default: "auto" when there are tools, "none" when there are none."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call of any of `tools` (OpenAI function tools)."""
    return {"anyOf": [{"type": "object", "required": ["name", CONSTRAINED_KEYS[0]], "properties": {
        "name": {"const": tool["function"]["name"]},
        CONSTRAINED_KEYS[0]: tool["function"].get("parameters", NO_PARAMETERS)}} for tool in tools]}


def call_constraint(tools: list[dict] | None, tool_choice: str | dict | None) -> StructuredOutputsParams | None:
    """The constraint tool_choice puts on the reply (None: free text). A tool whose parameters the compiler
    cannot enforce raises TinyVLLMError naming it."""
    mode = choice_mode(tools, tool_choice)
    if mode in ("none", "auto"):
        return None
    chosen = tools if mode == "required" else [t for t in tools if t["function"]["name"] == mode["function"]["name"]]
    for tool in chosen:   # one at a time, so that the error names the tool
        try:
            StructuredOutputsParams(json=call_schema([tool]))
        except TinyVLLMError as e:
            name = tool["function"]["name"]
            raise TinyVLLMError(f"the parameters of tool {name!r} cannot be enforced: {e}") from None
    return StructuredOutputsParams(json=call_schema(chosen))


def reply_format(tokenizer: Tokenizer, tools: list[dict] | None, tool_choice: str | dict | None) -> str | None:
    """The format to parse the reply in (a tool_parsers name), or None: the reply is plain text."""
    mode = choice_mode(tools, tool_choice)
    if mode == "none":
        return None
    return format_of(tokenizer) if mode == "auto" else CONSTRAINED_FORMAT


def render_prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None, tool_choice,
                  add_generation_prompt: bool) -> list[int]:
    """Prompt ids for a conversation that may hold tool calls and results, and for the tools it may call.
    Messages are OpenAI's, tool calls' arguments JSON text; raises TinyVLLMError when the template fails."""
    tools = tools if choice_mode(tools, tool_choice) != "none" else None
    if tokenizer.template_takes_tools:   # HF's convention: arguments as objects, the tools as given
        refuse_special_tokens(tokenizer, tools, messages)
        return tokenizer.apply_chat_template([template_message(m) for m in messages], add_generation_prompt, tools)
    parser = PARSERS[format_of(tokenizer)]
    written = [written_message(m, parser) for m in messages]
    if tools:
        written = with_system_text(written, parser.instructions(tools))
    return tokenizer.apply_chat_template(written, add_generation_prompt)


def template_message(message: dict) -> dict:
    if "tool_calls" not in message:
        return message
    calls = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def written_message(message: dict, parser) -> dict:
    """A message for a template that knows only role and content: past calls become text in the model's format."""
    calls = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls", [])]
    text = "\n".join(filter(None, [message.get("content") or "", *map(parser.format_call, calls)]))
    return {"role": message["role"], "content": text}


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """The tool listing after the system prompt, or as one when there is none."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def refuse_special_tokens(tokenizer: Tokenizer, tools: list[dict] | None, messages: list[dict]) -> None:
    """The template pastes tools and calls into the prompt as they are, where a special token's text would be
    read as that token (a forged end of turn): refused, as only message contents are encoded as plain text."""
    pasted = json.dumps([tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False)
    token = next((t for t in tokenizer.special_tokens if t in pasted), None)
    if token is not None:
        raise TinyVLLMError(f"tools and tool_calls may not hold the special token {token!r}")
