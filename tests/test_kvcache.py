"""flash_attn_with_kvcache (kvcache.py, kernels/decode.py) against a dense float64 reference.

Every case follows flash-attn's test_flash_attn_kvcache: the cache the kernel attends to is
rebuilt densely per sequence (keys cache_leftpad .. cache_seqlens + new, new tokens rotated and
written in place), and the output must satisfy the flash-attn rule against float64 attention
on it (error <= 2 x plain PyTorch's in the same dtype + a few ulps). Shapes are small; each
(head dim, dtype, softcap, ALiBi) compiles once (~1-2 s), then comes from the disk cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DTYPES, assert_flash_rule

from tvmflash import flash_attn_with_kvcache, plan
from tvmflash.reference import reference_attention, window_mask

D = 64


def rotary_ref(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb (fp32 math, cast once), written out independently."""
    rot = 2 * cos.shape[1]
    c, s = cos.float()[positions][:, :, None, :], sin.float()[positions][:, :, None, :]
    out = x.float().clone()
    if interleaved:
        x1, x2 = x[..., 0:rot:2].float(), x[..., 1:rot:2].float()
        out[..., 0:rot:2], out[..., 1:rot:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        half = rot // 2
        x1, x2 = x[..., :half].float(), x[..., half:rot].float()
        out[..., :half], out[..., half:rot] = x1 * c - x2 * s, x1 * s + x2 * c
    return out.to(x.dtype)


def dense_view(cache, b, cache_rows, block_table):
    """Sequence b's logical cache rows (capacity, heads_k, D)."""
    if block_table is None:
        return cache[cache_rows[b]]
    return cache[block_table[b].long()].flatten(0, 1)


def check_against_reference(tag, out, lse, q_ro, k_cache, v_cache, *, starts, ends, cache_rows=None,
                            block_table=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            scale=None, seed=0):
    dtype = q_ro.dtype
    batch, seqlen_q = q_ro.shape[:2]
    if cache_rows is None:
        cache_rows = list(range(batch))
    for b in range(batch):
        k = dense_view(k_cache, b, cache_rows, block_table)[starts[b]:ends[b]][None]
        v = dense_view(v_cache, b, cache_rows, block_table)[starts[b]:ends[b]][None]
        slopes = None if alibi_slopes is None else alibi_slopes.reshape(-1, alibi_slopes.shape[-1])[
            min(b, alibi_slopes.reshape(-1, alibi_slopes.shape[-1]).shape[0] - 1)]
        kw = dict(causal=causal, window_size=window_size, softcap=softcap, scale=scale, alibi_slopes=slopes)
        ref64, lse64 = reference_attention(q_ro[b:b + 1], k, v, dtype=torch.float64, **kw)
        same, _ = reference_attention(q_ro[b:b + 1], k, v, dtype=dtype, **kw)
        assert_flash_rule(f"{tag} b={b} out", out[b:b + 1], ref64, same, dtype, seed,
                          magnitude=float(v.abs().max()) if v.numel() else 1.0)
        if lse is not None:
            finite = torch.isfinite(lse64)
            assert torch.equal(torch.isfinite(lse[b:b + 1]), finite), f"{tag} b={b}: lse -inf pattern (seed {seed})"
            if finite.any():
                err = (lse[b:b + 1][finite].double() - lse64[finite]).abs().max().item()
                assert err <= 1e-5 * max(1.0, lse64[finite].abs().max().item()), f"{tag} b={b} lse error {err}"


def make_cache(gen, batch_cache, capacity, heads_k, dtype):
    draw = lambda: torch.randn(batch_cache, capacity, heads_k, D, generator=gen).to(DTYPES[dtype])  # noqa: E731
    return draw(), draw()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (3, 3), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_update_lengths_gqa_causal(gen, seed, dtype, seqlen_q, seqlen_new, causal):
    """New tokens written in place at each sequence's length, GQA (4 heads per kv head), several
    new queries under a causal mask, per-sequence lengths (one empty cache)."""
    batch, heads, heads_k, capacity = 3, 8, 2, 200
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, dtype)
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen).to(DTYPES[dtype])
    k_new = torch.randn(batch, seqlen_new, heads_k, D, generator=gen).to(DTYPES[dtype])
    v_new = torch.randn(batch, seqlen_new, heads_k, D, generator=gen).to(DTYPES[dtype])
    seqlens = torch.tensor([150, 0, 77], dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        n = int(seqlens[b])
        expected_k[b, n:n + seqlen_new], expected_v[b, n:n + seqlen_new] = k_new[b], v_new[b]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), "cache update"
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (batch, heads, seqlen_q)
    ends = [int(n) + seqlen_new for n in seqlens]
    check_against_reference("update", out, lse, q, k_cache, v_cache, starts=[0] * batch, ends=ends, causal=causal,
                            seed=seed)


