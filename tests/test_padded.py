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


def _real_rows_reference(q, k, v, dout, mask, window, dtype, len_q=None, causal=True):
    """out, dq, dk, dv in ``dtype`` of attention among each row's real tokens (the queries the
    last ``len_q`` of the mask's positions), the padding rows' dout zeroed (what they get is
    ``test_uniform_rows.py``'s; here they add no gradient)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*leaves, causal, window_size=window, mask=mask[:, None, None, :], dtype=dtype)
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


@pytest.mark.parametrize("window", [(-1, 0), (5, 0)])
def test_one_compiled_graph_for_every_mask(gen, window):
    """Under torch.compile(fullgraph=True) the call is one op: one graph (no recompile) serves
    left and right padding, holes and a full mask, with the eager call's results and gradients,
    from (batch, heads, N, D) views transposed as a model passes them; also with a window (over
    the holes: flex inside the op, which traces its mask_mod while the compiled graph runs)."""
    compiled = torch.compile(padded.attention, fullgraph=True, backend="aot_eager")
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in
               (torch.randn(BATCH, 4, N, 24, generator=gen), *(torch.randn(BATCH, 2, N, 24, generator=gen)
                                                               for _ in range(2))))
    dout = torch.randn(BATCH, N, 4, 24, generator=gen)
    for step, mask in enumerate(_masks().values()):
        results = []
        for attention in (padded.attention, compiled):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                out = attention(q, k, v, mask, causal=True, window_size=window)
                results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        for name, eager, traced in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5, msg=f"{step} {name}")


def _restarting_positions() -> torch.Tensor:
    """(BATCH, N) position_ids of documents packed into rows (restarts), one row of one sequence."""
    rows = ([12, 25], [5, 9, 23], [N], [1, 30, 6])
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


@pytest.mark.parametrize("dtype,window", [("float32", (-1, -1)), ("bfloat16", (-1, -1)), ("float32", (6, 0))])
def test_documents_where_the_mask_holds_no_padding(gen, seed, dtype, window):
    """With position_ids, a mask of ones gives each document they mark its own attention
    (against float64 with a block-diagonal mask: out and every gradient; a window counts
    positions in the document); a mask with padding ignores them (flash_attention_2's rule)."""
    positions = _restarting_positions()
    document = (positions == 0).cumsum(1)  # (a document starts where a position restarts at 0, here)
    same_document = document[:, :, None] == document[:, None, :]
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 32, dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    for mask_name in ("none", "left"):
        mask = _masks()[mask_name]
        out = padded.attention(q, k, v, mask, position_ids=positions, causal=True, window_size=window)
        ours = (out * mask[:, :, None, None], *torch.autograd.grad(out, (q, k, v), dout * mask[:, :, None, None]))
        if mask_name == "none":
            results = []
            for reference_dtype in (torch.float64, q.dtype):
                leaves = [t.detach().to(reference_dtype).requires_grad_() for t in (q, k, v)]
                ref, _ = reference_attention(*leaves, True, window_size=window, mask=same_document[:, None],
                                             dtype=reference_dtype)
                results.append((ref, *torch.autograd.grad(ref, leaves, dout.to(reference_dtype))))
            want, same = results
        else:
            dout_real = dout * mask[:, :, None, None]
            want = _real_rows_reference(q, k, v, dout_real, mask, window, torch.float64)
            same = _real_rows_reference(q, k, v, dout_real, mask, window, q.dtype)
        magnitude = reference_magnitudes(q, k, v, dout)
        for name, got, ref, yardstick in zip(("out", "dq", "dk", "dv"), ours, want, same):
            assert_flash_rule(f"{mask_name} {name}", got, ref.detach(), yardstick.detach(), q.dtype, seed,
                              magnitude=magnitude[name])


def test_documents_in_the_compiled_graph(gen):
    """Under torch.compile(fullgraph=True), one graph serves a mask of ones with documents in its
    position_ids and a padded mask, with the eager call's results and gradients."""
    compiled = torch.compile(padded.attention, fullgraph=True, backend="aot_eager")
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 24, "float32", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen)
    for step, (mask_name, positions) in enumerate((("none", _restarting_positions()), ("left", torch.arange(N)[None]),
                                                   ("none", torch.arange(N)[None]))):
        results = []
        for attention in (padded.attention, compiled):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                out = attention(q, k, v, _masks()[mask_name], position_ids=positions.expand(BATCH, N).contiguous(),
                                causal=True)
                results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        for name, eager, traced in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5, msg=f"{step} {name}")


