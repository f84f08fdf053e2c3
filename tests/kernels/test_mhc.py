"""mHC kernels (engine.kernels.mhc, mhc_merge) against the torch paths of engine.models.v4.hyper (V4) and
engine.models.v41.hyper (V4.1): coefficients with Sinkhorn, the stream statistics, collapse, merge, each
site as the model calls it, a CUDA-graph replay, and a tiny V4 model with and without the kernels."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import kernel_mode
from engine.kernels.dispatch import pinned
from engine.models.v4 import hyper
from engine.models.v4.config import ModelConfig, read_config_dict
from engine.models.v41 import hyper as hyper41

TOKENS = (1, 5, 300)  # none a multiple of a block
SITE_TOKENS = (1, 5, 33)  # whole sites: the kernels alone cover 300 (the interpreter is slow)
# (tokens, hidden): a wide hidden (several BLOCK_H tiles, the last partial) only with few tokens
SHAPES = ((1, 1300), (5, 1300), (300, 96))
TIGHT = dict(rtol=1e-5, atol=1e-5)


def bf16(device) -> dict:
    """Two bf16 ulps on a GPU; four under the interpreter, whose fp32 -> bf16 casts truncate."""
    ulps = 2 if device.type == "cuda" else 4
    return dict(rtol=ulps * 2.0**-7, atol=ulps * 2.0**-7)


def randn(*shape, device, dtype=torch.float32, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def reference_coefficients(mixes, scale, base, n, iters, eps, v41, row_scale=None):
    """The coefficient math as HyperConnection.forward (V4) and predict_mix (V4.1) write it."""
    if row_scale is not None:
        mixes = mixes * row_scale[:, None]
    if v41:
        scales = torch.cat([scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)])
        logits = torch.addcmul(base, mixes, scales)
        pre_l, post_l, comb_l = logits[:, :n], logits[:, n : 2 * n], logits[:, 2 * n :].unflatten(-1, (n, n))
    else:
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_l, post_l = pre_w * scale[0] + pre_b, post_w * scale[1] + post_b
        comb_l = comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
    pre = torch.sigmoid(pre_l) + eps
    return pre, 2 * torch.sigmoid(post_l), hyper.mix_matrix(comb_l, iters, eps)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("iters", [20, 1])
@pytest.mark.parametrize("v41", [False, True])
@pytest.mark.parametrize("n", [4, 3])  # 3: padded to 4 inside the kernel
def test_coefficients_match_reference(device, tokens, iters, v41, n):
    from engine.kernels.mhc import hc_coefficients

    width = (2 + n) * n
    mixes = randn(tokens, width, device=device, scale=2.0, seed=tokens)
    scale, base = randn(3, device=device, seed=1).abs() + 0.5, randn(width, device=device, seed=2)
    row_scale = randn(tokens, device=device, seed=3).abs() + 0.1
    for rows in (None, row_scale):
        ours = hc_coefficients(mixes, scale, base, n, iters, 1e-6, v41, row_scale=rows)
        expected = reference_coefficients(mixes, scale, base, n, iters, 1e-6, v41, row_scale=rows)
        for got, want in zip(ours, expected):
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, **TIGHT)
    # Sinkhorn ran: after the closing column pass every column sums to ~1 (1 - eps / column sum)
    torch.testing.assert_close(ours[2].sum(-2), torch.ones(tokens, n, device=device), rtol=0, atol=1e-3)


def test_coefficients_of_a_saturated_softmax_stay_finite(device):
    from engine.kernels.mhc import hc_coefficients

    mixes = torch.zeros(2, 24, device=device)
    mixes[:, 8:] = torch.tensor([80.0, -80.0] * 8, device=device)  # one entry per row dominates
    ours = hc_coefficients(mixes, torch.ones(3, device=device), torch.zeros(24, device=device), 4, 20, 1e-6, True)
    expected = reference_coefficients(mixes, torch.ones(3, device=device), torch.zeros(24, device=device),
                                      4, 20, 1e-6, True)
    assert all(torch.isfinite(t).all() for t in ours)
    torch.testing.assert_close(ours[2], expected[2], **TIGHT)


@pytest.mark.parametrize("tokens, hidden", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_stats_give_flat_rms_and_collapse(device, tokens, dtype, hidden):
    from engine.kernels.mhc import hc_stream_stats

    streams = randn(tokens, 4, hidden, device=device, dtype=dtype, scale=3.0)
    pre = randn(tokens, 4, device=device, seed=4)
    flat, inv_rms, collapsed = hc_stream_stats(streams, 1e-6, collapse_pre=pre)
    reference = streams.flatten(-2).float()
    assert flat.dtype == torch.float32 and torch.equal(flat, reference)
    torch.testing.assert_close(inv_rms, torch.rsqrt(reference.square().mean(-1) + 1e-6), **TIGHT)
    assert collapsed.dtype == dtype
    with kernel_mode("off"):
        expected = hyper41.collapse(streams, pre)
    torch.testing.assert_close(collapsed, expected, **(TIGHT if dtype == torch.float32 else bf16(device)))
    assert hc_stream_stats(streams, 1e-6)[2] is None


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_matches_both_references(device, tokens, dtype):
    from engine.kernels.mhc_merge import hc_collapse

    streams = randn(tokens, 4, 96, device=device, dtype=dtype)
    pre = randn(tokens, 4, device=device, seed=5).abs()
    ours = hc_collapse(streams, pre)
    v4 = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)  # HyperConnection's expression
    with kernel_mode("off"):
        v41 = hyper41.collapse(streams, pre)
    tolerance = TIGHT if dtype == torch.float32 else bf16(device)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, v4, **tolerance)
    torch.testing.assert_close(ours, v41, **tolerance)


def _merge_inputs(tokens, n, hidden, dtype, device):
    streams = randn(tokens, n, hidden, device=device, dtype=dtype, seed=6)
    block_out = randn(tokens, hidden, device=device, dtype=dtype, seed=7)
    post = 2 * torch.sigmoid(randn(tokens, n, device=device, seed=8))
    comb = torch.softmax(randn(tokens, n, n, device=device, seed=9), dim=-1)
    return streams, block_out, post, comb


@pytest.mark.parametrize("tokens, hidden", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_matches_merge_streams_and_expand(device, tokens, dtype, hidden):
    from engine.kernels.mhc_merge import hc_merge

    streams, block_out, post, comb = _merge_inputs(tokens, 4, hidden, dtype, device)
    with kernel_mode("off"):
        v4 = hyper.merge_streams(streams, block_out, post, comb)
        v41 = hyper41.expand(block_out, streams, hyper41.Mix(post, post, comb))
    tolerance = TIGHT if dtype == torch.float32 else bf16(device)
    for v41_flag, expected in ((False, v4), (True, v41)):
        ours = hc_merge(streams, block_out, post, comb, v41=v41_flag)
        assert ours.shape == expected.shape and ours.dtype == expected.dtype
        torch.testing.assert_close(ours, expected, **tolerance)
    if dtype == torch.bfloat16:
        # V4's roundings exactly: comb and post to bf16, the mixed and the post term each rounded,
        # then their sum (merge_streams itself gave the same bits on an H200, but the order its
        # bmm sums in is cuBLAS's choice)
        mixed = torch.einsum("tjk,tjh->tkh", comb.to(dtype).float(), streams.float()).to(dtype)
        update = (post.to(dtype).float()[..., None] * block_out.float()[:, None]).to(dtype)
        emulated = (update.float() + mixed.float()).to(dtype)
        same = (hc_merge(streams, block_out, post, comb, v41=False) == emulated).float().mean().item()
        assert same > 0.99


def test_merge_reads_a_strided_block_output_and_odd_stream_counts(device):
    from engine.kernels.mhc_merge import hc_merge

    streams, _, post, comb = _merge_inputs(5, 3, 96, torch.float32, device)
    wide = randn(5, 200, device=device, seed=10)
    block_out = wide[:, 7:103]  # row stride 200
    with kernel_mode("off"):
        expected = hyper41.expand(block_out, streams, hyper41.Mix(post, post, comb))
    torch.testing.assert_close(hc_merge(streams, block_out, post, comb, v41=True), expected, **TIGHT)


def _v4_config(hidden: int) -> ModelConfig:
    raw = read_config_dict("tiny")
    raw["hidden_size"] = hidden
    return ModelConfig.from_dict(raw)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05 + 0.1)


@pytest.mark.parametrize("tokens", SITE_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_hyper_connection_and_head(device, tokens, dtype):
    config = _v4_config(96)
    site, head = hyper.HyperConnection(config), hyper.HyperHead(config)
    _randomise(site, 11), _randomise(head, 12)
    site, head = site.to(device), head.to(device)
    streams = randn(tokens, 4, 96, device=device, dtype=dtype, scale=2.0)
    ours = site(streams), head(streams)
    with kernel_mode("off"):
        expected = site(streams), head(streams)
    (post, comb, collapsed), (post_e, comb_e, collapsed_e) = ours[0], expected[0]
    torch.testing.assert_close(post, post_e, **TIGHT)
    torch.testing.assert_close(comb, comb_e, **TIGHT)
    tolerance = TIGHT if dtype == torch.float32 else bf16(device)
    torch.testing.assert_close(collapsed, collapsed_e, **tolerance)
    torch.testing.assert_close(ours[1], expected[1], **tolerance)


class _V41Config:
    hc_mult, hc_sinkhorn_iters, hc_eps, rms_norm_eps, hidden_size = 4, 20, 1e-6, 1e-6, 96


@pytest.mark.parametrize("tokens", SITE_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_site_functions(device, tokens, dtype):
    config = _V41Config()
    module = torch.nn.Module()
    hyper41.register_site(module, "attn", config)
    _randomise(module, 13)
    fn, base, scale = (t.to(device) for t in (module.hc_attn_fn, module.hc_attn_base, module.hc_attn_scale))
    streams = randn(tokens, 4, 96, device=device, dtype=dtype, scale=2.0)
    previous_pre = torch.sigmoid(randn(tokens, 4, device=device, seed=14))
    block_out = randn(tokens, 96, device=device, dtype=dtype, seed=15)

    mix, collapsed = hyper41.mix_and_collapse(streams, previous_pre, fn, base, scale, config)
    alone = hyper41.predict_mix(streams, fn, base, scale, config)
    expanded = hyper41.expand(block_out, streams, mix)
    with kernel_mode("off"):
        mix_e, collapsed_e = hyper41.mix_and_collapse(streams, previous_pre, fn, base, scale, config)
        expanded_e = hyper41.expand(block_out, streams, mix_e)
    for got, again, want in zip(mix, alone, mix_e):
        torch.testing.assert_close(got, want, **TIGHT)
        assert torch.equal(got, again)  # the fused site and predict_mix run the same kernels
    tolerance = TIGHT if dtype == torch.float32 else bf16(device)
    torch.testing.assert_close(collapsed, collapsed_e, **tolerance)
    torch.testing.assert_close(expanded, expanded_e, **tolerance)
    assert expanded.dtype == dtype


def test_kernel_sites_replay_from_a_cuda_graph(device):
    """No host syncs, shape-only grids: the V4 site and merge capture and replay with fresh inputs."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    config = _v4_config(256)
    site = hyper.HyperConnection(config)
    _randomise(site, 16)
    site = site.to(device)
    streams = randn(3, 4, 256, device=device, dtype=torch.bfloat16)
    block_out = randn(3, 256, device=device, dtype=torch.bfloat16, seed=17)

    def step():
        post, comb, collapsed = site(streams)
        return hyper.merge_streams(streams, block_out + collapsed, post, comb)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    streams.copy_(randn(3, 4, 256, device=device, dtype=torch.bfloat16, seed=18))
    graph.replay()
    torch.testing.assert_close(captured, step(), rtol=0, atol=0)
    with kernel_mode("off"):
        torch.testing.assert_close(captured, step(), **bf16(device))


def test_tiny_v4_model_logits_with_and_without_mhc_kernels(device, tmp_path):
    """Only the mHC sites switch (the rest of the model stays on torch), prefill and two decode steps."""
    from engine.models.v4 import load_model
    from engine.models.v4.random_init import write_random_model_dir
    from tests.engine.references import make_prompt, rel_err

    model_dir = write_random_model_dir("tiny", tmp_path / "tiny", seed=0, vocab_size=1024, dtype=torch.float32)
    model = load_model(model_dir, device=device, dtype=torch.float32)
    prompt, decoded = make_prompt(9, 0).to(device), make_prompt(2, 1).to(device)

    def run(mhc_kernels: bool) -> torch.Tensor:
        with pinned(("hc_v4_site", "hc_merge", "hc_v4_head"), mhc_kernels):   # V4's mHC sites
            state = model.new_state()
            logits = [model([prompt], [state], all_logits=True)]
            for token in decoded:
                logits.append(model([token.view(1)], [state], all_logits=True))
        return torch.cat(logits)

    with kernel_mode("off"):
        expected, ours = run(False), run(True)
    assert rel_err(expected, ours) <= 1e-5
