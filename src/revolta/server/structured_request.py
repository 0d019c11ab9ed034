"""Request fields -> StructuredOutputsParams (structured.py), with every mistake a 400 naming its field.

Chat Completions: `response_format` ({"type": "text" | "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"?}}), vLLM's `structured_outputs` extra ({"json" | "regex" |
"choice" | "grammar" | "json_object": ..., "disable_any_whitespace"?}) and the legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` extras; at most one of them. Responses: `text.format`
({"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict"?}).
`--structured-outputs-config '{"disable_any_whitespace": true}'` sets the whitespace default (vLLM's flag).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..engine.structured import StructuredOutputError, StructuredOutputsParams
from .errors import bad_request

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SPEC_FIELDS = frozenset(f.name for f in fields(StructuredOutputsParams))


def _build(where: str | None, disable_any_whitespace: bool, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), checked without a tokenizer. An error names `where` (the request
    field), or the structured_outputs.<kind> field when `where` is None."""
    kwargs.setdefault("disable_any_whitespace", disable_any_whitespace)
    try:
        spec = StructuredOutputsParams(**kwargs)
        spec.check()
    except StructuredOutputError as e:
        if where is None:
            raise bad_request(e.message, e.param) from None
        raise bad_request(e.message.replace(e.param or "", where, 1) if e.param else e.message, where) from None
    return spec


def _schema_format(fmt: Mapping[str, Any], where: str, disable_any_whitespace: bool) -> StructuredOutputsParams | None:
    """{"type": "text" | "json_object" | "json_schema", ...}; the json_schema body sits at `fmt[schema_key]`."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build(where, disable_any_whitespace, json_object=True)
    if kind != "json_schema":
        raise bad_request(f"{where}.type must be text, json_object or json_schema, got {kind!r}", f"{where}.type")
    return None  # the caller reads the schema (its place differs between Chat and Responses)


def from_chat(body: Mapping[str, Any], disable_any_whitespace: bool = False) -> StructuredOutputsParams | None:
    """The constraint of a Chat Completions body (a model_dump with extras), or None."""
    sources = [name for name in ("response_format", "structured_outputs", *_LEGACY) if body.get(name) is not None]
    sources = [s for s in sources if not (s == "response_format" and isinstance(body[s], Mapping)
                                          and body[s].get("type", "text") == "text")]  # not an object: 400 below
    if len(sources) > 1:
        raise bad_request(f"give at most one of {', '.join(sources)}: each sets the output's structure", sources[1])
    if not sources:
        return None
    source = sources[0]
    value = body[source]
    if source == "response_format":
        if not isinstance(value, Mapping):
            raise bad_request("response_format must be an object such as {\"type\": \"json_object\"}",
                              "response_format")
        spec = _schema_format(value, "response_format", disable_any_whitespace)
        if spec is not None or value.get("type") != "json_schema":
            return spec
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping):
            raise bad_request("response_format of type json_schema needs a json_schema object: "
                              "{\"name\": ..., \"schema\": {...}}", "response_format.json_schema")
        return _json_schema(inner.get("schema"), "response_format.json_schema.schema", disable_any_whitespace)
    if source == "structured_outputs":
        if not isinstance(value, Mapping):
            raise bad_request("structured_outputs must be an object such as {\"json\": {...schema...}}",
                              "structured_outputs")
        unknown = sorted(set(value) - _SPEC_FIELDS)
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; use {sorted(_SPEC_FIELDS)}",
                              "structured_outputs")
        return _build(None, disable_any_whitespace, **dict(value))
    return _build(source, disable_any_whitespace, **{_LEGACY[source]: value})


def from_responses(text: Mapping[str, Any] | None,
                   disable_any_whitespace: bool = False) -> StructuredOutputsParams | None:
    """The constraint of a Responses `text` field, or None."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad_request("text.format must be an object such as {\"type\": \"json_schema\", ...}", "text.format")
    spec = _schema_format(fmt, "text.format", disable_any_whitespace)
    if spec is not None or fmt.get("type", "text") != "json_schema":
        return spec
    return _json_schema(fmt.get("schema"), "text.format.schema", disable_any_whitespace)


def _json_schema(schema: Any, where: str, disable_any_whitespace: bool) -> StructuredOutputsParams:
    if not isinstance(schema, Mapping):
        raise bad_request(f"{where} must be a JSON schema object", where)
    return _build(where, disable_any_whitespace, json=schema)


def check_tool_choice(spec: StructuredOutputsParams | None, tool_choice_mode: str, forced: bool) -> None:
    """A forced tool call already fixes the output's structure; a second constraint on it is a 400."""
    if spec is not None and forced:
        raise bad_request(f"tool_choice {tool_choice_mode!r} already fixes the output's structure; drop the "
                          "structured output (response_format / text.format / structured_outputs) or use "
                          "tool_choice 'auto'", "tool_choice")
