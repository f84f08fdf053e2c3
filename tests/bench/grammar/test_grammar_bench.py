"""`epd bench grammar` end to end at a tiny size (xgrammar hidden: its rows must say so), the forked
compile's limits, a walk the matcher gives up on, and the xgrammar adapter itself (where installed).
No timing asserts."""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from pathlib import Path

import pytest

import bench
from bench.grammar.cases import Case, cases, optional_properties_schema, simple_schema

REPO = Path(__file__).resolve().parents[3]
LIBRARIES = ("llguidance", "xgrammar")


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "grammar", *argv])
    return args.func(args)


def table(printed: str, title_start: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, row cells) of the printed table whose title starts with `title_start`: the
    header follows the title, a rule follows the header, rows run to a blank or unindented-text line."""
    lines = printed[printed.index(title_start) + 1:].splitlines()
    header, rule, *rest = lines[1:]
    assert set(rule.replace(" ", "")) == {"-"}
    rows = []
    for line in rest:
        if not line.strip() or line.endswith(":"):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return re.split(r"\s{2,}", header.strip()), rows


@pytest.fixture
def without_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)   # `import xgrammar` raises ImportError


@pytest.mark.slow   # forks a process per compile; loads the engine
def test_the_bench_runs_end_to_end_and_its_tables_have_every_class_and_library(
        tiny_v41_model_dir, without_xgrammar, tmp_path, capsys):
    out = tmp_path / "grammar.json"
    argv = ["--model-dir", str(tiny_v41_model_dir), "--quick", "--tokens", "3", "--runs", "1", "--steps", "1",
            "--rounds", "1", "--batches", "2", "--json", str(out)]
    assert run_bench(argv) == 0
    printed = capsys.readouterr().out
    names = [c.name for c in cases()]

    header, rows = table(printed, "\nepd bench grammar: cold compiles")
    assert header == ["class", "library", "runs", "p50 ms", "max ms", "artifact bytes", "time vs llg",
                      "size vs llg", "status"]
    assert [(r[0], r[1]) for r in rows] == [(n, lib) for n in names for lib in LIBRARIES]
    for r in rows:
        assert r[-1] == ("ok" if r[1] == "llguidance" else "xgrammar not installed")

    header, rows = table(printed, "\nmask per token")
    assert header[:6] == ["class", "library", "tokens", "matcher ms", "mask p50 us", "p99 us"]
    assert header[-1] == "status" and "p50 vs llg" in header
    assert [(r[0], r[1]) for r in rows] == [(n, lib) for n in names for lib in LIBRARIES]
    assert all(r[-1] == "xgrammar not installed" for r in rows if r[1] == "xgrammar")

    header, rows = table(printed, "\nengine steps")
    assert header[:5] == ["batch", "steps", "plain ms/step", "masked ms/step", "masked/plain"]
    assert [r[0] for r in rows] == ["2"] and rows[0][4].endswith("x")

    doc = json.loads(out.read_text())
    assert doc["bench"] == "grammar" and doc["vocab_size"] == 129280
    for r in doc["compile"]:
        if r["library"] == "llguidance":
            assert r["status"] == "ok" and 0 < r["p50_ms"] <= r["max_ms"] and r["artifact_bytes"] > 0
            assert r["walk"]["tokens"] == 3 and 0 < r["walk"]["p50_us"] <= r["walk"]["p99_us"] <= r["walk"]["max_us"]
        else:
            assert r == {"case": r["case"], "what": r["what"], "library": "xgrammar",
                         "status": "xgrammar not installed"}
    for r in doc["engine"]:
        assert r["steps"] == 1 and r["plain_ms"] > 0 and r["masked_ms"] > 0 and r["fill_ms"] > 0 and r["apply_ms"] > 0


@pytest.mark.slow   # forks compile processes (a tenth of a second each)
def test_a_compile_past_its_time_limit_is_stopped_and_the_row_says_so(llguidance_side, monkeypatch):
    from bench.grammar.compile import measure
    case = Case("simple", "3 fields", {"kind": "json_schema", "schema": simple_schema(), "strict": True})
    # a compile that never ends (the forked child inherits it): a real one can beat 1 ms when this process is slow
    monkeypatch.setattr(llguidance_side, "compile", lambda constraint: threading.Event().wait())
    timed_out = measure(llguidance_side, case, runs=2, walk_tokens=3, seed=0, timeout_s=0.001, memory_gib=4)
    assert timed_out == {"status": "timeout (> 0.001 s)", "runs": 0}


@pytest.mark.slow   # forks a compile process
def test_a_grammar_the_parser_would_give_up_on_is_refused_by_the_check(llguidance_side):
    """llguidance 1.9.1: 600 optional properties pass the first mask, then the first token the mask
    allows overflows the parser's row limit; the compiler's trial walk refuses it up front."""
    from bench.grammar.compile import measure
    case = Case("optional", "600", {"kind": "json_schema", "schema": optional_properties_schema(600), "strict": True})
    result = measure(llguidance_side, case, runs=1, walk_tokens=5, seed=0, timeout_s=30, memory_gib=4)
    assert re.match(r"refused: the constraint is too complex to enforce: .*max is 2000", result["status"])


def test_xgrammar_missing_is_a_reason_not_an_error(without_xgrammar):
    from bench.grammar.compile import XGrammarSide, measure
    from services.grammar_compiler.xgrammar_backend import available
    assert available() == "xgrammar not installed"
    side = XGrammarSide(REPO / "unused-tokenizer.json", 129280, 1, threads=1)
    assert measure(side, cases()[0], runs=3, walk_tokens=3, seed=0, timeout_s=1, memory_gib=1) == {
        "status": "xgrammar not installed"}


def test_nothing_in_the_stack_imports_the_xgrammar_adapter():
    """xgrammar is a bench-time comparison: only bench/grammar/*.py may reach it."""
    importers = [str(p.relative_to(REPO)) for top in ("services", "engine", "messages", "ops", "bench")
                 for p in (REPO / top).rglob("*.py") if "xgrammar_backend" in p.read_text(encoding="utf-8")]
    assert importers and all(re.fullmatch(r"bench/grammar/\w+\.py", p) for p in importers), importers


@pytest.mark.slow   # xgrammar's import (torch, transformers) and TokenizerInfo: ~5-10 s
def test_the_xgrammar_adapter_compiles_serializes_and_walks_our_constraints(tiny_v41_model_dir):
    """Where xgrammar is installed: json_schema and tool_calls compile, the artifact loads back into
    the same grammar, a walk through it runs; what it has no form of is GrammarUnsupported."""
    pytest.importorskip("xgrammar")
    from messages.errors import GrammarUnsupported
    from bench.grammar.cases import tool_set
    from bench.grammar.masks import walk
    from services.grammar_compiler.xgrammar_backend import XGrammarBackend
    backend = XGrammarBackend(tiny_v41_model_dir / "tokenizer.json", 129280, max_threads=1)
    artifact, ms = backend.compile({"kind": "json_schema", "schema": simple_schema(), "strict": True})
    assert ms > 0 and json.loads(artifact)
    stats = walk(lambda: backend.matcher(backend.load(artifact)), 8, 129280, (1,), seed=0)
    assert stats["tokens"] == 8
    tools = tool_set(2)
    compiled, _ = backend.compile_grammar(tools)
    assert "DSML\\uff5c calls>" in str(compiled.grammar) and tools["tools"][1]["name"] in str(compiled.grammar)
    assert walk(lambda: backend.matcher(compiled), 8, 129280, (1,), seed=0)["tokens"] == 8
    with pytest.raises(GrammarUnsupported, match="opened"):
        backend.compile_grammar({**tools, "opened": True})
    with pytest.raises(GrammarUnsupported, match="no xgrammar form"):
        backend.compile_grammar({"kind": "regex"})


@pytest.fixture(scope="module")
def llguidance_side(tiny_v41_model_dir):
    from engine.grammar import load_grammar_tokenizer
    from bench.grammar.compile import LLGuidanceSide
    return LLGuidanceSide(load_grammar_tokenizer(tiny_v41_model_dir / "tokenizer.json", 129280, 1), 129280, 1)