def test_opcheck(gen):
    """The ops have no autograd formula (``_PaddedAttention`` has): inputs without gradients."""
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 16, "float32")
    for name, mask in _masks().items():
        torch.library.opcheck(padded._padded_ops.forward, (q, k, v, mask, 0.25, -1, 0, 0.0))
        out, lse = padded._padded_ops.forward(q, k, v, mask, 0.25, -1, 0, 0.0)
        torch.library.opcheck(padded._padded_ops.backward, (torch.randn_like(out), q, k, v, out, lse, mask, 0.25, -1, 0,
                                                        0.0))


def test_what_the_op_refuses(gen):
    """A mask whose shape does not fit q and k when it is called: a clear error."""
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 16, "float32")
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


@pytest.mark.parametrize("dtype,variant", [("float32", {}), ("bfloat16", {}), ("float32", {"window_size": (6, -1)}),
                                           ("float32", {"softcap": 3.0})])
def test_each_run_is_its_own_sequence(gen, seed, dtype, variant):
    """Rows of one run of real tokens each (left padding, right padding, both, none, an empty row),
    read in place: each run attends within itself, causal, as a sequence of its own would. Rows
    outside a run get 0 where they see a real key, eager's mean of v where they see none; with
    dout 0 at the latter, every gradient row outside the runs is 0. Two calls with other runs:
    rows the first call wrote do not leak into the second."""
    batch, n = 5, 37
    q, k, v = random_inputs(gen, batch, n, n, 4, 2, 64, dtype, requires_grad=True)
    options = dict(causal=True, window_size=variant.get("window_size", (-1, -1)), softcap=variant.get("softcap", 0.0))
    left = options["window_size"][0]
    for runs in (((0, 37), (9, 37), (0, 20), (3, 30), (0, 0)), ((5, 37), (0, 37), (0, 0), (0, 1), (30, 37))):
        mask = torch.zeros(batch, n, dtype=torch.bool)
        for b, (start, end) in enumerate(runs):
            mask[b, start:end] = True
        distance = torch.arange(n)[:, None] - torch.arange(n)
        seen = (distance >= 0) & ((distance <= left) if left >= 0 else True)  # (query, key) by position
        blind = ~(seen[None] & mask[:, None, :]).any(-1)  # (batch, query): sees no real key
        dout = torch.randn(q.shape, generator=gen).to(q.dtype) * ~blind[:, :, None, None]
        out = padded.attention(q, k, v, mask, **options)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        mean_v = v.detach().double().mean(1).repeat_interleave(2, 1)  # (batch, heads, dim)
        for b, (start, end) in enumerate(runs):
            outside = ~mask[b]
            assert torch.all(out[b, outside & ~blind[b]] == 0), f"out row {b}: nonzero outside the run {start, end}"
            torch.testing.assert_close(out[b, blind[b]].double(), mean_v[b].expand(int(blind[b].sum()), -1, -1),
                                       atol=4 * torch.finfo(q.dtype).eps, rtol=0)
            for name, t in zip(("dq", "dk", "dv"), grads):
                assert torch.all(t[b, outside] == 0), f"{name} row {b}: nonzero outside the run {start, end}"
            if end == start:
                continue
            rows = [t[b:b + 1, start:end].detach() for t in (q, k, v, dout)]
            results = {}
            for ref_dtype in (torch.float64, q.dtype):
                leaves = [t.to(ref_dtype).requires_grad_() for t in rows[:3]]
                ref, lse = reference_attention(*leaves, True, dtype=ref_dtype, **variant)
                results[ref_dtype] = (ref, *torch.autograd.grad(ref, leaves, rows[3].to(ref_dtype)), lse)
            magnitude = reference_magnitudes(*rows, lse=results[torch.float64][-1].detach())
            for i, (name, t) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
                assert_flash_rule(f"{name} row {b} of runs {runs}", t[b:b + 1, start:end].detach(),
                                  results[torch.float64][i].detach(), results[q.dtype][i].detach(), q.dtype, seed,
                                  magnitude=magnitude[name])


