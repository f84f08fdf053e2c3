"""The table of message types: every type has a fixed 16-bit tag that travels as frame 0.

Tags are grouped by boundary (high byte) so a tag tells a reader where a frame comes from:
0x00 errors, 0x01 control/membership, 0x02 gateway<->upstream, 0x03 routers<->workers,
0x04 worker<->worker hand-off, 0x05 SWA registry, 0x06 KV store, 0x07 grammar compiler, 0x08 the
vision pool. Tags never change meaning; new types take new tags. Tests may register types in 0xF0xx.
"""
from __future__ import annotations

import msgspec


class Message(msgspec.Struct, array_like=True, gc=False):
    """Base of every wire message: encoded as a MessagePack array, new fields appended with defaults."""


_BY_TAG: dict[int, type[Message]] = {}
_BY_TYPE: dict[type[Message], int] = {}


def register(tag: int):
    """Class decorator giving a message type its permanent tag."""
    if not 0 <= tag <= 0xFFFF:
        raise ValueError(f"tag {tag:#x} does not fit 16 bits")

    def wrap(cls: type[Message]) -> type[Message]:
        if not issubclass(cls, Message):
            raise TypeError(f"{cls.__name__} is not a Message")
        taken = _BY_TAG.get(tag)
        if taken is not None and taken is not cls:
            raise ValueError(f"tag {tag:#06x} already used by {taken.__name__}")
        _BY_TAG[tag] = cls
        _BY_TYPE[cls] = tag
        return cls

    return wrap


def tag_of(cls: type[Message]) -> int:
    try:
        return _BY_TYPE[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not a registered message type") from None


def type_of(tag: int) -> type[Message] | None:
    return _BY_TAG.get(tag)


def message_types() -> dict[int, type[Message]]:
    """A copy of the whole table, tag -> type."""
    return dict(_BY_TAG)
