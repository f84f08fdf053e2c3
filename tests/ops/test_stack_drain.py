"""`epd down` on the default (E/P/D) stack while 5 requests stream: the gateway stops taking work
(503 in the protocol's shape, /health 503), every stream finishes normally within the grace period,
then the services stop wave by wave from the edge inwards, with no storm of DRAINING error replies
(issue 11: before, every stream got an error at 3.9 s amid ~16k bounced errors) and no process left."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from ops.launcher import stop_waves
from ops.topology import load_topology
from tests.helpers.test_helper_processes import wait_until
from tests.helpers.test_helper_stack import pid_alive, up_stack

pytestmark = pytest.mark.slow   # starts service processes

STREAMS = 5
MAX_TOKENS = 24          # a few seconds of decoding for 5 streams on a small CPU: they outlive the drain's start
REFUSALS_ALLOWED = 5     # a refusal or two racing the stop is fine; a bounce storm is thousands


class Stream(threading.Thread):
    """One streaming chat completion; `started` is set at its first chunk."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.prompt = f"Tell me story number {i}."
        self.started = threading.Event()
        self.finish_reason = self.completion_tokens = self.error = None

    def run(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                    model="deepseek-v41-tiny", messages=[{"role": "user", "content": self.prompt}],
                    max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"thinking": {"type": "disabled"}}):
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage:
                    self.completion_tokens = chunk.usage.completion_tokens
        except Exception as exc:   # noqa: BLE001 - reported by the test's assertion
            self.error = repr(exc)
        finally:
            self.started.set()


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode() if body else None,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_epd_down_drains_streams_then_stops_edge_inwards(tmp_path, tiny_v41_model_dir):
    stack = up_stack(tmp_path, "default", tiny_v41_model_dir)
    state, url = stack["state"], stack["url"]
    streams = [Stream(url, i) for i in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60), "a stream got no first chunk"
    assert not any(s.error for s in streams), [s.error for s in streams]
    down_started = time.monotonic()
    down = subprocess.Popen([sys.executable, "-m", "ops.cli", "down"], cwd=stack["root"], env=stack["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: http(url + "/health")[0] == 503, 10, "the gateway's /health to say it drains")
        assert all(s.is_alive() for s in streams), "the streams ended before the drain could be seen"
        assert http(url + "/health")[1]["state"] == "draining"
        status, body = http(url + "/v1/chat/completions", {
            "model": "deepseek-v41-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "late"}]})
        assert status == 503 and "shutting down" in body["error"]["message"]   # OpenAI's error shape
        for stream in streams:
            stream.join(timeout=state["grace_s"] + 5)
        drained_in = time.monotonic() - down_started
        out, _ = down.communicate(timeout=state["stop_timeout_s"] + 15)
    finally:
        if down.poll() is None:
            down.kill()
    outcomes = [(s.error, s.finish_reason, s.completion_tokens) for s in streams]
    assert outcomes == [(None, "length", MAX_TOKENS)] * STREAMS
    assert drained_in < state["grace_s"]
    assert down.returncode == 0 and "stack stopped" in out, out
    assert not any(pid_alive(pid) for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])])

    logs = {s["instance"]: [json.loads(line) for line in open(s["log"]) if line.startswith("{")]
            for s in state["services"]}
    refusals = [e for lines in logs.values() for e in lines if e["event"] == "message.refused"]
    assert len(refusals) <= REFUSALS_ALLOWED, refusals[:10]
    gateway_outcomes = [e["outcome"] for e in logs["gateway-0"] if e["event"] == "request.summary"]
    assert gateway_outcomes.count("ok") == STREAMS

    def moment(name: str, event: str) -> float:
        return next(e["ts"] for e in logs[f"{name}-0"] if e["event"] == event)
    waves = stop_waves(load_topology("default"))
    for outer, inner in zip(waves, waves[1:]):   # a wave begins only once the one before it has stopped
        assert max(moment(name, "service.stopped") for name in outer) < \
            min(moment(name, "service.draining") for name in inner), (outer, inner)
