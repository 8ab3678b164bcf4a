"""flash-attn 2's Python surface: window_size (both sides, bottom-right aligned), softcap, ALiBi,
GQA, return values, the packed and varlen functions, against a dense float64 reference (torch
autograd) by the flash-attn rule; varlen also against per-sequence flash_attn_func calls."""

from __future__ import annotations

import pytest
import torch

import tvmflash
from conftest import DTYPES, assert_flash_rule, assert_matches_reference, random_inputs
from tvmflash import checks
from tvmflash.config import tile_edge
from tvmflash.reference import reference_attention


def _randint(gen, lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _window(gen, seqlen):
    """A random flash-attn window: each side -1 (unlimited) or 0 .. seqlen."""
    return tuple(-1 if torch.rand(1, generator=gen) < 0.25 else _randint(gen, 0, seqlen) for _ in range(2))


def _run(q, k, v, dout, **kwargs):
    out, lse, s_dmask = tvmflash.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert s_dmask is None
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("repeat", range(3))
def test_windows_softcap_alibi_gqa(gen, seed, dtype, repeat):
    batch, heads_k = _randint(gen, 1, 2), _randint(gen, 1, 2)
    heads = heads_k * _randint(gen, 1, 3)
    seqlen_q, seqlen_k = _randint(gen, 1, 200), _randint(gen, 1, 200)
    head_dim = (32, 64, 80, 128)[_randint(gen, 0, 3)]
    q, k, v = random_inputs(gen, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).to(DTYPES[dtype])
    causal = bool(torch.rand(1, generator=gen) < 0.3)
    window = _window(gen, max(seqlen_q, seqlen_k))
    softcap = float(torch.empty(1).uniform_(2, 30, generator=gen)) if torch.rand(1, generator=gen) < 0.5 else 0.0
    slopes = None
    if torch.rand(1, generator=gen) < 0.5:
        slopes = torch.rand((batch, heads) if torch.rand(1, generator=gen) < 0.5 else (heads,), generator=gen) * 0.3
    variant = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    tag = f"{dtype} B{batch} H{heads}/{heads_k} Nq{seqlen_q} Nk{seqlen_k} D{head_dim} causal={causal} {variant}"
    results = _run(q, k, v, dout, causal=causal, **variant)
    assert_matches_reference(tag, (q, k, v, dout), results, causal, seed, **variant)


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (0, 5), (7, 2), (-1, 4), (6, -1)])
def test_window_edges(gen, seed, window):
    """Windows narrower than a tile, seqlen_q > seqlen_k (rows above the diagonal see nothing)."""
    q, k, v = random_inputs(gen, 1, 97, 41, 2, 2, 64, "float32", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen)
    results = _run(q, k, v, dout, window_size=window)
    assert_matches_reference(f"window {window}", (q, k, v, dout), results, False, seed, window_size=window)


def test_window_is_positional_where_flash_attn_has_it(gen):
    q, k, v = random_inputs(gen, 1, 50, 50, 2, 2, 32, "float32")
    positional = tvmflash.flash_attn_func(q, k, v, 0.0, None, False, (4, 2))
    keyword = tvmflash.flash_attn_func(q, k, v, window_size=(4, 2))
    assert torch.equal(positional, keyword)
    assert not torch.equal(keyword, tvmflash.flash_attn_func(q, k, v))


def test_causal_equals_window_with_zero_right_side(gen):
    q, k, v = random_inputs(gen, 2, 70, 90, 2, 1, 64, "float32")
    assert torch.equal(tvmflash.flash_attn_func(q, k, v, causal=True),
                       tvmflash.flash_attn_func(q, k, v, window_size=(-1, 0)))


def test_packed_functions_equal_the_unpacked_one(gen):
    q, k, v = random_inputs(gen, 2, 75, 75, 4, 4, 64, "float32")
    qkv = torch.stack((q, k, v), 2).requires_grad_()
    out = tvmflash.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(9, 0))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expect = tvmflash.flash_attn_func(*leaves, causal=True, window_size=(9, 0))
    assert torch.equal(out, expect)
    dout = torch.randn(out.shape, generator=gen)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(expect, leaves, dout), 2))

    kv = torch.stack((k, v), 2)
    assert torch.equal(tvmflash.flash_attn_kvpacked_func(q, kv, softcap=5.0), tvmflash.flash_attn_func(q, k, v, softcap=5.0))


