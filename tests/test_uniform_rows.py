"""Rows whose keys a padding mask all hides (left padding), against transformers' ``eager`` in
float64: eager adds the dtype's most negative number to every masked score, so such a row's
softmax is uniform over all keys, its output the mean of v, and its gradient softmax's Jacobian
at that uniform P. The reference below is that computation, dense, with autograd (no formula of
ours in it). Through the integration's ``_padded_attention`` (``padded.attention`` without
torch's dispatcher): rows read in place (the uniform rows in the row-runs kernels, or their
torch formulation), a mask with holes (the gather, then the torch formulation) and keys past the
mask (a static cache's empty slots); and through the ops themselves, as torch.compile calls them."""

import pytest
import torch

from conftest import assert_flash_rule, reference_magnitudes

pytest.importorskip("transformers")
from tvmflash import padded, uniform_rows  # noqa: E402
from tvmflash.integrations import transformers as tvm_hf  # noqa: E402
from tvmflash.runtime import FlashKernels  # noqa: E402


def eager_attention(q, k, v, allowed, scale: float, softcap: float):
    """transformers' eager attention in q's dtype: scores (+ softcap), + the dtype's minimum where
    ``allowed`` (batch, n_q, n_k) is False, softmax, times v. (batch, n, heads, d) tensors."""
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(groups, 1), v.transpose(1, 2)
    scores = qh @ kh.mT * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    p = torch.softmax(scores + bias[:, None], dim=-1)
    return (p @ vh.repeat_interleave(groups, 1)).transpose(1, 2)


def _with_holes(mask):
    return mask.index_fill(1, torch.tensor([20]), False)


def _eager_path(q, k, v, mask, opts):
    return tvm_hf._padded_attention(q, k, v, mask, opts)


class _SeeTheOps(torch.overrides.TorchFunctionMode):
    """A mode that passes every call on: under it, calls take the ops, as torch.compile's do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _one_op(q, k, v, mask, opts):  # (the ops themselves, which torch.compile's graphs call)
    with _SeeTheOps():
        return padded.attention(q, k, v, mask, **opts)


CASES = {  # (mask over the keys (batch, n), keys past the mask, the call)
    "rows in place": (lambda m: m, 0, _eager_path),  # (the uniform rows on the kernels' uniform_means / _grads)
    "rows in place, torch ops": (lambda m: m, 0, _eager_path),  # (their torch formulation, which softcap takes)
    "holes": (_with_holes, 0, _eager_path),
    "static cache": (lambda m: m, 9, _eager_path),
    "one op, rows in place": (lambda m: m, 0, _one_op),
    "one op, holes": (_with_holes, 0, _one_op),
    "one op, static cache": (lambda m: m, 9, _one_op),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (without softcap, the torch ops: head_dim-square products at 24, through the scores at 64; the kernels
# choose per batch row: at 24 row 0's 5 x 3 rows through the scores, rows 1 and 3 the products; at 64 rows
# 0 and 1 through the scores, row 3's 111 rows (over ROWS_THROUGH_SCORES) the products)
@pytest.mark.parametrize("dim", [24, 64])
def test_uniform_rows_match_eager_in_float64(gen, seed, monkeypatch, case, softcap, dtype, dim):
    if case.endswith("torch ops"):
        monkeypatch.setattr(FlashKernels, "_uniform", lambda *args: False)
    batch, n, heads, heads_k = 4, 37, 6, 2
    make_mask, empty_slots, attend = CASES[case]
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, :5] = False  # left padding: 5 rows see no key
    mask[1, :19] = False
    mask[2, -7:] = False  # right padding (those rows see keys: not uniform; undefined in transformers)
    mask[3] = False  # padding only: every row uniform
    mask = make_mask(mask)
    keys = n + empty_slots
    q = (torch.randn(batch, n, heads, dim, generator=gen) * 2).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, keys, heads_k, dim, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    scale = dim ** -0.5
    opts = {"softmax_scale": scale, "causal": True, "window_size": (-1, -1), "softcap": softcap}
    out = attend(q, k, v, mask, opts)
    with torch.no_grad():  # (the uniform rows' means written in place): the same output
        assert torch.equal(attend(q, k, v, mask, opts), out)

    causal = torch.ones(n, keys, dtype=torch.bool).tril()
    allowed = causal[None] & torch.nn.functional.pad(mask, (0, empty_slots))[:, None, :]
    uniform = ~allowed.any(-1)  # (batch, n): rows that see no key
    defined = (mask | uniform)[:, :, None, None]  # real rows and uniform rows (others: undefined)
    assert uniform[:2].sum() == 5 + 19 and uniform[3].all()
    dout = torch.randn(out.shape, generator=gen).to(dtype) * defined
    grads = torch.autograd.grad(out, (q, k, v), dout)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = eager_attention(*leaves, allowed, scale, softcap)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    plain = [t.detach().requires_grad_() for t in (q, k, v)]  # eager in the dtype: the flash rule's yardstick
    same = eager_attention(*plain, allowed, scale, softcap)
    same_grads = torch.autograd.grad(same, plain, dout)
    # the size of the terms the kernels sum and cancel on the real rows (flash_rule), their LSE
    # from the float64 scores (rows that see no key: -inf, left out)
    groups = heads // heads_k
    scores = leaves[0].detach().transpose(1, 2) @ leaves[1].detach().transpose(1, 2).repeat_interleave(groups, 1).mT
    scores = scores * scale if not softcap else softcap * torch.tanh(scores * scale / softcap)
    lse = scores.masked_fill(~allowed[:, None], -torch.inf).logsumexp(-1)
    magnitude = reference_magnitudes(q, k, v, dout, scale, lse=lse)
    assert_flash_rule("out", out * defined, want * defined, same * defined, dtype, seed, magnitude=magnitude["out"])
    for name, got, ref, yardstick in zip("qkv", grads, want_grads, same_grads):
        assert_flash_rule(f"d{name}", got, ref, yardstick, dtype, seed, magnitude=magnitude[f"d{name}"])
    assert (out[uniform].double() - want[uniform]).abs().max() <= 4 * torch.finfo(dtype).eps  # means of v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_in_place_take_the_kernels(gen, monkeypatch, dtype):
    """Without softcap, the row-runs path adds the uniform rows' means and gradients in the
    kernels (one launch each), not through the torch ops (whose results the float64 test above
    judges both ways); a row whose every key is hidden gets the mean of v."""
    def refuse(*args, **kwargs):
        raise AssertionError("the uniform rows took the torch ops")

    monkeypatch.setattr(uniform_rows, "add_means", refuse)
    monkeypatch.setattr(uniform_rows, "add_gradients", refuse)
    batch, n, heads, heads_k, dim = 3, 29, 4, 1, 64
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, :11] = False
    mask[2, :28] = False
    q = torch.randn(batch, n, heads, dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, n, heads_k, dim, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    opts = {"softmax_scale": dim ** -0.5, "causal": True, "window_size": (-1, -1), "softcap": 0.0}
    out = tvm_hf._padded_attention(q, k, v, mask, opts)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen).to(dtype))
    assert all(bool(g.isfinite().all()) for g in (out, *grads))
    mean_v = v.detach().double().mean(1).repeat_interleave(heads // heads_k, 1)  # (batch, heads, dim)
    torch.testing.assert_close(out[2, :27].double(), mean_v[2].expand(27, heads, dim),
                               atol=4 * torch.finfo(dtype).eps, rtol=0)
