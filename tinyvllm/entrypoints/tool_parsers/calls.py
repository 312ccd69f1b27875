"""A tool call as the parsers find it, and what they share: reading one call object, holding back a marker."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def openai(self) -> dict:
        """OpenAI's tool_calls item: the arguments travel as a JSON string, the id is new for each call."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def call_from_json(value, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": ..., <one of arguments_keys>: {...}} as a call; None for anything else, so that a plain JSON
    answer with other keys (say {"name": "Bob", "age": 3}) stays text."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    keys = [k for k in arguments_keys if k in value]
    if set(value) != {"name", *keys} or len(keys) > 1:
        return None
    arguments = value[keys[0]] if keys else {}
    if isinstance(arguments, str):   # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def marker_start(text: str, marker: str) -> int:
    """Where `marker` starts in text, or where a tail that may become it starts (len(text): neither)."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)
