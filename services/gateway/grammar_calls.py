"""The gateway's side of structured output: which compiler replica compiles a request's constraint,
and what its answer means to the client.

Grammar compilers register with the gateway (their `upstream`). A constraint goes to the live
replica that ranks highest for its key (rendezvous hashing), so repeats of a constraint hit that
replica's cache, and a replica that joins or leaves moves only its own share of keys. The gateway
sends the request on at once with that replica's address; the worker that runs it asks the same
replica for the same key while it loads the prefix, so the compile overlaps routing and prefix
lookup and runs once. The gateway waits for its own answer before the client sees a byte: a
constraint that fails to compile is a 400 in the caller's shape, and the request is aborted.
"""
from __future__ import annotations

import hashlib

from messages.errors import ErrorCode, WireError
from messages.grammar import GrammarCompile, GrammarRef
from services.gateway.adapter.errors import GatewayError, invalid_request

COMPILER_KIND = "grammar_compiler"


def pick_compiler(service, key: str) -> str:
    """The address of the live compiler replica ranking highest for `key`; "" when none is up."""
    peers = [p for p in service.members.alive(COMPILER_KIND) if p.accepts_work]
    if not peers:
        return ""
    return max(peers, key=lambda p: hashlib.sha256(f"{p.instance}\n{key}".encode()).digest()).address


def compile_message(ref: GrammarRef) -> GrammarCompile:
    return GrammarCompile(constraint=ref.constraint, tokenizer_id=ref.tokenizer_id, key=ref.key)


def no_compiler() -> GatewayError:
    return GatewayError(503, "overloaded_error", "structured output needs a grammar compiler and none is "
                        "running; retry shortly", code="grammar_compiler_unavailable")


def compile_failure(exc: WireError) -> GatewayError:
    """A compiler's answer (or silence) as the client's error."""
    if exc.code == ErrorCode.GRAMMAR_UNSUPPORTED:
        return invalid_request(exc.message, param=None, code="unsupported_schema_feature")
    if exc.code == ErrorCode.GRAMMAR_TIMEOUT:
        return invalid_request(exc.message, param=None, code="grammar_too_complex")
    if exc.code == ErrorCode.INVALID_REQUEST:
        return invalid_request(f"the output constraint cannot be compiled: {exc.message}", param=None,
                               code="invalid_schema")
    return GatewayError(503, "overloaded_error", f"the grammar compiler did not answer: {exc.message}",
                        code="grammar_compiler_unavailable")
