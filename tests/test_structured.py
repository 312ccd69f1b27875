"""Structured outputs (chapter 11): regex -> DFA, the DFA lifted to token masks, JSON schemas, and the engine
sampling under them. Outputs are checked by codes that are not ours: Python's re.fullmatch and the jsonschema
library; the masks against a brute-force walk of every token."""
from __future__ import annotations

import json
import re
from collections import deque

import jsonschema
import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams, StructuredOutputsParams, TinyVLLMError
from tinyvllm.engine.structured.compiler import StructuredOutputCompiler
from tinyvllm.engine.structured.dfa import DEAD, compile_dfa
from tinyvllm.engine.structured.regex_parser import parse_regex
from tinyvllm.engine.structured.token_dfa import Matcher, TokenDFA
from tinyvllm.engine.structured.utf8 import characters
from tinyvllm.engine.structured.vocabulary import build_vocabulary, token_states
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model.sampler import sample_step
from tinyvllm.model.step_plan import Sampling

# bounded schemas: a random model must finish them (every string and list has a maximum length)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"},
                                      "color": {"enum": ["red", "grün", 3, None]}, "n": {"type": "number"}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                  "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
                                "required": ["id", "tags"]}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 4}, {"type": "integer"}, {"type": "null"}]},
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                           "required": ["x", "y"]}},
     "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}[0-9]$"},
                                      "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
                                      "kind": {"const": "ünïcödé ✓"}},
     "required": ["code", "day", "id", "kind"]},
    {"type": ["string", "null"], "maxLength": 5, "title": "maybe a word", "description": "annotations are ignored"},
    {"type": "object", "properties": {"opt1": {"type": "integer"}, "opt2": {"type": "boolean"}, "req": {"const": 1},
                                      "opt3": {"type": "string", "maxLength": 2}}, "required": ["req"]},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)!?", r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}", r"[日本語é]{1,5}x",
           r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?", r"[^\n]{0,12}\.", r"(ab|a)*b"]


# ---------------------------------------------------------------- regex -> DFA, against Python's re

@pytest.mark.parametrize("pattern", REGEXES + [r"a[^b]?c", r"(a|b)*abb", r"x{2,}y?", r"\w+\s\S", r".é"])
def test_the_dfa_matches_what_re_fullmatch_matches(pattern, rng):
    dfa = compile_dfa(parse_regex(pattern))
    alphabet = list("abcxy019-. !AZé日本\n") + ["maybe", "yes", "no"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, size=rng.integers(0, 8)))
        assert dfa.matches(text.encode()) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


def test_minimisation_leaves_the_textbook_dfa():
    """(a|b)*abb: 4 states (the dragon book's minimal DFA) and DEAD."""
    assert compile_dfa(parse_regex("(a|b)*abb")).num_states == 5


def test_dead_states_are_pruned():
    """A prefix that can no longer become a match leads to DEAD at once, and every other state can still reach
    an accepting one (which a token mask relies on)."""
    dfa = compile_dfa(parse_regex("ab?c"))
    assert dfa.walk(dfa.start, b"abb") == DEAD and dfa.walk(dfa.start, b"ab") != DEAD
    for state in range(1, dfa.num_states):
        assert dfa.accepting[state] or (dfa.transitions[state] != DEAD).any()


@pytest.mark.parametrize("low, high", [(0x41, 0x5A), (0x7F, 0x800), (0xD7F0, 0xE010), (0xFFF0, 0x10010), (0x10FFF0, 0x10FFFF)])
def test_utf8_ranges_spell_exactly_the_characters(low, high, rng):
    dfa = compile_dfa(characters([(low, high)]))
    inside = [c for c in range(low, high + 1) if not 0xD800 <= c <= 0xDFFF]
    assert all(dfa.matches(chr(c).encode()) for c in inside)
    for c in rng.integers(0, 0x110000, 2000):
        if not 0xD800 <= c <= 0xDFFF:
            assert dfa.matches(chr(c).encode()) == (low <= c <= high), hex(c)
    assert not dfa.matches("\ud800".encode("utf-8", "surrogatepass"))   # not UTF-8
    assert not dfa.matches(b"\xc0\x80")                                   # an overlong encoding


