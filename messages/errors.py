"""Typed errors: raised locally as WireError subclasses, sent to a peer as ErrorReply.

Every failure that crosses a boundary has a code, so a caller can decide (retry, re-route,
give up) without parsing text.
"""
from __future__ import annotations

from enum import IntEnum

from messages.registry import Message, register


class ErrorCode(IntEnum):
    INTERNAL = 1
    UNKNOWN_MESSAGE_TYPE = 2
    SCHEMA_VERSION_MISMATCH = 3
    MALFORMED_FRAME = 4
    FRAME_TOO_LARGE = 5
    UNEXPECTED_MESSAGE = 6      # a known type this service does not handle
    OVERLOADED = 7              # bounded queue or socket high-water mark reached
    DRAINING = 8                # service is shutting down and takes no new work
    PEER_DEAD = 9               # the peer holding the work stopped heartbeating
    TIMEOUT = 10
    INVALID_REQUEST = 11        # well-formed frames, but the content is not acceptable
    ABORTED = 12
    GRAMMAR_UNSUPPORTED = 13    # a constraint uses a feature the grammar library cannot enforce (named)
    GRAMMAR_TIMEOUT = 14        # a constraint too complex to compile: past the hard time limit, or the library's own limits
    MODEL_MISMATCH = 15         # a worker registered with a model identity other than its pool's


class WireError(Exception):
    """Base of every error the wire layer and the runtime raise."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, request_id: str = ""):
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def to_reply(self) -> "ErrorReply":
        return ErrorReply(code=int(self.code), message=self.message)


class UnknownMessageType(WireError):
    code = ErrorCode.UNKNOWN_MESSAGE_TYPE


class SchemaVersionMismatch(WireError):
    code = ErrorCode.SCHEMA_VERSION_MISMATCH


class MalformedFrame(WireError):
    code = ErrorCode.MALFORMED_FRAME


class FrameTooLarge(WireError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnexpectedMessage(WireError):
    code = ErrorCode.UNEXPECTED_MESSAGE


class Overloaded(WireError):
    code = ErrorCode.OVERLOADED


class Draining(WireError):
    code = ErrorCode.DRAINING


class PeerDead(WireError):
    code = ErrorCode.PEER_DEAD


class RequestTimeout(WireError):
    code = ErrorCode.TIMEOUT


class InvalidRequest(WireError):
    code = ErrorCode.INVALID_REQUEST


class RemoteError(WireError):
    """An ErrorReply received from a peer, raised on the caller's side."""

    def __init__(self, code: int, message: str, *, request_id: str = ""):
        super().__init__(message, request_id=request_id)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.INTERNAL


@register(0x0001)
class ErrorReply(Message):
    code: int
    message: str

    def to_exception(self, request_id: str = "") -> RemoteError:
        return RemoteError(self.code, self.message, request_id=request_id)


class GrammarUnsupported(WireError):
    code = ErrorCode.GRAMMAR_UNSUPPORTED


class GrammarTimeout(WireError):
    code = ErrorCode.GRAMMAR_TIMEOUT


class ModelMismatch(WireError):
    code = ErrorCode.MODEL_MISMATCH