def test_eager_calls_skip_the_dispatcher_and_modes_see_the_ops(gen, monkeypatch):
    """Eager calls on plain tensors run the ops' bodies without torch's dispatcher (an inference
    call the forward's body, a training call the Function over the bodies), as flash_attn_func's
    do; a dispatch mode sees both ops. All three give the same out and gradients, bit for bit,
    and a second derivative raises (a clear error: the blind rows' torch ops in the backward record nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    mask = _masks()["holes"]
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 32, "float32", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen)
    seen = Seen()
    with seen:
        out = padded.attention(q, k, v, mask, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert {"tvmflash.flash_attn_padded_forward.default", "tvmflash.flash_attn_padded_backward.default"} <= seen.ops

    monkeypatch.setattr(padded._padded_ops, "_through_ops", None)  # (the Function over the ops: gone)
    eager = padded.attention(q, k, v, mask, causal=True)
    assert torch.equal(eager, out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(eager, (q, k, v), dout), grads))
    with torch.no_grad():
        assert torch.equal(padded.attention(q, k, v, mask, causal=True), out)
    monkeypatch.undo()
    dq, = torch.autograd.grad(padded.attention(q, k, v, mask, causal=True).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (dq.pow(2).sum() + q.sum()).backward()


def _eager_with_blind_rows(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Dense attention of (batch, n, heads, d) tensors where ``allowed`` (batch, 1, n_q, n_k) says
    which keys a query sees; a row that sees none gets eager's uniform softmax over all keys
    (scores s - s.detach(): the value and gradient of eager's most-negative bias)."""
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(groups, 1), v.transpose(1, 2)
    scores = qh @ kh.mT * q.shape[-1] ** -0.5
    blind = ~allowed.any(-1, keepdim=True)
    scores = torch.where(blind, scores - scores.detach(), scores.masked_fill(~allowed, -torch.inf))
    return (torch.softmax(scores, -1) @ vh.repeat_interleave(groups, 1)).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_window_over_holes_against_float64(gen, causal):
    """A sliding window over a mask with holes (on flex_attention inside the op) against dense
    float64 attention with eager's window by row position: rows with holes, left and right
    padding, a row of padding only; queries the whole row and, as in a chunked prefill, its
    last 170 keys; lengths no multiple of the 128-key blocks. Real rows as eager's, rows that
    see no key eager's mean of v, other padding rows 0. Its block mask (built from block bounds)
    keeps every block torch's dense create_block_mask keeps, and calls full only blocks torch
    calls full."""
    from torch.nn.attention.flex_attention import create_block_mask

    from tvmflash.flex import EMPTY, FULL, PARTIAL, _block_states

    batch, n, heads, heads_k, dim, w = 4, 600, 4, 2, 32, 260  # (128-key blocks: some inside the window whole)
    window = (w - 1, 0) if causal else (w, w)  # (transformers' sliding window w)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, 30:35], mask[0, 60:290] = False, False  # holes, one nearly as long as the window
    mask[1, :60], mask[1, 200:210] = False, False  # left padding and a hole
    mask[2, 450:] = False  # right padding
    mask[3] = False  # padding only
    kinds = set()
    for len_q in (n, 170):
        q = torch.randn(batch, len_q, heads, dim, generator=gen, requires_grad=True)
        k, v = (torch.randn(batch, n, heads_k, dim, generator=gen, requires_grad=True) for _ in range(2))
        out = padded.attention(q, k, v, mask, causal=causal, window_size=window)

        def allowed_pairs(b, h, qi, kj):  # (eager's: the window by position in the row, holes included)
            distance = qi + n - len_q - kj
            return mask[b, kj] & (((distance >= 0) & (distance < w)) if causal else distance.abs() <= w)

        indices = torch.arange(batch)[:, None, None, None], None, torch.arange(len_q)[:, None], torch.arange(n)
        allowed = allowed_pairs(*indices)
        blind = ~allowed.any(-1)[:, 0]  # (batch, len_q)
        defined = (mask[:, -len_q:] | blind)[:, :, None, None]
        assert bool((out[~defined.expand_as(out)] == 0).all())  # (padding rows that see keys)
        dout = torch.randn(out.shape, generator=gen) * defined
        grads = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = _eager_with_blind_rows(*leaves, allowed)
        want_grads = torch.autograd.grad(want, leaves, dout.double())
        assert ((out.double() - want) * defined).abs().max() <= 1e-5, (len_q, causal)
        for name, got, ref in zip("qkv", grads, want_grads):
            assert (got.double() - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), (name, len_q)

        ours = _block_states(padded._window_block_mask(mask, len_q, *window))
        theirs = _block_states(create_block_mask(allowed_pairs, batch, None, len_q, n, device="cpu"))
        assert bool(((ours != EMPTY) | (theirs == EMPTY)).all()), "a block with visible keys was left out"
        assert bool(((ours != FULL) | (theirs == FULL)).all()), "a block called full holds masked pairs"
        kinds.update(ours.unique().tolist())
    assert kinds == {EMPTY, PARTIAL, FULL}  # (the test covers each kind of block)


