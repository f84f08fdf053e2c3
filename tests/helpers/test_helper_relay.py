"""Test-only service: relays Echo to a downstream (a fixed address, or a peer registered with it),
so tests can build chains of processes and kill a peer that holds work."""
from __future__ import annotations

from messages.control import Echo
from messages.errors import Overloaded
from services.runtime.service import Service


class TestHelperRelay(Service):
    kind = "test_helper_relay"
    __test__ = False   # not a pytest test class

    def handlers(self):
        return {Echo: self._relay}

    async def _relay(self, msg: Echo, ctx):
        address = self.config.settings.get("downstream")
        if not address:
            peers = self.members.alive()
            if not peers:
                raise Overloaded("no downstream peer registered")
            peer = min(peers, key=lambda p: p.load.in_flight)
            address = peer.address
            self.dispatched.track(ctx.request_id, peer.instance, ctx)
        env = ctx.envelope
        try:
            reply = await self.call(address, msg, request_id=ctx.request_id, span=ctx.span,
                                    buffers=list(zip(env.header.tensors, env.buffers)))
        finally:
            self.dispatched.untrack(ctx.request_id)
        ctx.reply(reply.message, buffers=list(zip(reply.header.tensors, reply.buffers)))
