"""The request side of tool calling: tool definitions, tool_choice, and the JSON types a tool's schema
gives each parameter (spec/server.md §1.2, §1.5, §4.2). The parser in tool_calls.py uses the types.

- `ToolSet.from_openai(tools)` validates an OpenAI Chat Completions `tools` list and keeps each
  parameter's allowed JSON types; `anthropic_tools_to_openai` and `responses_tools_to_openai`
  convert the other APIs' lists first. Bad definitions raise `ToolRequestError` (a ValueError
  carrying the field at fault in `.param`): the server answers 400.
- `resolve_tool_choice(tool_choice, toolset)` gives a `ToolChoice` or raises `ToolRequestError`;
  `validate_tool_choice` returns the message instead (None when valid);
  `anthropic_tool_choice_to_openai` maps Anthropic's tool_choice first.
- `convert_value(raw, types)` types one raw parameter value (rules and fallback there).

Typing follows vLLM's engine parser: aliases of type names are accepted, `anyOf` / `oneOf` / `allOf`,
type lists, `enum` / `const` and `nullable` widen the allowed set, and local `$ref`s are resolved
(ReVolta 0.1.3 typed them as strings, a known issue there). Property schemas that are not objects
count as untyped rather than failing the request, as vLLM accepts them too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# Conversion order when a schema allows several types (vLLM's priority, spec/server.md §4.2).
TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


class ToolRequestError(ValueError):
    """Unusable `tools` or `tool_choice` in a request: the server answers 400 with this message.

    Attributes:
        param: the request field at fault, e.g. "tools[0].function.name" or "tool_choice".
    """

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


# Tool definitions and JSON-schema types


def canonical_type(name: str) -> str | None:
    """A schema `type` name (case-insensitive, with the aliases vLLM accepts) as one of TYPE_PRIORITY."""
    t = name.strip().lower()
    if t in ("string", "str", "text", "varchar", "char", "enum"):
        return "string"
    if t.startswith(("int", "uint")) or t in ("long", "short", "unsigned"):
        return "integer"
    if t.startswith(("num", "float")) or t == "double":
        return "number"
    if t in ("boolean", "bool", "binary"):
        return "boolean"
    if t == "object" or t.startswith("dict"):
        return "object"
    if t in ("array", "arr") or t.startswith("list"):
        return "array"
    if t == "null":
        return "null"
    return None


def _type_of_value(value: Any) -> str:
    """The JSON type of an `enum` / `const` value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _resolve_ref(root: Mapping[str, Any], ref: str) -> Any:
    """The target of a local JSON pointer `$ref` ("#/$defs/X") inside `root`, or None."""
    if not ref.startswith("#"):
        return None  # remote references are never fetched
    node: Any = root
    for raw in ref[1:].split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def schema_types(schema: Any, root: Mapping[str, Any], _seen: frozenset[str] = frozenset()) -> frozenset[str]:
    """The JSON types a parameter schema allows, from `type` (a name or a list), `anyOf` / `oneOf` /
    `allOf`, `enum` / `const` values, `nullable: true` and local `$ref`s (resolved against `root`,
    the tool's `parameters`; cycles stop). Empty when the schema says nothing usable."""
    if not isinstance(schema, Mapping):
        return frozenset()
    types: set[str] = set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in _seen:
        types |= schema_types(_resolve_ref(root, ref), root, _seen | {ref})
    declared = schema.get("type")
    for name in [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []:
        if isinstance(name, str) and (canonical := canonical_type(name)):
            types.add(canonical)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                types |= schema_types(sub, root, _seen)
    if isinstance(schema.get("enum"), list):
        types.update(_type_of_value(v) for v in schema["enum"])
    if "const" in schema:
        types.add(_type_of_value(schema["const"]))
    if schema.get("nullable") is True:
        types.add("null")
    return frozenset(types)


@dataclass(frozen=True)
class ToolSchema:
    """One tool's parameter types.

    Attributes:
        name: the function name.
        param_types: parameter name -> allowed JSON types (TYPE_PRIORITY names; empty = untyped).
        other_types: types for parameters not in `properties` (from `additionalProperties`).
    """

    name: str
    param_types: Mapping[str, frozenset[str]]
    other_types: frozenset[str] = frozenset()

    def types_of(self, param: str) -> frozenset[str]:
        """Allowed JSON types of `param` (empty: untyped, kept as a raw string)."""
        return self.param_types.get(param, self.other_types)

    @classmethod
    def from_parameters(cls, name: str, parameters: Mapping[str, Any]) -> ToolSchema:
        """Read a tool's `parameters` JSON schema. Malformed property schemas count as untyped: vLLM
        accepts them too, and they only cost typing, not the request."""
        props = parameters.get("properties")
        props = props if isinstance(props, Mapping) else {}
        types = {str(p): schema_types(s, parameters) for p, s in props.items()}
        extra = parameters.get("additionalProperties")
        return cls(name, MappingProxyType(types), schema_types(extra, parameters))


def _tool_entries(tools: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """A `tools` array as (field path, tool object) pairs; anything else is a ToolRequestError."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ToolRequestError("tools must be an array of tool definitions.", "tools")
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ToolRequestError(f"tools[{k}] must be an object, got {type(tool).__name__}.", f"tools[{k}]")
    return [(f"tools[{k}]", tool) for k, tool in enumerate(tools)]


@dataclass(frozen=True)
class ToolSet:
    """The request's tools by name (insertion order kept). Build it with `from_openai`.

    Attributes:
        tools: function name -> ToolSchema.
    """

    tools: Mapping[str, ToolSchema]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tools)

    def get(self, name: str) -> ToolSchema | None:
        return self.tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def __len__(self) -> int:
        return len(self.tools)

    @classmethod
    def from_openai(cls, tools: Sequence[Mapping[str, Any]] | None) -> ToolSet:
        """Validate an OpenAI Chat Completions `tools` list: [{"type": "function", "function":
        {"name", "description"?, "parameters"?, "strict"?}}]. None gives an empty set.

        Raises:
            ToolRequestError: `tools: []`, a non-list, a tool that is not a function tool, a missing
                or empty name, a repeated name, or `parameters` / `description` of the wrong type.
        """
        if tools is None:
            return cls(MappingProxyType({}))
        entries = _tool_entries(tools)
        if not entries:
            raise ToolRequestError("tools must not be an empty array; omit it to call no tools.", "tools")
        out: dict[str, ToolSchema] = {}
        for where, tool in entries:
            if tool.get("type", "function") != "function":
                raise ToolRequestError(
                    f"{where}.type must be 'function' (the only tool type served), got {tool.get('type')!r}.",
                    f"{where}.type",
                )
            fn = tool.get("function")
            if not isinstance(fn, Mapping):
                raise ToolRequestError(
                    f"{where}.function must be an object with a name, e.g. "
                    '{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}.',
                    f"{where}.function",
                )
            name = fn.get("name")
            if not isinstance(name, str) or not name.strip():
                raise ToolRequestError(f"{where}.function.name must be a non-empty string.", f"{where}.function.name")
            if name in out:
                raise ToolRequestError(
                    f"{where}.function.name {name!r} is already used by an earlier tool; tool names must be unique.",
                    f"{where}.function.name",
                )
            if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
                raise ToolRequestError(
                    f"{where}.function.description must be a string.", f"{where}.function.description"
                )
            params = fn.get("parameters")
            if params is None:
                params = {}
            if not isinstance(params, Mapping):
                raise ToolRequestError(
                    f"{where}.function.parameters must be a JSON Schema object such as "
                    f'{{"type": "object", "properties": {{...}}}}, got {type(params).__name__}.',
                    f"{where}.function.parameters",
                )
            out[name] = ToolSchema.from_parameters(name, params)
        return cls(MappingProxyType(out))


def anthropic_tools_to_openai(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic `tools` ([{name, description?, input_schema}]) as an OpenAI `tools` list, for
    `ToolSet.from_openai` and the chat template. A missing `input_schema.type` becomes "object"
    (spec/server.md §1.5).

    Raises:
        ToolRequestError: a non-list, a non-object tool, a server tool type (only custom tools are
            served), or `input_schema` that is not an object.
    """
    out = []
    for where, tool in _tool_entries(tools):
        if tool.get("type", "custom") not in ("custom", None):
            raise ToolRequestError(
                f"{where}.type {tool.get('type')!r} is a server tool, which this server does not run; "
                "send custom tools ({name, description, input_schema}).",
                f"{where}.type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"].strip():
            raise ToolRequestError(f"{where}.name must be a non-empty string.", f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise ToolRequestError(f"{where}.input_schema must be a JSON Schema object.", f"{where}.input_schema")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": {"type": "object", **schema}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def responses_tools_to_openai(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Responses API function tools ({"type": "function", "name", "description"?, "parameters"?,
    "strict"?}) as an OpenAI Chat Completions `tools` list.

    Raises:
        ToolRequestError: a non-list, a non-object tool, or a built-in tool type (web_search, ...).
    """
    out = []
    for where, tool in _tool_entries(tools):
        if tool.get("type") != "function":
            raise ToolRequestError(
                f"{where}.type must be 'function' (built-in tools are not served), got {tool.get('type')!r}.",
                f"{where}.type",
            )
        fn = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": fn})
    return out


# tool_choice


@dataclass(frozen=True)
class ToolChoice:
    """A validated tool_choice.

    Attributes:
        mode: "none" (do not parse calls), "auto", "required" (at least one call) or "named".
        name: the forced function for "named", else None.
    """

    mode: str
    name: str | None = None


def resolve_tool_choice(tool_choice: Any, tools: ToolSet | None) -> ToolChoice:
    """Check an OpenAI `tool_choice` against the request's tools (spec/server.md §1.2).

    Args:
        tool_choice: None (defaults to "auto" with tools, "none" without), "none" | "auto" |
            "required", {"type": "function", "function": {"name": N}} (Chat Completions) or
            {"type": "function", "name": N} (Responses).
        tools: the request's ToolSet, or None when the request has no `tools`.
    Raises:
        ToolRequestError (param "tool_choice"): a choice other than "none" without tools, an
            unknown string (e.g. Anthropic's "any"), a malformed object, or a name not in tools.
    """
    have_tools = tools is not None and len(tools) > 0
    if tool_choice is None:
        return ToolChoice("auto" if have_tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ToolRequestError(
                f"tool_choice {tool_choice!r} is not supported; use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        if not have_tools:
            raise ToolRequestError(
                f"tool_choice {tool_choice!r} needs tools; add tools or drop tool_choice.", "tool_choice"
            )
        return ToolChoice(tool_choice)
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ToolRequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError(
            'a named tool_choice needs the function name: {"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if not have_tools:
        raise ToolRequestError(f"tool_choice names {name!r} but the request has no tools.", "tool_choice")
    if name not in tools:
        known = ", ".join(repr(n) for n in tools.names)
        raise ToolRequestError(f"tool_choice names {name!r}, which is not in tools (tools: {known}).", "tool_choice")
    return ToolChoice("named", name)


def validate_tool_choice(tool_choice: Any, tools: ToolSet | None) -> str | None:
    """The error message `resolve_tool_choice` would raise, or None when the choice is valid."""
    try:
        resolve_tool_choice(tool_choice, tools)
    except ToolRequestError as e:
        return e.message
    return None


def anthropic_tool_choice_to_openai(tool_choice: Mapping[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic `tool_choice` as (OpenAI tool_choice, parallel_tool_calls): auto -> "auto",
    any -> "required", tool -> named, none -> "none"; `disable_parallel_tool_use: true` gives
    parallel_tool_calls False (None when not set). None maps to (None, None).

    Raises:
        ToolRequestError (param "tool_choice"): an unknown type, or type "tool" without a name.
    """
    if tool_choice is None:
        return None, None
    if not isinstance(tool_choice, Mapping):
        raise ToolRequestError('tool_choice must be an object such as {"type": "auto"}.', "tool_choice")
    kind = tool_choice.get("type")
    parallel = False if tool_choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError('tool_choice type "tool" needs a "name".', "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise ToolRequestError(
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}.", "tool_choice"
    )


# Typing parameter values


_INT_RE = re.compile(r"[+-]?[0-9]+\Z")
_NUMBER_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _as_null(text: str) -> tuple[bool, Any]:
    # "None" too: the chat template renders a Python None argument with `| string`.
    return text.lower() in ("null", "none"), None


def _as_number(text: str) -> tuple[bool, Any]:
    """A finite number; integral values become ints ("3.0" -> 3), as both vLLM parsers do."""
    if _INT_RE.match(text):
        try:
            return True, int(text)
        except ValueError:  # past Python's int-digits limit
            return False, None
    if not _NUMBER_RE.match(text):
        return False, None
    value = float(text)
    if not math.isfinite(value):
        return False, None
    return True, int(value) if value.is_integer() else value


def _as_integer(text: str) -> tuple[bool, Any]:
    ok, value = _as_number(text)
    return (True, value) if ok and isinstance(value, int) else (False, None)


def _as_boolean(text: str) -> tuple[bool, Any]:
    lowered = text.lower()
    if lowered in ("true", "1"):
        return True, True
    if lowered in ("false", "0"):
        return True, False
    return False, None


def _as_json(text: str, kind: type) -> tuple[bool, Any]:
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return False, None
    return isinstance(value, kind), value


_CONVERTERS: dict[str, Callable[[str], tuple[bool, Any]]] = {
    "null": _as_null,
    "integer": _as_integer,
    "number": _as_number,
    "boolean": _as_boolean,
    "object": lambda text: _as_json(text, dict),
    "array": lambda text: _as_json(text, list),
}


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """The JSON value of one parameter's raw text, given the types its schema allows.

    Untyped or string-only parameters keep the raw text. Otherwise the allowed types are tried in
    TYPE_PRIORITY order on the stripped text: null (`null` or `None`, any case), integer (digits, or an
    integral number such as `3.0`), number (finite; integral values become ints), boolean
    (`true`/`1`, `false`/`0`, any case), object / array (JSON, finite numbers only, of that
    kind), string (raw). Fallback: when no allowed type accepts the text, the raw string is kept,
    so nothing the model wrote is lost; the caller's schema check (if any) sees the mismatch.
    """
    if types <= {"string"}:
        return raw
    text = raw.strip()
    for kind in TYPE_PRIORITY:
        if kind in types and kind != "string":
            ok, value = _CONVERTERS[kind](text)
            if ok:
                return value
    return raw
