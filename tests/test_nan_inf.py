"""Non-finite inputs and rows without keys: a NaN reaches exactly the output rows that see it (as
in PyTorch), an infinite query gives NaN rather than 0, and a row that sees no key gives 0 and
lse = -inf, never NaN."""

from __future__ import annotations

import pytest
import torch

from conftest import random_inputs, reference_attention


def _run(kernels, q, k, v, dout, **mask):
    out, lse = torch.full_like(q, 7.0), torch.full((q.shape[0], q.shape[2], q.shape[1]), 7.0)
    kernels.forward(q, k, v, out, lse, **mask)
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads, **mask)
    return out, lse, grads


@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_spreads_to_every_row_that_sees_it(kernels_d32, gen, where):
    """Causal, seqlen_k - seqlen_q = 20: query i sees key j iff j <= i + 20. A NaN in key 40 (or
    its value) reaches rows 20..69 (PyTorch's attention gives NaN there too; its MATH backend also
    spreads it into rows that do not see the key, through the -inf + NaN of its additive mask)."""
    q, k, v = random_inputs(gen, 1, 70, 90, 2, 1, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    {"q": q, "k": k, "v": v}[where][0, 40, 0, 3] = float("nan")
    out, lse, (dq, dk, dv) = _run(kernels_d32, q, k, v, dout, causal=True)
    rows_nan = out.isnan().any(-1).any(-1)[0]  # (seqlen_q,)
    sees = torch.arange(70) + 20 >= 40
    if where == "q":  # one query row
        assert rows_nan.tolist() == [i == 40 for i in range(70)]
        assert dq[0, 40, 0].isnan().all() and torch.isfinite(dq[0, 40, 1]).all()  # its head only
        assert dk[0, :61].isnan().any(-1).all()  # every key row 40 sees
    elif where == "k":  # exactly the rows that see it: masked scores never reach the softmax
        assert torch.equal(rows_nan, sees)
        assert out[0, sees].isnan().all() and lse[0, :, sees].isnan().all()
    else:  # v: every row that sees it, in the value's own dimension (P V spreads it further within
        # a tile through 0 x NaN, as PyTorch's attention does across all rows); the LSE stays finite
        assert out[0, sees, :, 3].isnan().all() and torch.isfinite(out[0, :, :, :3]).all()
        assert torch.isfinite(lse).all()
    if where != "q":
        # gradients: NaN in every row that sees it (0 x NaN spreads it further within a tile pair, as
        # in PyTorch's backward, whose dQ = dS K multiplies the NaN key row by the masked zeros)
        assert dq[0, sees].isnan().any(-1).all()
        assert dv[0, 40].isnan().any() or dk[0, 40].isnan().any()
    ref, _ = reference_attention(*(t.double() for t in (q, k, v)), True)
    finite = ~out.isnan() & ~ref.isnan()
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=1e-5, rtol=0)


def test_infinite_query_gives_nan_not_zero(kernels_d32, gen):
    q, k, v = random_inputs(gen, 1, 20, 30, 1, 1, 32, "float32")
    q[0, 5] = float("inf")
    out, lse, _ = _run(kernels_d32, q, k, v, torch.randn(q.shape, generator=gen))
    leaves = [t.transpose(1, 2) for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves).transpose(1, 2)
    assert out[0, 5].isnan().all() and ref_out[0, 5].isnan().all()
    assert torch.isfinite(out[0, :5]).all() and torch.isfinite(out[0, 6:]).all()


def test_fully_masked_rows_stay_zero_not_nan(kernels_d32, gen):
    q, k, v = random_inputs(gen, 1, 100, 30, 2, 2, 32, "float32")
    out, lse, grads = _run(kernels_d32, q, k, v, torch.randn(q.shape, generator=gen), causal=True)
    assert torch.all(out[:, :70] == 0) and torch.all(lse[:, :, :70] == float("-inf"))
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :70] == 0)
