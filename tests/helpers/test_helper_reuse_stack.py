"""The stack of test_epd_reuse: E/P/D with two prefill workers, plus a cold reference, from one
`epd up --detach` of a topology written at a free port base (literal tcp://127.0.0.1 peer addresses).

The prefill router splits its length buckets at SPLIT tokens and never re-deals them (round_s of a
day; a rank that misses heartbeats would re-deal them, hence its long dead_after), so each prefill
worker serves one side of SPLIT: a prompt of at most SPLIT tokens goes to one worker and a longer
one to the other. Which is which depends on the order they registered; the tests read it from the
logs. Beside the E/P/D path, a `unified` worker with its prefix cache off sits behind a second
gateway: it computes every prompt from scratch (the cold run).

The test process renders prompts with the gateway's own adapter, so it knows each request's token
ids and block hash chain, and asks the KV writer (KvLookup) and the SWA registry (SwaLookup,
SwaUnregister) directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai

from messages.kv_store import KvLookup
from messages.swa_registry import SwaLookup, SwaUnregister
from ops.control_client import call
from tests.helpers.test_helper_processes import REPO, wait_until
from tests.helpers.test_helper_stack import free_port_base, link_model, pid_alive

MODEL = "deepseek-v4-tiny"   # served under its directory's name; V4 here, V4.1 in test_epd_replay
SPLIT = 1280          # prompt tokens: <= SPLIT -> bucket 0's prefill worker, more -> bucket 1's
NO_THINKING = {"thinking": {"type": "disabled"}}
# slot (port offset) of each instance, in the topology's order
KV_WRITER, SWA_REGISTRY, DECODE_ROUTER, PREFILL_ROUTER, DECODE_WORKER = range(5)
PREFILL_WORKERS = (5, 6)
SLOTS = 10

_ENGINE = """num_pages = 512
max_num_seqs = 8
max_batched_tokens = 2048
max_model_len = 8192"""


def topology(port_base: int, http_ports: tuple[int, int], model: str = MODEL) -> str:
    at = lambda slot: f"tcp://127.0.0.1:{port_base + slot}"   # noqa: E731
    peers = f'kv_writer = "{at(KV_WRITER)}"\nswa_registry = "{at(SWA_REGISTRY)}"'
    gateway = f"""served_model = "{model}"
context_length = 8192"""
    return f"""[stack]
host = "127.0.0.1"
port_base = {port_base}
ready_timeout_s = 240.0

[model]
dir = ".epd/models/{model}"
dtype = "float32"

[[service]]
name = "kv_writer"
kind = "kv_writer"
[service.settings]
root = ".epd/kvstore"

[[service]]
name = "swa_registry"
kind = "swa_registry"

[[service]]
name = "decode_router"
kind = "decode_router"

[[service]]
name = "prefill_router"
kind = "prefill_router"
dead_after = 30       # a worker slowed down by a busy test machine must not lose its bucket
[service.settings]
kv_store_dir = ".epd/kvstore"
decode_router = "{at(DECODE_ROUTER)}"
bucket_bounds = [{SPLIT}, 4096, 16384]
round_s = 86400.0

[[service]]
name = "decode_worker"
kind = "decode_worker"
upstream = "decode_router"
[service.settings]
{_ENGINE}
{peers}

[[service]]
name = "prefill_worker"
kind = "prefill_worker"
replicas = 2
upstream = "prefill_router"
[service.settings]
{_ENGINE}
kv_store_dir = ".epd/kvstore"
{peers}

[[service]]
name = "gateway"
kind = "gateway"
upstream = "prefill_router"
[service.settings]
http_bind = "127.0.0.1:{http_ports[0]}"
{gateway}

[[service]]
name = "cold_worker"
kind = "unified_worker"
[service.settings]
{_ENGINE}
enable_prefix_cache = false

