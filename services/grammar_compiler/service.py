"""GrammarCompilerService: compiles output constraints off the engine's path (messages/grammar.py).

GrammarCompile(constraint, tokenizer_id, key) -> GrammarCompiled(key, "llguidance", grammar,
compile_ms, cached), or ErrorReply INVALID_REQUEST (malformed constraint, a grammar error, a
tokenizer this compiler does not hold, a key that is not the constraint's) / GRAMMAR_UNSUPPORTED (a
keyword or format the library cannot enforce, named) / GRAMMAR_TIMEOUT (past compile_timeout_s) /
OVERLOADED (max_queue compiles already waiting for a process).

Compiles run in child processes with a hard timeout (pool.py); answers are cached by constraint key,
failures for error_ttl_s, and concurrent requests for one key share one compile (cache.py). The key
is always recomputed here, so a client cannot file an artifact under another constraint's key.
Replicas are interchangeable (any one compiles any constraint); each registers with its `upstream`
when one is configured, every replica of it (each gateway replica: ServiceConfig.upstream_replicas).

Settings (ServiceConfig.settings): model_dir (its tokenizer.json is the tokenizer), processes,
compile_timeout_s, cache_bytes, error_ttl_s, max_queue.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from messages.errors import ErrorCode, InvalidRequest
from messages.grammar import GrammarCompile, GrammarCompiled, constraint_key, tokenizer_id
from services.grammar_compiler.cache import Compiled, GrammarCache
from services.grammar_compiler.metrics import CompileCounts, declare_metrics
from services.grammar_compiler.pool import CompilePool
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.service import Handler, Service
from services.runtime.settings import parse_settings, require_positive

LIBRARY = "llguidance"


@dataclass(slots=True, frozen=True)
class GrammarCompilerSettings:
    model_dir: str = ""               # the model whose tokenizer.json the grammars are checked against
    processes: int = 2                # compile processes (each holds a tokenizer: ~160 MB)
    compile_timeout_s: float = 10.0   # hard limit per compile; past it the process is killed
    cache_bytes: int = 256 << 20      # grammar artifacts kept (LRU)
    error_ttl_s: float = 30.0         # how long a constraint's failure is answered from the cache
    max_queue: int = 256              # compiles waiting for a free process; beyond it OVERLOADED

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (its tokenizer.json is the grammars' tokenizer)")
        require_positive(self, "compile_timeout_s", "error_ttl_s")
        if min(self.processes, self.cache_bytes, self.max_queue) < 1:
            raise ValueError("processes, cache_bytes and max_queue must be >= 1")

    @property
    def tokenizer_json(self) -> Path:
        return Path(self.model_dir) / "tokenizer.json"


class GrammarCompilerService(Service):
    kind = "grammar_compiler"

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(GrammarCompilerSettings, config.settings, self.kind)
        self.tokenizer_id = ""    # set at start, from tokenizer.json's bytes
        self.counts = CompileCounts()
        self.cache = GrammarCache(self.settings.cache_bytes, self.settings.error_ttl_s)
        super().__init__(config)
        s = self.settings
        self.pool = CompilePool(s.tokenizer_json, s.processes, s.compile_timeout_s, s.max_queue,
                                log=self.log.bind(component="compile_pool"))
        declare_metrics(self.metrics, self)

    def handlers(self) -> dict[type, Handler]:
        return {GrammarCompile: self.on_compile}

    # ---- handlers ----------------------------------------------------------------------
    async def on_compile(self, msg: GrammarCompile, ctx: Context) -> GrammarCompiled:
        started = time.perf_counter()
        key = constraint_key(self.tokenizer_id, msg.constraint)
        if msg.tokenizer_id != self.tokenizer_id:
            result = Compiled("", 0.0, "refused", InvalidRequest(
                f"this compiler holds tokenizer {self.tokenizer_id}, not {msg.tokenizer_id!r}"))
        elif msg.key and msg.key != key:
            result = Compiled("", 0.0, "refused", InvalidRequest(
                f"key {msg.key!r} is not the constraint's key ({key})"))
        else:
            result = await self.cache.get(key, lambda: self.pool.compile(msg.constraint))
        self._account(key, result, time.perf_counter() - started)
        if result.error is not None:
            raise result.error
        cached = result.source == "cached"
        return GrammarCompiled(key, LIBRARY, result.grammar, 0.0 if cached else round(result.compile_ms, 3), cached)

    def _account(self, key: str, result: Compiled, seconds: float) -> None:
        """Count the answer and write its one log line."""
        counts, error = self.counts, result.error
        counts.requests += 1
        if error is None:
            outcome = "ok"
            if result.source == "compiled":
                counts.compiled += 1
                counts.compile_s.observe(result.compile_ms / 1e3)
        else:
            outcome = error.code.name
            if error.code == ErrorCode.GRAMMAR_UNSUPPORTED:
                counts.unsupported += 1
            elif error.code == ErrorCode.INVALID_REQUEST:
                counts.invalid += 1
            elif error.code == ErrorCode.GRAMMAR_TIMEOUT:
                counts.timeouts += 1
            else:
                counts.failed += 1
        fields = {"key": key, "ms": round(seconds * 1e3, 3), "compile_ms": round(result.compile_ms, 3),
                  "cached": result.source == "cached", "source": result.source, "outcome": outcome}
        if error is not None:
            fields["error"] = error.message[:200]
        self.log.info("grammar.compile", **fields)

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        path = self.settings.tokenizer_json
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (model_dir must hold the model's tokenizer.json)")
        self.tokenizer_id = await asyncio.get_running_loop().run_in_executor(None, tokenizer_id, path)
        await self.pool.start()
        s = self.settings
        self.log.info("grammar_compiler.started", tokenizer_id=self.tokenizer_id, tokenizer=str(path),
                      processes=s.processes, pids=self.pool.pids(), compile_timeout_s=s.compile_timeout_s,
                      cache_bytes=s.cache_bytes, error_ttl_s=s.error_ttl_s, max_queue=s.max_queue)

    async def on_stop(self) -> None:
        await self.cache.close()
        await self.pool.close()
