"""The committed Compose file, run for real: `make compose-test` builds epd:latest, then this module
starts the default topology in containers, serves SDK requests through the published port, shows
that a link without the stack's CURVE keys gets no answer, scales both worker pools to two replicas
and sees each replica serve, kills a decode container mid-stream and gets the same greedy text,
follows one request across containers with `epd trace`, and leaves nothing behind after `down -v`.
It needs a Docker engine, so it runs only under EPD_COMPOSE_TEST=1 (`make compose-test`, which
`.ci/run` calls when dockerd can start)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from tests.compose.compose_cli_for_tests import (ROOT, ComposeStackForTests, compose_command, docker_answers,
                                                 log_records)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("EPD_COMPOSE_TEST") != "1",
                       reason="starts containers: `make compose-test` runs it (a Docker engine and epd:latest)"),
]

URL = "http://127.0.0.1:8000"
MODEL = "deepseek-v41-tiny"
IMAGE = os.environ.get("EPD_IMAGE", "epd:latest")
KEYS_DIR = ROOT / "compose" / "keys"
NO_THINKING = {"thinking": {"type": "disabled"}}
DEFAULT = {"gateway": 1, "grammar_compiler": 1, "prefill_router": 1, "prefill_worker": 1, "decode_router": 1,
           "decode_worker": 1, "kv_writer": 1, "swa_registry": 1, "vision_balancer": 1, "vision_worker": 1}
SCALED = {**DEFAULT, "prefill_worker": 2, "decode_worker": 2}


@pytest.fixture(scope="module")
def stack():
    command = compose_command()
    if command is None:
        pytest.fail("neither `docker compose` nor `docker-compose` is installed")
    why = docker_answers()
    if why:
        pytest.fail(why)
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it with compose/build-image (make compose-test does)")
    if not (KEYS_DIR / "server.key_secret").exists():
        subprocess.run(["compose/make-keys"], cwd=ROOT, check=True, timeout=120)
    compose = ComposeStackForTests(command)
    compose.run("down", "-v", "--remove-orphans", check=False)   # what an aborted earlier run left
    compose.run("up", "-d", "--no-build", timeout=600)
    compose.wait_healthy(DEFAULT)
    yield compose
    compose.run("down", "-v", "--remove-orphans", check=False, timeout=300)


def chat_client() -> openai.OpenAI:
    return openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=180)


def test_sdk_requests_through_the_published_port(stack):
    client = chat_client()
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_body=NO_THINKING,
                                          messages=[{"role": "user", "content": "Hello from Compose"}])
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    assert chat.choices[0].message.content

    response = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0,
                                       input="Hello from the Responses API", extra_body=NO_THINKING)
    assert response.usage.output_tokens == 6 and response.output

    message = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0, timeout=180).messages.create(
        model=MODEL, max_tokens=5, extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Hello from the Anthropic SDK"}])
    assert message.usage.output_tokens == 5 and message.stop_reason == "max_tokens"


def test_links_between_containers_need_the_stacks_curve_keys(stack):
    gateway = stack.containers("gateway")[0]["name"]
    probe = ["epd", "health", "--address", "tcp://prefill_router:5602"]
    keyed = subprocess.run(["docker", "exec", gateway, *probe], capture_output=True, text=True, timeout=60)
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    keyless = subprocess.run(["docker", "exec", gateway, "env", "-u", "EPD_KEYS_DIR", *probe],
                             capture_output=True, text=True, timeout=60)
    assert keyless.returncode != 0
    assert "CURVE" in keyless.stdout + keyless.stderr   # says why, instead of a bare timeout


def test_both_replicas_of_each_scaled_pool_serve_requests(stack):
    stack.run("up", "-d", "--no-build", "--no-recreate",
              "--scale", "prefill_worker=2", "--scale", "decode_worker=2", timeout=600)
    stack.wait_healthy(SCALED)
    client = chat_client()
    seen_prefill: set[str] = set()
    seen_decode: set[str] = set()
    ids: list[str] = []

    def one(i: int) -> str:
        request_id = f"req-compose-scale-{uuid.uuid4().hex[:12]}"
        client.chat.completions.create(
            model=MODEL, max_tokens=24, temperature=0, extra_body=NO_THINKING,
            extra_headers={"x-request-id": request_id},
            messages=[{"role": "user", "content": f"request {i}: " + "spread the load " * (5 + i)}])
        return request_id

    # A replica registers with its router a moment after it turns healthy, so send rounds of
    # concurrent requests until each replica has served one (bounded by the rounds).
    for round_ in range(6):
        with ThreadPoolExecutor(8) as pool:
            ids += list(pool.map(one, range(round_ * 8, round_ * 8 + 8)))
        wanted = set(ids)
        for prefix, record in log_records(stack.logs("prefill_worker", "decode_worker")):
            if record.get("request_id") not in wanted:
                continue
            if record.get("event") == "request.prefilled":
                seen_prefill.add(prefix)
            if record.get("event") == "request.summary" and record.get("type") == "StateHandoff":
                seen_decode.add(prefix)
        if len(seen_prefill) == 2 and len(seen_decode) == 2:
            break
    assert len(seen_prefill) == 2, f"prefill replicas that served: {seen_prefill}"
    assert len(seen_decode) == 2, f"decode replicas that served: {seen_decode}"


def stream_text(client: openai.OpenAI, request_id: str, on_chunk=None) -> str:
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=160, temperature=0, stream=True, extra_body=NO_THINKING,
        extra_headers={"x-request-id": request_id},
        messages=[{"role": "user", "content": "Tell a long story about containers " * 3}])
    parts = []
    for n, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if on_chunk:
            on_chunk(n)
    return "".join(parts)


def decode_container_of(stack: ComposeStackForTests, request_id: str) -> str | None:
    """The decode container a request was handed to: the prefill worker logs its address, whose host
    is the container's hostname, which Docker sets to the container's short id."""
    for _prefix, record in log_records(stack.logs("prefill_worker")):
        if record.get("request_id") == request_id and record.get("event") == "request.prefilled":
            host = record["decode"].removeprefix("tcp://").rpartition(":")[0]
            for container in stack.containers("decode_worker"):
                if container["id"].startswith(host):
                    return container["name"]
    return None


def test_killing_the_decode_container_mid_stream_keeps_the_greedy_text(stack, request_ids):
    client = chat_client()
    reference = stream_text(client, f"req-compose-ref-{uuid.uuid4().hex[:12]}")
    request_id = f"req-compose-kill-{uuid.uuid4().hex[:12]}"
    killed: list[str] = []

    def kill_after_some_tokens(n: int) -> None:
        if n == 8 and not killed:
            name = decode_container_of(stack, request_id)
            assert name, "the prefill worker logged no decode address for the request"
            subprocess.run(["docker", "kill", name], check=True, capture_output=True, timeout=60)
            killed.append(name)

    text = stream_text(client, request_id, kill_after_some_tokens)
    assert killed, "the stream ended before the kill"
    assert text == reference
    request_ids["killed"] = request_id


@pytest.fixture(scope="module")
def request_ids() -> dict[str, str]:
    return {}


def test_compose_logs_piped_to_epd_trace_follow_the_resumed_request(stack, request_ids):
    request_id = request_ids.get("killed")
    assert request_id, "the kill test did not run"
    logs = stack.run("logs", "--no-color").stdout
    trace = subprocess.run([sys.executable, "-m", "ops.cli", "trace", request_id, "-"], input=logs,
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert trace.returncode == 0, trace.stderr
    for service in ("gateway", "prefill_router", "prefill_worker", "decode_worker"):
        assert service in trace.stdout, f"{service} missing from the trace:\n{trace.stdout}"
    print(trace.stdout)   # the closing note quotes it


def test_the_image_keeps_no_build_secret_and_runs_as_the_epd_user():
    inside = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                             "id -u; ls -A /run/secrets; env"], capture_output=True, text=True, timeout=120)
    uid, *rest = inside.stdout.splitlines()
    assert uid == "10001"
    assert not any(line.startswith(("pip_cert", "PIP_CERT=")) for line in rest), rest
    history = subprocess.run(["docker", "history", "--no-trunc", IMAGE], capture_output=True, text=True,
                             check=True).stdout
    assert "BEGIN CERTIFICATE" not in history


def test_down_with_volumes_leaves_no_container_network_or_volume(stack):
    stack.run("down", "-v", "--remove-orphans", timeout=300)
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
