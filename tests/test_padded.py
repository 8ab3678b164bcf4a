"""A padded batch's attention as one op over its mask (``tvmflash.padded``): what torch.compile
traces, one graph whatever the mask. Against float64 math on the real tokens (the rows that see
no key, eager's mean of v: ``test_uniform_rows.py``), against the eager calls, and the op's own
contract (opcheck, the path it takes, what it refuses)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_flash_rule, random_inputs, reference_magnitudes
from tvmflash import padded, torch_op
from tvmflash.reference import reference_attention

BATCH, N = 4, 37  # no multiple of a tile


def _masks() -> dict[str, torch.Tensor]:
    left = torch.ones(BATCH, N, dtype=torch.bool)
    left[1, :11] = False
    left[2, :30] = False
    left[3] = False  # padding only
    right = torch.ones(BATCH, N, dtype=torch.bool)
    right[0, -5:] = False
    right[2, -36:] = False
    holes = left.clone()
    holes[0, 7:9] = False
    holes[1, 20] = False
    return {"left": left, "right": right, "holes": holes, "none": torch.ones(BATCH, N, dtype=torch.bool)}


def _real_rows_reference(q, k, v, dout, mask, window, dtype, len_q=None):
    """out, dq, dk, dv in ``dtype`` of attention among each row's real tokens (the queries the
    last ``len_q`` of the mask's positions), the padding rows' dout zeroed (what they get is
    ``test_uniform_rows.py``'s; here they add no gradient)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*leaves, True, window_size=window, mask=mask[:, None, None, :], dtype=dtype)
    real = mask[:, -(len_q or mask.shape[1]):, None, None]
    return out * real, *torch.autograd.grad(out, leaves, (dout * real).to(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask_name", ["left", "right", "holes"])
@pytest.mark.parametrize("head_dim", [32, 20])  # (20: the kernels' head dim padded to 24)
def test_real_rows_match_float64(gen, seed, dtype, mask_name, head_dim):
    """The real tokens' output and every gradient against float64 by the flash-attn rule; GQA,
    causal (a window on the masks without holes, counted in positions of the row)."""
    mask = _masks()[mask_name]
    window = (-1, -1) if mask_name == "holes" else (9, 0)
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, head_dim, dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype) * mask[:, :, None, None]
    out = padded.attention(q, k, v, mask, causal=True, window_size=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    ours = (out * mask[:, :, None, None], *torch.autograd.grad(out, (q, k, v), dout))
    want = _real_rows_reference(q, k, v, dout, mask, window, torch.float64)
    same = _real_rows_reference(q, k, v, dout, mask, window, q.dtype)
    magnitude = reference_magnitudes(q, k, v, dout)  # (the size of the terms each result sums)
    for name, got, ref, yardstick in zip(("out", "dq", "dk", "dv"), ours, want, same):
        assert_flash_rule(f"{mask_name} {name}", got, ref.detach(), yardstick.detach(), q.dtype, seed,
                          magnitude=magnitude[name])


def test_right_padding_rows_get_zero(gen):
    """Padding rows after a row's tokens see real keys in transformers' mask; no real token
    depends on them: 0, as flash-attn's unpadded calls give (and no NaN anywhere)."""
    mask = _masks()["right"]
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 32, "float32")
    out = padded.attention(q, k, v, mask, causal=True)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask])) and bool(out.isfinite().all())


def test_rows_in_place_or_gathered(gen, monkeypatch):
    """The op reads rows whose real tokens are one run in place (the row-runs kernels, no gather:
    the varlen body never runs) and gathers a mask with holes for the varlen kernels."""
    taken = []
    for name, function in (("in place", "row_runs_forward"), ("gathered", "_forward_impl")):
        original = getattr(torch_op, function)
        monkeypatch.setattr(torch_op, function, lambda *a, _f=original, _n=name, **kw: taken.append(_n) or _f(*a, **kw))
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 32, "float32")
    for mask_name in ("left", "right", "none", "holes"):
        taken.clear()
        padded.attention(q, k, v, _masks()[mask_name], causal=True)
        assert taken == (["gathered"] if mask_name == "holes" else ["in place"]), mask_name


