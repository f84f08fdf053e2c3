"""The output constraint a request asks for, read from its body, in the compiler's terms.

Read from the raw body, not from deepseek-recipe 0.2.0's conversion, which loses some of them:
Anthropic `tool_choice: {type: any}` becomes an optional call and `output_format` is dropped.

    Chat       response_format {json_object | json_schema{schema, strict}}
    Responses  text.format     {json_object | json_schema{schema, strict}}
    Messages   output_format / output_config.format {json_schema{schema}}  (always strict)
    tools      tool_choice required / any -> a call of one of the tools; a named tool -> that call;
               auto with a strict tool -> the model may answer or call, a call's arguments obey
               the schema; a tool's `strict` decides whether unenforceable keywords are refused.
The result is a messages.grammar constraint dict (grammar_compiler/grammars.py builds the grammar),
or None for free text. What cannot be enforced is a 400 naming it, never silence.
"""
from __future__ import annotations

from services.gateway.adapter.errors import GatewayError, Protocol, invalid_request
from services.gateway.adapter.parsing import OutputParsing
from services.gateway.adapter.tool_calls import V41_TAGS


def unsupported(message: str, param: str | None) -> GatewayError:
    return invalid_request(message, param=param, code="unsupported_parameter")


def constraint_of(protocol: Protocol, payload: dict, parsing: OutputParsing) -> dict | None:
    output = _output_format(protocol, payload)
    tools = _tool_call(protocol, payload, parsing)
    if output is not None and tools is not None:
        raise unsupported("a structured output format together with a forced or strict tool call is not "
                          "supported: ask for one of them", "tool_choice")
    return output or tools


# ---- output formats ------------------------------------------------------------------------------

def _output_format(protocol: Protocol, payload: dict) -> dict | None:
    if protocol is Protocol.CHAT:
        return _openai_format(payload.get("response_format"), "response_format", nested=True)
    if protocol is Protocol.RESPONSES:
        text = payload.get("text")
        return _openai_format(text.get("format") if isinstance(text, dict) else None, "text.format", nested=False)
    config = payload.get("output_config")
    for param, value in (("output_format", payload.get("output_format")),
                         ("output_config.format", config.get("format") if isinstance(config, dict) else None)):
        if value is None:
            continue
        if not isinstance(value, dict) or value.get("type") != "json_schema":
            raise unsupported(f"{param} must be {{type: json_schema, schema: ...}}", param)
        return {"kind": "json_schema", "schema": _schema(value.get("schema"), f"{param}.schema"), "strict": True}
    return None


def _openai_format(fmt, param: str, nested: bool) -> dict | None:
    """Chat nests the schema (`json_schema: {name, schema, strict}`); Responses does not."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind != "json_schema":
        raise unsupported(f"{param} of type {kind!r} is not supported; use text, json_object or json_schema", param)
    body = fmt.get("json_schema") if nested else fmt
    where = f"{param}.json_schema" if nested else param
    if not isinstance(body, dict):
        raise invalid_request(f"{where} is required for type json_schema", param=where)
    return {"kind": "json_schema", "schema": _schema(body.get("schema"), f"{where}.schema"),
            "strict": body.get("strict") is True}


def _schema(schema, param: str) -> dict:
    if not isinstance(schema, dict):
        raise invalid_request(f"{param} must be a JSON schema object", param=param)
    return schema


# ---- tool calls ----------------------------------------------------------------------------------

def _tool_call(protocol: Protocol, payload: dict, parsing: OutputParsing) -> dict | None:
    tools = _declared_tools(protocol, payload.get("tools"))
    mode, name, allowed = _choice(protocol, payload.get("tool_choice"))
    if mode == "none" or not tools:
        return None
    if allowed is not None:
        tools = [t for t in tools if t["name"] in allowed]
        if not tools and mode == "required":
            raise invalid_request("tool_choice.allowed_tools names no declared tool", param="tool_choice")
    if mode == "optional" and not any(t["strict"] for t in tools):
        return None   # calling is optional and no schema is promised: the adapter checks calls are JSON
    if mode == "named" and name not in {t["name"] for t in tools}:
        raise invalid_request(f"tool_choice names {name!r}, which is not a declared tool", param="tool_choice")
    return {"kind": "tool_calls", "mode": mode, "name": name, "tools": tools, "parallel": _parallel(protocol, payload),
            "tags": "v4.1" if parsing.dsml_tags == V41_TAGS else "v4", "opened": parsing.starts_in_tool_calls}


def _parallel(protocol: Protocol, payload: dict) -> bool:
    """Whether several calls may come in one answer (OpenAI parallel_tool_calls, Anthropic
    tool_choice.disable_parallel_tool_use)."""
    if protocol is Protocol.MESSAGES:
        choice = payload.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return payload.get("parallel_tool_calls") is not False


def _declared_tools(protocol: Protocol, tools) -> list[dict]:
    out = []
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        if protocol is Protocol.MESSAGES:
            if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
                continue   # server tools (web search, ...) take no DSML call
            spec = {"name": tool.get("name"), "schema": tool.get("input_schema"), "strict": tool.get("strict") is True}
        elif protocol is Protocol.CHAT:
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                continue
            spec = {"name": function.get("name"), "schema": function.get("parameters"),
                    "strict": function.get("strict") is True}
        else:
            if tool.get("type") != "function":
                continue
            spec = {"name": tool.get("name"), "schema": tool.get("parameters"), "strict": tool.get("strict") is True}
        if isinstance(spec["name"], str) and spec["name"]:
            spec["schema"] = spec["schema"] if isinstance(spec["schema"], dict) else {"type": "object", "properties": {}}
            out.append(spec)
    return out


def _choice(protocol: Protocol, choice) -> tuple[str, str | None, set[str] | None]:
    """(mode, named tool, allowed tool names or None for all) of a tool_choice."""
    if choice is None:
        return "optional", None, None
    if isinstance(choice, str):
        return {"auto": "optional", "none": "none", "required": "required", "any": "required"}.get(
            choice, "optional"), None, None
    if not isinstance(choice, dict):
        return "optional", None, None
    kind = choice.get("type")
    if protocol is Protocol.MESSAGES:
        return {"any": ("required", None, None), "tool": ("named", choice.get("name"), None),
                "none": ("none", None, None)}.get(kind, ("optional", None, None))
    if kind == "allowed_tools":   # Chat nests {mode, tools} under `allowed_tools`; Responses does not
        spec = choice.get("allowed_tools") if isinstance(choice.get("allowed_tools"), dict) else choice
        names = {t.get("name") or (t.get("function") or {}).get("name")
                 for t in spec.get("tools") or [] if isinstance(t, dict)}
        return ("required" if spec.get("mode") == "required" else "optional"), None, names
    function = choice.get("function")
    name = (function.get("name") if isinstance(function, dict) else None) or choice.get("name")
    return ("named", name, None) if isinstance(name, str) else ("optional", None, None)
