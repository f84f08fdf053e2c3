"""The scenarios of `epd chaos`, by name, in the order they run: the ones that leave the stack as
it was first, the ones that kill a process next, and drain (which stops the stack) last.

Each is `async def scenario(ctx: Context) -> list[Row]`; tests import them from here."""
from __future__ import annotations

from ops.chaos.faults import decode_freeze, decode_kill, prefill_kill, router_restart
from ops.chaos.lifecycle import bind_fail, drain
from ops.chaos.load import disconnect, storm
from ops.chaos.store import kv_writer_kill

SCENARIOS = {
    "disconnect": disconnect,
    "storm": storm,
    "decode_freeze": decode_freeze,
    "decode_kill": decode_kill,
    "prefill_kill": prefill_kill,
    "kv_writer_kill": kv_writer_kill,
    "router_restart": router_restart,
    "bind_fail": bind_fail,
    "drain": drain,
}

__all__ = ["SCENARIOS", "bind_fail", "decode_freeze", "decode_kill", "disconnect", "drain", "kv_writer_kill",
           "prefill_kill", "router_restart", "storm"]