def test_window_over_holes_traces_its_mods_once_without_dynamo(gen, monkeypatch):
    """The op's flex path traces its mask_mod once per mask (and softcap once per value), never
    through dynamo's guards (``flex_trace.capture``): inside a compiled graph that nested dynamo
    run left guards whose tracebacks deadlocked torch at interpreter exit (torch._dynamo.explain
    of a windowed Mistral with a hole, cold kernel cache: the process hung after its output)."""
    from tvmflash import flex_trace

    def refuse(*args, **kwargs):
        raise AssertionError("the padded op's mods went through dynamo")

    traced = []
    original = flex_trace.trace_mask_mod
    monkeypatch.setattr(flex_trace, "capture", refuse)
    monkeypatch.setattr(flex_trace, "trace_mask_mod", lambda *a, **kw: traced.append(1) or original(*a, **kw))
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 24, "float32", requires_grad=True)  # (the kernels of the test
    mask = _masks()["holes"]  # of one compiled graph above; softcap's mod: Gemma2's compiled test in test_transformers)
    for _ in range(2):
        out = padded.attention(q, k, v, mask, causal=True, window_size=(5, 0))
        torch.autograd.grad(out.sum(), (q, k, v))
    assert traced == [1]


@pytest.mark.parametrize("mask_name", ["left", "holes"])
def test_asymmetric_window_against_float64(gen, mask_name):
    """A bidirectional window of 2 keys before and 6 after (flash-attn's (2, 6)): rows in place
    (left padding) and flex over holes. Rows that see no real key in their window (the first
    rows of a left-padded row: its first real key lies further right than 6) get eager's mean of
    v; rows just after them see it, and are real or 0 as any padding row."""
    mask, window = _masks()[mask_name], (2, 6)
    q, k, v = random_inputs(gen, BATCH, N, N, 4, 2, 24, "float32", requires_grad=True)
    out = padded.attention(q, k, v, mask, causal=False, window_size=window)
    distance = torch.arange(N)[:, None] - torch.arange(N)
    allowed = (mask[:, None, :] & (distance >= -window[1]) & (distance <= window[0]))[:, None]  # (batch, 1, q, k)
    blind = ~allowed.any(-1)[:, 0]
    assert bool(blind[1, :5].all()) and not bool(blind[1, 5:].any())  # (row 1: 11 pads; rows 5.. see key 11)
    defined = (mask | blind)[:, :, None, None]
    dout = torch.randn(out.shape, generator=gen) * defined
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _eager_with_blind_rows(*leaves, allowed)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    assert ((out.double() - want) * defined).abs().max() <= 1e-5
    assert bool((out[~defined.expand_as(out)] == 0).all())
    for name, got, ref in zip("qkv", grads, want_grads):
        assert (got.double() - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), name


def test_window_over_holes_kernels_per_size_class(gen, monkeypatch):
    """The flex kernels of a window over holes do not depend on the offset of the queries, the
    window or the mask's exact shape (batch, n): masks of other shapes in one size class and
    other windows run the same compiled kernels (a kernel per shape compiled 2-9 s each)."""
    from tvmflash import flex

    spec_keys = []
    original = flex._flex_forward
    monkeypatch.setattr(flex, "_flex_forward", lambda *args: spec_keys.append(args[-1]) or original(*args))
    for batch, n, len_q, window in ((4, 37, 37, (5, 0)), (3, 41, 30, (5, 0)), (2, 50, 50, (9, 0))):
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[0, 7:9] = False
        q, k, v = random_inputs(gen, batch, len_q, n, 4, 2, 24, "float32")
        padded.attention(q, k, v, mask, causal=True, window_size=window)
    assert len(spec_keys) == 3 and len(set(spec_keys)) == 1


