"""The stack waiters (epd chaos, the bench's local stack) wait for the gateway's /ready, not /health:
/health answers 200 while the workers still load. A stand-in gateway answers each probe here."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ops.chaos.stack import ChaosStack
from ops.gateway_ready import gateway_not_ready
from ops.ports import free_port_base

NOT_READY = {"status": "not_ready", "pools": {"prefill": "no live worker has registered with prefill_router-0",
                                             "decode": "ready"}, "not_ready": ["prefill"]}


class Gateway:
    """/health always 200; /ready answers `self.ready` (status, body); /v1/models names one model."""

    def __init__(self):
        self.ready: tuple[int, bytes] = (503, json.dumps(NOT_READY).encode())
        self.probes: list[str] = []
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                gateway.probes.append(self.path)
                status, body = {"/health": (200, b'{"status": "ok"}'), "/ready": gateway.ready,
                                "/v1/models": (200, b'{"data": [{"id": "tiny"}]}')}.get(self.path, (404, b"{}"))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway():
    server = Gateway()
    yield server
    server.close()


def test_ready_is_empty_only_when_the_gateway_answers_200(gateway):
    assert gateway_not_ready(gateway.url) == {"prefill": NOT_READY["pools"]["prefill"]}
    gateway.ready = (503, b"not json")
    assert gateway_not_ready(gateway.url) == {"gateway": "/ready answered 503"}
    gateway.ready = (200, b'{"status": "ready"}')
    assert gateway_not_ready(gateway.url + "/") == {}
    assert "/health" not in gateway.probes


def test_a_gateway_that_does_not_answer_is_not_ready():
    url = f"http://127.0.0.1:{free_port_base(1)}"
    assert list(gateway_not_ready(url)) == ["gateway"] and "does not answer" in gateway_not_ready(url)["gateway"]


def test_the_chaos_stack_waits_for_ready_and_names_the_pools_that_are_not(gateway, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"services": []}))
    stack = ChaosStack(run_dir, gateway.url)
    assert stack.model == "tiny"
    assert not stack.wait_healthy(0.3)                  # /health is 200 all along: not enough
    assert stack.not_ready() == [f"pool prefill: {NOT_READY['pools']['prefill']}"]
    gateway.ready = (200, b'{"status": "ready"}')
    assert stack.wait_healthy(5.0) and stack.not_ready() == []
    assert "/health" not in gateway.probes
