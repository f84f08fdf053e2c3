"""The adapter's own byte-level detokenizer agrees with Hugging Face `tokenizers`."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HfTokenizer

from services.gateway.adapter import Protocol, packaged_v4_tokenizer
from services.gateway.adapter.detokenizer import IncrementalDetokenizer, TokenTable
from tests.gateway.conftest import chat_body


@pytest.fixture(scope="module")
def table(adapter) -> TokenTable:
    return adapter.prepare(Protocol.CHAT, chat_body()).response.table


@pytest.fixture(scope="module")
def reference() -> HfTokenizer:
    return HfTokenizer.from_file(packaged_v4_tokenizer())


TEXTS = ["Hello, world!", "  leading and   inner   spaces\n\n\ttabs", "Zürich 🦜 𝔘𝔫𝔦 龘 🫠🪿",
         "<｜User｜>text that spells <｜end▁of▁sentence｜> tokens</think>", "def f(x):\n    return x**2\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_reference_and_round_trips(table, reference, tokenizer, text):
    ids = tokenizer.encode(text)
    assert table.decode(ids) == reference.decode(ids, skip_special_tokens=False) == text


def test_random_ids_decode_like_the_reference(table, reference):
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(len(table.token_bytes)) for _ in range(rng.randint(1, 40))]
        assert table.decode(ids) == reference.decode(ids, skip_special_tokens=False)


def test_incremental_decoding_holds_split_utf8_sequences(table, tokenizer):
    ids = tokenizer.encode("a🦜b")
    detok = IncrementalDetokenizer(table)
    pieces = []
    for token in ids:
        pieces.append(detok.feed(token))
        if pieces[-1] == "":
            assert detok.pending
    assert "".join(pieces) + detok.flush() == "a🦜b"
    assert "" in pieces                                   # the emoji really was split


def test_an_unfinished_sequence_at_the_end_flushes_as_replacement(table, tokenizer):
    detok = IncrementalDetokenizer(table)
    assert detok.feed(tokenizer.encode("🦜")[0]) == ""
    assert detok.flush() == "\ufffd"


def test_out_of_vocabulary_ids_show_as_replacement(table):
    assert table.decode([10**9, -1]) == "\ufffd\ufffd"