def test_one_compiled_graph_for_every_mask(gen):
    """Under torch.compile(fullgraph=True) the call is one op: one graph (no recompile) serves
    left and right padding, holes and a full mask, with the eager call's results and gradients,
    from (batch, heads, N, D) views transposed as a model passes them."""
    compiled = torch.compile(padded.attention, fullgraph=True, backend="aot_eager")
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in
               (torch.randn(BATCH, 4, N, 24, generator=gen), *(torch.randn(BATCH, 2, N, 24, generator=gen)
                                                               for _ in range(2))))
    dout = torch.randn(BATCH, N, 4, 24, generator=gen)
    for step, mask in enumerate(_masks().values()):
        results = []
        for attention in (padded.attention, compiled):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                out = attention(q, k, v, mask, causal=True)
                results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        for name, eager, traced in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5, msg=f"{step} {name}")


def test_opcheck(gen):
    """The ops have no autograd formula (``_PaddedAttention`` has): inputs without gradients."""
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 16, "float32")
    for name, mask in _masks().items():
        torch.library.opcheck(padded._padded_forward, (q, k, v, mask, 0.25, -1, 0, 0.0))
        out, lse = padded._padded_forward(q, k, v, mask, 0.25, -1, 0, 0.0)
        torch.library.opcheck(padded._padded_backward, (torch.randn_like(out), q, k, v, out, lse, mask, 0.25, -1, 0,
                                                        0.0))


def test_what_the_op_refuses(gen):
    """A window over holes (the packed sequences would count packed positions, not positions in
    the row) when the op runs, and a mask whose shape does not fit q and k when it is called:
    clear errors."""
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 16, "float32")
    with pytest.raises(NotImplementedError, match="sliding window over a padding mask with holes"):
        padded.attention(q, k, v, _masks()["holes"], causal=True, window_size=(5, 0))
    for short_mask, keys in ((_masks()["left"][:, 1:], (k, v)), (_masks()["left"], (k[:, 1:], v[:, 1:])),
                             (_masks()["left"][:2], (k, v))):  # (fewer positions than queries, keys; batch)
        with pytest.raises(ValueError, match="padding mask must be a"):
            padded.attention(q, *keys, short_mask, causal=True)


@pytest.mark.parametrize("mask_name", ["left", "holes"])
def test_queries_after_a_cache_and_empty_slots(gen, seed, mask_name):
    """Queries that are the last len_q < n of the mask's positions (a prompt continuing a cache:
    the varlen path, bottom-right aligned per row), keys past the mask (a static cache's empty
    slots), and a mask of the cache's fixed length whose trailing columns hold no real key (cut
    when the op runs): the real rows against float64, the fixed-length mask exactly as the cut one."""
    mask, len_q, slots = _masks()[mask_name][:3], 12, 9
    q, k, v = random_inputs(gen, 3, len_q, N + slots, 4, 2, 32, "float32", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen) * mask[:, -len_q:, None, None]
    out = padded.attention(q, k, v, mask, causal=True)
    ours = (out * mask[:, -len_q:, None, None], *torch.autograd.grad(out, (q, k, v), dout))
    assert bool((ours[2][:, N:] == 0).all() and (ours[3][:, N:] == 0).all())  # (no real key there)
    written = tuple(t[:, :N] for t in (k, v))  # (the reference aligns the queries to the end of its keys)
    magnitude = reference_magnitudes(q, *written, dout)  # (the size of the terms each result sums)
    for name, got, ref, same in zip(("out", "dq", "dk", "dv"), ours,
                                    *(_real_rows_reference(q, *written, dout, mask, (-1, -1), dt, len_q)
                                      for dt in (torch.float64, torch.float32))):
        got = got[:, :N] if name in ("dk", "dv") else got
        assert_flash_rule(f"{mask_name} {name}", got, ref.detach(), same.detach(), q.dtype, seed,
                          magnitude=magnitude[name])
    fixed_length = padded.attention(q, k, v, torch.nn.functional.pad(mask, (0, slots)), causal=True)
    assert torch.equal(fixed_length, out)