@pytest.mark.parametrize("heads,heads_k,seqlen_q", [(4, 4, 1), (8, 1, 3), (12, 3, 2)])
def test_mqa_mha_and_row_blocks(gen, seed, heads, heads_k, seqlen_q):
    """MHA (group 1), MQA with 8 heads x 3 queries = 24 rows per kv head (several row blocks),
    and a group of 4 with 2 queries; no new tokens, the cache read as it is."""
    batch, capacity = 2, 300
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, "float32")
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen)
    seqlens = torch.tensor([300, 129], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    check_against_reference("mqa", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=seqlens.tolist(), causal=True,
                            seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window_size,causal", [((50, 0), False), ((10, -1), True), ((0, 0), False), ((70, 3), False),
                                                ((-1, 2), False)])
def test_sliding_window(gen, seed, dtype, window_size, causal):
    batch, heads, heads_k, capacity, seqlen_q = 2, 4, 2, 256, 4
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, dtype)
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen).to(DTYPES[dtype])
    k_new = torch.randn(batch, seqlen_q, heads_k, D, generator=gen).to(DTYPES[dtype])
    v_new = torch.randn(batch, seqlen_q, heads_k, D, generator=gen).to(DTYPES[dtype])
    seqlens = torch.tensor([200, 5], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                                       window_size=window_size, return_softmax_lse=True)
    ends = [int(n) + seqlen_q for n in seqlens]
    check_against_reference("window", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=ends, causal=causal,
                            window_size=window_size, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_fraction", [0.5, 1.0])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(gen, seed, dtype, interleaved, rotary_fraction, causal):
    """Rotary embedding of the new keys at cache_seqlens + t (written rotated into the cache)
    and of the queries at cache_seqlens + i (causal) or cache_seqlens (not causal)."""
    batch, heads, heads_k, capacity, seqlen_q = 2, 4, 2, 128, 3
    rotary_dim = int(rotary_fraction * D)
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, dtype)
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen).to(DTYPES[dtype])
    k_new = torch.randn(batch, seqlen_q, heads_k, D, generator=gen).to(DTYPES[dtype])
    v_new = torch.randn(batch, seqlen_q, heads_k, D, generator=gen).to(DTYPES[dtype])
    angle = torch.rand(capacity, rotary_dim // 2, generator=gen) * 2 * math.pi
    cos, sin = torch.cos(angle).to(DTYPES[dtype]), torch.sin(angle).to(DTYPES[dtype])
    seqlens = torch.tensor([100, 17], dtype=torch.int32)
    base = seqlens.long()[:, None]
    q_pos = base + (torch.arange(seqlen_q)[None] if causal else torch.zeros(1, seqlen_q, dtype=torch.long))
    q_ro = rotary_ref(q, cos, sin, q_pos, interleaved)
    k_ro = rotary_ref(k_new, cos, sin, base + torch.arange(seqlen_q)[None], interleaved)
    q_before = q.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=seqlens, causal=causal, rotary_interleaved=interleaved)
    assert torch.equal(q, q_before), "q itself is not modified"
    for b in range(batch):
        n = int(seqlens[b])
        torch.testing.assert_close(k_cache[b, n:n + seqlen_q], k_ro[b], rtol=1e-3, atol=1e-3)
        assert torch.equal(v_cache[b, n:n + seqlen_q], v_new[b])
    ends = [int(n) + seqlen_q for n in seqlens]
    check_against_reference("rotary", out, None, q_ro, k_cache, v_cache, starts=[0, 0], ends=ends, causal=causal,
                            seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_paged_cache(gen, seed, dtype, seqlen_new):
    """A paged cache: pages of 64 rows in a shuffled pool, read and written through block_table."""
    batch, heads, heads_k, page, max_blocks = 3, 8, 2, 64, 4
    num_blocks = batch * max_blocks + 2
    k_pool, v_pool = make_cache(gen, num_blocks, page, heads_k, dtype)
    block_table = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].reshape(batch, max_blocks).int()
    q = torch.randn(batch, 2, heads, D, generator=gen).to(DTYPES[dtype])
    seqlens = torch.tensor([250, 63, 130], dtype=torch.int32)
    k_new = v_new = None
    if seqlen_new:
        k_new = torch.randn(batch, seqlen_new, heads_k, D, generator=gen).to(DTYPES[dtype])
        v_new = torch.randn(batch, seqlen_new, heads_k, D, generator=gen).to(DTYPES[dtype])
    untouched = [p for p in range(num_blocks) if p not in block_table.flatten().tolist()]
    pool_before = k_pool[untouched].clone()
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=block_table, causal=True, return_softmax_lse=True)
    assert torch.equal(k_pool[untouched], pool_before)
    for b in range(batch):
        n = int(seqlens[b])
        if seqlen_new:
            assert torch.equal(dense_view(k_pool, b, None, block_table)[n:n + seqlen_new], k_new[b])
            assert torch.equal(dense_view(v_pool, b, None, block_table)[n:n + seqlen_new], v_new[b])
    ends = [int(n) + seqlen_new for n in seqlens]
    check_against_reference("paged", out, lse, q, k_pool, v_pool, starts=[0] * batch, ends=ends,
                            block_table=block_table, causal=True, seed=seed)


