"""Chapter 11: what a request asks of its output's shape — vLLM's StructuredOutputsParams.

Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (a list of strings), grammar
(a small EBNF, grammar.py) or json_object=True (any JSON object). It is checked when the request arrives:
the constraint is parsed into its regex tree (a Grammar of rules when it is recursive), so a bad schema or an
unsupported keyword is refused at once, by name. The engine compiles the tree into a token automaton
(compiler.py), once per distinct constraint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tinyvllm.engine.structured.grammar import grammar_tree
from tinyvllm.engine.structured.json_schema import any_json_object, schema_tree
from tinyvllm.engine.structured.pda import check_grammar
from tinyvllm.engine.structured.regex_ast import Grammar, Node, alt, literal
from tinyvllm.engine.structured.regex_parser import parse_regex
from tinyvllm.errors import TinyVLLMError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: dict | str | bool | None = None     # a JSON schema
    regex: str | None = None                  # the whole output must match it
    choice: list[str] | None = None           # the output is one of these strings
    grammar: str | None = None                # a small EBNF grammar (grammar.py)
    json_object: bool | None = None           # any JSON object

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise TinyVLLMError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                                f"{', '.join(given) or 'none'}")
        if self.json_object not in (None, True, False):
            raise TinyVLLMError(f"structured_outputs.json_object must be true or false, got {self.json_object!r:.40}")
        tree = self.tree()   # parse now: a bad constraint is the request's mistake, refused before it is queued
        if isinstance(tree, Grammar):
            check_grammar(tree)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def tree(self) -> Node | Grammar:
        """The constraint as a regex tree over bytes; a Grammar of rules when a grammar rule or a $ref is
        recursive (the pushdown automaton's input)."""
        if self.kind == "json":
            return schema_tree(self.json)
        if self.kind == "regex":
            return parse_regex(self.regex)
        if self.kind == "choice":
            return choice_tree(self.choice)
        if self.kind == "grammar":
            return grammar_tree(self.grammar)
        return any_json_object()

    def key(self) -> str:
        """The same constraint, the same key: what the engine's compiled-automaton cache is keyed by."""
        return json.dumps([self.kind, getattr(self, self.kind)], sort_keys=True)


def choice_tree(choice) -> Node:
    if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
        raise TinyVLLMError(f"structured_outputs.choice must be a non-empty list of strings, got {choice!r:.80}")
    return alt(*(literal(c) for c in choice))
