"""Chapter 11 exercises: a regex tree to a DFA, one DFA state's token mask, a JSON-schema object to a regex tree.

All three are Python/NumPy on the host and graded on the CPU. Fill them in, then:

    make grade CH=11                  # the graders: a score table
    make chapter-11 IMPL=student      # the chapter's checkpoint, the engine running on your three functions
    .venv/bin/python -m pytest tests/test_ch11_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces the names the engine calls them by: compile_dfa in
tinyvllm.engine.structured.compiler (every constraint's automaton), token_states in
tinyvllm.engine.structured.token_dfa (every state's token mask) and schema_tree in
tinyvllm.engine.structured.params (every JSON schema). Your schema_tree only has to handle the subset of
Exercise 11.3, which is what the checkpoint asks for.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.structured.dfa import DEAD, DFA  # noqa: F401  (for your solution)
from tinyvllm.engine.structured.json_schema import INTEGER, STRING_CHAR  # noqa: F401  (for your solution)
from tinyvllm.engine.structured.regex_ast import (  # noqa: F401  (for your solution)
    EMPTY, Alt, ByteSet, Node, Repeat, Seq, alt, literal, optional, seq)
from tinyvllm.engine.structured.vocabulary import Vocabulary
from tinyvllm.errors import TinyVLLMError  # noqa: F401  (for your solution)

REFERENCE = {
    "compile_dfa": "tinyvllm.engine.structured.compiler:compile_dfa",
    "token_states": "tinyvllm.engine.structured.token_dfa:token_states",
    "schema_tree": "tinyvllm.engine.structured.params:schema_tree",
}


def compile_dfa(tree: Node) -> DFA:
    """The deterministic automaton over BYTES of a regex tree: Thompson's NFA, then subset construction.

    Exercise 11.1. `tree` is what tinyvllm.engine.structured.regex_parser.parse_regex makes of a regex
    (Python's own parser reads the syntax; the tree is over UTF-8 bytes), built of four node kinds
    (tinyvllm/engine/structured/regex_ast.py):
      ByteSet(values)                  one byte out of the frozenset `values` ([a-z] is one ByteSet; é is
                                       a Seq of two ByteSets, its two UTF-8 bytes)
      Seq(items)                       each item in turn; Seq(()) is the empty string
      Alt(items)                       any one of the items (a|b|c)
      Repeat(item, low, high, separator)   item from low to high times (high None: no limit), with the
                                       separator node between two copies when separator is not None.
                                       x* is Repeat(x, 0, None), x+ Repeat(x, 1, None), x? Repeat(x, 0, 1),
                                       x{2,3} Repeat(x, 2, 3); JSON's lists use the separator (", ").
    1. Thompson: give every node a fragment (entry state, exit state) joined by empty moves; a byte move is
       labelled with a set of bytes. 2. Subset construction: a DFA state is the set of NFA states the input
       so far can have reached (closed under empty moves); follow each byte 0..255 from each set.
    Return DFA(transitions, accepting, start) with
      transitions  (states, 256) integer array: the next state for each byte
      accepting    (states,) bool: whether the input so far matches the whole regex
      start        the state before any byte
    and this convention, which the token masks rely on: state DEAD (= 0) is the state with no way to a
    match; its row is all DEAD, and every byte after which no match is possible any more leads to DEAD
    (the empty set of NFA states is such a state; number it 0). Every other state must have a way to an
    accepting state. Merging equivalent states (minimisation) is not required.
    """
    raise NotImplementedError("Exercise 11.1: compile_dfa")


def token_states(vocab: Vocabulary, transitions: np.ndarray, state: int, dead: int) -> np.ndarray:
    """The DFA's state after each token's bytes, fed from `state`: the mask is this != dead.

    Exercise 11.2. A model emits tokens, not bytes, and a token's bytes may hold part of a UTF-8 character
    (b"\\xe6\\x97" is the first two bytes of 日). Token i may come next exactly when walking its bytes
    vocab.tokens[i] through `transitions` ((states, 256) integers, as in 11.1) from `state` never reaches
    `dead` (dead's row leads only to dead, so "never" is "not at the end").
    Return a (vocab.size,) integer array: entry i is the state after token i's bytes, and `dead` for a token
    without bytes (vocab.tokens[i] is None: a special token such as EOS; the engine allows those itself).
    A loop over vocab.tokens is right, and slow on a 49,152-token vocabulary (the engine computes each state
    once and caches it). Faster: vocab is also a trie of the byte strings, laid out level by level
    (tinyvllm/engine/structured/vocabulary.py): node 0 is the empty prefix, vocab.levels[d - 1] is the slice
    of the nodes of depth d, vocab.parent[n] the node one byte shorter, vocab.byte[n] the last byte, and
    vocab.token_node[i] token i's node; one gather per depth computes every node's state.
    Do not change `transitions`.
    """
    raise NotImplementedError("Exercise 11.2: token_states")


def schema_tree(schema: dict) -> Node:
    """The regex tree of the JSON texts that validate against an object schema of the subset agents use.

    Exercise 11.3. `schema` is {"type": "object", "properties": {name: property schema, ...}, "required":
    [names]} (required may be missing: none), each property schema {"type": "string"} (optionally with
    "maxLength": n), {"type": "integer"} or {"type": "boolean"}. Build the tree (regex_ast: literal, seq,
    alt, optional, Repeat; json_schema.STRING_CHAR is one JSON string character, maybe escaped, and
    json_schema.INTEGER a JSON integer) of texts:
      - `{`, then the properties present IN THE SCHEMA'S ORDER, each `"name":value` (the name as
        json.dumps(name, ensure_ascii=False) writes it), separated by commas, then `}`;
      - every required property present; each optional one may be left out, and then so is its comma
        (no `{,"b":1}`, no `{"a":1,}`, no `{"a":1"b":2}`);
      - a string value is `"`, up to maxLength (any number without one) STRING_CHARs, `"`; an integer is
        INTEGER; a boolean is true or false;
      - one optional space " " after `{`, before and after each `:` and `,`, and before `}` (so both
        json.dumps(obj, separators=(",", ":")) and json.dumps(obj) of a valid object in schema order match).
    Every text the tree matches must be JSON that validates against the schema (the grader checks with the
    jsonschema library). Raise TinyVLLMError (one line) for a schema outside this subset.
    """
    raise NotImplementedError("Exercise 11.3: schema_tree")
