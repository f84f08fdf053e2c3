"""Typed gateway errors, rendered in each protocol's own error shape and status.

One `GatewayError` carries an HTTP status, an error type from the Anthropic vocabulary (the richer
of the two), a message and the offending parameter. `body(protocol)` renders it:

- OpenAI (Chat Completions, Responses): `{"error": {"message", "type", "param", "code"}}`
- Anthropic Messages: `{"type": "error", "error": {"type", "message"}}`; overloaded is status 529.

`from_library_error` maps what deepseek-recipe raises (bare `ValueError` for shape errors,
`ConversionError` with an OpenAI-shaped body for semantic ones, `ImageError`) onto this type.
"""
from __future__ import annotations

import json
from enum import Enum

from deepseek_recipe import ConversionError, ImageError


class Protocol(str, Enum):
    CHAT = "chat.completions"
    RESPONSES = "responses"
    MESSAGES = "messages"

    @property
    def is_openai(self) -> bool:
        return self is not Protocol.MESSAGES


# Error types (Anthropic's names); the OpenAI rendering maps them below.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
REQUEST_TOO_LARGE = "request_too_large"
RATE_LIMIT = "rate_limit_error"
API_ERROR = "api_error"
OVERLOADED = "overloaded_error"

_OPENAI_TYPE = {
    INVALID_REQUEST: "invalid_request_error",
    AUTHENTICATION: "invalid_request_error",
    PERMISSION: "invalid_request_error",
    NOT_FOUND: "invalid_request_error",
    REQUEST_TOO_LARGE: "invalid_request_error",
    RATE_LIMIT: "rate_limit_error",
    API_ERROR: "server_error",
    OVERLOADED: "server_error",
}
_OPENAI_DEFAULT_CODE = {
    AUTHENTICATION: "invalid_api_key",
    NOT_FOUND: "not_found",
    RATE_LIMIT: "rate_limit_exceeded",
    OVERLOADED: "overloaded",
}
_TYPE_BY_STATUS = {400: INVALID_REQUEST, 401: AUTHENTICATION, 403: PERMISSION, 404: NOT_FOUND,
                   413: REQUEST_TOO_LARGE, 422: INVALID_REQUEST, 429: RATE_LIMIT,
                   503: OVERLOADED, 529: OVERLOADED}


class GatewayError(Exception):
    """A request failure that the client sees, in its protocol's shape."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        if type not in _OPENAI_TYPE:
            raise ValueError(f"unknown gateway error type {type!r}")
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"GatewayError({self.status}, {self.type!r}, {self.message!r}, param={self.param!r})"

    def status_for(self, protocol: Protocol) -> int:
        if self.type == OVERLOADED:
            return 503 if protocol.is_openai else 529
        return self.status

    def payload(self, protocol: Protocol) -> dict:
        if protocol.is_openai:
            return {"error": {"message": self.message, "type": _OPENAI_TYPE[self.type],
                              "param": self.param,
                              "code": self.code or _OPENAI_DEFAULT_CODE.get(self.type, self.type)}}
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def body(self, protocol: Protocol) -> bytes:
        return json.dumps(self.payload(protocol), ensure_ascii=False).encode()


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, INVALID_REQUEST, message, param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(404, NOT_FOUND, message, param, code)


def request_too_large(message: str) -> GatewayError:
    return GatewayError(413, REQUEST_TOO_LARGE, message)


def overloaded(message: str) -> GatewayError:
    return GatewayError(503, OVERLOADED, message)


def internal(message: str) -> GatewayError:
    return GatewayError(500, API_ERROR, message)


def from_library_error(exc: BaseException) -> GatewayError:
    """Map an exception raised by deepseek-recipe to a GatewayError (never re-raises)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ConversionError):
        status = int(getattr(exc, "status_code", 400) or 400)
        message, param, code = str(exc), None, None
        try:
            err = json.loads(exc.body)["error"]
            message, param, code = err.get("message") or message, err.get("param"), err.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        kind = _TYPE_BY_STATUS.get(status, API_ERROR if status >= 500 else INVALID_REQUEST)
        if code == kind or code == "invalid_request_error":
            code = None
        return GatewayError(status, kind, message, param, code)
    if isinstance(exc, ImageError):
        kind = getattr(exc, "kind", "ImageError")
        if getattr(exc, "is_retryable", False):
            return GatewayError(502, API_ERROR, f"image could not be fetched ({kind}): {exc}")
        return invalid_request(f"invalid image ({kind}): {exc}", code="invalid_image")
    if isinstance(exc, (ValueError, TypeError)):
        return invalid_request(str(exc) or "invalid request body")
    return internal(f"internal error while preparing the request: {type(exc).__name__}")
