"""ServiceConfig from env and validation; membership and dispatch bookkeeping with a fake clock;
trace context parsing."""
from __future__ import annotations

import pytest

from messages.control import Load, ServiceState
from services.runtime.config import ServiceConfig
from services.runtime.membership import DispatchTracker, MembershipTable
from services.runtime.tracing import new_trace, span_from


def test_config_round_trips_through_environment_variables():
    config = ServiceConfig(kind="echo", instance="e-1", bind="tcp://0.0.0.0:7000",
                           advertise="tcp://{hostname}:7000", upstream="tcp://hub:7001", queue_size=7,
                           heartbeat_s=0.25, settings={"ttl": 3, "nested": {"a": [1, 2]}})
    again = ServiceConfig.from_env(config.to_env())
    assert again == config
    assert "{hostname}" not in config.advertise


def test_config_overrides_beat_environment_and_bad_values_are_named():
    env = {"EPD_KIND": "echo", "EPD_QUEUE_SIZE": "5", "EPD_BIND": "tcp://127.0.0.1:7100"}
    assert ServiceConfig.from_env(env, queue_size=9).queue_size == 9
    with pytest.raises(ValueError, match="EPD_QUEUE_SIZE"):
        ServiceConfig.from_env({**env, "EPD_QUEUE_SIZE": "many"})
    with pytest.raises(ValueError, match="EPD_SETTINGS"):
        ServiceConfig.from_env({**env, "EPD_SETTINGS": "[1, 2]"})
    with pytest.raises(ValueError, match="kind"):
        ServiceConfig.from_env({})
    with pytest.raises(ValueError, match="queue_size"):
        ServiceConfig(kind="echo", bind="tcp://127.0.0.1:7100", queue_size=0)
    with pytest.raises(ValueError, match="unknown service config keys"):
        ServiceConfig.from_mapping({"kind": "echo", "bind": "tcp://127.0.0.1:7100", "colour": "red"})


def test_membership_declares_silent_peers_dead_once():
    table = MembershipTable(dead_after_s=3.0)
    table.register("w0", "worker", "tcp://a:1", "", now=0.0)
    table.register("w1", "worker", "tcp://a:2", "", now=0.0)
    assert table.heartbeat("w0", ServiceState.RUNNING, Load(in_flight=4), now=2.5)
    assert table.expire(now=3.0) == []
    dead = table.expire(now=3.1)
    assert [p.instance for p in dead] == ["w1"]
    assert table.expire(now=3.2) == []                       # reported once
    assert not table.heartbeat("w1", ServiceState.RUNNING, Load(), now=3.3)   # must register again
    assert [p.instance for p in table.alive()] == ["w0"]
    assert table.get("w0").load.in_flight == 4
    table.register("w1", "worker", "tcp://a:2", "", now=4.0)  # a restarted instance comes back
    assert {p.instance for p in table.alive()} == {"w0", "w1"}


def test_draining_peer_is_alive_but_takes_no_work():
    table = MembershipTable(dead_after_s=3.0)
    peer = table.register("w0", "worker", "tcp://a:1", "", now=0.0)
    table.heartbeat("w0", ServiceState.DRAINING, Load(), now=1.0)
    assert peer.alive and not peer.accepts_work


def test_dispatch_tracker_hands_back_exactly_the_dead_peers_work():
    tracker = DispatchTracker()
    tracker.track("r1", "w0", "caller-1")
    tracker.track("r2", "w1", "caller-2")
    tracker.track("r3", "w0", "caller-3")
    tracker.untrack("r3")
    assert tracker.take_held_by("w0") == [("r1", "caller-1")]
    assert tracker.take_held_by("w0") == []
    assert tracker.holder("r2") == "w1" and len(tracker) == 1


def test_traceparent_continues_a_trace_and_rejects_garbage():
    root = new_trace()
    child = span_from(root.traceparent)
    assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
    assert child.span_id != root.span_id
    for bad in ("", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "01-abc"):
        fresh = span_from(bad)
        assert len(fresh.trace_id) == 32 and fresh.parent_span_id == ""