@pytest.mark.parametrize("head_dim,dtype", [(40, "float32"), (72, "bfloat16"), (256, "float32")])
def test_head_dims(gen, seed, head_dim, dtype):
    """Head dims that are not a multiple of the vector width (40, 72) and the largest (256); a
    paged cache whose unused block_table entries are -1 (as vLLM leaves them)."""
    batch, heads, heads_k, page = 2, 4, 1, 64
    pool_k = torch.randn(6, page, heads_k, head_dim, generator=gen).to(DTYPES[dtype])
    pool_v = torch.randn(6, page, heads_k, head_dim, generator=gen).to(DTYPES[dtype])
    block_table = torch.tensor([[4, 1, 3], [0, -1, -1]], dtype=torch.int32)
    q = torch.randn(batch, 2, heads, head_dim, generator=gen).to(DTYPES[dtype])
    seqlens = torch.tensor([150, 60], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, block_table=block_table,
                                       causal=True, return_softmax_lse=True)
    table = block_table.clamp_min(0)
    check_against_reference(f"d{head_dim}", out, lse, q, pool_k, pool_v, starts=[0, 0], ends=[150, 60],
                            block_table=table, causal=True, seed=seed)


@pytest.mark.parametrize("head_dim,dtype,paged", [(59, "float32", False), (111, "bfloat16", True)])
def test_head_dims_padded_to_a_multiple_of_8(gen, seed, head_dim, dtype, paged):
    """Head dims that are no multiple of 8 (flash-attn's test uses 59): q, the caches and the new
    tokens are zero-padded as flash-attn pads them; the new tokens land in the caller's cache
    (rotated), nothing else in it changes, and the scale defaults to 1/sqrt(true head dim)."""
    batch, heads, heads_k, seqlen_q, rotary_dim = 2, 4, 2, 2, 32
    draw = lambda *shape: torch.randn(*shape, head_dim, generator=gen).to(DTYPES[dtype])  # noqa: E731
    block_table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32) if paged else None
    k_cache, v_cache = (draw(5, 64, heads_k) if paged else draw(batch, 128, heads_k) for _ in range(2))
    q, k_new, v_new = draw(batch, seqlen_q, heads), draw(batch, seqlen_q, heads_k), draw(batch, seqlen_q, heads_k)
    angle = torch.rand(128, rotary_dim // 2, generator=gen) * 2 * math.pi
    cos, sin = torch.cos(angle).to(DTYPES[dtype]), torch.sin(angle).to(DTYPES[dtype])
    seqlens = torch.tensor([100, 17], dtype=torch.int32)
    positions = seqlens.long()[:, None] + torch.arange(seqlen_q)[None]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        n = int(seqlens[b])
        rows = [(block_table[b, (n + t) // 64].item(), (n + t) % 64) if paged else (b, n + t) for t in range(seqlen_q)]
        k_rotated = rotary_ref(k_new, cos, sin, positions, False)[b]
        for t, (row, col) in enumerate(rows):
            expected_k[row, col], expected_v[row, col] = k_rotated[t], v_new[b, t]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=block_table, causal=True,
                                       rotary_interleaved=False, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    torch.testing.assert_close(k_cache, expected_k, rtol=1e-3, atol=1e-3)
    assert torch.equal(v_cache, expected_v)
    q_ro = rotary_ref(q, cos, sin, positions, False)
    check_against_reference(f"d{head_dim}", out, lse, q_ro, k_cache, v_cache, starts=[0, 0],
                            ends=[int(n) + seqlen_q for n in seqlens], block_table=block_table, causal=True, seed=seed)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=f"must have shape .* zero-padded to {head_dim + 8 - head_dim % 8}"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new[:, :, :1], v_new[:, :, :1], cache_seqlens=seqlens,
                                block_table=block_table)
    assert torch.equal(k_cache, before), "a refused call leaves the cache alone"


def test_batch_idx_leftpad_scale(gen, seed):
    """cache_batch_idx picks cache rows (new tokens land there), cache_leftpad hides the first
    keys (masks and ALiBi stay aligned at the end), softmax_scale."""
    batch, heads, heads_k, capacity = 2, 4, 2, 160
    k_cache, v_cache = make_cache(gen, 5, capacity, heads_k, "float32")
    q = torch.randn(batch, 2, heads, D, generator=gen)
    k_new = torch.randn(batch, 2, heads_k, D, generator=gen)
    v_new = torch.randn(batch, 2, heads_k, D, generator=gen)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    seqlens = torch.tensor([120, 40], dtype=torch.int32)
    leftpad = torch.tensor([30, 0], dtype=torch.int32)
    slopes = torch.rand(heads, generator=gen) * 0.3
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       cache_batch_idx=rows, cache_leftpad=leftpad, softmax_scale=0.3, causal=True,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    assert torch.equal(k_cache[3, 120:122], k_new[0]) and torch.equal(v_cache[1, 40:42], v_new[1])
    check_against_reference("batch_idx", out, lse, q, k_cache, v_cache, starts=leftpad.tolist(), ends=[122, 42],
                            cache_rows=rows.tolist(), causal=True, alibi_slopes=slopes, scale=0.3, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_alibi(gen, seed, dtype):
    batch, heads, heads_k, capacity = 2, 8, 2, 150
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, dtype)
    q = (3 * torch.randn(batch, 1, heads, D, generator=gen)).to(DTYPES[dtype])
    seqlens = torch.tensor([150, 90], dtype=torch.int32)
    slopes = torch.rand(batch, heads, generator=gen) * 0.3
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, softcap=5.0, alibi_slopes=slopes,
                                       return_softmax_lse=True)
    check_against_reference("softcap_alibi", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=seqlens.tolist(),
                            softcap=5.0, alibi_slopes=slopes, seed=seed)


def test_splits_agree_and_empty_rows(gen, seed):
    """Any num_splits gives the flash-attn rule's answer; a sequence with no visible key gives
    out = 0 and lse = -inf (as flash-attn); the automatic split of one (batch, kv head) uses
    every thread."""
    batch, heads, heads_k, capacity = 2, 4, 1, 1000
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, "float32")
    q = torch.randn(batch, 1, heads, D, generator=gen)
    seqlens = torch.tensor([1000, 0], dtype=torch.int32)
    for splits in (0, 1, 2, 5, 100):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits,
                                           return_softmax_lse=True)
        check_against_reference(f"splits={splits}", out[:1], lse[:1], q[:1], k_cache, v_cache, starts=[0],
                                ends=[1000], seed=seed)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    # no unit at all: every sequence empty (or hidden by its left padding)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                                       cache_leftpad=torch.tensor([0, 5], dtype=torch.int32), return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    _, units = plan.decode_units([0], [16384], seqlen_q=1, window=(1 << 40, 1 << 40), block_k=64, heads_k=1,
                                 threads=2)
    assert len(units) >= 2 and units[:, 1].min() == 0 and units[:, 2].max() == 256