def test_mask_rows_against_each_row_read_in_python(gen):
    """``MaskRows`` (each row's count, first and end of its real keys; the rows as runs where
    each is one) against the rows read one key at a time: random masks with holes, left and
    right padding, empty rows, a view with a row stride, an expanded row and a transposed mask."""
    def read(row: list[bool]) -> tuple[int, int, int]:
        real = [j for j, x in enumerate(row) if x]
        return (len(real), real[0], real[-1] + 1) if real else (0, 0, 0)

    masks = [m for m in _masks().values()]
    masks += [torch.rand(5, 23, generator=gen) < p for p in (0.1, 0.5, 0.9)]
    masks += [torch.zeros(3, 0, dtype=torch.bool), torch.zeros(0, 7, dtype=torch.bool)]
    wide = torch.rand(3, 40, generator=gen) < 0.7
    masks += [wide[:, 5:29], (torch.arange(17) < 9).expand(4, 17), (torch.rand(23, 5, generator=gen) < 0.5).t()]
    for mask in masks:
        rows = padded.MaskRows(mask)
        want = [read(row) for row in mask.tolist()]
        assert list(zip(rows.count, rows.first, rows.end)) == want
        assert rows.written == max((end for _, _, end in want), default=0)
        one_run = all(count == end - first for count, first, end in want)
        assert rows.runs == (tuple((first, end) for _, first, end in want) if one_run else None)
        n = mask.shape[1]
        left = one_run and all(count == 0 or end == n for count, _, end in want)
        assert rows.left_pad(n) == (tuple(n - count for count, _, _ in want) if left else None)
        wide_ints = padded.MaskRows(mask.to(torch.int64))  # (a mask of another dtype: its nonzero keys)
        assert (wide_ints.count, wide_ints.first, wide_ints.end) == (rows.count, rows.first, rows.end)


def test_random_calls_against_float64(gen, seed):
    """Random shapes, masks (left or right padding, holes, rows without a real token), windows
    (causal or not, asymmetric) and queries after a cache (len_q <= n <= the layer's keys): the
    real rows and every gradient against float64. Where len_q < n, the op's contract applies: the
    trailing columns without a real key in any row are a static cache's slots, and the queries
    are the last len_q of the columns before them."""
    for _ in range(12):
        batch, n_k = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(2, 70, (), generator=gen))
        n = int(torch.randint(1, n_k + 1, (), generator=gen))
        len_q = n if torch.rand((), generator=gen) < 0.5 else int(torch.randint(1, n + 1, (), generator=gen))
        mask = torch.rand(batch, n, generator=gen) < 0.8  # (holes)
        for b, edge in enumerate(torch.randint(0, n, (batch,), generator=gen).tolist()):
            kind = int(torch.randint(0, 4, (), generator=gen))
            if kind == 0:
                mask[b] = torch.arange(n) >= edge  # left padding
            elif kind == 1:
                mask[b] = torch.arange(n) < edge  # right padding (a row of none where edge is 0)
        causal = bool(torch.rand((), generator=gen) < 0.7)
        left = int(torch.randint(-1, 30, (), generator=gen))
        window = (left, 0) if causal else (left, int(torch.randint(-1, 30, (), generator=gen)) if left >= 0 else -1)
        dtype = "float32" if torch.rand((), generator=gen) < 0.5 else "bfloat16"
        q, k, v = random_inputs(gen, batch, len_q, n_k, 4, 2, 32, dtype, requires_grad=True)
        used = mask.any(0).nonzero()
        cut = n if len_q == n else max(int(used.max()) + 1 if used.numel() else 0, len_q)  # (the contract)
        real = mask[:, cut - len_q:cut, None, None]
        dout = torch.randn(q.shape, generator=gen).to(q.dtype) * real
        out = padded.attention(q, k, v, mask, causal=causal, window_size=window)
        ours = (out * real, *torch.autograd.grad(out, (q, k, v), dout))
        written = tuple(t[:, :cut] for t in (k, v))
        magnitude = reference_magnitudes(q, *written, dout)
        case = f"batch {batch}, len_q {len_q}, n {n}, keys {n_k}, causal {causal}, window {window}, {dtype}"
        refs = (_real_rows_reference(q, *written, dout, mask[:, :cut], window, dt, len_q, causal)
                for dt in (torch.float64, q.dtype))
        for name, got, ref, same in zip(("out", "dq", "dk", "dv"), ours, *refs):
            got = got[:, :cut] if name in ("dk", "dv") else got
            assert_flash_rule(f"{case}: {name}", got, ref.detach(), same.detach(), q.dtype, seed,
                              magnitude=magnitude[name])
