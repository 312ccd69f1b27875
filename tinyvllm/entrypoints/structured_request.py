"""Chapter 11: a request's structured-output fields -> vLLM's StructuredOutputsParams.

Two ways to ask, as with vLLM's server:
    response_format      (OpenAI)  {"type": "text"} | {"type": "json_object"}
                                   | {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    structured_outputs   (vLLM's extra field)  {"json": ...} | {"regex": ...} | {"choice": [...]}
                                   | {"grammar": ...} | {"json_object": true}
A bad one (a schema keyword tinyvllm does not honour, a regex that does not parse) raises TinyVLLMError,
whose message names the problem; the protocol turns it into a 400 naming the field.
"""
from __future__ import annotations

from tinyvllm.engine.structured.params import KINDS, StructuredOutputsParams
from tinyvllm.errors import TinyVLLMError

JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# each kind's value, as JSON: the OpenAPI schema publishes these shapes (what they say is the compiler's to check)
KIND_SCHEMAS = {"json": {"type": ["object", "string", "boolean"]}, "regex": {"type": "string"},
                "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "grammar": {"type": "string"}, "json_object": {"const": True}}
STRUCTURED_OUTPUTS_SCHEMA = {"oneOf": [{"type": "null"}] + [
    {"type": "object", "properties": {kind: schema}, "required": [kind], "additionalProperties": False}
    for kind, schema in KIND_SCHEMAS.items()]}
RESPONSE_FORMAT_SCHEMA = {"oneOf": [
    {"type": "null"},
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"],
     "additionalProperties": False},
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
     "properties": {"type": {"const": "json_schema"}, "json_schema": {
         "type": "object", "required": ["name"], "additionalProperties": False,
         "properties": {"name": {"type": "string"}, "schema": {"type": ["object", "boolean"]},
                        "strict": {"type": ["boolean", "null"]}, "description": {"type": "string"}}}}}]}


def from_response_format(value: dict) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or set(spec) - JSON_SCHEMA_KEYS:
            raise TinyVLLMError(f"json_schema must be an object with a name, a schema and optionally strict and "
                                f"description, got {spec!r:.80}")
        return StructuredOutputsParams(json=spec.get("schema", {}))
    raise TinyVLLMError('must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                        f'"json_schema": {{"name": ..., "schema": ...}}}}, got {value!r:.80}')


def from_structured_outputs(value: dict) -> StructuredOutputsParams:
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise TinyVLLMError(f"{unknown[0]!r} is not supported; give one of {', '.join(KINDS)}")
    for kind, given in value.items():
        if given is not None and not of_json_type(given, KIND_SCHEMAS[kind]):
            raise TinyVLLMError(f"{kind} must be {KIND_SCHEMAS[kind]}, got {given!r:.60}")
    return StructuredOutputsParams(**value)


def of_json_type(value, schema: dict) -> bool:
    """Whether a JSON value has the shape KIND_SCHEMAS gives (a bool is no number, as in JSON Schema)."""
    if "const" in schema:
        return value is schema["const"]
    types = {"object": dict, "string": str, "boolean": bool, "array": list}
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not isinstance(value, tuple(types[k] for k in kinds)):
        return False
    return not isinstance(value, list) or (len(value) >= 1 and all(isinstance(v, str) for v in value))


def structured_params(response_format: dict | None, structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """The request's constraint, or None (free text)."""
    if structured_outputs is not None:
        return from_structured_outputs(structured_outputs)
    return None if response_format is None else from_response_format(response_format)