def test_head_groups(gen, seed, monkeypatch):
    """Units that cover a group of the kv heads (one head each here): the merge combines the
    groups' partials; with windows, several new tokens and splits."""
    monkeypatch.setattr(plan, "DECODE_TILE_BYTES", 1)
    assert plan.decode_head_group(4, 64, D, 4) == 1
    batch, heads, heads_k, capacity = 2, 8, 4, 300
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, "float32")
    q = torch.randn(batch, 3, heads, D, generator=gen)
    seqlens = torch.tensor([300, 150], dtype=torch.int32)
    for splits in (0, 3):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window_size=(100, 0),
                                           num_splits=splits, return_softmax_lse=True)
        check_against_reference(f"groups splits={splits}", out, lse, q, k_cache, v_cache, starts=[0, 0],
                                ends=[300, 150], window_size=(100, 0), seed=seed)


def test_inference_mode_and_full_cache(gen, seed):
    """Under torch.inference_mode (inference tensors, cache updated in place), and with
    cache_seqlens omitted: the whole cache is attended to."""
    with torch.inference_mode():
        k_cache, v_cache = make_cache(gen, 1, 96, 1, "bfloat16")
        q = torch.randn(1, 1, 2, D, generator=gen).to(torch.bfloat16)
        out = flash_attn_with_kvcache(q, k_cache, v_cache)
        ref64, _ = reference_attention(q, k_cache, v_cache, dtype=torch.float64)
        same, _ = reference_attention(q, k_cache, v_cache, dtype=torch.bfloat16)
        assert_flash_rule("inference_mode full cache", out, ref64, same, torch.bfloat16, seed)
        k_new = torch.randn(1, 1, 1, D, generator=gen).to(torch.bfloat16)
        out2 = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=95)
        assert torch.equal(k_cache[0, 95], k_new[0, 0])
    ref64, _ = reference_attention(q, k_cache, v_cache, dtype=torch.float64)
    same, _ = reference_attention(q, k_cache, v_cache, dtype=torch.bfloat16)
    assert_flash_rule("inference_mode", out2, ref64, same, torch.bfloat16, seed)
    assert out.shape == out2.shape


