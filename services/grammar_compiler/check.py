"""The llguidance backend: check a grammar and trial-run it, so a worker can trust the artifact.

`compile_constraint` is one compile job (pool.py runs it in a child process): canonical constraint
JSON -> grammar text (grammars.py) -> `check_grammar`. The check builds a matcher against the model's
tokenizer (which validates the grammar) and walks its first few tokens: the first mask forces the
lexer build, where pathological regexes spend their time, and the first tokens meet the parser's
limits, so the hard timeout covers both and a request never fails on its first token instead.

Failures are typed: a JSON schema keyword or string format llguidance cannot enforce is
GRAMMAR_UNSUPPORTED naming it; any other grammar error (a bad regex, a limit the grammar exceeds)
is INVALID_REQUEST with the library's first line, except the library's own complexity limits, which
are GRAMMAR_TIMEOUT like a compile past the hard timeout (the client sees "too complex" for both).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import msgspec

from messages.errors import GrammarTimeout, GrammarUnsupported, InvalidRequest, WireError

# What llguidance 1.9.1 enforces (tests/grammar_compiler/test_check.py keeps these lists in step
# with the installed library); annotations such as title or description are accepted and ignored.
ENFORCEABLE_KEYWORDS = (
    "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type",
    "items", "additionalItems", "prefixItems", "minItems", "maxItems",
    "properties", "additionalProperties", "patternProperties", "required", "minProperties", "maxProperties",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
)
ENFORCEABLE_FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
# The library's own complexity limits (grammar size, lexer states, Earley items, fuel): refused fast,
# the same verdict as a compile that runs past the hard timeout.
_TOO_COMPLEX = re.compile(r"too large|too complex|TooComplex|fuel|limit|max is \d+", re.IGNORECASE)
_MAX_DETAIL = 300   # characters of a library message quoted back to the client
TRIAL_TOKENS = 8    # tokens of the trial walk (check_grammar)


def load_tokenizer(tokenizer_json: Path):
    """The llguidance tokenizer of a tokenizer.json: about a second to build, so once per process."""
    from llguidance import LLTokenizer
    return LLTokenizer(Path(tokenizer_json).read_text(encoding="utf-8"))


def compile_constraint(constraint_json: str, tokenizer) -> tuple[str, float]:
    """One compile job: (grammar text, milliseconds spent). Raises the typed WireError."""
    from services.grammar_compiler.grammars import build_grammar
    started = time.perf_counter()
    try:
        constraint = msgspec.json.decode(constraint_json)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the constraint is not valid JSON: {exc}") from None
    grammar = build_grammar(constraint)
    check_grammar(grammar, tokenizer, strict=strict_of(constraint))
    return grammar, (time.perf_counter() - started) * 1e3


def strict_of(constraint: dict) -> bool:
    """Whether library warnings about unenforced keywords refuse the grammar. A lenient json_schema
    accepts them; tool_calls carry each tool's own strictness inside the grammar (a strict tool's
    unenforceable keyword is already an error there), so its warnings are the lenient tools'."""
    kind = constraint.get("kind")
    if kind == "json_schema":
        return bool(constraint.get("strict", True))
    return kind != "tool_calls"


def check_grammar(grammar: str, tokenizer, strict: bool) -> None:
    """Validate `grammar` for `tokenizer` and trial-run it; GrammarUnsupported / InvalidRequest.

    The matcher's constructor validates exactly as LLMatcher.validate_grammar_with_warnings does
    (same errors, same warnings via get_grammar_warnings), so the grammar is parsed once, not twice:
    on a large schema the parse is a third of the compile time."""
    from llguidance import LLMatcher
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise refusal(matcher.get_error())
    if strict:
        for warning in matcher.get_grammar_warnings():
            unsupported = unsupported_feature(warning)
            if unsupported:
                raise GrammarUnsupported(unsupported)
    _trial_walk(matcher)


def _trial_walk(matcher, steps: int = TRIAL_TOKENS) -> None:
    """Compute the first masks and take the lowest allowed token each time. The first mask builds
    the lexer (the expensive part of a pathological grammar); the first tokens hit the parser's
    per-row limit (2,000 Earley items: a schema with ~700+ optional properties passes the first mask
    and fails on its first token), which would otherwise end a request mid-stream."""
    import numpy as np
    for _ in range(steps):
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if matcher.is_error():
            raise refusal(matcher.get_error())
        words = np.flatnonzero(mask)
        if matcher.is_stopped() or not len(words):
            return
        word = int(words[0])
        token = word * 32 + (int(mask[word]) & -int(mask[word])).bit_length() - 1
        if not matcher.consume_token(token):
            raise refusal(matcher.get_error())


def refusal(message: str) -> WireError:
    """The typed error for one llguidance error message."""
    unsupported = unsupported_feature(message)
    if unsupported:
        return GrammarUnsupported(unsupported)
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if _TOO_COMPLEX.search(first_line):
        return GrammarTimeout(f"the constraint is too complex to enforce: {first_line[:_MAX_DETAIL]}")
    return InvalidRequest(f"the constraint does not compile: {first_line[:_MAX_DETAIL]}")


def unsupported_feature(message: str) -> str:
    """The client-facing sentence naming an unenforceable keyword or format, or "" for other messages."""
    keys = _UNIMPLEMENTED.search(message)
    if keys:
        try:
            names = [str(k) for k in json.loads(keys.group(1))]
        except ValueError:
            names = [keys.group(1)]
        which = ", ".join(f"'{n}'" for n in names)
        noun = "keyword" if len(names) == 1 else "keywords"
        verb = "is" if len(names) == 1 else "are"
        return (f"the JSON schema {noun} {which} {verb} not supported "
                f"(enforceable keywords: {', '.join(ENFORCEABLE_KEYWORDS)})")
    fmt = _UNKNOWN_FORMAT.search(message)
    if fmt:
        return (f"the JSON schema string format '{fmt.group(1)}' is not supported "
                f"(enforceable formats: {', '.join(ENFORCEABLE_FORMATS)})")
    return ""