[[service]]
name = "cold_gateway"
kind = "gateway"
upstream = "cold_worker"
[service.settings]
http_bind = "127.0.0.1:{http_ports[1]}"
{gateway}
"""


@dataclass
class ReuseStack:
    root: Path
    env: dict
    state: dict
    port_base: int
    urls: tuple[str, str]        # the E/P/D gateway, the cold gateway
    model: str = MODEL           # the served model name (its directory's)

    def address(self, slot: int) -> str:
        return f"tcp://127.0.0.1:{self.port_base + slot}"

    def client(self, cold: bool = False) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[cold] + "/v1", api_key="unused", max_retries=0, timeout=300)

    # ---- what the services say ----------------------------------------------------------
    def events(self, instance: str, event: str, request_id: str) -> list[dict]:
        """The log lines `event` of `request_id` in one instance's log."""
        path = self.root / "runs" / "current" / "logs" / f"{instance}.log"
        lines = (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
        return [line for line in lines if line.get("event") == event and line.get("request_id") == request_id]

    def prefilled_by(self, request_id: str) -> tuple[str, dict]:
        """(prefill worker instance, its request.prefilled line) of the request: exactly one. The
        worker writes the line once the decode worker took the state, so it may trail the answer."""
        def found():
            return [(f"prefill_worker-{i}", line) for i in range(len(PREFILL_WORKERS))
                    for line in self.events(f"prefill_worker-{i}", "request.prefilled", request_id)]
        lines = wait_until(found, 30, f"the request.prefilled line of {request_id}")
        assert len(lines) == 1, f"{request_id} prefilled {len(lines)} times: {lines}"
        return lines[0]

    def stored_blocks(self, hashes: list[bytes]) -> int:
        reply = call(self.address(KV_WRITER), KvLookup(hashes, with_locations=False), timeout_s=5.0)
        assert reply is not None, "the KV writer did not answer KvLookup"
        return reply.hit_blocks

    def holders(self, hashes: list[bytes]) -> list[str]:
        reply = call(self.address(SWA_REGISTRY), SwaLookup(hashes), timeout_s=5.0)
        assert reply is not None, "the SWA registry did not answer SwaLookup"
        return list(reply.holders)

    def unregister(self, block_hash: bytes, holder: str) -> int:
        reply = call(self.address(SWA_REGISTRY), SwaUnregister([block_hash], holder, ack=True), timeout_s=5.0)
        assert reply is not None, "the SWA registry did not answer SwaUnregister"
        return reply.count

    def wait_stored(self, hashes: list[bytes], blocks: int) -> None:
        wait_until(lambda: self.stored_blocks(hashes) >= blocks, 60, f"{blocks} blocks in the KV store")

    def wait_held(self, block_hash: bytes, holder: str) -> None:
        wait_until(lambda: self.holders([block_hash]) == [holder], 60, f"the window registered by {holder}")


def up(root: Path, tiny_model_dir: Path) -> ReuseStack:
    """The stack serving `tiny_model_dir` (V4 or V4.1) under the directory's name."""
    env = {**os.environ, "EPD_RUN_ROOT": str(root / "runs"), "PYTHONPATH": str(REPO)}
    link_model(root, tiny_model_dir)
    base = free_port_base(SLOTS)
    http = free_port_base(2, offset=0)
    (root / "reuse.toml").write_text(topology(base, (http, http + 1), tiny_model_dir.name))
    done = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--detach", "--topology", str(root / "reuse.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((root / "runs/current/state.json").read_text())
    return ReuseStack(root, env, state, base, (f"http://127.0.0.1:{http}", f"http://127.0.0.1:{http + 1}"),
                      tiny_model_dir.name)


def down(stack: ReuseStack) -> None:
    """`epd down`, then no process of the stack may be left."""
    subprocess.run([sys.executable, "-m", "ops.cli", "down"], cwd=stack.root, env=stack.env,
                   capture_output=True, timeout=120)
    for pid in [stack.state["supervisor_pid"], *(s["pid"] for s in stack.state["services"])]:
        assert not pid_alive(pid), "epd down left a process behind"


class Prompts:
    """Chat prompts rendered by the gateway's adapter: token ids and the block hash chain."""

    def __init__(self, model_dir: Path):
        from messages.prefix import model_identity
        from services.gateway.adapter import Adapter, AdapterConfig, ServedModel
        from services.gateway.model_dir import served_encoding
        self.model = model_dir.name
        served = ServedModel(self.model, context_length=8192, tokenizer_path=str(model_dir / "tokenizer.json"),
                             encoding=served_encoding(str(model_dir)))
        self.adapter = Adapter(AdapterConfig(models=(served,)))
        self.model_id = model_identity(model_dir, "float32")

    def ids(self, messages: list[dict]) -> list[int]:
        from services.gateway.adapter.errors import Protocol
        body = {"model": self.model, "messages": messages, "max_tokens": 1, **NO_THINKING}
        return self.adapter.prepare(Protocol.CHAT, json.dumps(body).encode()).prompt_ids

    def hashes(self, ids: list[int]) -> list[bytes]:
        from messages.prefix import block_hashes
        return block_hashes(self.model_id, ids)
