"""Tool calling on the chat endpoint (tools.py, tool_parsers/): the parsers on hand-written replies of both
formats, the constrained tool_choice modes on a random-weight model (every call must validate against its
tool's schema, whatever the model draws), and the whole path through the official openai client: plain,
streaming, multi-turn, and the 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.entrypoints import tools
from tinyvllm.entrypoints.responses import HeldCalls
from tinyvllm.entrypoints.server import Server
from tinyvllm.entrypoints.tool_parsers import ToolCall, parse
from tinyvllm.formats.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}   # no parameters
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", tools.NO_PARAMETERS) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def called(name: str, arguments: str, call_id: str = "call_1") -> dict:
    """An assistant message that made one call, as a client sends it back."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


# ---- the parsers, on hand-written replies ----

@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [ToolCall("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "arguments": {}}', None, [ToolCall("f", {})]),
    ('Let me look. <|python_tag|>{"name": "f", "parameters": {"a": 1}}', "Let me look.", [ToolCall("f", {"a": 1})]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": [1]}}', None,
     [ToolCall("f", {}), ToolCall("g", {"x": [1]})]),
    ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),        # cut short
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),                                 # an answer
    ('The capital is Paris.', 'The capital is Paris.', []),
])
def test_the_llama3_json_parser(text, content, calls):
    assert parse(text, "llama3_json") == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', None,
     [ToolCall("get_weather", {"city": "Rome"})]),
    ('Sure! <tool_call>{"name": "f", "arguments": {}}</tool_call>', "Sure!", [ToolCall("f", {})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}'
     '</tool_call>', None, [ToolCall("f", {}), ToolCall("g", {"b": 2})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [ToolCall("f", {"a": 1})]),    # the stop token cut it
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>{"name": "f", "arguments": {"a": '
     '</tool_call>', []),                                                                      # invalid JSON: text
    ('No tools needed: 4.', 'No tools needed: 4.', []),
])
def test_the_hermes_parser(text, content, calls):
    assert parse(text, "hermes") == (content, calls)


def test_a_call_goes_out_in_openais_shape():
    out = ToolCall("f", {"city": "Zürich"}).openai()
    assert out["id"].startswith("call_") and len(out["id"]) > 10 and out["type"] == "function"
    assert out["function"] == {"name": "f", "arguments": '{"city": "Zürich"}'}
    assert ToolCall("f", {}).openai()["id"] != out["id"]


@pytest.mark.parametrize("format_, pieces, sent, content, calls", [
    ("hermes", ["Sure <tool", "_call>{\"name\": \"f\", ", "\"arguments\": {}}</tool_call>"], "Sure ", None,
     [ToolCall("f", {})]),
    ("hermes", ["a <to", "y> b"], "a <toy> b", "", []),            # a tail that looked like a tag, then was not
    ("llama3_json", ["{\"name\": \"f\", ", "\"parameters\": {}}"], "", None, [ToolCall("f", {})]),
    ("llama3_json", ["{\"answer\": ", "4}"], "", "{\"answer\": 4}", []),   # JSON, but no call: text at the end
    ("llama3_json", ["It is ", "{4}"], "It is {4}", "", []),
])
def test_streaming_holds_back_what_may_be_a_call(format_, pieces, sent, content, calls):
    held = HeldCalls(format_)
    assert "".join(held.feed(p) for p in pieces) == sent
    assert held.finish() == (content, calls)


# ---- the prompt ----

