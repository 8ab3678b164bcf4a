"""Tiles for short sequences (config.tile_edge): calls whose queries or keys 64-row tiles would pad
by more than an eighth run kernels built with 16- or 32-row tiles, compiled at the first such call. Results against float64
at lengths on both sides of each threshold (none a multiple of a tile, but the thresholds)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, random_inputs
from tvmflash import compiler, flash_attn_func, records, torch_op
from tvmflash import target as targets
from tvmflash.config import CPUKernelConfig, RegisterTile, default_cpu_config, tile_edge
from tvmflash.spec import AttentionSpec


def test_tile_edge_pads_least():
    """The largest edge that pads by at most an eighth of the sequence, else the least padding
    (16 rows only up to 64 tokens)."""
    lengths = (1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 100, 127, 129, 200, 300, 5000, None)
    assert [tile_edge(n) for n in lengths] == [16, 16, 16, 32, 32, 32, 16, 16, 64, 64, 32, 32, 64, 64, 32, 32, 64,
                                               64, 64]
    for n in range(1, 600):
        padding = {edge: -n % edge for edge in ((16, 32, 64) if n <= 64 else (32, 64))}
        assert padding[tile_edge(n)] * 8 <= n or padding[tile_edge(n)] == min(padding.values())


@pytest.mark.parametrize("seqlen_q", [1, 16, 17, 32, 100])
def test_forward_register_tiles_fit_the_tile(seqlen_q):
    """The forward's products have the query tile in their 16 vector lanes: the register tile's
    vectors fit in it, and it keeps at least 8 independent accumulators."""
    cfg = default_cpu_config("forward", True, seqlen_q=seqlen_q, seqlen_k=seqlen_q)
    for product in ("scores", "pv"):
        tile = cfg.tile(product)
        assert tile.vectors * cfg.lanes <= cfg.block_q and cfg.block_q % (tile.vectors * cfg.lanes) == 0
        assert tile.rows * tile.vectors >= 8 and cfg.block_k % tile.rows == 0


def test_kernels_follow_the_call_length():
    q = torch.zeros(1, 1, 1, 64)
    edges = {}
    for seqlens in ((16, 16), (17, 17), (15, 1000), (64, 64), None):
        cfg = torch_op.kernels_for(q, seqlens=seqlens).configs["forward"]
        edges[seqlens] = (cfg.block_q, cfg.block_k)
    assert edges == {(16, 16): (16, 16), (17, 17): (32, 32), (15, 1000): (16, 64), (64, 64): (64, 64),
                     None: (64, 64)}
    # one compile per size class: the same kernels for every length in it
    assert torch_op.kernels_for(q, seqlens=(3, 9)) is torch_op.kernels_for(q, seqlens=(16, 16))
    assert torch_op.kernels_for(q, seqlens=(128, 2000)) is torch_op.kernels_for(q)


def test_short_sequences_skip_tuning_records_with_long_tiles(monkeypatch):
    """A record tuned at long lengths (64-row tiles) would compute padding on short sequences."""
    tuned = CPUKernelConfig("forward", 64, 64, 16, (("scores", RegisterTile(2, 4)), ("pv", RegisterTile(2, 4))))
    monkeypatch.setattr(records, "lookup", lambda _t, _s, kernel, _n: (tuned, "record") if kernel == "forward"
                        else None)
    target = targets.resolve("llvm")
    spec = AttentionSpec(64, "float32")
    assert compiler.choose_configs(target, spec)[0]["forward"] is tuned
    assert compiler.choose_configs(target, spec, seqlen=2048)[0]["forward"] is tuned
    short, used = compiler.choose_configs(target, spec, seqlen=(16, 16))
    assert (short["forward"].block_q, short["forward"].block_k) == (16, 16) and used is None


SHAPES = [
    dict(batch=1, seqlen_q=15, seqlen_k=15, heads=3, heads_k=1),
    dict(batch=2, seqlen_q=16, seqlen_k=16, heads=2, heads_k=2),
    dict(batch=1, seqlen_q=17, seqlen_k=17, heads=4, heads_k=2),
    dict(batch=1, seqlen_q=31, seqlen_k=33, heads=2, heads_k=1),
    dict(batch=1, seqlen_q=33, seqlen_k=31, heads=2, heads_k=2),
    dict(batch=2, seqlen_q=1, seqlen_k=203, heads=4, heads_k=2),
    dict(batch=1, seqlen_q=13, seqlen_k=5, heads=2, heads_k=2),
    dict(batch=2, seqlen_q=41, seqlen_k=100, heads=2, heads_k=1),  # 16-row tiles past 32 tokens
    dict(batch=1, seqlen_q=150, seqlen_k=150, heads=2, heads_k=2),  # 32-row ones past 64
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['seqlen_q']}x{s['seqlen_k']}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_short_sequences_match_float64(shape, causal, gen, seed):
    q, k, v = random_inputs(gen, head_dim=64, dtype="float32", requires_grad=True, **shape)
    dout = torch.randn(q.shape, generator=gen)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_reference(f"{shape} causal={causal}", (q, k, v, dout), (out, lse, dq, dk, dv), causal, seed)


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: f"{s['seqlen_q']}x{s['seqlen_k']}")
def test_short_sequences_bf16(shape, gen, seed):
    q, k, v = random_inputs(gen, head_dim=64, dtype="bfloat16", requires_grad=True, **shape)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_reference(f"{shape} bf16", (q, k, v, dout), (out, lse, dq, dk, dv), True, seed)


def test_inference_calls_take_the_short_tiles(gen):
    """The dispatcher-free inference path and the custom op choose the same kernels."""
    q, k, v = random_inputs(gen, 1, 9, 9, 2, 2, 64, "float32")
    with torch.inference_mode():
        fast = flash_attn_func(q, k, v, causal=True)
    slow = torch.ops.tvmflash.flash_attn_forward(q, k, v, None, None, None, 0.125, -1, 0, 0.0, False, False, None)[0]
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("lengths_q,lengths_k,edges", [
    ([15, 1, 9], [15, 1, 9], (16, 16)),      # a padded batch of short prompts: 16-row tiles
    ([31, 17, 5], [20, 48, 5], (32, 16)),    # the longest query and key choose each side
])
def test_packed_short_sequences_match_float64(lengths_q, lengths_k, edges, gen, seed):
    """Packed sequences (``flash_attn_varlen_func``, transformers' padded batches) choose tiles by
    their longest sequence: each sequence's out, lse, dq, dk, dv against float64 attention."""
    from tvmflash import flash_attn_varlen_func

    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    assert torch_op._call_seqlens(torch.zeros(1, 1, 1, 64), None, cu_q, cu_k) == (max(lengths_q), max(lengths_k))
    cfg = torch_op.kernels_for(torch.zeros(1, 1, 1, 64), seqlens=(max(lengths_q), max(lengths_k))).configs["forward"]
    assert (cfg.block_q, cfg.block_k) == edges
    heads, heads_k = 4, 2
    q = torch.randn(sum(lengths_q), heads, 64, generator=gen).requires_grad_()
    k = torch.randn(sum(lengths_k), heads_k, 64, generator=gen).requires_grad_()
    v = torch.randn(sum(lengths_k), heads_k, 64, generator=gen).requires_grad_()
    dout = torch.randn(q.shape, generator=gen)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                         return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths_q)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = lambda t, rows: t[rows][None]  # noqa: E731  (1, length, heads, head_dim)
        assert_matches_reference(f"sequence {b}", (one(q, rq), one(k, rk), one(v, rk), one(dout, rq)),
                                 (one(out, rq), lse[:, rq][None], one(dq, rq), one(dk, rk), one(dv, rk)), True, seed)
