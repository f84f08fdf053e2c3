"""Issue #5, shown on real processes through the openai SDK: a prefix prefilled by one prefill worker
is loaded from the KV store by the other one; the SWA registry decides the hit (L1 with the window
registered, L1 - 128 without it, never beyond L - 134); a conversation that continues with the
model's own answer hits the blocks the decode worker wrote. Every answer equals the cold run (a
unified worker without a prefix cache, same greedy request). The stack and its routing rule (prompts
of at most SPLIT tokens to one prefill worker, longer ones to the other) are in
tests/helpers/test_helper_reuse_stack.py; which worker prefilled a request and its hit come from its
`request.prefilled` log line, the L1 the router routed with from the router's `request.queued` line,
and who served the window from the holder's summary line of the forwarded SwaFetch."""
from __future__ import annotations

import random

import pytest
import tokenizers

from messages.prefix import BLOCK_TOKENS as BLOCK
from tests.helpers.test_helper_reuse_stack import (DECODE_WORKER, NO_THINKING, PREFILL_WORKERS, SPLIT, Prompts, down,
                                                   up)

pytestmark = pytest.mark.slow   # starts service processes



@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    s = up(tmp_path_factory.mktemp("reuse"), tiny_model_dir)
    yield s
    down(s)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    return Prompts(tiny_model_dir)


def notes(seed: int, count: int) -> str:
    """`count` sentences (15 tokens each for a one-digit seed) that no other test shares."""
    r = random.Random(seed)
    words = ["harbor", "lamp", "keeper", "ship", "storm", "log", "tide", "rope", "gull", "fog", "bell", "stone"]
    return " ".join(f"Note {seed}.{i}: the {r.choice(words)} and the {r.choice(words)} by the {r.choice(words)}."
                    for i in range(count))


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def chat(stack, messages, request_id: str, *, cold: bool = False, max_tokens: int = 16, **kw):
    return stack.client(cold).chat.completions.create(
        model=stack.model, messages=messages, temperature=0, max_tokens=max_tokens, extra_body=NO_THINKING,
        extra_headers={"x-request-id": request_id}, **kw)


def answer(response):
    choice = response.choices[0]
    return choice.message.content, choice.finish_reason, response.usage.completion_tokens


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def probe(stack, request_id: str) -> int:
    """The hit the prefill router routed the request with: the store's L1, capped at L - 134."""
    [line] = stack.events("prefill_router-0", "request.queued", request_id)
    return line["kv_hit_tokens"]


def window_from(stack, request_id: str) -> str:
    """The instance that served the request's window state (the SWA registry forwarded the fetch)."""
    instances = [*(f"prefill_worker-{i}" for i in range(len(PREFILL_WORKERS))), "decode_worker-0"]
    found = [i for i in instances
             if any(line.get("type") == "SwaFetch" for line in stack.events(i, "request.summary", request_id))]
    assert len(found) == 1, f"{request_id}: window served by {found}"
    return found[0]


def address_of(stack, instance: str) -> str:
    return next(s["address"] for s in stack.state["services"] if s["instance"] == instance)


def shared_prefix_pair(prompts, seed: int):
    """A short prompt (<= SPLIT tokens) and a long one (> SPLIT) sharing about 1000 tokens."""
    shared = notes(seed, 67)
    short = user(shared + " Question: which note came first?")
    long = user(shared + " " + notes(seed + 1000, 25) + " Question: which note came last?")
    short_ids, long_ids = prompts.ids(short), prompts.ids(long)
    assert len(short_ids) <= SPLIT < len(long_ids)
    common = common_prefix(short_ids, long_ids)
    assert 1000 <= common < 1024, common          # L1 = 7 blocks, whichever side is asked
    return short, long, prompts.hashes(long_ids), common // BLOCK * BLOCK


def prefill_first(stack, messages, request_id: str, hashes: list[bytes], blocks: int) -> str:
    """Run the request; wait until its first `blocks` blocks are stored and the window at the end
    of the last one is registered by the worker that prefilled it; that worker's instance."""
    chat(stack, messages, request_id)
    instance, _ = stack.prefilled_by(request_id)
    stack.wait_stored(hashes, blocks)
    stack.wait_held(hashes[blocks - 1], address_of(stack, instance))
    return instance


