"""Registration names the model identity: a pool serves one. A worker announcing another identity than
its pool's live workers is refused (MODEL_MISMATCH), and both sides log it; a restarted instance or a
pool whose workers all died may change it. The upstream names its pool's identity to every service
that registers (Registered, then each HeartbeatAck): that is how a gateway learns it."""
from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from messages.errors import ModelMismatch
from services.runtime.membership import MembershipTable
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices

PLAIN, RELEASED = "tiny-float32-0123", "tiny-float32+released-0123"


class TestHelperModelWorker(Service):
    """A worker serving the identity named in its settings (an engine worker's is its engine's model_id)."""

    kind = "prefill_worker"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.model_id = config.settings["model_id"]


# ---- the table ----------------------------------------------------------------------------------
def test_a_second_identity_in_a_pool_is_refused_and_other_pools_and_modelless_peers_are_not():
    table = MembershipTable(dead_after_s=3.0)
    table.register("prefill-0", "prefill_worker", "tcp://a:1", "", 0.0, PLAIN)
    with pytest.raises(ModelMismatch, match=r"prefill-1 serves model 'tiny-float32\+released-0123' but the live "
                                            r"prefill_workers here serve 'tiny-float32-0123'"):
        table.register("prefill-1", "prefill_worker", "tcp://a:2", "", 0.0, RELEASED)
    assert table.get("prefill-1") is None and table.model_id("prefill_worker") == PLAIN
    table.register("decode-0", "decode_worker", "tcp://a:3", "", 0.0, RELEASED)   # another pool, its own identity
    table.register("gateway-0", "gateway", "tcp://a:4", "", 0.0)                 # serves no model: never refused
    assert table.model_id("decode_worker") == RELEASED and table.model_id("gateway") == ""
    assert {p.instance: p.model_id for p in table.status(0.0)} == {   # the decode router's table carries it
        "prefill-0": PLAIN, "decode-0": RELEASED, "gateway-0": ""}


def test_a_restarted_instance_or_an_emptied_pool_may_change_identity():
    table = MembershipTable(dead_after_s=3.0)
    table.register("prefill-0", "prefill_worker", "tcp://a:1", "", 0.0, PLAIN)
    table.register("prefill-0", "prefill_worker", "tcp://a:1", "", 1.0, RELEASED)   # its own restart
    assert table.model_id() == RELEASED
    table.register("prefill-1", "prefill_worker", "tcp://a:2", "", 1.0, RELEASED)
    assert [p.instance for p in table.expire(10.0)] == ["prefill-0", "prefill-1"]   # all dead: no identity left
    assert table.model_id() == ""
    table.register("prefill-2", "prefill_worker", "tcp://a:3", "", 10.0, PLAIN)
    assert table.model_id("prefill_worker") == PLAIN


# ---- over the wire ------------------------------------------------------------------------------
async def test_a_mismatched_worker_gets_a_typed_refusal_and_both_sides_log_it(tmp_path):
    services = InProcessServices(tmp_path)
    with capture_logs() as logs:
        try:
            router = await services.start(Service, "router")
            plain = await services.start(TestHelperModelWorker, "plain", {"model_id": PLAIN}, router.config.advertise)
            await eventually(lambda: plain.upstream.connected, what="the first worker registered")
            released = await services.start(TestHelperModelWorker, "released", {"model_id": RELEASED},
                                            router.config.advertise)
            refused = lambda: [e for e in logs if e["event"] == "upstream.registration_refused"]   # noqa: E731
            await eventually(refused, what="the second worker to log its refusal")
            assert router.members.get("released") is None and not released.upstream.connected
            assert [p.instance for p in router.members.alive()] == ["plain"]
        finally:
            await services.close()
    worker_line = refused()[0]
    assert worker_line["model_id"] == RELEASED and "one pool serves one model" in worker_line["error"]
    router_lines = [e for e in logs if e["event"] == "peer.refused"]
    assert router_lines and router_lines[0]["peer"] == "released" and RELEASED in router_lines[0]["error"]


async def test_a_service_learns_the_identity_from_its_upstream_when_a_worker_registers_later(tmp_path):
    services = InProcessServices(tmp_path)
    try:
        router = await services.start(Service, "router")
        front = await services.start(Service, "front", upstream=router.config.advertise)   # as a gateway does
        await eventually(lambda: front.upstream.connected, what="the front registered")
        assert front.upstream.model_id == ""   # no worker yet: nothing to learn
        await services.start(TestHelperModelWorker, "worker", {"model_id": RELEASED}, router.config.advertise)
        await eventually(lambda: front.upstream.model_id == RELEASED, what="the identity in a HeartbeatAck")
        late = await services.start(Service, "late", upstream=router.config.advertise)
        await eventually(lambda: late.upstream.connected, what="the late front registered")
        assert late.upstream.model_id == RELEASED   # named in Registered itself
    finally:
        await services.close()
