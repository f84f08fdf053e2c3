"""Test-only stand-ins for the gateway's structured-output peers, in-process over real ZeroMQ: a
grammar compiler that refuses every constraint with the ErrorReply it is told to give (registering
with its upstream under the real kind, so the gateway picks it), and an upstream that records, in
arrival order, each GenerateRequest and AbortRequest it gets and answers none."""
from __future__ import annotations

from messages.errors import ErrorCode, ErrorReply
from messages.generate import AbortRequest, GenerateRequest
from messages.grammar import GrammarCompile
from services.gateway.grammar_calls import COMPILER_KIND
from services.runtime.service import Service


class TestHelperRefusingCompiler(Service):
    """settings: code (an ErrorCode name, GRAMMAR_UNSUPPORTED by default), message."""

    kind = COMPILER_KIND
    __test__ = False   # not a pytest test class

    def __init__(self, config):
        super().__init__(config)
        self.compiles: list[tuple[str, GrammarCompile]] = []   # (request id, message) as they came

    def handlers(self):
        return {GrammarCompile: self._refuse}

    async def _refuse(self, msg: GrammarCompile, ctx) -> ErrorReply:
        self.compiles.append((ctx.request_id, msg))
        settings = self.config.settings
        code = ErrorCode[settings.get("code", "GRAMMAR_UNSUPPORTED")]
        return ErrorReply(int(code), settings.get("message", "keyword 'patternProperties' is not supported"))


class TestHelperRecordingUpstream(Service):
    kind = "test_helper_recording_upstream"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.received: list[tuple[str, str, object]] = []   # (message type, request id, message)

    def handlers(self):
        return {GenerateRequest: self._record, AbortRequest: self._record}

    async def _record(self, msg, ctx) -> None:
        self.received.append((type(msg).__name__, ctx.request_id, msg))