def test_a_prefix_prefilled_by_one_worker_is_loaded_from_the_store_by_the_other(stack, prompts):
    short, long, hashes, l1 = shared_prefix_pair(prompts, seed=1)
    first = prefill_first(stack, short, "cross-a", hashes, l1 // BLOCK)

    got = chat(stack, long, "cross-b")
    second, line = stack.prefilled_by("cross-b")
    assert second != first                                     # the other prefill worker ...
    assert probe(stack, "cross-b") == l1 and window_from(stack, "cross-b") == first   # window there: the hit is L1
    [imported] = stack.events(second, "prefix.imported", "cross-b")
    assert imported["blocks"] == l1 // BLOCK and imported["with_state"]  # ... read the pages from the store
    assert cached(got) == line["hit_tokens"] == l1 >= 896
    assert answer(got) == answer(chat(stack, long, "cross-b-cold", cold=True))
    assert cached(chat(stack, long, "cross-b-cold-again", cold=True)) == 0   # the cold side never caches


def test_without_the_window_at_l1_the_hit_is_one_block_less(stack, prompts):
    short, long, hashes, l1 = shared_prefix_pair(prompts, seed=2)
    first = prefill_first(stack, short, "backoff-a", hashes, l1 // BLOCK)
    holder = address_of(stack, first)
    # the registry forgets the window at L1 (as when its TTL ran out); the one at L1 - 128 stays
    assert stack.unregister(hashes[l1 // BLOCK - 1], holder) == 1
    assert stack.holders([hashes[l1 // BLOCK - 1], hashes[l1 // BLOCK - 2]]) == ["", holder]

    got = chat(stack, long, "backoff-b")
    second, _ = stack.prefilled_by("backoff-b")
    assert second != first
    assert probe(stack, "backoff-b") == l1 and window_from(stack, "backoff-b") == first
    assert cached(got) == l1 - BLOCK
    assert answer(got) == answer(chat(stack, long, "backoff-b-cold", cold=True))


def test_the_hit_never_goes_beyond_l_minus_134(stack, prompts):
    text = notes(3, 130)
    long = user(text + " Question: which note came last?")
    long_ids = prompts.ids(long)
    sentences = text.split(". ")
    short = user(". ".join(sentences[:72]) + ".")               # ~1080 tokens, all of them in the long prompt
    short_ids = prompts.ids(short)
    assert len(short_ids) <= SPLIT < len(long_ids)
    short_hashes = prompts.hashes(short_ids)
    cap = (len(short_ids) - 134) // BLOCK * BLOCK
    l1 = common_prefix(short_ids, long_ids) // BLOCK * BLOCK
    assert cap < l1 == len(short_hashes) * BLOCK                # the cap binds, not the store
    first = prefill_first(stack, long, "cap-a", prompts.hashes(long_ids), l1 // BLOCK)
    assert stack.stored_blocks(short_hashes) == l1 // BLOCK

    got = chat(stack, short, "cap-b")
    assert stack.prefilled_by("cap-b")[0] != first
    assert probe(stack, "cap-b") == cap and window_from(stack, "cap-b") == first
    assert cached(got) == cap
    assert answer(got) == answer(chat(stack, short, "cap-b-cold", cold=True))


def test_a_continued_conversation_hits_the_blocks_of_the_answer(stack, prompts, tiny_model_dir):
    content = notes(4, 25)
    while len(prompts.ids(user(content))) < 3 * BLOCK - 1:     # the answer's first token completes block 3
        content += " ok"
    question = user(content)
    prompt_ids = prompts.ids(question)
    assert len(prompt_ids) == 3 * BLOCK - 1
    first = chat(stack, question, "conv-a", logprobs=True)
    assert first.usage.completion_tokens > 1                   # the decode worker computed token 383's KV

    follow_up = [*question, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": notes(5, 80) + " Go on."}]
    ids = prompts.ids(follow_up)
    assert len(ids) > SPLIT and ids[: len(prompt_ids)] == prompt_ids
    # the answer's first token comes back as itself (random weights make odd tokens; this one is not)
    decoder = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert decoder.decode([ids[len(prompt_ids)]]) == first.choices[0].logprobs.content[0].token
    hashes = prompts.hashes(ids)
    stack.wait_stored(hashes, 3)                               # block 3 holds a generated token
    decode = stack.address(DECODE_WORKER)
    stack.wait_held(hashes[2], decode)                         # its window: the decode worker's

    got = chat(stack, follow_up, "conv-b")
    assert stack.prefilled_by("conv-b")[0] != stack.prefilled_by("conv-a")[0]
    assert probe(stack, "conv-b") == 3 * BLOCK and window_from(stack, "conv-b") == "decode_worker-0"
    assert cached(got) == 3 * BLOCK > len(prompt_ids) // BLOCK * BLOCK
    assert answer(got) == answer(chat(stack, follow_up, "conv-b-cold", cold=True))


def test_logprobs_cover_the_first_token_and_equal_the_cold_run(stack):
    question = user("Name three harbors and a lamp.")

    def logprobs(cold: bool):
        response = chat(stack, question, f"logprobs-{int(cold)}", cold=cold, max_tokens=12, logprobs=True,
                        top_logprobs=3)
        return answer(response), response.choices[0].logprobs.content
    got, got_lp = logprobs(cold=False)
    expected, expected_lp = logprobs(cold=True)
    assert got == expected and got_lp
    assert [t.token for t in got_lp] == [t.token for t in expected_lp]
    assert [t.logprob for t in got_lp] == pytest.approx([t.logprob for t in expected_lp], abs=1e-4)
    assert [[c.token for c in t.top_logprobs] for t in got_lp] == \
        [[c.token for c in t.top_logprobs] for t in expected_lp]
