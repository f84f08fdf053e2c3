"""The prefill worker's short hit path, in-process over real ZeroMQ (prefill and decode workers, KV
writer, SWA registry; the test-helper gateway): the first token reaches the gateway before the
decode worker has accepted the state, numbered, naming no worker, and the decode worker's copy of
it names the decode worker, so the output is the unified engine's, each token once; a hit's prefix
import and its request enter the engine in one engine-thread command."""
from __future__ import annotations

import asyncio

from messages.common import FinishReason
from messages.prefix import block_hashes
from tests.engine.references import make_prompt
from tests.helpers.test_helper_async import eventually
from tests.workers.test_workers_inprocess import generate, reference, stack  # noqa: F401 - fixtures


async def test_the_first_token_reaches_the_gateway_before_the_hand_off_is_accepted(stack, reference):
    s = stack
    gate, restore = asyncio.Event(), s.decode.engine

    async def engine_after_gate(fn, *args):   # the decode worker's engine waits: the hand-off stays open
        await gate.wait()
        return await restore(fn, *args)

    s.decode.engine = engine_after_gate
    prompt = make_prompt(200, 31).tolist()
    running = asyncio.create_task(generate(s, s.prefill_a, "early", prompt, 12))
    await eventually(lambda: s.gw.received.get("early"), timeout=60, what="the prefill worker's first token")
    [first] = s.gw.received["early"]
    assert first.token_ids == reference(prompt, 12)[:1]
    assert (first.first_index, first.worker, first.finish_reason) == (0, "", int(FinishReason.NONE))
    assert s.prefill_a.jobs["early"].handing_off   # the decode worker has not restored nor accepted it yet
    gate.set()
    done, tokens, last = await running
    assert tokens == reference(prompt, 12)                                  # each token once, in order
    assert last.usage.completion_tokens == 12 and (done.hit_tokens, done.computed_tokens) == (0, 200)
    copy = s.gw.received["early"][1]                                        # the decode worker's first chunk
    assert copy.token_ids == first.token_ids and copy.first_index == 0 and copy.worker == s.decode.config.advertise
    assert sum(len(c.token_ids) for c in s.gw.received["early"]) == 13      # the first token came twice


async def test_a_store_hit_imports_its_prefix_and_adds_its_request_in_one_engine_command(stack, reference):
    s = stack
    prompt = make_prompt(300, 32).tolist()
    await generate(s, s.prefill_a, "cold", prompt, 4)
    hashes = block_hashes(s.decode.model_id, prompt)
    await eventually(lambda: s.kv.store.lookup(hashes) == 2, timeout=10, what="prompt blocks persisted")
    await eventually(lambda: s.prefill_a.persister.states_registered >= 2, timeout=10, what="windows registered")

    thread, engine = s.prefill_b.engine_thread, s.prefill_b.engine_thread.engine
    commands, seen = [0], {}
    real_call, real_import, real_add = thread.call, engine.import_prefix, engine.add_request

    async def counted_call(fn, *args):
        commands[0] += 1
        number = commands[0]
        return await real_call(lambda e, *a: (seen.setdefault("command", []).append(number), fn(e, *a))[1], *args)

    def import_prefix(*args, **kwargs):
        seen["import"] = seen["command"][-1]
        return real_import(*args, **kwargs)

    def add_request(request, **kwargs):
        seen["add"] = seen["command"][-1]
        return real_add(request, **kwargs)

    thread.call, engine.import_prefix, engine.add_request = counted_call, import_prefix, add_request
    second = prompt[:256] + make_prompt(140, 33).tolist()
    done, tokens, last = await generate(s, s.prefill_b, "hit", second, 8, hit=256)
    assert (done.hit_tokens, last.usage.cached_tokens) == (256, 256) and tokens == reference(second, 8)
    assert seen["import"] == seen["add"]                   # one engine-thread command: admit
