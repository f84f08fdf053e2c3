"""The compressed vocabulary is built once per tokenizer content and kept on disk for the next
process (engine/models/v41/engram_vocab.py): a kept map is read back instead of rebuilt, and one
that is damaged or not a valid map is rebuilt, never used."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.v4.random_init import tokenizer_json_path
from engine.models.v41 import engram_vocab


@pytest.fixture(scope="module")
def built():
    """The map as _build makes it (once for the module: about a second)."""
    token_map, size = engram_vocab._build(tokenizer_json_path().read_text())
    return token_map, size


@pytest.fixture
def fresh(tmp_path, monkeypatch, built):
    """An empty cache directory and in-process cache; _build counted, answering the module's map."""
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engram_vocab, "_cache", {})
    calls = []
    monkeypatch.setattr(engram_vocab, "_build", lambda text: calls.append(1) or (built[0].clone(), built[1]))
    return calls


def _kept_file():
    [path] = engram_vocab.cache_dir().glob("*.npy")
    return path


def test_a_built_map_is_kept_and_the_next_process_reads_it_instead_of_building(fresh, built, monkeypatch):
    first = engram_vocab.compressed_vocab(tokenizer_json_path())
    assert fresh == [1] and first.size == built[1] and torch.equal(first.token_map, built[0])
    assert _kept_file().name == f"{first.digest}.v{engram_vocab._BUILD_VERSION}.npy"
    monkeypatch.setattr(engram_vocab, "_cache", {})                 # as in a new process
    again = engram_vocab.compressed_vocab(tokenizer_json_path())
    assert fresh == [1]                                             # read back, not rebuilt
    assert again.size == built[1] and torch.equal(again.token_map, built[0])


@pytest.mark.parametrize("damage", ["truncated", "not an array", "skips an id", "negative", "float"])
def test_a_damaged_or_invalid_kept_map_is_rebuilt(fresh, built, damage, monkeypatch):
    engram_vocab.compressed_vocab(tokenizer_json_path())
    path = _kept_file()
    values = built[0].numpy().copy()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "not an array":
        path.write_bytes(b"garbage")
    else:
        if damage == "skips an id":
            values[values == values.max()] += 1        # an id never handed out in token order
        elif damage == "negative":
            values[5] = -1
        else:
            values = values.astype(np.float64)
        np.save(path, values)
    monkeypatch.setattr(engram_vocab, "_cache", {})
    again = engram_vocab.compressed_vocab(tokenizer_json_path())
    assert fresh == [1, 1]                                          # rebuilt
    assert again.size == built[1] and torch.equal(again.token_map, built[0])
    assert np.array_equal(np.load(_kept_file()), built[0].numpy())  # and kept again, whole


def test_a_map_kept_by_another_build_version_is_not_read(fresh, built, monkeypatch):
    engram_vocab.compressed_vocab(tokenizer_json_path())
    monkeypatch.setattr(engram_vocab, "_BUILD_VERSION", engram_vocab._BUILD_VERSION + 1)
    monkeypatch.setattr(engram_vocab, "_cache", {})
    engram_vocab.compressed_vocab(tokenizer_json_path())
    assert fresh == [1, 1]                                          # the new build's map, built again
    assert len(list(engram_vocab.cache_dir().glob("*.npy"))) == 2


def test_an_unwritable_cache_directory_only_means_building_each_time(fresh, built, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("EPD_CACHE_DIR", str(blocker))
    vocab = engram_vocab.compressed_vocab(tokenizer_json_path())
    assert fresh == [1] and torch.equal(vocab.token_map, built[0])
