"""Issue 24, item 2, on real processes: an E/P/D stack whose workers serve the release's packed
weights (`weights = "released"` in the topology's [model] table) keeps its prefix cache through the
KV store. The workers' identity ends `+released`; the gateway learns it from them (it has no dtype
or weights setting), so its block hashes match the pages the decode worker stored. A prompt of
several blocks is answered, the prefill worker is killed and restarted (its own cache gone), and the
same prompt again is served from the store: cached tokens > 0 (with hashes under another identity
the store is never hit, and the answer was 0)."""
from __future__ import annotations

import json
import os
import signal

import openai
import pytest

from messages.kv_store import KvLookup
from messages.prefix import BLOCK_TOKENS, block_hashes, model_identity
from ops.control_client import call, query_status
from tests.helpers.test_helper_processes import wait_until
from tests.helpers.test_helper_reuse_stack import NO_THINKING, Prompts
from tests.helpers.test_helper_stack import down_stack, up_stack

pytestmark = pytest.mark.slow   # starts service processes

TOPOLOGY = """[stack]
host = "127.0.0.1"
ready_timeout_s = 240.0

[model]
dir = ".epd/models/{model}"
dtype = "float32"
weights = "released"

[[service]]
name = "gateway"
kind = "gateway"
upstream = "prefill_router"
[service.settings]
http_bind = "127.0.0.1:8000"   # moved to a free port by up_stack
context_length = 8192

[[service]]
name = "prefill_router"
kind = "prefill_router"
[service.settings]
kv_store_dir = ".epd/kvstore"
decode_router = "@decode_router"

[[service]]
name = "prefill_worker"
kind = "prefill_worker"
upstream = "prefill_router"
[service.settings]
num_pages = 128
max_num_seqs = 4
torch_threads = 1
kv_store_dir = ".epd/kvstore"
kv_writer = "@kv_writer"
swa_registry = "@swa_registry"

[[service]]
name = "decode_router"
kind = "decode_router"

[[service]]
name = "decode_worker"
kind = "decode_worker"
upstream = "decode_router"
[service.settings]
num_pages = 128
max_num_seqs = 4
torch_threads = 1
kv_writer = "@kv_writer"
swa_registry = "@swa_registry"

[[service]]
name = "kv_writer"
kind = "kv_writer"
[service.settings]
root = ".epd/kvstore"

[[service]]
name = "swa_registry"
kind = "swa_registry"
"""
PROMPT = " ".join(f"Line {i}: the keeper rang the bell by the harbor wall while the fog came in." for i in range(24))


@pytest.fixture
def stack(tmp_path, tiny_v41_model_dir):
    path = tmp_path / "released.toml"
    path.write_text(TOPOLOGY.format(model=tiny_v41_model_dir.name))
    s = up_stack(tmp_path, str(path), tiny_v41_model_dir)
    yield s
    down_stack(s)


def current(stack: dict, name: str) -> dict:
    """The instance's entry in state.json as the supervisor writes it now (its pid changes on restart)."""
    state = json.loads((stack["root"] / "runs/current/state.json").read_text())
    return next(svc for svc in state["services"] if svc["instance"] == name)


@pytest.mark.timeout(420)   # a stack start, a worker restart (a model load) and two requests on 2 cores
def test_a_released_weights_stack_keeps_prefix_hits_through_the_store_after_a_prefill_restart(stack,
                                                                                              tiny_v41_model_dir):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": PROMPT}]

    def ask(request_id: str):
        return client.chat.completions.create(model=tiny_v41_model_dir.name, messages=messages, temperature=0,
                                              max_tokens=4, extra_body=NO_THINKING,
                                              extra_headers={"x-request-id": request_id})

    released = model_identity(tiny_v41_model_dir, "float32+released")   # what the workers' engines derive
    gateway = current(stack, "gateway-0")["address"]

    def gateway_identity() -> str:
        reply = query_status(gateway, 1.0)
        return reply.model_id if reply else ""
    wait_until(lambda: gateway_identity() == released, 30, "the gateway to learn the workers' +released identity")

    first = ask("released-1")
    assert first.usage.prompt_tokens >= 3 * BLOCK_TOKENS, first.usage.prompt_tokens
    hashes = block_hashes(released, Prompts(tiny_v41_model_dir).ids(messages))
    kv_writer = current(stack, "kv_writer-0")["address"]

    def stored() -> bool:
        reply = call(kv_writer, KvLookup(hashes, with_locations=False), timeout_s=5.0)
        return reply is not None and reply.hit_blocks >= 2
    wait_until(stored, 60, "the prompt's blocks in the KV store under the +released identity")

    old = current(stack, "prefill_worker-0")
    os.kill(old["pid"], signal.SIGKILL)

    def restarted() -> bool:
        now = current(stack, "prefill_worker-0")
        reply = now["pid"] and now["pid"] != old["pid"] and query_status(now["address"], 1.0)
        return bool(reply and reply.pid == now["pid"] and reply.upstream_connected)
    wait_until(restarted, 180, "the prefill worker restarted and registered again", poll_s=0.3)

    again = ask("released-2")
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0