def test_strided_caches(gen, seed):
    """Caches that are views (a window of a longer buffer, every other kv head of a wider one):
    read in place through their strides, new tokens written into the views."""
    batch, heads, heads_k, capacity = 2, 4, 2, 100
    wide = torch.randn(batch, capacity + 7, 2 * heads_k, D, generator=gen)
    k_cache, v_cache = wide[:, 3:capacity + 3, 0::2], wide[:, 3:capacity + 3, 1::2]
    q = torch.randn(batch, 2, heads, D, generator=gen)
    k_new = torch.randn(batch, 2, heads_k, D, generator=gen)
    v_new = torch.randn(batch, 2, heads_k, D, generator=gen)
    seqlens = torch.tensor([98, 40], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    assert torch.equal(wide[0, 3 + 98:3 + 100, 0::2], k_new[0]) and torch.equal(wide[1, 3 + 40:3 + 42, 1::2], v_new[1])
    check_against_reference("strided", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=[100, 42], causal=True,
                            seed=seed)


def test_decode_benchmark_quick(tmp_path):
    """benchmarks/decode.py runs (small sizes) and writes its table."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/decode.py", "--quick", "--out-dir", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "TVMFLASH_QUIET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (tmp_path / "decode.md").read_text()
    assert "Geomean speed-up" in report and "read bandwidth" in report and "| bfloat16 B=4" in report


def test_errors(gen):
    q = torch.randn(1, 1, 4, D)
    k_cache = torch.randn(1, 64, 2, D)
    with pytest.raises(ValueError, match="block_table"):  # flash-attn's bounds test: capacity 64 per sequence
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=torch.tensor([65], dtype=torch.int32),
                                block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="block_table"):  # the class flash-attn raises (and a ValueError)
        new = torch.randn(1, 1, 2, D)
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=64,
                                block_table=torch.zeros(1, 1, dtype=torch.int32))
    out = flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=torch.tensor([64], dtype=torch.int32),
                                  block_table=torch.zeros(1, 1, dtype=torch.int32))
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="cache length"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=65)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_with_kvcache(q, k_cache.bfloat16(), k_cache.bfloat16())
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        flash_attn_with_kvcache(torch.randn(1, 1, 3, D), k_cache, k_cache.clone())
    with pytest.raises(ValueError, match="page indices"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=10,
                                block_table=torch.full((1, 1), 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_block_size"):
        flash_attn_with_kvcache(q, torch.randn(2, 32, 2, D), torch.randn(2, 32, 2, D), cache_seqlens=10,
                                block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="need cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D))
    before = k_cache.clone()
    with pytest.raises(ValueError, match="alibi_slopes"):  # checked before the cache is written
        new = torch.randn(1, 1, 2, D)
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=3, alibi_slopes=torch.ones(3))
    assert torch.equal(k_cache, before)
    new = torch.randn(1, 1, 2, D)
    for table in (torch.ones(100, D // 2, dtype=torch.int64), torch.ones(100, D // 2, dtype=torch.float64)):
        with pytest.raises(TypeError, match="rotary_cos and rotary_sin must have q's dtype"):
            flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=3, rotary_cos=table,
                                    rotary_sin=table)
    assert torch.equal(k_cache, before)
    # a block table of no blocks: nothing to attend to (zeros and lse -inf, as a cache of length 0)
    out, lse = flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=0,
                                       block_table=torch.zeros(1, 0, dtype=torch.int32), return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and bool((lse == float("-inf")).all())
    with pytest.raises(RuntimeError, match="forward only"):
        flash_attn_with_kvcache(q.requires_grad_(), k_cache, k_cache.clone())


def test_avx2_build(gen, seed):
    """The kernel compiled for an AVX2-only CPU (8-lane vectors, 16 registers) runs here and
    gives the same answer (this machine's CPU runs AVX2 code)."""
    import numpy as np

    from tvmflash import compiler
    from tvmflash.spec import AttentionSpec, UNLIMITED_WINDOW

    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    kernels = compiler.compile_decode({"kind": "llvm", "mcpu": "haswell"}, AttentionSpec(D, "float32"))
    assert kernels.config.lanes == 8
    batch, heads, heads_k, capacity = 2, 8, 2, 200
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, "float32")
    q = torch.randn(batch, 1, heads, D, generator=gen)
    ends = [200, 70]
    window = (UNLIMITED_WINDOW, UNLIMITED_WINDOW)
    seq_info, units = plan.decode_units([0, 0], ends, seqlen_q=1, window=window, block_k=kernels.config.block_k,
                                        heads_k=heads_k, threads=2)
    out, lse = torch.empty_like(q), torch.empty(batch, heads, 1)
    kernels.decode(q, k_cache, v_cache, out, lse, D ** -0.5, window, 2, torch.from_numpy(seq_info),
                   torch.from_numpy(units), torch.arange(batch, dtype=torch.int32)[:, None])
    assert np.isfinite(lse.numpy()).all()
    check_against_reference("avx2", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=ends, seed=seed)


@pytest.mark.parametrize("score_lanes,score_keys,block_rows,heads,head_dim,dtype", [
    (8, 4, 4, 8, 64, "float32"),     # 16 accumulators of 8 lanes: two vectors of sums
    (16, 1, 4, 12, 64, "bfloat16"),  # 4 accumulators of 16 lanes: one vector folded onto itself
    (16, 4, 2, 6, 64, "float32"),    # 8 of 16, 2-row blocks; 6 rows per kv head: three blocks
    (16, 2, 4, 6, 40, "bfloat16"),   # head dim 40: 8 lanes; a 4-row block half padding
])
def test_score_tree_shapes(gen, seed, score_lanes, score_keys, block_rows, heads, head_dim, dtype):
    """The score product's lane sums (``DecodeKernel.sum_tree``) for every shape of its tree:
    more accumulators than lanes, fewer, and row blocks that pad the GQA group."""
    from tvmflash import compiler
    from tvmflash.config import DecodeConfig
    from tvmflash.spec import AttentionSpec, UNLIMITED_WINDOW

    config = DecodeConfig(block_rows=block_rows, score_lanes=score_lanes, score_keys=score_keys)
    kernels = compiler.compile_decode({"kind": "llvm"}, AttentionSpec(head_dim, dtype), config=config)
    batch, heads_k, capacity, ends = 2, heads // (6 if heads % 4 else 4), 150, [150, 77]
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(DTYPES[dtype])  # noqa: E731
    k_cache, v_cache = draw(batch, capacity, heads_k, head_dim), draw(batch, capacity, heads_k, head_dim)
    q = draw(batch, 1, heads, head_dim)
    window = (UNLIMITED_WINDOW, UNLIMITED_WINDOW)
    seq_info, units = plan.decode_units([0, 0], ends, seqlen_q=1, window=window, block_k=kernels.config.block_k,
                                        heads_k=heads_k, threads=2)
    out, lse = torch.full_like(q, float("nan")), torch.full((batch, heads, 1), float("nan"))
    kernels.decode(q, k_cache, v_cache, out, lse, head_dim ** -0.5, window, 2, torch.from_numpy(seq_info),
                   torch.from_numpy(units), torch.arange(batch, dtype=torch.int32)[:, None])
    check_against_reference(f"tree {config}", out, lse, q, k_cache, v_cache, starts=[0, 0], ends=ends, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window_size,value", [((-1, -1), "nan"), ((40, -1), "nan"), ((-1, -1), "inf")])
def test_nan_in_cache_reaches_exactly_the_rows_that_see_it(gen, seed, dtype, num_splits, window_size, value):
    """A NaN (or inf) in a cached key or value the query attends to makes that kv head's query
    heads NaN, as in float64 dense attention (the probabilities' exponent cap once turned a NaN
    score into P = 1: finite, wrong rows). Slots past cache_seqlens, in cache_leftpad, or masked
    for every query by the causal mask or the window change nothing (the reference: float64
    attention over the sequence's keys, those slots' values zeroed). GQA (2 query heads per kv
    head), 2 causal queries, caches of several key tiles split 1 or 4 ways."""
    batch, heads, heads_k, capacity, seqlen_q = 2, 4, 2, 300, 2
    k_cache, v_cache = make_cache(gen, batch, capacity, heads_k, dtype)
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen).to(DTYPES[dtype])
    seqlens, leftpad = [260, 190], [0, 21]
    bad = float(value)
    k_cache[0, 70, 1, 3] = bad  # seen by both queries unless the window hides it
    k_cache[0, 259, 0, 5] = bad  # the last key: query 0 does not see it (causal)
    k_cache[0, 280, 0, 1] = v_cache[0, 290, 1, 2] = bad  # past cache_seqlens
    v_cache[1, 130, 0, 7] = bad  # seen unless the window hides it
    k_cache[1, 5, 1, 0] = v_cache[1, 20, 1, 9] = bad  # cache_leftpad
    k_cache[1, 250, 1, 4] = v_cache[1, 195, 0, 6] = bad  # past cache_seqlens
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                  cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=True,
                                  window_size=window_size, num_splits=num_splits)
    for b in range(batch):
        k, v = (c[b:b + 1, leftpad[b]:seqlens[b]].clone() for c in (k_cache, v_cache))
        seen = window_mask(seqlen_q, k.shape[1], window_size, causal=True).any(0)
        v[:, ~seen] = 0  # keys no query attends to are not there
        ref, _ = reference_attention(q[b:b + 1], k, v, causal=True, window_size=window_size, dtype=torch.float64)
        rows = ~torch.isfinite(ref).all(-1)  # (1, seqlen_q, heads)
        assert torch.equal(~torch.isfinite(out[b:b + 1]).all(-1), rows), (
            f"b={b}: non-finite rows {~torch.isfinite(out[b]).all(-1)} vs float64 {rows[0]} (seed {seed})")
        same, _ = reference_attention(q[b:b + 1], k, v, causal=True, window_size=window_size, dtype=q.dtype)
        finite = ~rows
        assert_flash_rule(f"b={b} finite rows", out[b:b + 1][finite], ref[finite], same[finite], q.dtype, seed)
    if value == "nan":  # the rows expected (guards the test itself)
        hidden = window_size[0] >= 0  # key 70 of sequence 0, value 130 of sequence 1
        assert (~torch.isfinite(out[0]).all(-1)).tolist() == [[False, False, not hidden, not hidden],
                                                              [True, True, not hidden, not hidden]]
        assert (~torch.isfinite(out[1]).all(-1)).tolist() == [[not hidden] * 2 + [False] * 2] * 2