def test_tools_reach_a_template_that_cannot_take_them_as_a_system_message(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert not tokenizer.template_takes_tools
    turns = ASK + [called("get_weather", '{"city": "Paris"}'),
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    text = tokenizer.decode(tools.render_prompt(tokenizer, turns, TOOLS, "auto", True))
    assert "<tools>" in text and '"name": "get_time"' in text and "<|im_start|>system\n" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nsunny, 21C" in text
    assert "get_time" not in tokenizer.decode(tools.render_prompt(tokenizer, ASK, TOOLS, "none", True))


def test_a_llama3_template_without_tools_gets_metas_words(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    turns = ASK + [called("get_weather", '{"city": "Rome"}')]
    text = tokenizer.decode(tools.render_prompt(tokenizer, turns, TOOLS, "required", True))
    assert "Given the following functions" in text and '"name": "get_time"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}' in text


def test_a_template_that_takes_tools_gets_them_and_no_special_token_through_them(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                               "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
                               "{{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
                               "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}")
    assert tokenizer.template_takes_tools
    turns = ASK + [called("get_weather", '{"city": "Rome"}')]
    text = tokenizer.decode(tools.render_prompt(tokenizer, turns, TOOLS, "auto", True))
    assert "CALL get_weather Rome" in text and "TOOL get_time" in text   # arguments as an object, as HF's
    forged = {"type": "function", "function": {"name": "f", "description": "<|eot_id|>"}}
    with pytest.raises(Exception, match="special token"):
        tools.render_prompt(tokenizer, ASK, [forged], "auto", True)


# ---- the server, with the official client ----

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(EngineConfig(str(tiny_model_dir), "cpu", max_model_len=1024, num_blocks=256), "tiny", port=0,
                 log_level="warning", engine_in_thread=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def check_call(call, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_tool_choice_gives_calls_valid_for_the_schema(client, choice, seed):
    """A random-weight model, sampled at temperature 1 with several seeds: only the automaton makes the calls
    valid, so this fails if the schema, the constraint or the parse is wrong."""
    names = {"get_weather"} if isinstance(choice, dict) else set(SCHEMAS)
    for k in range(4):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed + k, max_tokens=200)
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", out.message
        assert out.message.content is None and len(out.message.tool_calls) == 1
        check_call(out.message.tool_calls[0], names)


def test_streaming_sends_the_call_as_tool_calls_deltas(client, seed):
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=seed, max_tokens=200, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)   # the call is never leaked as text
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0], set(SCHEMAS))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_none_answer_in_text_or_calls_and_a_conversation_goes_on(client, seed):
    """A random model rarely writes a call by itself: auto must then answer in text (no tool_calls), and a
    multi-turn conversation with a call and its result renders and is answered."""
    turns = ASK + [called("get_weather", '{"city": "Paris"}'),
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model="tiny", messages=turns, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed, max_tokens=8)
        out = reply.choices[0]
        if out.message.tool_calls:
            assert choice == "auto" and out.finish_reason == "tool_calls"
        else:
            assert out.finish_reason == "length" and isinstance(out.message.content, str)


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ""),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}}}}], "tool_choice": "required"}, "tool_choice", "'minimum'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages", "tool_call_id"),
    ({"messages": [called("f", "not json")]}, "messages", "arguments"),
])
def test_a_bad_tool_request_is_a_400_naming_the_problem(server, client, extra, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert words in error["message"], error
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", **{"messages": ASK, **extra})


@pytest.mark.parametrize("extra, valid", [
    ({"tools": TOOLS, "tool_choice": "required"}, True), ({"tool_choice": "auto"}, False),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, False),
    ({"tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "json_object"}}, True),
    ({"messages": [{"role": "tool", "content": "21C"}]}, False),
    ({"messages": [{"role": "tool", "content": "21C", "tool_call_id": "c"}]}, True),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, False),
    ({"messages": [{"role": "user", "tool_calls": []}]}, False)])
def test_the_published_schema_states_the_tool_rules(server, extra, valid):
    """The rules between tool fields that JSON Schema can state are in /openapi.json, as strict as the server."""
    schema = httpx.get(f"{server.url}/openapi.json").json()
    request = {**schema["components"]["schemas"]["ChatRequest"], "components": schema["components"]}
    body = {"messages": ASK, **extra}
    assert jsonschema.Draft202012Validator(request).is_valid(body) == valid
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert (r.status_code == 200) == valid, r.text


def test_a_call_sent_back_as_the_client_returned_it_continues_the_conversation(client, seed):
    """The usual loop: call, run the tool, append the assistant message object and the result, ask again."""
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200)
    message = reply.choices[0].message
    turns = ASK + [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21C"}]
    again = client.chat.completions.create(model="tiny", messages=turns, tools=TOOLS, tool_choice="none",
                                           temperature=1.0, seed=seed, max_tokens=4)
    assert again.choices[0].finish_reason == "length" and again.choices[0].message.tool_calls is None
