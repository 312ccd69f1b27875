"""Structured outputs that nest without a bound (chapter 11): recursive grammars and $refs on the pushdown
automaton. Judged by codes that are not the PDA's: a recursive-descent recogniser written here, Python's json
and the jsonschema library; the masks against feeding every token's bytes through the PDA one by one."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams, StructuredOutputsParams, TinyVLLMError
from tinyvllm.engine.structured import pda as pda_module
from tinyvllm.engine.structured import token_pda as token_pda_module
from tinyvllm.engine.structured.compiler import StructuredOutputCompiler
from tinyvllm.engine.structured.pda import compile_pda, initial, matches, walk
from tinyvllm.engine.structured.token_dfa import Matcher, TokenDFA
from tinyvllm.engine.structured.token_pda import TokenPDA
from tinyvllm.engine.structured.vocabulary import build_vocabulary
from tinyvllm.formats.tokenizer import load_tokenizer

LISTS = 'root ::= value\nvalue ::= "[" (value ("," value)*)? "]" | [0-9]+'
ARITHMETIC = '''root   ::= expr
                expr   ::= term (("+" | "-") term)*
                term   ::= factor ("*" factor)*
                factor ::= [0-9]+ | "(" expr ")" | "-" factor'''
TREE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}},
        "required": ["name", "children"]}
COMMENTS = {"$defs": {"comment": {"type": "object", "properties": {
                "text": {"type": "string", "maxLength": 8}, "score": {"type": "integer"},
                "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}, "maxItems": 2}},
                "required": ["text", "replies"]}},
            "type": "object", "properties": {"thread": {"$ref": "#/$defs/comment"}}, "required": ["thread"]}


def compiled(**constraint):
    return compile_pda(StructuredOutputsParams(**constraint).tree())


# ---------------------------------------------------------------- independent judges

def lists_depth(text: str) -> int | None:
    """Recursive descent for LISTS: the bracket depth of a match, None when the text does not match."""
    def value(at: int, depth: int) -> tuple[int, int] | None:
        if at < len(text) and text[at].isdigit():
            while at < len(text) and text[at].isdigit():
                at += 1
            return at, depth
        if at >= len(text) or text[at] != "[":
            return None
        at, deepest = at + 1, depth + 1
        if at < len(text) and text[at] == "]":
            return at + 1, deepest
        while True:
            found = value(at, depth + 1)
            if found is None:
                return None
            at, deepest = found[0], max(deepest, found[1])
            if at < len(text) and text[at] == "]":
                return at + 1, deepest
            if at >= len(text) or text[at] != ",":
                return None
            at += 1
    found = value(0, 0)
    return found[1] if found is not None and found[0] == len(text) else None


def arithmetic_ok(text: str) -> bool:
    """Recursive descent for ARITHMETIC."""
    def expr(at):
        at = term(at)
        while at is not None and at < len(text) and text[at] in "+-":
            at = term(at + 1)
        return at

    def term(at):
        at = factor(at)
        while at is not None and at < len(text) and text[at] == "*":
            at = factor(at + 1)
        return at

    def factor(at):
        if at < len(text) and text[at].isdigit():
            while at < len(text) and text[at].isdigit():
                at += 1
            return at
        if at < len(text) and text[at] == "-":
            return factor(at + 1)
        if at < len(text) and text[at] == "(":
            at = expr(at + 1)
            return at + 1 if at is not None and at < len(text) and text[at] == ")" else None
        return None
    return expr(0) == len(text)


def random_list(rng, depth: int) -> str:
    if depth == 0 or rng.random() < 0.2:
        return str(rng.integers(0, 100))
    return "[" + ",".join(random_list(rng, depth - 1) for _ in range(rng.integers(0, 4))) + "]"


def mutate(rng, text: str, alphabet: str) -> str:
    at = int(rng.integers(0, len(text) + 1))
    kind = rng.integers(0, 3)
    if kind == 0:
        return text[:at] + str(rng.choice(list(alphabet))) + text[at:]
    return text[:at] + text[at + 1:] if kind == 1 else text[:at] + str(rng.choice(list(alphabet))) + text[at + 1:]


def random_tree(rng, depth: int) -> dict:
    return {"name": "".join(rng.choice(list("abcé日 \"\\"), size=rng.integers(0, 7))),
            "children": [random_tree(rng, depth - 1) for _ in range(rng.integers(0, 4) if depth else 0)]}


# ---------------------------------------------------------------- the PDA against the judges

@pytest.mark.slow   # hundreds of nested outputs
def test_recursive_lists_match_at_any_depth(rng):
    """Nested lists of random depth up to 40, and their one-character mutations: the PDA matches exactly what
    the recursive-descent recogniser matches."""
    pda = compiled(grammar=LISTS)
    for _ in range(300):
        text = random_list(rng, int(rng.integers(0, 40)))
        assert matches(pda, text.encode()), text
        wrong = mutate(rng, text, "[],0")
        assert matches(pda, wrong.encode()) == (lists_depth(wrong) is not None), wrong
    deep = "[" * 100 + "7" + "]" * 100
    assert matches(pda, deep.encode()) and not matches(pda, deep[:-1].encode())


def test_mutually_recursive_rules_match_what_recursive_descent_matches(rng):
    pda = compiled(grammar=ARITHMETIC)
    alphabet = "0123456789+-*()"
    for _ in range(1500):
        text = "".join(rng.choice(list(alphabet), size=rng.integers(0, 12)))
        assert matches(pda, text.encode()) == arithmetic_ok(text), text
    assert matches(pda, ("(" * 60 + "1" + ")" * 60 + "*-(2+3)").encode())


def test_a_recursive_schema_matches_trees_of_any_depth(rng):
    """Trees written with json.dumps, compact and with its spaces, at random depths: they validate, so they must
    match; and what the PDA matches among mutations must validate (the jsonschema library judges)."""
    for schema in (TREE, {**TREE, "properties": {**TREE["properties"], "children": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}, "$defs": {"node": TREE}}):
        pda = compiled(json=schema)
        for _ in range(60):
            tree = random_tree(rng, int(rng.integers(0, 12)))
            if any(len(node["children"]) > 3 for node in walk_tree(tree)):
                continue
            for separators in ((",", ":"), (", ", ": ")):
                text = json.dumps(tree, ensure_ascii=False, separators=separators)
                assert matches(pda, text.encode()), text
                wrong = mutate(rng, text, '{}[],:" ab')
                if matches(pda, wrong.encode()):
                    jsonschema.validate(json.loads(wrong), TREE)


def walk_tree(tree: dict):
    yield tree
    for child in tree["children"]:
        yield from walk_tree(child)


def nesting(monkeypatch, depth: int) -> None:
    """A small MAX_NESTING, so that tests reach the bound."""
    monkeypatch.setattr(pda_module, "MAX_NESTING", depth)
    monkeypatch.setattr(token_pda_module, "MAX_NESTING", depth)


def test_the_nesting_bound_is_exact_and_leaves_only_closing(monkeypatch):
    """MAX_NESTING 5: five levels match, six do not; at the bound the mask allows "]" and no longer "[" (nor a
    number, which the called rule `value` would match one level deeper)."""
    nesting(monkeypatch, 5)
    pda = compiled(grammar=LISTS)
    assert matches(pda, b"[" * 5 + b"]" * 5) and not matches(pda, b"[" * 6 + b"]" * 6)
    assert matches(pda, b"[[[[[]],[1]]]]")
    token_pda = TokenPDA(pda, build_vocabulary([b"[", b"]", b"1", b","]))
    mask = token_pda.token_mask(walk(pda, token_pda.start, b"[[[["))
    assert mask.tolist() == [True, True, True, False]
    mask = token_pda.token_mask(walk(pda, token_pda.start, b"[[[[["))
    assert mask.tolist() == [False, True, False, False]


def test_a_hopelessly_ambiguous_grammar_is_stopped_by_name():
    """Every "x" can open either alternative: the ways to read x^n grow like Fibonacci numbers, and past
    MAX_STACKS the parser refuses instead of growing without limit."""
    pda = compiled(grammar='root ::= s\ns ::= "x" s "y" | "x" "x" s "z" | ""')
    assert len(walk(pda, initial(pda), b"x" * 5)) == 21
    with pytest.raises(TinyVLLMError, match="too ambiguous"):
        walk(pda, initial(pda), b"x" * 20)


# ---------------------------------------------------------------- token masks

def small_vocabulary(rng, pieces: list[str]):
    raw = [b"".join(rng.choice([p.encode() for p in pieces], size=rng.integers(1, 4))) for _ in range(400)]
    return build_vocabulary(raw + [bytes([b]) for b in range(256)] + [None])


def reachable_configs(token_pda: TokenPDA, rng, walks: int, steps: int, prefer: bytes):
    """Parser states along random token walks that prefer tokens holding `prefer` (to nest deeper)."""
    for _ in range(walks):
        config = token_pda.start
        for _ in range(steps):
            yield config
            allowed = np.flatnonzero(token_pda.token_mask(config))
            if not len(allowed):
                break
            deeper = [t for t in allowed if prefer in token_pda.vocab.tokens[t]]
            token = int(rng.choice(deeper if deeper and rng.random() < 0.7 else allowed))
            config = walk(token_pda.pda, config, token_pda.vocab.tokens[token])


@pytest.mark.parametrize("constraint, pieces, prefer", [
    (dict(grammar=LISTS), ["[", "]", ",", "1", "[[", "]]", "],", ",[", "1]", "[1", "12", "][", "[]"], b"["),
    (dict(grammar=ARITHMETIC), ["(", ")", "1", "+", "-", "*", "((", "))", ")*", "(-", "1)", "2+"], b"("),
    (dict(json=TREE), ['{"name":"', '"', 'ab', '","children":[', '{', '}', ']', '},', '}]', ', ', ':', ' ', '[{'], b"[{"),
], ids=["lists", "arithmetic", "tree"])
@pytest.mark.parametrize("depth", [4, pda_module.MAX_NESTING])
def test_a_mask_allows_exactly_the_tokens_the_pda_lets_through(constraint, pieces, prefer, depth, monkeypatch, rng):
    """Against brute force (every token's bytes fed through the PDA from the parser's state), in the states random
    walks reach, with the default bound and with one that the walks hit. And no dead ends: in every state some
    token continues, or the output is complete."""
    nesting(monkeypatch, depth)
    token_pda = TokenPDA(compiled(**constraint), small_vocabulary(rng, pieces))
    seen = 0
    for config in reachable_configs(token_pda, rng, walks=6, steps=40, prefer=prefer):
        expected = [data is not None and bool(walk(token_pda.pda, config, data)) for data in token_pda.vocab.tokens]
        assert token_pda.token_mask(config).tolist() == expected
        assert token_pda.token_mask(config).any() or token_pda.accepts(config), config
        seen = max(seen, max(len(stack) for stack in config))
    assert seen > 2, "the walks never nested"


@pytest.fixture(scope="module")
def smollm(default_model_dir):
    from tinyvllm.formats.config import load_config
    return StructuredOutputCompiler(load_tokenizer(default_model_dir).token_bytes, load_config(default_model_dir).vocab_size)


def test_only_a_recursive_constraint_takes_the_pushdown_automaton(smollm):
    """A grammar or schema that does not recurse stays on the DFA, whose masks are cached per state."""
    assert isinstance(smollm.compile(StructuredOutputsParams(grammar='root ::= "[" [0-9]* "]"')), TokenDFA)
    assert isinstance(smollm.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "array"}})), TokenDFA)
    assert isinstance(smollm.compile(StructuredOutputsParams(grammar=LISTS)), TokenPDA)
    assert isinstance(smollm.compile(StructuredOutputsParams(json=TREE)), TokenPDA)


def random_walk(constraint, rng, max_steps: int, brackets: bytes) -> tuple[bytes, bool, int]:
    """An adversarial writer over the real vocabulary: uniform over the allowed tokens, but 7 times in 10 one that
    opens a level (brackets[0]) in the first half of the walk, one that closes (brackets[1]) in the second.
    Returns the bytes, whether the output ended, and the deepest stack."""
    matcher, out, deepest = Matcher(constraint, {2}), b"", 0
    for step in range(max_steps):
        allowed = np.flatnonzero(matcher.allowed())
        assert len(allowed), out
        if matcher.accepting and (len(allowed) == 1 or step > max_steps // 2):
            return out, True, deepest
        regular = [t for t in allowed if t != 2]
        bracket = brackets[0] if step < max_steps // 2 else brackets[1]
        preferred = [t for t in regular if bytes([bracket]) in constraint.vocab.tokens[t]]
        token = int(rng.choice(preferred if preferred and rng.random() < 0.7 else regular))
        matcher.advance(token)
        out += constraint.vocab.tokens[token]
        deepest = max(deepest, max(len(stack) for stack in matcher.state))
        if matcher.must_stop():
            return out, True, deepest
    return out, False, deepest


@pytest.mark.parametrize("schema", [TREE, COMMENTS], ids=["tree", "comments"])
def test_random_walks_over_the_real_vocabulary_validate(schema, smollm, rng):
    token_pda = smollm.compile(StructuredOutputsParams(json=schema))
    finished, deepest = 0, 0
    for _ in range(6):
        text, done, depth = random_walk(token_pda, rng, 400, b"{}")
        deepest = max(deepest, depth)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text.decode()), schema)
    assert finished and deepest > 3


def test_random_walks_over_the_real_vocabulary_match_the_grammar(smollm, rng):
    token_pda = smollm.compile(StructuredOutputsParams(grammar=LISTS))
    deepest = 0
    for _ in range(6):
        text, done, depth = random_walk(token_pda, rng, 300, b"[]")
        deepest = max(deepest, depth)
        if done:
            assert lists_depth(text.decode()) is not None, text
    assert deepest > 3


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu")


def test_a_random_model_samples_valid_recursive_json(tiny, seed):
    """Sampling at temperature 1 under recursive schemas and a recursive grammar: every output that ends is valid
    (a random model may run out of max_tokens inside a tree that keeps growing: those are cut, and counted)."""
    constraints = [StructuredOutputsParams(json=TREE), StructuredOutputsParams(json=COMMENTS),
                   StructuredOutputsParams(grammar=LISTS)] * 3
    params = [SamplingParams(temperature=1.0, seed=seed + k, max_tokens=300, structured_outputs=c)
              for k, c in enumerate(constraints)]
    outputs = tiny.generate(["Answer:"] * len(params), params)
    stopped = [(c, out.text) for c, out in zip(constraints, outputs) if out.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= len(params) // 2, [out.outputs[0].finish_reason for out in outputs]
    for constraint, text in stopped:
        if constraint.grammar:
            assert lists_depth(text) is not None, text
        else:
            jsonschema.validate(json.loads(text), constraint.json)
