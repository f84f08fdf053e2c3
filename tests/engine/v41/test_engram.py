"""V4.1 Engram against NeMo Automodel's reference (CPU fp32): compressed vocabulary, hash rows
(whole sequences, chunked with lookback context, packed batches, image and padding tokens), the
gated stream update (FP8 table with e8m0 scales, and a plain float table), table placement."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.models.v4.random_init import tokenizer_json_path
from engine.models.v41.config import V41Config
from engine.models.v41.engram import Engram
from engine.models.v41.engram_hash import NgramHasher, engram_row_counts
from engine.quant import quantize_fp8_rows as quantize_table
from engine.models.v41 import engram_vocab
from engine.models.v41.engram_vocab import compressed_vocab, tokenizer_digest

nemo_engram = pytest.importorskip(
    "nemo_automodel.components.models.deepseek_v41.engram", reason="NeMo Automodel is the test-only reference")
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

IMAGE = 129264
VOCAB = 129280
# The tiny Engram layout: 2 layers, 8 heads, n-grams up to 4, 3000-row buckets, head_dim 32.
TINY_ROWS = (74516, 79414)


def _tiny_config(**overrides) -> V41Config:
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=2, head_dim=32, rope_dim=16, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, experts_per_token=2,
        compress_ratios=(0, 0, 0), kv_source_layer_ids=(), index_source_layer_ids=(), engram_layer_ids=(1, 2),
        engram_num_embeddings=TINY_ROWS, engram_vocab_size=3000, engram_head_dim=32,
        engram_compressed_vocab_size=99092, image_token_id=IMAGE, rms_norm_eps=1e-20,
    )
    fields.update(overrides)
    return V41Config(**fields)


def _nemo_config(cfg: V41Config) -> DeepseekV41TextConfig:
    return DeepseekV41TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_dim,
        q_lora_rank=cfg.q_lora_rank, o_lora_rank=cfg.o_lora_rank, o_groups=cfg.o_groups,
        moe_intermediate_size=cfg.moe_intermediate_size, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.experts_per_token, compress_ratios=list(cfg.compress_ratios),
        kv_source_layer_ids=[], index_source_layer_ids=[], candidate_source_layer_id=-1,
        engram_layer_ids=list(cfg.engram_layer_ids), engram_num_embeddings=list(cfg.engram_num_embeddings),
        engram_vocab_size=cfg.engram_vocab_size, engram_n_heads=cfg.engram_n_heads,
        engram_head_dim=cfg.engram_head_dim, engram_max_ngram_size=cfg.engram_max_ngram_size,
        engram_compressed_vocab_size=cfg.engram_compressed_vocab_size, rms_norm_eps=cfg.rms_norm_eps,
        num_nextn_predict_layers=0, dtype="float32",
    )


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """Built here, not read back from a map an earlier run kept on disk: the comparison with NeMo
    checks the build itself."""
    path = tokenizer_json_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPD_CACHE_DIR", str(tmp_path_factory.mktemp("engram_cache")))
        engram_vocab._cache.pop(tokenizer_digest(path), None)
        return compressed_vocab(path)


@pytest.fixture(scope="module")
def reference_hash():
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json_path()))
    return nemo_engram.DeepseekV41NgramHash(_nemo_config(_tiny_config()), tokenizer)


@pytest.fixture(scope="module")
def hasher(vocab):
    return NgramHasher(_tiny_config(), vocab.token_map, vocab.size)


def _sequence(seed: int, length: int, images: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    ids[torch.randint(0, length, (length // 4,), generator=g)] = int(ids[0])  # repeats: shared n-grams
    for start, end in images:
        ids[start:end] = IMAGE
    return ids


def _reference_rows(reference_hash, ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    mask = ids != IMAGE if token_mask is None else token_mask
    return reference_hash(ids[None], token_mask=mask[None])[0]


def test_compressed_vocab_is_nemos(vocab, reference_hash):
    assert len(vocab) == VOCAB and vocab.size == 99092
    assert torch.equal(vocab.token_map, reference_hash.token_map)
    started = time.perf_counter()
    assert compressed_vocab(tokenizer_json_path()) is vocab  # cached per tokenizer content
    assert time.perf_counter() - started < 0.5


def test_row_counts_from_primes(reference_hash, hasher):
    assert engram_row_counts(2, 16_000_000, 4, 8) == (384006168, 384016682)  # the released table sizes
    assert engram_row_counts(2, 3000, 4, 8) == TINY_ROWS
    assert torch.equal(hasher.primes, reference_hash.primes)
    assert torch.equal(hasher.offsets, reference_hash.offsets)
    assert torch.equal(hasher.multipliers, reference_hash.multipliers)
    assert tuple(reference_hash.primes.sum(-1).tolist()) == TINY_ROWS


def test_whole_sequence_rows_match(reference_hash, hasher):
    ids = _sequence(1, 40, images=((9, 14), (30, 31)))
    ours = hasher(ids)
    assert ours.shape == (40, 2, 24)
    assert torch.equal(ours, _reference_rows(reference_hash, ids))
    explicit = hasher(ids, image_mask=ids == IMAGE)
    assert torch.equal(explicit, ours)
    assert len(set(ours[:, 0, 0].tolist())) > 30  # hashes really vary


def test_chunked_with_lookback_matches_whole(reference_hash, hasher):
    ids = _sequence(2, 37, images=((12, 15),))
    expected = _reference_rows(reference_hash, ids)
    k = _tiny_config().engram_context
    for cuts in ((0, 5, 13, 14, 20, 37), (0, 1, 2, 3, 4, 36, 37), (0, 16, 37)):
        pieces = [hasher(ids[a:b], ids[max(0, a - k):a].tolist()) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces), expected), cuts
    # a longer context than needed is fine; a tensor context is fine
    assert torch.equal(hasher(ids[20:], ids[:20]), expected[20:])


def test_padding_and_masked_tokens_block_lookback(reference_hash, hasher):
    ids = _sequence(3, 24)
    pad = torch.zeros(24, dtype=torch.bool)
    pad[[6, 18, 19]] = True  # e.g. padded rows: they stop lookback like images do
    expected = _reference_rows(reference_hash, ids, ~pad)
    assert torch.equal(hasher(ids, image_mask=pad), expected)
    assert torch.equal(torch.cat([hasher(ids[:10], image_mask=pad[:10]),
                                  hasher(ids[10:], ids[7:10].tolist(), image_mask=pad[10:])]), expected)
    # an image id in the context blocks like one in the chunk
    ids[8] = IMAGE
    assert torch.equal(hasher(ids[9:], ids[6:9].tolist()), _reference_rows(reference_hash, ids)[9:])
    # blocking changes the hash: position 7 after a dead 6 differs from an unmasked run
    assert not torch.equal(hasher(ids[:8])[7], hasher(ids[:8], image_mask=pad[:8])[7])


def test_packed_batch_matches_each_sequence(reference_hash):
    seqs = [_sequence(10 + i, n, images=((2, 4),) if i == 1 else ()) for i, n in enumerate((17, 9, 30, 5))]
    starts = (0, 4, 21, 0)  # chunk of each sequence: ids[start:] with the ids before it as context
    chunks = [s[a:] for s, a in zip(seqs, starts)]
    contexts = [s[max(0, a - 3):a].tolist() for s, a in zip(seqs, starts)]
    spans, at = [], 0
    for c in chunks:
        spans.append((at, at + c.numel()))
        at += c.numel()
    rows = NgramHasher.from_tokenizer(_tiny_config(), tokenizer_json_path()).packed(torch.cat(chunks), spans, contexts)
    for s, a, (b, e) in zip(seqs, starts, spans):
        assert torch.equal(rows[b:e], _reference_rows(reference_hash, s)[a:])


def test_hasher_rejects_mismatched_configs(vocab):
    with pytest.raises(ValueError, match="compresses to 99092"):
        NgramHasher(_tiny_config(engram_compressed_vocab_size=99000), vocab.token_map, vocab.size)
    with pytest.raises(ValueError, match="hashes into 74516 rows"):
        NgramHasher(_tiny_config(engram_num_embeddings=(74000, 79414)), vocab.token_map, vocab.size)


def _engrams(cfg: V41Config, quantized: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ours = Engram(cfg, 1, dtype=torch.float32)
    reference = nemo_engram.DeepseekV41Engram(_nemo_config(cfg), 1, BackendConfig(linear="torch"))
    table = torch.randn(ours.table.num_rows, cfg.engram_head_dim, generator=g) * 0.5
    with torch.no_grad():
        ours.wkv.weight.copy_(torch.randn(ours.wkv.weight.shape, generator=g) * 0.02)
        ours.q_weight.copy_(1 + 0.3 * torch.randn(ours.q_weight.shape, generator=g))
        ours.k_weight.copy_(1 + 0.3 * torch.randn(ours.k_weight.shape, generator=g))
        if quantized:
            values, scales = quantize_table(table)
            ours.load_table(values, scales)
            dense = dequantize_checkpoint_weight(values, scales, dtype=torch.float32, rowwise=True)
        else:
            ours.load_table(table)
            dense = table
        reference.embed.weight.copy_(dense)
        for name in ("wkv.weight", "q_weight", "k_weight"):
            reference.get_parameter(name).copy_(ours.get_parameter(name))
    return ours, reference


@pytest.mark.parametrize("quantized", [True, False])
def test_engram_update_matches_nemo(hasher, quantized):
    cfg = _tiny_config()
    ours, reference = _engrams(cfg, quantized)
    ids = _sequence(5, 20, images=((4, 7),))
    rows = hasher(ids)[:, ours.hash_index]
    mask = ids != IMAGE
    mask[15] = False  # padding
    streams = torch.randn(20, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(6)) * 3
    out = ours(streams, rows, mask)
    expected = reference(streams[None], rows[None], token_mask=mask[None])[0]
    assert out.dtype == streams.dtype and out.shape == streams.shape
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert torch.equal(out[~mask], streams[~mask])  # gate 0: masked tokens pass unchanged
    assert (out[mask] - streams[mask]).abs().amax() > 1e-3  # and the others really change
    # rows fetched ahead give the same result
    assert torch.equal(ours(streams, rows, mask, memory=ours.read_rows(rows)), out)


def test_fp8_rows_dequantize_exactly():
    table = torch.randn(300, 64, generator=torch.Generator().manual_seed(7)) * torch.logspace(-6, 3, 300)[:, None]
    values, scales = quantize_table(table)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu and scales.shape == (300, 2)
    ours = Engram(_tiny_config(engram_num_embeddings=(300, 300), engram_head_dim=64), 1)
    ours.load_table(values, scales)
    picked = torch.tensor([[0, 299, 5], [17, 17, 150]])
    dense = dequantize_checkpoint_weight(values, scales, dtype=torch.float32, rowwise=True)
    assert torch.equal(ours.table.read(picked, "cpu", torch.float32), dense[picked])
    # e4m3 keeps 3 mantissa bits; values far below their block's maximum fall into subnormals
    bound = 0.07 * table.abs() + 1e-5 * table.abs().amax(1, keepdim=True)
    assert ((dense - table).abs() <= bound).all()


def test_table_is_host_memory_not_a_parameter():
    cfg = _tiny_config()
    module = Engram(cfg, 2)
    assert module.hash_index == 1 and module.table.num_rows == TINY_ROWS[1]
    values, scales = quantize_table(torch.randn(TINY_ROWS[1], 32))
    module.load_table(values, scales)
    assert set(module.state_dict()) == {"wkv.weight", "q_weight", "k_weight"}
    stored = module.table.values
    module.to(torch.float64)
    assert module.table.values is stored and stored.device.type == "cpu" and stored.dtype == torch.uint8
    with pytest.raises(ValueError, match="expected"):
        module.load_table(values[:-1], scales[:-1])
    with pytest.raises(ValueError, match="needs its scales"):
        module.load_table(values)
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(cfg, 0)


def test_context_size_matches_lookback(hasher):
    assert _tiny_config().engram_context == hasher.lookback == 3
    assert dataclasses.replace(_tiny_config(), engram_layer_ids=(), engram_num_embeddings=()).engram_context == 0
