"""Gateway / workers <-> the grammar compiler (services/grammar_compiler/).

A constraint is compact JSON (`constraint_json`, keys in their given order) of one of:
    {"kind": "json_object"}
    {"kind": "json_schema", "schema": {...}, "strict": true|false}
    {"kind": "tool_calls", "mode": "required"|"named"|"optional", "name": "<tool>"|null,
     "tags": "v4"|"v4.1", "opened": true|false, "parallel": true|false,
     "tools": [{"name": "...", "schema": {...}, "strict": true|false}, ...]}
`strict` false compiles leniently (keywords the library cannot enforce are ignored); strict true
refuses them (GRAMMAR_UNSUPPORTED naming the keyword). `opened`: the prompt already opened the
tool-call block, so the output starts inside it. `parallel` false: exactly one call (a named tool always
gets one).

GrammarCompile -> GrammarCompiled, or ErrorReply INVALID_REQUEST / GRAMMAR_UNSUPPORTED /
GRAMMAR_TIMEOUT. The gateway sends it as soon as it knows the constraint, in parallel with routing;
the worker that runs the request sends the same one (answered from the compiler's cache, or joining
the compile under way) while it loads the prefix. The artifact is the library's grammar text: small
(about the schema's size), checked and trial-run by the compiler, so a worker builds its matcher
from it in milliseconds.
"""
from __future__ import annotations

import hashlib

import msgspec

from messages.registry import Message, register


def tokenizer_id(tokenizer_json_path: str) -> str:
    """A tokenizer's identity: the first 16 hex digits of its tokenizer.json's sha256."""
    with open(tokenizer_json_path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def constraint_json(constraint: dict) -> str:
    """The spelling every cache key and compile input uses: compact, keys in their given order. Not
    sorted: a schema's `properties` order is the order the model writes them in (clients put a
    "reasoning" field before "answer" on purpose); the gateway builds the constraint's own keys in
    a fixed order, so equal requests spell equally."""
    return msgspec.json.encode(constraint).decode()


def constraint_key(tokenizer_id: str, constraint: str) -> str:
    """The cache key: (tokenizer identity, constraint hash)."""
    return hashlib.sha256(f"{tokenizer_id}\n{constraint}".encode()).hexdigest()[:32]


class GrammarRef(msgspec.Struct, array_like=True, gc=False):
    """What a GenerateRequest carries about its constraint."""
    key: str                        # constraint_key(tokenizer_id, constraint)
    constraint: str                 # canonical constraint JSON: any compiler replica can compile it
    tokenizer_id: str
    compiler: str = ""              # the compiler replica the gateway asked (it holds the result first)
    after_token: int = -1           # the constraint starts after this token (thinking mode: `</think>`)
    replay: list[int] = []          # output tokens already produced (a resume): the matcher consumes them first


@register(0x0701)
class GrammarCompile(Message):
    constraint: str                 # canonical constraint JSON
    tokenizer_id: str               # the compiler refuses a tokenizer it does not hold
    key: str = ""                   # recomputed by the compiler when empty


@register(0x0702)
class GrammarCompiled(Message):
    key: str
    library: str                    # "llguidance" (the engine's matcher)
    grammar: str                    # the artifact: the library's grammar text
    compile_ms: float = 0.0         # 0 for a cache hit
    cached: bool = False
