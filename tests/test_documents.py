"""Rows holding several documents, told apart by position_ids (``tvmflash.documents``): eager
and under torch.compile, where the call is one op that finds the documents when it runs,
against float64 math with each document masked to itself."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, random_inputs
from tvmflash import documents

ROWS = ([7, 10, 20], [37], [3, 30, 4])  # documents per row: 37 tokens, no length a multiple of a tile


def _positions(rows) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _same_document(rows) -> torch.Tensor:
    """(batch, 1, N, N) True where query and key are in the same document."""
    ids = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in rows])
    return (ids[:, :, None] == ids[:, None, :])[:, None]


def _assert_matches_per_document(tag, q, k, v, dout, rows, results, window, seed):
    """out, lse, dq, dk, dv against float64 and same-dtype math, each document masked to itself."""
    assert_matches_reference(tag, (q, k, v, dout), results, True, seed, window_size=window, mask=_same_document(rows))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [ROWS, ([37], [37], [37])], ids=["documents", "one per row"])
def test_the_op_matches_float64_per_document(gen, seed, dtype, rows):
    """The op torch.compile sees: documents (or none) found from position_ids when it runs, GQA,
    a sliding window counted within each document; out, lse and the gradients."""
    q, k, v = random_inputs(gen, 3, 37, 37, 4, 2, 32, dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    window = (9, 0)
    out, lse, _ = documents._DocumentsAttention.apply(q, k, v, _positions(rows), 32 ** -0.5, *window, 0.0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _assert_matches_per_document(f"op {dtype}", q, k, v, dout, rows, (out, lse, *grads), window, seed)


@pytest.mark.parametrize("head_dim", [24, 20])  # (20: padded to the kernels' 24 before the checks)
def test_compiled_and_eager_calls_agree(gen, seed, head_dim):
    """``documents.attention`` under torch.compile(fullgraph=True) (the op) and eagerly (the
    flash-attn functions on rows or packed documents): the same results, documents or not,
    from transposed (batch, heads, N, D) views as a model passes them."""
    compiled = torch.compile(documents.attention, fullgraph=True, backend="aot_eager")
    for rows in (ROWS, ([37],) * 3):
        q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in
                   (torch.randn(3, 4, 37, head_dim, generator=gen), *(torch.randn(3, 2, 37, head_dim, generator=gen)
                                                                      for _ in range(2))))
        dout = torch.randn(3, 37, 4, head_dim, generator=gen)
        results = []
        for attention in (documents.attention, compiled):
            out = attention(q, k, v, _positions(rows), causal=True)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        for name, eager, traced in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5, msg=name)
        if head_dim % 8:  # (the op takes the kernels' head dims: lse below from a head dim they run)
            continue
        _, lse, _ = documents._documents_forward(q, k, v, _positions(rows), head_dim ** -0.5, -1, 0, 0.0)
        _assert_matches_per_document("compiled", q, k, v, dout, rows, (results[1][0], lse, *results[1][1:]),
                                     (-1, 0), seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_calls_read_the_documents_in_place(gen, seed, dtype, monkeypatch):
    """Eager calls read each document as a run of its row (``torch_op.row_runs_call``: no packed
    copies; position_ids of one row for all, too), with a gradient to record or not, from
    transposed views as a model passes them: bitwise the packed varlen path's, and against
    float64 per document (a sliding window counted within each)."""
    from tvmflash import torch_op

    window = (9, 0)
    in_place = []
    original = torch_op.row_runs_call
    monkeypatch.setattr(torch_op, "row_runs_call", lambda *a, **kw: in_place.append(original(*a, **kw)) or in_place[-1])
    for rows in (ROWS, ([5, 32],) * 3):
        q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in
                   (torch.randn(3, 4, 37, 32, generator=gen).to(getattr(torch, dtype)),
                    *(torch.randn(3, 2, 37, 32, generator=gen).to(getattr(torch, dtype)) for _ in range(2))))
        dout = torch.randn(3, 37, 4, 32, generator=gen).to(q.dtype)
        positions = _positions(rows) if rows is ROWS else _positions(rows[:1])  # (one row's for all rows)

        def run():
            out = documents.attention(q, k, v, positions, causal=True, window_size=window)
            with torch.no_grad():
                plain = documents.attention(q, k, v, positions, causal=True, window_size=window)
            return out.detach(), plain, *torch.autograd.grad(out, (q, k, v), dout)

        in_place.clear()
        ours = run()
        assert len(in_place) == 2 and all(call is not None for call in in_place)
        with monkeypatch.context() as m:
            m.setattr(documents, "_in_rows", lambda *a: None)
            packed = run()
        assert all(torch.equal(a, b) for a, b in zip(ours, packed))
        assert torch.equal(ours[0], ours[1])
        _, lse, _ = documents._documents_forward(q, k, v, positions, 32 ** -0.5, *window, 0.0)
        _assert_matches_per_document(f"in place {dtype}", q, k, v, dout, rows, (ours[0], lse, *ours[2:]), window,
                                     seed)


def test_cu_seqlens_of_documents_in_rows_are_read_in_place(gen, monkeypatch):
    """``rows_as_documents`` (transformers' cu_seq_lens kwargs): documents within rows, as equal
    tensors or one, are read in place (bitwise the packed varlen path's); documents across rows
    take the varlen path; cu_seqlens out of order are named by its checks."""
    from tvmflash import torch_op

    q, k, v = (t.requires_grad_() for t in random_inputs(gen, 2, 19, 19, 4, 2, 32, "float32"))
    dout = torch.randn(q.shape, generator=gen)
    in_place = []
    original = torch_op.row_runs_call
    monkeypatch.setattr(torch_op, "row_runs_call", lambda *a, **kw: in_place.append(original(*a, **kw)) or in_place[-1])

    def run(cu_q, cu_k):
        out = documents.rows_as_documents(q, k, v, cu_q, cu_k, causal=True)
        return out.detach(), *torch.autograd.grad(out, (q, k, v), dout)

    within, across = [0, 7, 19, 30, 38], [0, 7, 25, 38]
    for bounds, read_in_place in ((within, True), (across, False)):
        cu = torch.tensor(bounds, dtype=torch.int32)
        for cu_k in (cu, cu.clone()):
            in_place.clear()
            ours = run(cu, cu_k)
            assert bool(in_place) == read_in_place and all(call is not None for call in in_place)
            with monkeypatch.context() as m:
                m.setattr(documents, "_in_rows", lambda *a: None)
                packed = run(cu, cu_k)
            assert all(torch.equal(a, b) for a, b in zip(ours, packed))
    with pytest.raises(ValueError, match="cu_seqlens"):
        run(*(torch.tensor([0, 19, 7, 38], dtype=torch.int32),) * 2)


def test_opcheck(gen):
    """The op has no autograd formula (``_DocumentsAttention`` has): inputs without gradients."""
    q, k, v = random_inputs(gen, 2, 29, 29, 4, 2, 16, "float32")
    for rows in (([9, 20], [29]), ([29], [29])):
        torch.library.opcheck(documents._documents_forward, (q, k, v, _positions(rows), 0.25, -1, 0, 0.0))


def test_positions_that_do_not_fit_the_rows_are_one_document_per_row():
    """position_ids of another length or batch are not documents (transformers' rule needs one per token)."""
    assert documents.documents_from_positions(torch.arange(5)[None], 2, 6) is None
    assert documents.documents_from_positions(torch.zeros(3, 6, dtype=torch.long), 2, 6) is None
    cu = documents.documents_from_positions(_positions(([2, 4], [6])), 2, 6)
    assert cu.tolist() == [0, 2, 6, 12]