def _varlen_batch(gen, n_seqs, max_len):
    lengths = [_randint(gen, 0, max_len) for _ in range(n_seqs)]
    lengths[_randint(gen, 0, n_seqs - 1)] = max(1, lengths[0])  # at least one non-empty sequence
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return lengths, cu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_matches_per_sequence_calls_and_the_reference(gen, seed, dtype):
    n_seqs, heads, heads_k, head_dim = _randint(gen, 2, 5), 4, 2, 64
    lengths_q, cu_q = _varlen_batch(gen, n_seqs, 150)
    lengths_k, cu_k = _varlen_batch(gen, n_seqs, 150)
    torch_dtype = DTYPES[dtype]
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=gen).to(torch_dtype).requires_grad_()
    k, v = (torch.randn(int(cu_k[-1]), heads_k, head_dim, generator=gen).to(torch_dtype).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q.shape, generator=gen).to(torch_dtype)
    slopes = torch.rand(n_seqs, heads, generator=gen) * 0.2
    variant = dict(causal=True, window_size=(_randint(gen, 0, 100), -1), softcap=15.0, alibi_slopes=slopes)
    out, lse, _ = tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  return_attn_probs=True, **variant)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0]) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)

    for b in range(n_seqs):
        rows_q, rows_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows_q.start == rows_q.stop:
            continue
        sq, sk, sv = (t.detach()[rows][None].requires_grad_() for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
        per_seq = dict(variant, alibi_slopes=slopes[b])
        if rows_k.start == rows_k.stop:  # no keys: zero output and gradients
            assert torch.all(out[rows_q] == 0) and torch.all(grads[0][rows_q] == 0)
            continue
        single = _run(sq, sk, sv, dout[rows_q][None], **per_seq)
        # the same kernels walk the same tiles: identical results (a packed call's tiles are its
        # longest sequence's, a single call's its own: other tiles round bf16 products otherwise)
        if (tile_edge(sq.shape[1]), tile_edge(sk.shape[1])) == (tile_edge(max(lengths_q)), tile_edge(max(lengths_k))):
            assert torch.equal(out[rows_q], single[0][0]), f"sequence {b}: out differs from flash_attn_func (seed {seed})"
            assert torch.equal(lse[:, rows_q], single[1][0]), f"sequence {b}: lse differs"
            assert torch.equal(grads[0][rows_q], single[2][0]), f"sequence {b}: dq differs"
        results = (out[rows_q][None], lse[:, rows_q][None], grads[0][rows_q][None], grads[1][rows_k][None],
                   grads[2][rows_k][None])
        ref_variant = dict(per_seq)
        ref_causal = ref_variant.pop("causal")
        assert_matches_reference(f"{dtype} varlen sequence {b} (Nq{sq.shape[1]} Nk{sk.shape[1]})",
                                 (sq, sk, sv, dout[rows_q][None]), results, ref_causal, seed, **ref_variant)


def test_varlen_packed_forms(gen):
    lengths, cu = _varlen_batch(gen, 3, 90)
    qkv = torch.randn(int(cu[-1]), 3, 2, 32, generator=gen)
    q, k, v = qkv.unbind(1)
    expect = tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert torch.equal(tvmflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True), expect)
    kv = qkv[:, 1:]
    assert torch.equal(tvmflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lengths), max(lengths),
                                                                causal=True), expect)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_p=0.1), ValueError, "dropout"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), (TypeError, ValueError), "alibi_slopes"),
])
def test_bad_variant_arguments_raise_clear_errors(gen, kwargs, error, match):
    q, k, v = random_inputs(gen, 1, 10, 10, 2, 2, 32, "float32")
    with pytest.raises(error, match=match):
        tvmflash.flash_attn_func(q, k, v, **kwargs)


def test_bad_cu_seqlens_raise_clear_errors(gen):
    q = torch.randn(20, 2, 32, generator=gen)
    good = torch.tensor([0, 8, 20], dtype=torch.int32)
    for bad, match in ((torch.tensor([0, 12, 8], dtype=torch.int32), "cu_seqlens"),
                       (torch.tensor([0, 8, 21], dtype=torch.int32), "cu_seqlens"),
                       (torch.tensor([1, 8, 20], dtype=torch.int32), "cu_seqlens"),
                       (torch.tensor([0, 8, 20], dtype=torch.int64), "int32")):
        with pytest.raises((ValueError, TypeError), match=match):
            tvmflash.flash_attn_varlen_func(q, q, q, bad, good, 12, 12)


@pytest.mark.parametrize("head_dim,dtype", [(59, "float32"), (111, "bfloat16"), (3, "float32")])
def test_head_dims_off_the_kernel_unit_are_padded(gen, seed, head_dim, dtype):
    """flash-attn accepts any head dim up to 256 (padding it to a multiple of 8): the output keeps
    the head dim, the default scale is 1/sqrt(head_dim) of the original, gradients match, and the
    varlen form agrees."""
    q, k, v = random_inputs(gen, 2, 37, 45, 4, 2, head_dim, dtype)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = tvmflash.flash_attn_func(*leaves, causal=True, window_size=(20, 0), return_attn_probs=True)
    assert out.shape == q.shape
    grads = torch.autograd.grad(out, leaves, dout)
    assert_matches_reference(f"head_dim {head_dim}", (q, k, v, dout), (out, lse, *grads), True, seed,
                             window_size=(20, 0))
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (37, 45))
    packed = tvmflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 37, 45,
                                    causal=True, window_size=(20, 0))
    torch.testing.assert_close(packed.view_as(out), out.detach(), rtol=0, atol=0)


