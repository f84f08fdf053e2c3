"""The wire contract: typed messages shared by every service.

One module per boundary (see each module's docstring for who talks to whom).
`envelope` turns a message into frames `[type tag, header, *buffers]` and back; `tensors`
describes buffer frames (dtype, shape, bytes); `prefix` is the block hash chain every service
shares. No torch here: routers and stores import this package without loading it.
Importing this package registers every message type in the catalogue.
"""
from messages import (control, errors, generate, grammar, handoff, kv_store, routing, swa_registry,  # noqa: F401
                      vision)  # (registration)
from messages.envelope import SCHEMA_VERSION, Codec, Envelope, Header, WireLimits
from messages.errors import ErrorCode, ErrorReply, WireError
from messages.registry import Message, message_types, tag_of

__all__ = [
    "SCHEMA_VERSION", "Codec", "Envelope", "Header", "WireLimits",
    "ErrorCode", "ErrorReply", "WireError", "Message", "message_types", "tag_of",
]
