"""A schema fuzzer against the OpenAI-compatible server: schemathesis reads /openapi.json (the pydantic request
models FastAPI publishes) and throws valid and invalid requests at every operation.

- no request, however wrong, gets a 5xx (`not_a_server_error`); a request the schema calls invalid gets a 4xx;
- responses conform to the schema where one is published; every 4xx body is OpenAI's error object
  {"error": {"message", "type", "param", "code"}}; a 200 completion has OpenAI's shape, and a 200 stream
  is well-formed server-sent events ending in [DONE], with no error event inside;
- afterwards the server still answers a plain completion and every block is back in the pool.

Every operation in the schema is fuzzed: the coverage phase (each field's boundaries and wrong types, invalid
requests only) and MAX_EXAMPLES generated requests per operation, valid and invalid. Deterministic
(derandomize=True, no example database): a failure reproduces on the next run, and schemathesis prints it as a
curl command. No shrinking: each shrink step that reaches the model costs a model run; the reproducer is the
failing request itself. Under 2 minutes on two busy CPU cores, mostly the ~25 requests the model answers.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (negative_data_rejection, positive_data_acceptance,
                                                response_schema_conformance)

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import MAX_N
from tinyvllm.entrypoints.server import Server

pytestmark = pytest.mark.slow   # not in make test-fast: thousands of generated requests against a served engine

MAX_EXAMPLES = 40          # per operation, valid and invalid requests together (the fuzzing phase)
MAX_REPLY_TOKENS = 4       # what one generated request may decode, at most
MAX_SAMPLES = 2            # n, at most
MAX_PROMPTS = 3            # prompts in one batched completion request, at most
MAX_STREAM_EVENTS = MAX_PROMPTS * MAX_SAMPLES * (MAX_REPLY_TOKENS + 1) + 2   # + usage and [DONE]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    srv = Server(EngineConfig("default", "cpu", max_model_len=256, num_blocks=64), port=0,
                 log_level="warning").start()
    yield srv
    srv.stop()


def bounded_cost(context, case):
    """Cap what one generated request may cost: at most MAX_REPLY_TOKENS decode steps for each of at most
    MAX_PROMPTS x MAX_SAMPLES sequences. The schema allows max_tokens of any size (and null, or for chat no
    limit at all: up to the context window), n up to 16 and any number of prompts; on a CPU at ~0.1 s a
    decode step, that is minutes per request instead of a fuzzer's milliseconds. The fields stay fuzzed
    (nothing is excluded): only their sizes shrink, and every change keeps a valid body valid and an invalid
    one invalid, so negative testing is untouched (JSON's 4.0 is the integer 4, and is capped as one): a max_tokens
    that is not an integer, or is below 1, stays
    as generated; an n past MAX_N stays (the server must refuse it); best_of follows n; a list of prompts
    keeps at least one. (A map_case hook, not map_body: the coverage phase applies only case hooks.)"""
    body = case.body
    if case.method.upper() != "POST" or not isinstance(body, dict):
        return case
    body = dict(body)
    keys = ("max_tokens", "max_completion_tokens") if case.path.endswith("/chat/completions") else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        whole = type(value) is int or (type(value) is float and value.is_integer())   # 4.0 is the integer 4
        if key in body and (value is None or (whole and value > MAX_REPLY_TOKENS)):
            body[key] = MAX_REPLY_TOKENS
    if not any(key in body for key in keys):
        body["max_tokens"] = MAX_REPLY_TOKENS   # absent: 16 for completions, the context window for chat
    n = body.get("n")
    if type(n) in (int, float) and MAX_SAMPLES < n <= MAX_N and n == int(n):
        body["n"] = MAX_SAMPLES
        if body.get("best_of") == n:
            body["best_of"] = MAX_SAMPLES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]   # several prompts (a list of token ids is one prompt: left whole)
    if body != case.body:
        case.body = body
    return case


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url, request_timeout=60)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=MAX_EXAMPLES, deterministic=True, database="none", no_shrink=True)
    # The coverage phase walks each field's boundaries and wrong types (hundreds of cases, unbounded by
    # max_examples): its invalid ones cost a millisecond each (a 400), its valid ones a model run each, which
    # the fuzzing phase already does within MAX_EXAMPLES. So coverage sends invalid requests only.
    schema.config.phases.coverage.generation.update(modes=[GenerationMode.NEGATIVE])
    # schemathesis stops reading an event stream after 20 events by default (a stream may never end); ours end,
    # and the check below needs each one whole: MAX_PROMPTS x MAX_SAMPLES x (MAX_REPLY_TOKENS + 1) + 2 events
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    schema.config.output.sanitization.update(enabled=False)   # nothing secret here; keep max_tokens readable
    schema.config.output.truncation.update(enabled=False)     # the whole request in the curl reproducer
    schema.hook("map_case")(bounded_cost)
    return schema


# ---- checks of our own (plain functions: passed to call_and_validate, not registered globally) ----

def json_body(response):
    try:
        return json.loads(response.content)
    except ValueError:
        raise AssertionError(f"the body is not JSON: {response.content[:200]!r}") from None


def openai_error_object(ctx, response, case):
    """Every 4xx body is OpenAI's error object, with exactly its four keys."""
    if not 400 <= response.status_code < 500:
        return None
    body, status = json_body(response), response.status_code
    assert isinstance(body, dict) and set(body) == {"error"}, f"a {status} body is not {{'error': {{...}}}}: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"{status}: error keys are not {ERROR_KEYS}: {error!r}"
    assert isinstance(error["message"], str) and error["message"], f"message is not a non-empty string: {error!r}"
    assert isinstance(error["type"], str) and error["type"], f"type is not a non-empty string: {error!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"param is not a string or null: {error!r}"
    # OpenAI sends a string or null; vLLM (and tinyvllm, for HTTP-level errors) the status as an int
    assert error["code"] is None or isinstance(error["code"], (str, int)), f"code is not a str, int or null: {error!r}"
    return None


def invalid_body_is_refused(ctx, response, case):
    """A body the schema calls invalid gets a 4xx: not a 200 (the server took a wrong field), not a 5xx.
    (Other locations are negative_data_rejection's: a GET with an odd Content-Type is not a wrong request.)"""
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.BODY):
        assert 400 <= response.status_code < 500, \
            f"an invalid body got {response.status_code}, expected a 4xx: {case.body!r}"[:2000]
    return None


