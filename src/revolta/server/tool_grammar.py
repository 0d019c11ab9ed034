"""tool_choice "required" / named as a grammar over the qwen3_coder call format (spec/server.md §4.2).

The prompt already ends with the opening of the call (`ToolSetup.forced_prefix`: `<tool_call>\\n<function=`
for required, `<tool_call>\\n<function=NAME>\\n` for a named tool), so the output parser reads the call
the same way in streaming and non-streaming mode. This module constrains the rest of the output: a
tool name from the request (required), its parameter blocks as its JSON schema allows (the chat
template's framing `<parameter=NAME>\\nVALUE\\n</parameter>\\n`, declared order, required ones present:
a string raw, an enum one of its values, a boolean true / True / false / False, anything else JSON
valid against its schema), the close
`</function>\\n</tool_call>`, then, for required with parallel calls, more whole calls, and the end of the
turn. The result is an xgrammar structural tag for `StructuredOutputsParams(structural_tag=...)`.
Without xgrammar the opening alone forces the call, as before. A tool schema xgrammar cannot compile
is a 400 naming the tool (as vLLM validates tool schemas): the opening alone let the model write a
tool name that does not exist, and the answer came back as plain text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..engine.structured import (
    INSTALL_HINT,
    StructuredOutputError,
    StructuredOutputsParams,
)
from .chat_prompt import CALL_OPEN, ToolSetup
from .errors import bad_request
from .tool_schema import _resolve_ref, schema_types

logger = logging.getLogger(__name__)

CALL_CLOSE = "</function>\n</tool_call>"  # after the last parameter block's own "\n"
BOOLEANS = ("true", "false", "True", "False")
PARAMETER_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"
COMPACT_WHITESPACE = 1  # with --structured-outputs-config disable_any_whitespace: inside JSON values


def _value(schema: Any, root: dict[str, Any], compact: bool) -> dict[str, Any]:
    """The format of one parameter's value as the template writes it: a string raw, anything else as JSON."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        schema = _resolve_ref(root, schema["$ref"]) or {}
    if not isinstance(schema, dict):
        return {"type": "any_text"}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return {"type": "or", "elements": [{"type": "const_string", "value": v if isinstance(v, str) else json.dumps(v)}
                                           for v in enum]}
    types = schema_types(schema, root)
    if "string" in types:  # raw text (the parser coerces the other types it allows)
        return {"type": "any_text"}
    if types == {"boolean"}:  # the template writes Python's True / False; JSON's spelling parses too
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in BOOLEANS]}
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    return {"type": "json_schema", "json_schema": {**schema, **defs}, "style": "json",
            "max_whitespace_cnt": COMPACT_WHITESPACE if compact else None}


def _arguments(tool: dict[str, Any], compact: bool) -> dict[str, Any]:
    """`<parameter=NAME>\\nVALUE\\n</parameter>\\n` for each declared parameter, in order; the required ones
    must be there. Undeclared parameters are refused (strict, as xgrammar's JSON schemas), except for a tool
    whose parameters declare no properties at all: its arguments are free-form."""
    params = tool.get("function", {}).get("parameters")
    params = params if isinstance(params, dict) else {}
    required = set(params.get("required") or ())
    blocks = []
    for name, schema in (params.get("properties") or {}).items():
        block = {"type": "tag", "begin": f"<parameter={name}>\n", "content": _value(schema, params, compact),
                 "end": "\n</parameter>\n"}
        blocks.append(block if name in required else {"type": "optional", "content": block})
    if "properties" not in params:  # free-form arguments: any named blocks, raw values
        blocks.append({"type": "star", "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "<parameter="}, {"type": "regex", "pattern": PARAMETER_NAME},
            {"type": "tag", "begin": ">\n", "content": {"type": "any_text"}, "end": "\n</parameter>\n"}]}})
    if not blocks:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": blocks} if len(blocks) > 1 else blocks[0]


def _call(tool: dict[str, Any], begin: str, compact: bool) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": _arguments(tool, compact), "end": CALL_CLOSE}


def forced_call_constraint(tools: ToolSetup, compact: bool = False) -> StructuredOutputsParams | None:
    """The structural tag that completes the forced call(s) of `tools`, or None when no call is forced."""
    if tools.choice == "named":
        [tool] = [t for t in tools.tools if t.get("function", {}).get("name") == tools.named]
        fmt: dict[str, Any] = _call(tool, "", compact)
    elif tools.choice == "required":
        first = {"type": "or", "elements": [_call(t, t["function"]["name"] + ">\n", compact) for t in tools.tools]}
        fmt = first
        if tools.parallel:
            more = {"type": "or", "elements": [_call(t, f"\n{CALL_OPEN}{t['function']['name']}>\n", compact)
                                               for t in tools.tools]}
            fmt = {"type": "sequence", "elements": [first, {"type": "star", "content": more}]}
    else:
        return None
    spec = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})
    try:
        spec.check()
    except StructuredOutputError as e:
        if e.message != INSTALL_HINT:
            _raise_for_the_tool(tools, compact, e.message)
        logger.warning("tool_choice %r is enforced by the call's opening only: %s", tools.choice, e.message)
        return None
    return spec


def _raise_for_the_tool(tools: ToolSetup, compact: bool, message: str) -> None:
    """The 400 for a forced call whose grammar does not compile, naming the (first) tool at fault."""
    forced = [t for t in tools.tools if tools.choice != "named" or t.get("function", {}).get("name") == tools.named]
    for tool in forced:
        one = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": _call(tool, "", compact)})
        try:
            one.check()
        except StructuredOutputError as e:
            message = e.message.removeprefix("structured_outputs.structural_tag is invalid: ")
            raise bad_request(f"tool {tool['function']['name']!r}: its parameters schema cannot be enforced for "
                              f"tool_choice {tools.choice!r} ({message}); fix the schema (JSON Schema types are "
                              "string, number, integer, boolean, object, array, null)", "tools") from None
    raise bad_request(f"the tools' call grammar for tool_choice {tools.choice!r} does not compile ({message}); "
                      "check the tools' parameters schemas", "tools")
