"""xgrammar over our constraints (messages/grammar.py): the comparison `epd bench grammar` measures
llguidance against. Bench-time only: nothing in the stack imports this module, and xgrammar is not a
dependency (`available()` says why it cannot run instead of failing at import).

Installed for the bench with `pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi` (its declared
triton dependency is a GPU kernel path, not needed for CPU compile and masks; torch and transformers
are already ours).

The JSON is the same spelling as ours (grammars.JSON_STYLE: ", " and ": ", no other whitespace).
xgrammar's `strict_mode` is left off: the schema is read as written, as llguidance reads it (our own
`strict` flag is about refusing keywords, which xgrammar does not report). Tool calls go through
xgrammar's DeepSeek structural tags (`deepseek_v4` / `deepseek_v4_1`): the same DSML, with JSON
values inside each parameter, after the reasoning block (disabled here: our constraint starts after
`</think>`). A prompt that already opened the block (`opened`) has no structural-tag equivalent.
"""
from __future__ import annotations

import time
from pathlib import Path

from messages.errors import GrammarUnsupported, InvalidRequest
from services.grammar_compiler.grammars import JSON_STYLE

_TOOL_CHOICE = {"required": "required", "optional": "auto"}   # named: {"type": "function", ...}
_MODEL = {"v4": "deepseek_v4", "v4.1": "deepseek_v4_1"}


def available() -> str:
    """"" when xgrammar can run here, else why not (a row of the bench says so)."""
    try:
        import xgrammar  # noqa: F401
        import transformers  # noqa: F401 - TokenizerInfo is built from a transformers tokenizer
    except ImportError as exc:
        return "xgrammar not installed" if exc.name == "xgrammar" else f"xgrammar cannot run: {exc}"
    return ""


def version() -> str:
    import xgrammar
    return getattr(xgrammar, "__version__", "") or _dist_version()


class XGrammarBackend:
    """One tokenizer's xgrammar: TokenizerInfo built once (about 2 s for the 129k vocabulary), then
    cold compiles (a fresh compiler, cache off, per call), artifacts and matchers."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, stop_token_ids=(1,), max_threads: int = 2):
        import transformers
        import xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                            stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self.max_threads = max_threads

    def compile(self, constraint: dict) -> tuple[bytes, float]:
        """(artifact: the serialized compiled grammar, compile milliseconds). Serializing is not timed."""
        compiled, ms = self.compile_grammar(constraint)
        return compiled.serialize_json().encode(), ms

    def compile_grammar(self, constraint: dict):
        """(xgrammar.CompiledGrammar, compile milliseconds), from a cache-free compiler.
        GrammarUnsupported for what xgrammar has no form of, InvalidRequest for what it refuses."""
        import xgrammar
        compiler = xgrammar.GrammarCompiler(self.info, max_threads=self.max_threads, cache_enabled=False)
        kind = constraint.get("kind")
        started = time.perf_counter()
        try:
            if kind == "json_object":
                compiled = self._json(compiler, {"type": "object"})
            elif kind == "json_schema":
                compiled = self._json(compiler, constraint["schema"])
            elif kind == "tool_calls":
                compiled = compiler.compile_structural_tag(structural_tag(constraint))
            else:
                raise GrammarUnsupported(f"constraint kind {kind!r} has no xgrammar form")
        except (RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "bad_alloc" in first:   # C++ out of memory surfaces as a RuntimeError
                raise MemoryError(f"xgrammar ran out of memory compiling the constraint: {first}") from None
            raise InvalidRequest(f"xgrammar refused the constraint: {first[:300]}") from None
        return compiled, (time.perf_counter() - started) * 1e3

    def load(self, artifact: bytes):
        """The CompiledGrammar an artifact holds (what a worker receiving it would do)."""
        import xgrammar
        return xgrammar.CompiledGrammar.deserialize_json(artifact.decode(), self.info)

    def matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    @staticmethod
    def _json(compiler, schema: dict):
        return compiler.compile_json_schema(
            schema, any_whitespace=False, strict_mode=False,
            separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))


class XGrammarMatcher:
    """An xgrammar matcher with engine.grammar.GrammarState's surface: fill, accept, done."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled):
        import xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)

    @property
    def done(self) -> bool:
        return self._matcher.is_completed()

    def fill(self, target) -> None:
        """The next token's bitmask into `target`: a contiguous CPU int32 tensor of ceil(V / 32) words."""
        self._matcher.fill_next_token_bitmask(target.view(1, -1), 0)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(int(token))


def structural_tag(constraint: dict):
    """xgrammar's DeepSeek structural tag for a tool_calls constraint, reasoning already over."""
    import xgrammar
    if constraint.get("opened"):
        raise GrammarUnsupported("xgrammar's structural tags cannot start inside an opened tool-call block")
    mode, tags = constraint.get("mode"), constraint.get("tags", "v4.1")
    if mode not in (*_TOOL_CHOICE, "named") or tags not in _MODEL:
        raise InvalidRequest(f"tool_calls mode {mode!r} / tags {tags!r} unknown")
    choice = _TOOL_CHOICE.get(mode) or {"type": "function", "function": {"name": constraint.get("name")}}
    # strict always: xgrammar leaves a non-strict tool's arguments unconstrained, while our lenient
    # tools are still held to their schema (only unenforceable keywords are ignored).
    functions = [{"type": "function", "function": {"name": t["name"], "strict": True,
                                                   "parameters": t.get("schema") or {"type": "object"}}}
                 for t in constraint.get("tools") or []]
    return xgrammar.get_model_structural_tag(
        _MODEL[tags], tools=functions, tool_choice=choice, reasoning="disabled",
        parallel_tool_calls=bool(constraint.get("parallel", True)) and mode != "named")


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("xgrammar")
    except PackageNotFoundError:
        return "unknown"