@pytest.mark.parametrize("kwargs, named", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(regex="(a"), "does not parse"),
    (dict(regex=r"(a)\1"), "not supported"), (dict(regex="(?i)a"), "flags"), (dict(choice=[]), "choice"),
    (dict(choice=["a", 1]), "choice"), (dict(json={"type": "integer", "minimum": 3}), "'minimum'"),
    (dict(json={"type": "object", "properties": {"a": {"type": "str"}}}), "'str'"),
    (dict(json={"oneOf": [{"type": "integer"}]}), "'oneOf'"), (dict(json="{not json"), "not valid JSON"),
    (dict(json={"$ref": "#/$defs/x", "$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}]}}}), "left-recursive"),
    (dict(json={"$ref": "#/$defs/missing"}), "points to nothing"), (dict(json={"type": "string", "format": "email"}), "email"),
    (dict(json={"type": "object", "properties": {}, "required": ["a"]}), "'a'"),
    (dict(json={"type": "array", "minItems": 3, "maxItems": 2}), "minItems"),
    (dict(grammar="root ::= a\na ::= a \"x\" | \"y\""), "left-recursive"), (dict(grammar="start ::= \"x\""), "root"),
    (dict(grammar="root ::= a | \"y\"\na ::= \"(\" a \")\""), "matches no finite text"),
    (dict(grammar="root ::= missing"), "missing"),
])
def test_a_bad_constraint_is_refused_naming_the_problem(kwargs, named):
    with pytest.raises(TinyVLLMError, match=re.escape(named)) as error:
        StructuredOutputsParams(**kwargs)
    assert "\n" not in str(error.value)


def test_structured_outputs_must_be_the_params_object():
    with pytest.raises(TinyVLLMError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_small_grammar():
    params = StructuredOutputsParams(grammar='''root ::= answer ("," ws answer)*   # a list
                                                answer ::= "yes" | "no" | [0-9]{1,3}
                                                ws ::= " "?''')
    dfa = compile_dfa(params.tree())
    assert [dfa.matches(t) for t in (b"yes", b"yes, no,12", b"1234", b"no,,yes", b"")] == [True, True, False, False, False]


# ---------------------------------------------------------------- token masks

@pytest.fixture(scope="module")
def smollm(default_model_dir):
    """The default model's vocabulary (49152 byte-level BPE tokens) as the engine compiles against it."""
    from tinyvllm.formats.config import load_config
    return StructuredOutputCompiler(load_tokenizer(default_model_dir).token_bytes, load_config(default_model_dir).vocab_size)


@pytest.fixture(scope="module")
def llama3(tiny_llama_dir):
    """Llama 3's vocabulary (128k tiktoken tokens)."""
    from tinyvllm.formats.config import load_config
    return StructuredOutputCompiler(load_tokenizer(tiny_llama_dir).token_bytes, load_config(tiny_llama_dir).vocab_size)


def test_a_mask_allows_exactly_the_tokens_that_keep_the_dfa_alive(rng):
    """Against a brute-force walk of every token, in every state, on a small random vocabulary with multi-byte
    pieces (tokens that end or start inside a character)."""
    pieces = ["a", "b", "ab", "é", "日", '"', "\\", "ba", "x1"]
    raw = [b"".join(rng.choice([p.encode() for p in pieces], size=rng.integers(1, 4))) for _ in range(300)]
    raw += [p.encode()[:k] for p in ("é", "日") for k in (1, 2)] + [bytes([b]) for b in range(256)] + [None]
    vocab = build_vocabulary(raw)
    for pattern in [r'"[^"\\]{0,4}"', r"(ab|日)+é?", r"[a-c]*x1"]:
        dfa = compile_dfa(parse_regex(pattern))
        for state in range(dfa.num_states):
            states = token_states(vocab, dfa.transitions, state, DEAD)
            expected = [DEAD if t is None else dfa.walk(state, t) for t in raw]
            assert states.tolist() == expected, (pattern, state)


def reachable_states(token_dfa: TokenDFA) -> set[int]:
    """Every DFA state a sequence of allowed tokens can reach from the start."""
    seen, todo = {token_dfa.dfa.start}, deque([token_dfa.dfa.start])
    while todo:
        state = todo.popleft()
        following = token_states(token_dfa.vocab, token_dfa.dfa.transitions, state, DEAD)
        for s in np.unique(following[token_dfa.token_mask(state)]).tolist():
            if s not in seen:
                seen.add(s)
                todo.append(s)
    return seen


@pytest.mark.parametrize("vocabulary", ["smollm", "llama3"])
@pytest.mark.parametrize("constraint", [dict(json=SCHEMAS[1]), dict(json=SCHEMAS[5]), dict(json_object=True),
                                        dict(regex=r"[日本語é]{1,5}x"), dict(choice=["日本", "日本語", "é"])],
                         ids=["enum", "pattern", "json_object", "unicode-regex", "unicode-choice"])
def test_a_constraint_never_removes_the_last_token(vocabulary, constraint, request):
    """In every state allowed tokens can reach, some token continues, or the output is complete: a mask never
    dead-ends a sequence, even between the bytes of one character."""
    token_dfa = request.getfixturevalue(vocabulary).compile(StructuredOutputsParams(**constraint))
    states = reachable_states(token_dfa)
    stuck = [s for s in states if not token_dfa.dfa.accepting[s] and not token_dfa.token_mask(s).any()]
    assert not stuck and len(states) > 1


def test_a_token_can_end_inside_a_character(smollm):
    """'日' is 3 bytes; the vocabulary has tokens holding part of it. After such a token the DFA waits mid-character
    and only tokens starting with the missing bytes are allowed."""
    token_dfa = smollm.compile(StructuredOutputsParams(regex="日本"))
    vocab = token_dfa.vocab
    partial = [t for t, b in enumerate(vocab.tokens) if b and "日".encode().startswith(b) and len(b) < 3]
    assert partial, "the vocabulary has no token ending inside 日"
    matcher = Matcher(token_dfa, {2})
    assert matcher.allowed()[partial].all()
    matcher.advance(partial[0])
    rest = ("日本".encode())[len(vocab.tokens[partial[0]]):]
    allowed = np.flatnonzero(matcher.allowed())
    assert len(allowed) and all(rest.startswith(vocab.tokens[t]) for t in allowed)


def test_eos_only_where_the_output_is_complete_and_then_it_must_stop(smollm):
    matcher = Matcher(smollm.compile(StructuredOutputsParams(regex="ab?")), {2})
    assert not matcher.allowed()[2]
    matcher.advance(smollm.vocab.tokens.index(b"a"))
    assert matcher.allowed()[2] and not matcher.must_stop()       # "a" is whole, "ab" may still come
    matcher.advance(smollm.vocab.tokens.index(b"b"))
    assert matcher.must_stop()                                     # "ab": only EOS could follow


def test_a_constraint_no_token_can_spell_is_refused(smollm):
    """SmolLM2 has no token starting with byte F1 (the lead byte of U+40000..U+7FFFF): nothing can start this."""
    with pytest.raises(TinyVLLMError, match="no token"):
        Matcher(smollm.compile(StructuredOutputsParams(regex="[\U00040000-\U0004FFFF]")), {2}).allowed()


def test_a_token_outside_the_mask_is_caught(smollm):
    matcher = Matcher(smollm.compile(StructuredOutputsParams(regex=r"\d+")), {2})
    with pytest.raises(TinyVLLMError, match="breaks the structured output"):
        matcher.advance(smollm.vocab.tokens.index(b"a"))


def random_walk(token_dfa: TokenDFA, stops: set[int], rng, max_steps: int = 2000) -> tuple[bytes, bool]:
    """An adversarial writer: uniform over the allowed tokens, a stop token half the time one is allowed.
    Returns the bytes and whether the output ended ("stop")."""
    matcher, out = Matcher(token_dfa, stops), b""
    for _ in range(max_steps):
        allowed = np.flatnonzero(matcher.allowed())
        can_stop = [t for t in allowed if t in stops]
        token = can_stop[0] if can_stop and rng.random() < 0.5 else int(rng.choice(allowed))
        if token in stops:
            return out, True
        matcher.advance(token)
        out += token_dfa.vocab.tokens[token]
        if matcher.must_stop():
            return out, True
    return out, False


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_random_token_walks_validate_against_the_schema(k, smollm, rng):
    schema = SCHEMAS[k]
    token_dfa = smollm.compile(StructuredOutputsParams(json=schema))
    for _ in range(20):
        text, finished = random_walk(token_dfa, {2}, rng)
        assert finished
        jsonschema.validate(json.loads(text.decode()), schema)


@pytest.mark.slow   # hundreds of walks through a 128K-token vocabulary
def test_random_walks_in_json_object_mode_give_json_objects(llama3, rng):
    token_dfa = llama3.compile(StructuredOutputsParams(json_object=True))
    done = 0
    for _ in range(10):
        text, finished = random_walk(token_dfa, {128009}, rng, max_steps=400)
        if finished:
            done += 1
            assert isinstance(json.loads(text.decode()), dict)
    assert done


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_token_walks_match_the_regex(pattern, llama3, rng):
    token_dfa = llama3.compile(StructuredOutputsParams(regex=pattern))
    for _ in range(20):
        text, finished = random_walk(token_dfa, {128009}, rng)
        assert finished and re.fullmatch(pattern, text.decode(), re.ASCII), text


# ---------------------------------------------------------------- the sampler: masks before everything

def test_the_mask_comes_before_greedy_sampling_and_logprobs(rng):
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    allowed = rng.random((3, 40)) < 0.3
    allowed[:, 0] = True
    samplings = [Sampling(SamplingParams(temperature=t, logprobs=5, seed=1), np.random.default_rng(1), [1], [],
                          allowed[i]) for i, t in enumerate((0.0, 1.0, 0.7))]
    out = sample_step(logits, samplings)
    for i in range(3):
        [token], [(chosen, _, top_ids, top_values)] = out.tokens[i], out.logprobs[i]   # one token per entry
        assert allowed[i, token]
        masked = np.where(allowed[i], logits[i], -np.inf)
        expected = masked - np.log(np.exp(masked[allowed[i]] - masked.max()).sum()) - masked.max()
        assert np.isclose(chosen, expected[token], atol=1e-5)
        finite = np.isfinite(top_values)
        assert allowed[i, top_ids[finite]].all() and np.allclose(top_values[finite], expected[top_ids[finite]], atol=1e-5)
        assert np.isclose(np.exp(expected[allowed[i]]).sum(), 1, atol=1e-5)   # the masked distribution sums to 1
    assert out.tokens[0] == [int(np.argmax(np.where(allowed[0], logits[0], -np.inf)))]


# ---------------------------------------------------------------- the engine, with real and random models

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu")


def test_a_random_model_samples_valid_json(tiny, seed):
    """A random-weight model draws tokens no real model would: every output must still validate."""
    params = [SamplingParams(temperature=1.0, seed=seed + k, max_tokens=300,
                             structured_outputs=StructuredOutputsParams(json=schema)) for k, schema in enumerate(SCHEMAS)]
    outputs = tiny.generate(["Answer in JSON:"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outputs):
        assert out.outputs[0].finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_a_random_model_samples_regexes_and_choices(tiny, seed):
    choices = ["north", "south", "日本", "naïve café"]
    constraints = [StructuredOutputsParams(regex=p) for p in REGEXES] + [StructuredOutputsParams(choice=choices)]
    params = [SamplingParams(temperature=1.0, seed=seed + k, max_tokens=100, structured_outputs=c, logprobs=3)
              for k, c in enumerate(constraints)]
    outputs = tiny.generate(["Say:"] * len(params), params)
    for pattern, out in zip(REGEXES, outputs):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.text, re.ASCII), out.text
    assert outputs[-1].text in choices
    for out in outputs:   # the logprobs are those of the masked distribution: the sampled token's is finite
        assert all(np.isfinite(entry[t].logprob) for t, entry in zip(out.token_ids, out.outputs[0].logprobs))


def test_a_wrong_mask_is_caught(tiny, seed, monkeypatch):
    """The tests can fail: a mask that lets every token through makes the engine fail the sequence (the matcher
    sees a token that breaks the constraint) instead of returning invalid JSON."""
    monkeypatch.setattr(TokenDFA, "token_mask", lambda self, state: np.ones(self.vocab.size, dtype=bool))
    tiny.engine.structured = StructuredOutputCompiler(tiny.tokenizer.token_bytes, tiny.model.cfg.vocab_size)
    out = tiny.generate("x", SamplingParams(temperature=1.0, seed=seed, max_tokens=50,
                                            structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    assert out.outputs[0].finish_reason == "error"


def test_a_complete_output_stops_without_a_stop_token(tiny):
    out = tiny.generate("x", SamplingParams(temperature=0, max_tokens=20,
                                            structured_outputs=StructuredOutputsParams(choice=["yes"])))[0]
    assert out.text == "yes" and out.outputs[0].finish_reason == "stop"
    assert tiny.tokenizer.decode(out.token_ids) == "yes"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM("default", device="cpu")


@pytest.mark.slow   # the default model generating
def test_the_default_model_fills_schemas(llm, seed):
    """The real model, sampling at temperature 1, in one batch: every reply validates."""
    schemas = [PERSON, SCHEMAS[1], {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                                     "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}]
    messages = [[{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(s)}"}] for s in schemas]
    params = [SamplingParams(temperature=1.0, seed=seed + k, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=s)) for k, s in enumerate(schemas)]
    for schema, out in zip(schemas, llm.chat(messages, params)):
        assert out.outputs[0].finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.slow   # the default model generating
def test_the_default_model_follows_a_regex_and_json_object_mode(llm, seed):
    messages = [[{"role": "user", "content": "What is your phone number?"}],
                [{"role": "user", "content": "Describe a cat as a JSON object with two keys."}]]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json_object=True))]
    phone, cat = llm.chat(messages, params)
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.outputs[0].finish_reason == "stop"
    if cat.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(cat.text), dict)
    assert cat.text.startswith("{")


@pytest.mark.parametrize("low", [0, 1, 2, 3])
def test_an_unbounded_array_keeps_its_commas_from_any_minimum(low):
    """minItems without maxItems: a loop whose every later round starts with the separator (the comma), whatever
    the minimum; judged against the jsonschema library on arrays of 0 to 5 items, and a comma left out."""
    from tinyvllm.engine.structured.json_schema import schema_tree
    schema = {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": low}
    dfa = compile_dfa(schema_tree(schema))
    for n in range(6):
        text = json.dumps(["ab"] * n, separators=(",", ":"))
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert dfa.matches(text.encode()) == valid, (low, text)
    assert not dfa.matches(b'["a""b"]'), "two items without the comma between them"
