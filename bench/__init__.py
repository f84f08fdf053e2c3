"""`epd bench ...`: one module per benchmark, each with a `register(subparsers)` adding its subcommand.

Adding a benchmark is one line in BENCH_MODULES. Modules keep heavy imports (torch, zmq, the
runtime) inside their handlers so `epd --help` stays fast.
"""
from __future__ import annotations

import importlib

BENCH_MODULES = (
    "bench.wire.command",      # bench wire: runtime transport vs raw pyzmq
    "bench.gateway.command",   # bench gateway: adapter vs bare deepseek-recipe (prepare, stream, loop lag)
    "bench.kv.command",        # bench kv: KV store vs plain file I/O, prefix lookups at 1M blocks
    "bench.engine.command",    # bench engine: EngineCore vs transformers DeepseekV4 vs the memory floor
    "bench.stack.command",     # bench stack: the E/P/D stack over HTTP vs the engine alone (TTFT, tokens/s)
    "bench.grammar.command",   # bench grammar: llguidance vs xgrammar (compile, masks), engine steps with masks
    "bench.vision.command",    # bench vision: patch-aware vision balancing vs round robin and random (simulated, real)
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure the stack (latency, throughput) against targets")
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module_name in BENCH_MODULES:
        importlib.import_module(module_name).register(benches)
