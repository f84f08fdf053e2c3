"""The context a handler gets for one inbound message: who sent it, how to answer, the span."""
from __future__ import annotations

import time

from messages import Envelope, Message
from services.runtime.tracing import SpanContext
from services.runtime.transport import Link


class Context:
    __slots__ = ("service", "envelope", "identity", "link", "span", "received_at", "replied")

    def __init__(self, service, envelope: Envelope, span: SpanContext, *,
                 identity: bytes | None = None, link: Link | None = None):
        self.service = service        # the Service (services/runtime/service.py) that received it
        self.envelope = envelope
        self.identity = identity      # set when the message came in on our Inbox
        self.link = link              # set when it came in on one of our Links
        self.span = span
        self.received_at = time.time()
        self.replied = False

    @property
    def message(self) -> Message:
        return self.envelope.message

    @property
    def request_id(self) -> str:
        return self.envelope.header.request_id

    @property
    def sender(self) -> str:
        return self.envelope.header.sender

    def log_fields(self) -> dict[str, str]:
        """What every log line inside this message's handling carries (read by `epd trace`)."""
        fields = {"trace_id": self.span.trace_id, "span_id": self.span.span_id}
        if self.span.parent_span_id:
            fields["parent_span_id"] = self.span.parent_span_id
        if self.request_id:
            fields["request_id"] = self.request_id
        return fields

    def reply(self, message: Message, buffers=()) -> None:
        """Answer the sender on the path it used; raises Overloaded / PeerDead if it cannot go."""
        frames = self.service.codec.encode(
            message, request_id=self.request_id, traceparent=self.span.traceparent,
            buffers=buffers, in_reply_to=self.envelope.header.msg_id)
        if self.identity is not None:
            self.service.inbox.send(self.identity, frames)
        else:
            self.link.send(frames)
        self.replied = True
        self.service.metrics.sent(type(message).__name__)
