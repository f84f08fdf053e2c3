"""Requests whose promise this deployment cannot keep yet are refused (400), never half-served.

Output constraints need the grammar service and images need vision workers. Until those exist, a
request that asks for either gets an invalid_request_error naming what is unsupported, instead of
an answer that looks right and breaks the promise: "JSON" that is not JSON, a "required" tool call
never made, arguments outside a strict schema, an image the model never saw.

Checked on the raw body, because deepseek-recipe 0.2.0 loses some of these without a trace:
Anthropic `tool_choice: {type: any}` converts to the optional tool-call constraint, `output_format`
is dropped, and the V4 encoding replaces an image with the text "[Unsupported Image]".
Plain tools with `tool_choice` auto / none stay accepted: calling a tool is optional there, and the
adapter already turns every invalid call into text (tool_calls.py).
"""
from __future__ import annotations

from services.gateway.adapter.errors import GatewayError, Protocol, invalid_request
from services.gateway.adapter.images import DOCUMENT_PARTS, first_image

_PROMPT_KEY = {Protocol.CHAT: "messages", Protocol.RESPONSES: "input", Protocol.MESSAGES: "messages"}
OPTIONAL_CONSTRAINT = "tool_call"   # the model may call a declared tool or answer in text
_NO_GRAMMAR = "this server cannot enforce structured output yet"
_AUTO = {Protocol.CHAT: "'auto'", Protocol.RESPONSES: "'auto'", Protocol.MESSAGES: "{type: auto}"}


def refuse_images(protocol: Protocol, payload: dict) -> None:
    key = _PROMPT_KEY[protocol]
    where = first_image(payload.get(key), key)
    if where is not None:
        raise invalid_request(f"image inputs are not supported: this deployment has no vision "
                              f"workers yet (image at {where})", param=key, code="unsupported_content")
    where = first_image(payload.get(key), key, DOCUMENT_PARTS)
    if where is not None:
        raise invalid_request(f"file and document inputs are not supported: this server reads text "
                              f"only (document at {where}); send the text itself", param=key,
                              code="unsupported_content")


def refuse_constraints(protocol: Protocol, payload: dict) -> None:
    """Structured-output formats, forced tool calls and strict tools, in each protocol's fields."""
    if protocol is Protocol.CHAT:
        _refuse_format(payload.get("response_format"), "response_format")
    elif protocol is Protocol.RESPONSES:
        text = payload.get("text")
        _refuse_format(text.get("format") if isinstance(text, dict) else None, "text.format")
    else:
        config = payload.get("output_config")   # its `effort` is fine; its `format` is a constraint
        formats = {"output_format": payload.get("output_format"),
                   "output_config.format": config.get("format") if isinstance(config, dict) else None}
        for param, value in formats.items():
            if value is not None:
                raise unsupported(f"{param} is not supported: {_NO_GRAMMAR}; ask for JSON in the "
                                  f"prompt instead", param)
    forced = _forced_tool_choice(protocol, payload.get("tool_choice"))
    if forced:
        raise unsupported(f"tool_choice {forced} is not supported: this server cannot force a tool "
                          f"call yet; use {_AUTO[protocol]} (the model may call a tool) or none",
                          "tool_choice")
    strict = _strict_tool(protocol, payload.get("tools"))
    if strict:
        raise unsupported(f"strict tools are not supported ({strict} is true): this server cannot "
                          f"enforce a tool's parameter schema yet; set strict to false (arguments "
                          f"are still checked to be JSON)", strict)


def refuse_converted(conversation, constraint) -> None:
    """The same, on what conversion produced: for hand-built requests that had no body to check."""
    kind = constraint.kind if constraint is not None else OPTIONAL_CONSTRAINT
    what = (f"tool_choice {conversation.tool_choice!r}" if conversation.tool_choice not in ("auto", "none")
            else f"response_format {conversation.response_format!r}" if conversation.response_format != "text"
            else "a strict tool" if any(tool.strict for tool in conversation.tools)
            else f"the output constraint {kind!r}" if kind != OPTIONAL_CONSTRAINT else "")
    if what:
        raise unsupported(f"{what} is not supported: {_NO_GRAMMAR}", None)


def unsupported(message: str, param: str | None) -> GatewayError:
    return invalid_request(message, param=param, code="unsupported_parameter")



def _refuse_format(fmt, param: str) -> None:
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind not in (None, "text"):
        raise unsupported(f"{param} of type {kind!r} is not supported: {_NO_GRAMMAR}; use type "
                          f"'text' and ask for JSON in the prompt", param)


def _forced_tool_choice(protocol: Protocol, choice) -> str:
    """How the request forces a tool call ('' when it does not)."""
    if isinstance(choice, str):
        return f"{choice!r}" if choice in ("required", "any") else ""
    if not isinstance(choice, dict):
        return ""
    kind = choice.get("type")
    if protocol is Protocol.MESSAGES:
        return f"{{type: {kind}}}" if kind in ("any", "tool") else ""
    if kind == "allowed_tools" and choice.get("mode") != "required":
        return ""
    function = choice.get("function")
    name = (function.get("name") if isinstance(function, dict) else None) or choice.get("name")
    return f"naming the tool {name!r}" if isinstance(name, str) else f"of type {kind!r}"


def _strict_tool(protocol: Protocol, tools) -> str:
    """The parameter path of the first tool declared strict ('' when none is)."""
    if not isinstance(tools, list):
        return ""
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        if protocol is Protocol.CHAT and isinstance(tool.get("function"), dict):
            if tool["function"].get("strict") is True:
                return f"tools[{i}].function.strict"
        elif tool.get("strict") is True:
            return f"tools[{i}].strict"
    return ""