def openai_success_shape(ctx, response, case):
    """A 200 from a completions endpoint is OpenAI's object (or, streaming, its events), with no error in it."""
    if response.status_code != 200 or case.method.upper() != "POST":
        return None
    chat, body = case.path.endswith("/chat/completions"), case.body
    if isinstance(body, dict) and body.get("stream") is True:
        text = response.content.decode(errors="replace")
        events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {text[-300:]!r}"
        for data in events[:-1]:
            try:
                chunk = json.loads(data)
            except ValueError:
                raise AssertionError(f"a stream event is not JSON: {data[:200]!r}") from None
            assert "error" not in chunk, f"the stream carried an error event: {chunk!r}"
            assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk   # OpenAI's names
        return None
    out = json_body(response)
    assert out.get("object") == ("chat.completion" if chat else "text_completion"), out
    assert out["choices"], out
    for choice in out["choices"]:
        if choice["finish_reason"] == "tool_calls":   # a call's content may be null (the reply was all calls)
            assert chat and choice["message"]["tool_calls"], choice
            continue
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str), choice
    use = out["usage"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"], use
    assert use["completion_tokens"] <= MAX_REPLY_TOKENS * len(out["choices"]), use   # bounded_cost's cap held
    return None


# What a schema cannot say: rules that depend on the model served or tie one field's value to another's. A 400
# naming one of these is the only refusal a schema-valid request may get (positive_data_acceptance).
MODEL_RULES = ("is outside the vocabulary",      # a token id, checked against the model's vocabulary
               "context window",                  # a prompt's tokens (and max_tokens more), against the window
               "best_of other than n")             # best_of must equal n: JSON Schema cannot compare two fields


CONSTRAINT_FIELDS = ("response_format", "structured_outputs")   # what a regex or a JSON schema SAYS is checked by
                                                                 # its compiler (tests/test_structured.py): JSON Schema
                                                                 # publishes their shape, not which regexes parse
TOOL_RULES = ("cannot be enforced",             # a tool's parameters, compiled for tool_choice (a constraint too)
              "which is not in tools",          # a named tool_choice, against the names in tools
              "two tools are named",            # names differ: JSON Schema's uniqueItems compares whole items
              "arguments must be the JSON text",   # JSON inside a string
              "may not hold the special token")    # depends on the model's tokenizer


def valid_body_is_served(ctx, response, case):
    """A request the schema calls valid is served, or refused for one of MODEL_RULES: the schema says all else."""
    error = json_body(response).get("error", {}) if response.status_code == 400 else {}
    if any(rule in error.get("message", "") for rule in MODEL_RULES + TOOL_RULES) \
            or error.get("param") in CONSTRAINT_FIELDS:
        return None
    return positive_data_acceptance(ctx, response, case)


CHECKS = [not_a_server_error, response_schema_conformance, negative_data_rejection, valid_body_is_served,
          openai_error_object, invalid_body_is_refused, openai_success_shape]

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request):
    """schemathesis's lazy schema (4.32) reads and writes `item._nodeid`, which pytest 9.2 no longer has (the
    id lives in `item._id`): give it a plain attribute of its own. It only names the per-operation subtests."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzz_every_operation(case):
    case.call_and_validate(checks=CHECKS)


def test_server_whole_after_fuzzing(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.monotonic() + 5
    while True:
        stats = server.engine.client.stats
        if (stats.running, stats.waiting, stats.free_blocks) == (0, 0, stats.num_blocks) and not server.engine.choices:
            break
        assert time.monotonic() < deadline, f"the pool is not whole 5 s after the last request: {stats}"
        time.sleep(0.05)
