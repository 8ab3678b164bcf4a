"""Non-finite inputs and rows without keys: a NaN reaches exactly the output rows that see it (as
in PyTorch), an infinite query gives NaN rather than 0, and a row that sees no key gives 0 and
lse = -inf, never NaN."""

from __future__ import annotations

import math

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


def _nan_heads(t):
    """(batch, heads) bool: which heads of a (batch, seqlen, heads, dim) tensor hold a NaN."""
    return t.isnan().any(-1).any(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where,value", [("q", "nan"), ("k", "nan"), ("v", "nan"), ("q", "inf"), ("k", "inf")])
def test_backward_nan_pattern_matches_torch(gen, dtype, causal, where, value):
    """A NaN or inf in q or k makes that head's recomputed P rows NaN, so dV of the head is NaN too,
    as in SDPA and in float64 dense math (the exponent's cap at 0 once turned a NaN exponent into
    P = 1: dq and dk became NaN but dv stayed finite). Compared per (batch, head) for dq, dk, dv,
    with GQA (2 query heads per kv head); the heads without NaN match float64."""
    from tvmflash import flash_attn_func

    q, k, v = random_inputs(gen, 2, 75, 75, 4, 2, 32, dtype)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    {"q": q, "k": k, "v": v}[where][1, 40, 1, 3] = float(value)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = torch.autograd.grad(flash_attn_func(*leaves, causal=causal), leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, causal)
    ref = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    sdpa_leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(*sdpa_leaves, is_causal=causal, enable_gqa=True)
    sdpa = [g.transpose(1, 2) for g in torch.autograd.grad(sdpa_out, sdpa_leaves, dout.transpose(1, 2))]
    for name, o, r, s in zip(("dq", "dk", "dv"), ours, ref, sdpa):
        assert torch.equal(_nan_heads(o), _nan_heads(r)), f"{name}: NaN heads {_nan_heads(o)} vs float64 {_nan_heads(r)}"
        assert torch.equal(_nan_heads(o), _nan_heads(s)), f"{name}: NaN heads {_nan_heads(o)} vs SDPA {_nan_heads(s)}"
        clean = ~_nan_heads(r)[:, None, :, None].expand_as(r)
        assert torch.isfinite(o[clean]).all()
        tol = 1e-4 if dtype == "float32" else 5e-2
        torch.testing.assert_close(o[clean].double(), r[clean], atol=tol, rtol=tol)
    if where == "q":  # the query row's P is NaN at every key it sees: so is dV there (kv head 0)
        sees = torch.arange(75) <= 40 if causal else torch.ones(75, dtype=torch.bool)
        assert ours[2][1, sees, 0].isnan().any(-1).all()


def _tanh_kernel(tanh):
    """y = tanh(x) over n = 16 k floats, the lanes vectorized as in the kernels."""
    import tvm
    from tvm import tirx

    from tvmflash.target import host_target

    n = tirx.Var("n", "int64")
    x, y = (tirx.decl_buffer((n,), "float32", name) for name in ("x", "y"))
    outer, lane = tirx.Var("o", "int64"), tirx.Var("l", "int64")
    i = outer * 16 + lane
    inner = tirx.For(lane, 0, 16, tirx.ForKind.VECTORIZED, tirx.BufferStore(y, tanh(x[i]), [i]))
    func = tirx.PrimFunc([x, y], tirx.For(outer, 0, n // 16, tirx.ForKind.SERIAL, inner))
    return tvm.compile(tvm.IRModule({"f": func.with_attr("global_symbol", "f")}), target=host_target())["f"]


@pytest.mark.parametrize("kind", ["FAST_INTRINSICS", "NATIVE_INTRINSICS"])
def test_kernel_tanh_keeps_nan_and_is_one_where_torch_is(kind):
    """The kernels' tanh (softcap, flex's tanh and gelu): NaN in, NaN out (it was +-1: softcap
    dropped a NaN score), +-1 exactly wherever torch's fp32 tanh is (it saturated at 1 - 2^-24,
    so gelu(-inf, approximate="tanh") was -inf, not NaN, and 1 - tanh^2 was 2^-23, not 0), and
    within 2 ulp of float64 elsewhere. NATIVE_INTRINSICS (GPUs) runs here on libm's exp2."""
    from tvmflash import score_mods

    f = _tanh_kernel(getattr(score_mods, kind)["tanh"])
    grid = torch.cat([torch.linspace(8.99, 9.03, 100_000), torch.linspace(0, 12, 200_000),
                      torch.tensor([0.625, 1e30, 3e38, math.inf, math.nan, -math.nan])])
    x = torch.cat([grid, -grid]).float()
    x = torch.cat([x, x.new_zeros(-len(x) % 16)])
    y = torch.full_like(x, 7.0)
    f(x, y)
    ref = torch.tanh(x)
    assert torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y.abs() == 1, ref.abs() == 1), x[(y.abs() == 1) != (ref.abs() == 1)][:4]
    finite = ~x.isnan()
    exact = torch.tanh(x[finite].double())
    ulp = torch.nextafter(exact.abs().float(), torch.tensor(2.0)).double() - exact.abs().float().double()
    assert ((y[finite].double() - exact).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where,value", [("q", "nan"), ("k", "nan"), ("v", "nan"), ("q", "inf"), ("k", "inf")])
def test_softcap_nan_pattern_matches_torch(gen, dtype, where, value):
    """softcap * tanh(s / softcap) keeps a NaN score, as PyTorch's does: the rows that see a NaN
    in q or k are NaN in the output, and their heads in dq, dk, dv, as in float64 dense math (the
    kernels' tanh mapped NaN to +-1: outputs stayed finite). An infinite score is capped to
    +-softcap with derivative 0 exactly, so the output stays finite and only dK/dQ meet 0 * inf.
    Causal, GQA (2 query heads per kv head); everything else matches float64."""
    from tvmflash import flash_attn_func

    q, k, v = random_inputs(gen, 2, 75, 75, 4, 2, 32, dtype)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    {"q": q, "k": k, "v": v}[where][1, 40, 1, 3] = float(value)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True, softcap=5.0)
    ours = [out, *torch.autograd.grad(out, leaves, dout)]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, True, softcap=5.0)
    ref = [ref_out, *torch.autograd.grad(ref_out, ref_leaves, dout.double())]
    if where != "v":  # the output rows (per head) that see the NaN or inf, exactly
        assert torch.equal(out.isnan().any(-1), ref_out.isnan().any(-1))
    for name, o, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert torch.equal(_nan_heads(o), _nan_heads(r)), f"{name}: NaN heads {_nan_heads(o)} vs float64 {_nan_heads(r)}"
        clean = ~_nan_heads(r)[:, None, :, None].expand_as(r)
        assert torch.isfinite(o[clean]).all()
        tol = 1e-4 if dtype == "float32" else 5e-2
        torch.testing.assert_close(o[clean].double(), r[clean], atol=tol, rtol=tol)
    assert _nan_heads(ours[0]).any() == (value == "nan")