def _paged(gen, lengths, page, heads_k, head_dim, dtype, spare_blocks=3):
    """Paged caches holding each sequence's keys in a random permutation of pages (plus unused
    pages full of NaN, which must never be read), the block table, and the dense keys."""
    blocks = [-(-n // page) for n in lengths]
    max_blocks = max(blocks) + 1  # one table entry more than any sequence needs (unused: garbage)
    num_blocks = sum(blocks) + spare_blocks
    k_cache, v_cache = (torch.full((num_blocks, page, heads_k, head_dim), float("nan")).to(dtype) for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lengths), max_blocks), 10**6, dtype=torch.int32)  # out of range where unused
    dense, used = [], 0
    for b, n in enumerate(lengths):
        k, v = (torch.randn(n, heads_k, head_dim, generator=gen).to(dtype) for _ in range(2))
        for blk in range(blocks[b]):
            p = int(order[used])
            used += 1
            table[b, blk] = p
            rows = slice(blk * page, min(n, (blk + 1) * page))
            k_cache[p, :rows.stop - rows.start], v_cache[p, :rows.stop - rows.start] = k[rows], v[rows]
        dense.append((k, v))
    return k_cache, v_cache, table, dense


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_kv_matches_the_dense_reference(gen, seed, dtype, page, causal):
    """flash_attn_varlen_func(..., block_table=...): k and v are paged caches read through the
    table (random page permutation, lengths no multiple of the page or the 64-key tile, GQA),
    against float64 attention on each sequence's dense keys; the pages left over and the rest of
    each sequence's last page hold NaN, which must not reach the output. Gradients reach the
    pages' rows (through the gather) and match the dense reference's."""
    torch_dtype = DTYPES[dtype]
    lengths_k = [301, 77, 530 if page == 256 else 130]
    lengths_q = [45, 77, 3]
    heads, heads_k, head_dim = 4, 2, 64
    k_cache, v_cache, table, dense = _paged(gen, lengths_k, page, heads_k, head_dim, torch_dtype)
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=gen).to(torch_dtype)
    k_leaf, v_leaf = k_cache.clone().requires_grad_(), v_cache.clone().requires_grad_()
    out = tvmflash.flash_attn_varlen_func(q, k_leaf, v_leaf, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                          causal=causal, block_table=table)
    assert out.shape == q.shape and torch.isfinite(out).all()
    dout = torch.randn(out.shape, generator=gen).to(torch_dtype)
    dk_pages, dv_pages = torch.autograd.grad(out, (k_leaf, v_leaf), dout)
    for b in range(len(lengths_k)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        k, v = dense[b]
        leaves = [t[None].double().requires_grad_() for t in (q[rows_q], k, v)]
        ref, _ = reference_attention(*leaves, causal)
        same, _ = reference_attention(q[rows_q][None], k[None], v[None], causal, dtype=torch_dtype)
        assert_flash_rule(f"{dtype} paged sequence {b} out", out[rows_q][None], ref.detach(), same, torch_dtype, seed,
                          magnitude=float(v.abs().max()))
        dk_ref, dv_ref = torch.autograd.grad(ref, leaves[1:], dout[rows_q][None].double())
        pages = table[b, :-(-lengths_k[b] // page)].long()
        for name, grad, ref_grad in (("dk", dk_pages, dk_ref), ("dv", dv_pages, dv_ref)):
            ours = grad[pages].flatten(0, 1)[:lengths_k[b]]
            tol = 2e-4 if dtype == "float32" else 6e-2
            torch.testing.assert_close(ours.double(), ref_grad[0], atol=tol, rtol=tol, msg=f"{name} seq {b} seed {seed}")
    # pages no sequence uses get no gradient
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    for b, n in enumerate(lengths_k):
        untouched[table[b, :-(-n // page)].long()] = False
    assert torch.all(dk_pages[untouched] == 0) and torch.all(dv_pages[untouched] == 0)


def test_varlen_paged_kv_bad_tables_raise_clear_errors(gen):
    k_cache, v_cache, table, _ = _paged(gen, [100, 40], 32, 2, 32, torch.float32)
    q = torch.randn(6, 2, 32, generator=gen)
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 140], dtype=torch.int32)
    call = lambda bt, ck=cu_k, kc=k_cache: tvmflash.flash_attn_varlen_func(  # noqa: E731
        q, kc, v_cache if kc is k_cache else kc, cu_q, ck, 3, 100, block_table=bt)
    call(table)  # the good table works
    for bad, error, match in ((table.long(), ValueError, "int32"), (table[0], ValueError, "2-D"),
                              (table[:1], ValueError, "block_table has 1 rows"),
                              (table[:, :1], checks.CapacityError, "block_table"),
                              (torch.where(table == table[0, 1], -1, table), ValueError, r"outside \[0, "),
                              (torch.where(table == table[1, 0], 999, table), ValueError, r"outside \[0, "),
                              ([[0, 1]], TypeError, "block_table must be a torch.Tensor")):
        with pytest.raises(error, match=match):
            call(bad)
    with pytest.raises(ValueError, match="paged caches"):
        call(table, kc=k_cache.flatten(0, 1))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(table, ck=torch.tensor([0, 100, 90], dtype=torch.int32))
