"""The bad-input suite over HTTP against the running stack: every malformed request gets its
status in its protocol's error shape, the gateway stays healthy, and the worker holds nothing."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

from ops.control_client import query_status
from tests.conftest import V41_MODEL_NAME as STACK_MODEL
from tests.gateway.conftest import MODEL
from tests.gateway.test_bad_inputs import CASES

pytestmark = pytest.mark.slow   # starts service processes

PATHS = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict | None]:
    target = urlparse(url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except json.JSONDecodeError:
        return response.status, None


def _safe_json(raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


# Cases whose body names the stack's served model (the others use test-only adapter models).
STACK_CASES = [c for c in CASES if not isinstance(_safe_json(c[2]), dict)
               or _safe_json(c[2]).get("model") in (MODEL, 5, "gpt-5") or "model" not in _safe_json(c[2])]


def test_the_suite_is_large_enough_and_spans_the_three_apis():
    assert len(STACK_CASES) >= 30
    assert {c[0].value for c in STACK_CASES} == set(PATHS)


@pytest.mark.parametrize("protocol, label, body, status, error_type, param", STACK_CASES,
                         ids=[f"{c[0].value}:{c[1]}" for c in STACK_CASES])
def test_malformed_request_gets_status_and_protocol_shape(stack, protocol, label, body, status, error_type, param):
    body = body.replace(f'"{MODEL}"'.encode(), f'"{STACK_MODEL}"'.encode())   # the stack serves V4.1
    got_status, payload = post(stack["url"], PATHS[protocol.value], body)
    assert got_status == status, payload
    if protocol.is_openai:
        assert set(payload) == {"error"} and payload["error"]["message"]
        assert {"message", "type", "param", "code"} <= set(payload["error"])
    else:
        assert payload["type"] == "error" and payload["error"]["type"] == error_type
        assert payload["error"]["message"]


def test_http_level_errors_and_the_stack_is_clean_afterwards(stack):
    url = urlparse(stack["url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/v1/chat/completions")
    assert conn.getresponse().status == 405
    conn.close()
    status, payload = post(stack["url"], "/v1/chat/completions", b"x" * (33 << 20))
    assert status == 413 and payload["error"]["type"] == "invalid_request_error"
    status, payload = post(stack["url"], "/v1/messages", b"x" * (33 << 20))
    assert status == 413 and payload["type"] == "error"
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert health.status == 200 and json.loads(health.read())["upstream_connected"] is True
    conn.close()
    holders = [s for s in stack["state"]["services"] if s["kind"] in ("prefill_router", "prefill_worker", "decode_worker")]
    assert len(holders) == 3   # the default (E/P/D) stack: nothing a bad request reached may hold it
    for service in holders:
        load = query_status(service["address"], 2.0).load
        assert (load.in_flight, load.batch_size, load.queue_depth) == (0, 0, 0), service["instance"]
