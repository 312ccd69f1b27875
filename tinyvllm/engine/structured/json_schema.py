"""Chapter 11: a JSON schema (the subset agents use) -> a regex tree, so the output is JSON that validates.

Why a regular expression, when JSON nests? Because a schema that does not refer to itself nests to a
fixed depth: an object of arrays of objects is a regular language, and its DFA masks are cached per state.
What nests without limit is not regular: it needs a stack (a pushdown automaton, pda.py).
  - A $ref to a schema it is inside of (a tree node whose children are nodes) is kept exact: that
    reference becomes a Call, the referenced schema a rule of its own, and schema_tree returns a Grammar
    of rules for the pushdown automaton. Any depth is allowed (up to pda.MAX_NESTING rules open).
  - "Any JSON value" (json_object mode, {}, an object without properties, an array without items) stays
    regular: it is cut at ANY_JSON_DEPTH levels of nesting, as outlines does. The DFA remembers the open
    brackets in its states (a bounded stack, spelled out), and its masks are cached per state.

Layout: one optional space wherever JSON allows whitespace (what models write, and bounded: a model cannot
fill the output with blanks). Objects list their properties in the schema's order; required ones always,
optional ones may be left out. Keywords this compiler does not honour are refused by name.
"""
from __future__ import annotations

import json

from tinyvllm.engine.structured.regex_ast import EMPTY, Call, Grammar, Node, Repeat, alt, literal, optional, seq
from tinyvllm.engine.structured.regex_parser import parse_regex
from tinyvllm.errors import TinyVLLMError

ANY_JSON_DEPTH = 3                # nesting levels of brackets where the schema leaves the value free
WHITESPACE = optional(literal(" "))
STRING_CHAR = parse_regex(r'[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}')   # one character, maybe escaped
INTEGER = parse_regex(r"-?(0|[1-9][0-9]*)")
NUMBER = parse_regex(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
FORMATS = {"date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "time": r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})?",
           "date-time": r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})",
           "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions"}   # they say nothing about which text is valid
KEYWORDS = {                      # what each type honours, besides type, enum, const, anyOf, $ref
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
}
SCALARS = {"integer": INTEGER, "number": NUMBER, "boolean": alt(literal("true"), literal("false")),
           "null": literal("null")}


