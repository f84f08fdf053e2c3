"""Cold compiles and mask walks of one (library, case), each compile in a fresh forked process.

The parent builds each library's tokenizer once (about a second each), then forks one child per
compile: the child starts with the tokenizer and nothing else the library may have cached, as a
compile worker does after its start, and a compile that runs away can be stopped. Each child has a
hard time limit on its compile (as the compiler service's `compile_timeout_s`) and a cap on the
memory it may add (RLIMIT_AS: xgrammar's serializer went past 22 GB on one nested schema); past
either it is killed and the row says which. The last run of a case also measures the artifact (its size) and
walks its grammar (masks.py) in the same child, on the grammar it just compiled; either may
fail on its own (xgrammar's serializer can need far more memory than its compile) and says so.

Children report over a pipe in JSON: {"compile_ms"} or {"error"}, then {"artifact_bytes" or
"artifact_error", "walk" or "walk_error"}.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import resource
import signal

from messages.errors import GrammarUnsupported, WireError
from messages.grammar import constraint_json
from bench.grammar.cases import Case
from bench.grammar.masks import RejectedToken, walk
from bench.stack.command import pick

AFTER_COMPILE_TIMEOUT_S = 300.0   # artifact + walk, once the compile itself is done


class LLGuidanceSide:
    """Production: services/grammar_compiler/check.py's compile job, the engine's matcher."""
    name = "llguidance"
    unavailable = ""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, (eos_id,)

    def compile(self, constraint: dict):
        from services.grammar_compiler.check import compile_constraint
        return compile_constraint(constraint_json(constraint), self.tokenizer)   # (grammar text, ms)

    def artifact_bytes(self, grammar: str) -> int:
        return len(grammar.encode())

    def matcher(self, grammar: str):
        from engine.grammar import GrammarState
        return GrammarState(self.tokenizer, grammar)

    @staticmethod
    def why(state) -> str:
        """The matcher's own reason for a rejected token (its first line)."""
        error = state.matcher_for_batch().get_error().strip()
        return f"({error.splitlines()[0][:160]})" if error else ""


class XGrammarSide:
    """services/grammar_compiler/xgrammar_backend.py, or the reason it cannot run here."""
    name = "xgrammar"

    def __init__(self, tokenizer_json, vocab_size: int, eos_id: int, threads: int):
        from services.grammar_compiler import xgrammar_backend
        self.vocab_size, self.stop_ids = vocab_size, (eos_id,)
        self.unavailable = xgrammar_backend.available()
        self.backend = None if self.unavailable else xgrammar_backend.XGrammarBackend(
            tokenizer_json, vocab_size, stop_token_ids=(eos_id,), max_threads=threads)

    def compile(self, constraint: dict):
        # what a compiler receives: the canonical constraint (its keys sorted, properties included)
        canonical = json.loads(constraint_json(constraint))
        return self.backend.compile_grammar(canonical)   # (CompiledGrammar, ms)

    def artifact_bytes(self, compiled) -> int:
        return len(compiled.serialize_json().encode())

    def matcher(self, compiled):
        return self.backend.matcher(compiled)

    @staticmethod
    def why(matcher) -> str:
        return ""


def measure(side, case: Case, runs: int, walk_tokens: int, seed: int, timeout_s: float, memory_gib: float) -> dict:
    """{"status", "runs", "p50_ms", "max_ms", "artifact_bytes", "walk"} for one library and case."""
    if side.unavailable:
        return {"status": side.unavailable}
    times, result = [], {"status": "ok"}
    for run in range(runs):
        last = run == runs - 1
        report = _in_child(side, case, walk_tokens if last else 0, seed, timeout_s, memory_gib)
        if "error" in report:
            return {"status": report["error"], "runs": len(times)}
        times.append(report["compile_ms"])
        if last:
            result.update({k: report[k] for k in ("artifact_bytes", "artifact_error", "walk", "walk_error")
                           if k in report})
    return {**result, "runs": len(times), "p50_ms": round(pick(times, 0.5), 2), "max_ms": round(max(times), 2),
            "compile_ms": [round(t, 2) for t in times]}


def _in_child(side, case: Case, walk_tokens: int, seed: int, timeout_s: float, memory_gib: float) -> dict:
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(writer, side, case, walk_tokens, seed, memory_gib), daemon=True)
    child.start()
    writer.close()
    try:
        first = _receive(reader, timeout_s)
        if first is None:
            return {"error": f"timeout (> {timeout_s:g} s)"}
        if "error" in first or not walk_tokens:
            return _explained(first, child, memory_gib)
        rest = _receive(reader, AFTER_COMPILE_TIMEOUT_S)
        if rest is None:
            return {"error": f"artifact + walk past {AFTER_COMPILE_TIMEOUT_S:g} s"}
        return _explained({**first, **rest}, child, memory_gib)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        reader.close()


def _receive(reader, timeout_s: float) -> dict | None:
    """The child's next report; None past the time limit; {"error"} when it died without one."""
    if not reader.poll(timeout_s):
        return None
    try:
        return json.loads(reader.recv_bytes())
    except EOFError:
        return {"error": "died"}


def _explained(report: dict, child, memory_gib: float) -> dict:
    """A child that died without a word: its exit code or signal, with the memory cap (the usual cause)."""
    if report.get("error") != "died":
        return report
    child.join(5.0)
    code = child.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
    return {**report, "error": f"died ({how}; memory cap {memory_gib:g} GiB)"}


def _child(writer, side, case: Case, walk_tokens: int, seed: int, memory_gib: float) -> None:
    _cap_memory(memory_gib)
    try:
        compiled, compile_ms = side.compile(case.constraint)
    except Exception as exc:  # noqa: BLE001 - a library's refusal or failure is this row's result
        _send(writer, {"error": _failure(exc, memory_gib)})
        return
    _send(writer, {"compile_ms": compile_ms})
    if not walk_tokens:
        return
    report = {}
    try:
        report["artifact_bytes"] = side.artifact_bytes(compiled)
    except Exception as exc:  # noqa: BLE001 - e.g. xgrammar's serializer out of memory (std::bad_alloc)
        report["artifact_error"] = _failure(exc, memory_gib)
    try:
        report["walk"] = walk(lambda: side.matcher(compiled), walk_tokens, side.vocab_size, side.stop_ids, seed)
    except RejectedToken as exc:
        report["walk_error"] = f"{exc} {side.why(exc.matcher)}".strip()
    except Exception as exc:  # noqa: BLE001
        report["walk_error"] = _failure(exc, memory_gib)
    _send(writer, report)


def _failure(exc: Exception, memory_gib: float) -> str:
    if isinstance(exc, GrammarUnsupported):
        return f"unsupported: {exc.message}"
    if isinstance(exc, WireError):
        return f"refused: {exc.message}"
    if isinstance(exc, MemoryError):
        return f"out of memory (cap {memory_gib:g} GiB)"
    return f"failed: {type(exc).__name__}: {str(exc)[:200]}"


def _send(writer, report: dict) -> None:
    writer.send_bytes(json.dumps(report).encode())


def _cap_memory(memory_gib: float) -> None:
    """Limit the address space to what the process holds now plus `memory_gib`."""
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = held + int(memory_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
