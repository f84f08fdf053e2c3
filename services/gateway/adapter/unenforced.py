"""Requests whose promise this deployment cannot keep are refused (400), never half-served.

Images need a model with a vision encoder: for one without, a request with an image gets an
invalid_request_error naming it, instead of an answer about an image the model never saw (the V4
encoding would replace it with the text "[Unsupported Image]"). Files and documents are refused
always (the encoding would turn each into "[Unsupported Document]"). Checked on the raw body.

Output constraints are read from the raw body and enforced (constraints.py, the grammar compiler,
the engine's token masks). A hand-built ConversationRequest has no body, and deepseek-recipe 0.2.0's
conversion loses some constraints, so `refuse_converted` refuses any it carries.
"""
from __future__ import annotations

from services.gateway.adapter.errors import GatewayError, Protocol, invalid_request
from services.gateway.adapter.images import DOCUMENT_PARTS, first_image

_PROMPT_KEY = {Protocol.CHAT: "messages", Protocol.RESPONSES: "input", Protocol.MESSAGES: "messages"}
OPTIONAL_CONSTRAINT = "tool_call"   # the model may call a declared tool or answer in text
_NO_GRAMMAR = "constraints are enforced only for requests sent as a body (the conversion loses some)"


def refuse_images(protocol: Protocol, payload: dict, accept_images: bool = False) -> None:
    key = _PROMPT_KEY[protocol]
    where = None if accept_images else first_image(payload.get(key), key)
    if where is not None:
        raise invalid_request(f"image inputs are not supported: the served model has no vision "
                              f"encoder (image at {where})", param=key, code="unsupported_content")
    where = first_image(payload.get(key), key, DOCUMENT_PARTS)
    if where is not None:
        raise invalid_request(f"file and document inputs are not supported: this server reads text "
                              f"only (document at {where}); send the text itself", param=key,
                              code="unsupported_content")


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