def schema_tree(schema: dict | bool | str) -> Node | Grammar:
    """The regex tree of the JSON texts that validate against `schema` (a dict, or its JSON text); a Grammar
    (rules[0] the whole schema) when a $ref is recursive."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise TinyVLLMError(f"the JSON schema is not valid JSON: {e}") from None
    compiler = SchemaCompiler(schema)
    rules = [compiler.tree(schema, "schema")]
    if not compiler.recursive:
        return rules[0]
    while len(rules) < len(compiler.called):   # each $ref reached recursively is a rule; one may call more
        rules.append(compiler.rule(compiler.called[len(rules)]))
    return Grammar(tuple(rules), tuple(compiler.called))


def any_json_object() -> Node:
    """json_object mode: any JSON object (nesting cut at ANY_JSON_DEPTH)."""
    return any_object(ANY_JSON_DEPTH)


class SchemaCompiler:
    def __init__(self, root):
        self.root = root
        self.refs_open = ["#"]                # the $refs being expanded: one seen again is recursion ("#": all)
        self.called = ["#"]                   # the recursive $refs: Call(i) matches called[i]'s schema, 0 the root
        self.recursive = False

    def rule(self, ref: str) -> Node:
        """The tree of a recursive $ref's schema, compiled on its own (its own reference inside: a Call)."""
        self.refs_open = ["#", ref]
        return self.tree(self.resolve(ref, ref), ref)

    def tree(self, schema, where: str) -> Node:
        if schema is True or schema == {}:
            return any_value(ANY_JSON_DEPTH)
        if not isinstance(schema, dict):
            raise TinyVLLMError(f"the JSON schema at {where} must be an object or true, got {schema!r:.60}")
        if "$ref" in schema:
            return self.reference(schema, where)
        if "anyOf" in schema:
            return self.any_of(schema, where)
        for key in ("enum", "const"):
            if key in schema:
                return self.constants(schema, key, where)
        types = schema.get("type", self.implied_type(schema))
        if types is None:
            self.check_keywords(schema, set(), where)
            return any_value(ANY_JSON_DEPTH)
        types = types if isinstance(types, list) else [types]
        bad = next((t for t in types if t not in KEYWORDS), None)
        if bad is not None or not types:
            raise TinyVLLMError(f"the JSON schema at {where}: type {bad!r} is not one of {sorted(KEYWORDS)}")
        self.check_keywords(schema, set().union(*(KEYWORDS[t] for t in types)), where)
        return alt(*(self.typed(schema, t, where) for t in types))

    def check_keywords(self, schema: dict, allowed: set[str], where: str) -> None:
        unknown = sorted(set(schema) - allowed - ANNOTATIONS - {"type"})
        if unknown:
            raise TinyVLLMError(f"the JSON schema at {where}: the keyword {unknown[0]!r} is not supported for structured "
                                "outputs; remove it")

    @staticmethod
    def implied_type(schema: dict) -> str | None:
        return "object" if "properties" in schema else "array" if "items" in schema else None

    def typed(self, schema: dict, type_: str, where: str) -> Node:
        if type_ == "object":
            return self.object(schema, where)
        if type_ == "array":
            return self.array(schema, where)
        if type_ == "string":
            return self.string(schema, where)
        return SCALARS[type_]

    def reference(self, schema: dict, where: str) -> Node:
        ref = schema["$ref"]
        self.check_keywords(schema, {"$ref"}, where)
        if ref in self.refs_open:             # recursion: a call of the rule the pushdown automaton keeps for it
            self.recursive = True
            if ref not in self.called:
                self.called.append(ref)
            return Call(self.called.index(ref))
        self.refs_open.append(ref)
        try:
            return self.tree(self.resolve(ref, where), ref)
        finally:
            self.refs_open.pop()

    def resolve(self, ref, where: str):
        """A local $ref: "#", "#/$defs/name", "#/definitions/name" (any JSON pointer into this schema)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise TinyVLLMError(f"the JSON schema at {where}: $ref {ref!r:.60} is not local (\"#/...\"); only "
                                "references inside the schema are supported")
        target = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise TinyVLLMError(f"the JSON schema at {where}: $ref {ref!r} points to nothing")
            target = target[part]
        return target

    def any_of(self, schema: dict, where: str) -> Node:
        self.check_keywords(schema, {"anyOf"}, where)
        options = schema["anyOf"]
        if not isinstance(options, list) or not options:
            raise TinyVLLMError(f"the JSON schema at {where}: anyOf must be a non-empty list of schemas")
        return alt(*(self.tree(option, f"{where}.anyOf[{i}]") for i, option in enumerate(options)))

    def constants(self, schema: dict, key: str, where: str) -> Node:
        self.check_keywords(schema, {key} | set(KEYWORDS) | set().union(*KEYWORDS.values()), where)
        values = schema[key] if key == "enum" else [schema[key]]
        if not isinstance(values, list) or not values:
            raise TinyVLLMError(f"the JSON schema at {where}: enum must be a non-empty list")
        return alt(*(literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in values))

    def object(self, schema: dict, where: str) -> Node:
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties", True)
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise TinyVLLMError(f"the JSON schema at {where}: properties must be an object and required a list")
        missing = [name for name in required if name not in properties]
        if missing:
            raise TinyVLLMError(f"the JSON schema at {where}: required property {missing[0]!r} is not in properties")
        if not properties:    # no properties named: a map of extra ones, or any object, or {}
            if isinstance(extra, dict):
                return listing("{", seq(string_of(STRING_CHAR, 0, None), WHITESPACE, literal(":"), WHITESPACE,
                                        self.tree(extra, f"{where}.additionalProperties")), "}")
            return any_object(ANY_JSON_DEPTH) if extra is not False else literal("{}")
        members = [(seq(literal(json.dumps(name, ensure_ascii=False)), WHITESPACE, literal(":"), WHITESPACE,
                        self.tree(sub, f"{where}.properties.{name}")), name in required)
                   for name, sub in properties.items()]
        return seq(literal("{"), WHITESPACE, members_tree(members), WHITESPACE, literal("}"))

    def array(self, schema: dict, where: str) -> Node:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        check_bounds(low, high, "minItems", "maxItems", where)
        items = schema.get("items", True)
        item = any_value(ANY_JSON_DEPTH) if items is True else self.tree(items, f"{where}.items")
        return listing("[", item, "]", low, high)

    def string(self, schema: dict, where: str) -> Node:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        check_bounds(low, high, "minLength", "maxLength", where)
        if "pattern" in schema or "format" in schema:
            if low or high is not None or ("pattern" in schema and "format" in schema):
                raise TinyVLLMError(f"the JSON schema at {where}: pattern or format cannot be combined with "
                                    "minLength, maxLength or each other")
            if "format" in schema and schema["format"] not in FORMATS:
                raise TinyVLLMError(f"the JSON schema at {where}: format {schema['format']!r:.40} is not supported; "
                                    f"supported: {sorted(FORMATS)}")
            pattern = schema["pattern"] if "pattern" in schema else FORMATS[schema["format"]]
            return seq(literal('"'), parse_regex(pattern), literal('"'))   # a JSON pattern is read as a fullmatch
        return string_of(STRING_CHAR, low, high)


def check_bounds(low, high, low_name: str, high_name: str, where: str) -> None:
    if not (isinstance(low, int) and low >= 0 and (high is None or isinstance(high, int) and high >= low)):
        raise TinyVLLMError(f"the JSON schema at {where}: {low_name} and {high_name} must be integers, "
                            f"0 <= {low_name} <= {high_name}")


def string_of(char: Node, low: int, high: int | None) -> Node:
    return seq(literal('"'), Repeat(char, low, high), literal('"'))


def members_tree(members: list[tuple[Node, bool]], after_first: bool = False) -> Node:
    """The properties in order, each (its "key": value tree, required), commas between those present."""
    if not members:
        return EMPTY
    (member, required), rest = members[0], members[1:]
    present = seq(seq(WHITESPACE, literal(","), WHITESPACE, member) if after_first else member,
                  members_tree(rest, True))
    if required:
        return present
    if after_first:                         # a comma is needed either way: the choice is only this member
        return seq(optional(seq(WHITESPACE, literal(","), WHITESPACE, member)), members_tree(rest, True))
    return alt(present, members_tree(rest, False))


def listing(open_: str, item: Node, close: str, low: int = 0, high: int | None = None) -> Node:
    """open item , item , ... close: from low to high items (high None: any number)."""
    comma = seq(WHITESPACE, literal(","), WHITESPACE)
    return seq(literal(open_), WHITESPACE, Repeat(item, low, high, comma), WHITESPACE, literal(close))


def any_value(depth: int) -> Node:
    """Any JSON value with at most `depth` levels of brackets."""
    scalars = [string_of(STRING_CHAR, 0, None), NUMBER, *SCALARS.values()]
    if depth == 0:
        return alt(*scalars)
    return alt(*scalars, any_object(depth), listing("[", any_value(depth - 1), "]"))


def any_object(depth: int) -> Node:
    key = seq(string_of(STRING_CHAR, 0, None), WHITESPACE, literal(":"), WHITESPACE)
    return listing("{", seq(key, any_value(depth - 1)), "}")
