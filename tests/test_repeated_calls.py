"""Calls that repeat a checked call's shapes and options (a model's layers and steps) skip the
checks they already passed (kvcache._steps, torch_op._calls): they must give the results of the
full path, and every input the full path refuses must still be refused after such a call."""

from __future__ import annotations


import pytest
import torch

from conftest import assert_flash_rule, in_two_threads, random_inputs, reference_attention, reference_magnitudes
from tvmflash import checks, flash_attn_func, flash_attn_with_kvcache, kvcache, torch_op


def _decode_inputs(gen, capacity=300, dtype=torch.float32):
    k_cache = torch.randn(2, capacity, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(2, capacity, 2, 64, generator=gen).to(dtype)
    return torch.randn(2, 1, 8, 64, generator=gen).to(dtype), k_cache, v_cache


def _full_path(fn, *args, **kwargs):
    """fn's result with the memo of repeated calls cleared before and after (the full checks run)."""
    kvcache.forget_steps()
    torch_op.forget_calls()
    try:
        return fn(*args, **kwargs)
    finally:
        kvcache.forget_steps()
        torch_op.forget_calls()


@pytest.mark.parametrize("lengths,window", [("int", -1), ("tensor", -1), ("int", 20)])
def test_growing_cache_matches_the_full_path(gen, lengths, window):
    """A cache that grows by one row per step (transformers' DynamicCache: a new tensor each
    step), lengths within a key tile (a step then rewrites only its table's ends) and crossing
    tiles (63 -> 65, 127 -> 129); a sliding window moves the first visible tile too."""
    q, k_all, v_all = _decode_inputs(gen)
    options = dict(causal=True, window_size=(window, -1), return_softmax_lse=True)
    lengths_seen = (61, 62, 63, 64, 65, 66, 84, 85, 86, 127, 128, 129, 200)

    def caches(n):  # (a new tensor each step, as a DynamicCache's)
        seqlens = n - 3 if lengths == "int" else torch.tensor([n - 3, n - 40], dtype=torch.int32)
        return k_all[:, :n].transpose(1, 2).contiguous().transpose(1, 2), v_all[:, :n], seqlens

    with torch.no_grad():
        want = {n: _full_path(flash_attn_with_kvcache, q, *caches(n)[:2], cache_seqlens=caches(n)[2], **options)
                for n in lengths_seen}
        flash_attn_with_kvcache(q, *caches(60)[:2], cache_seqlens=caches(60)[2], **options)
        for n in lengths_seen:
            k_cache, v_cache, seqlens = caches(n)
            assert kvcache._steps  # (the step of the calls before)
            got, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **options)
            assert torch.equal(got, want[n][0]) and torch.equal(lse, want[n][1])
            ends = [n - 3, n - 40] if lengths == "tensor" else [n - 3] * 2
            for b, end in enumerate(ends):
                start = 0 if window < 0 else max(end - 1 - window, 0)
                ref = reference_attention(q[b:b + 1], k_cache[b:b + 1, start:end], v_cache[b:b + 1, start:end],
                                          dtype=torch.float64)[0]
                torch.testing.assert_close(got[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_steps_from_two_threads_keep_their_own_lengths(gen):
    """Threads that repeat one decode step with lengths of their own each get the attention over
    their own lengths (each thread's tables are its own, rewritten as its lengths change)."""
    q, k_cache, v_cache = _decode_inputs(gen)
    want = {n: reference_attention(q, k_cache[:, :n], v_cache[:, :n], dtype=torch.float64)[0]
            for n in range(100, 140)}
    errors = []

    def run(offset):
        with torch.inference_mode():
            for n in range(100 + offset, 140, 2):
                for _ in range(3):
                    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n)
                    errors.append(float((out.double() - want[n]).abs().max()))

    in_two_threads(run)
    assert len(errors) == 120 and max(errors) <= 1e-5


def test_left_padded_cache_matches_the_full_path(gen):
    """generate()'s batch of left-padded prompts: cache_leftpad (the first real key of each row)
    takes the repeated-call path too, and a left pad past a row's length is still refused."""
    q, k_all, v_all = _decode_inputs(gen)
    pads = torch.tensor([3, 70], dtype=torch.int32)
    with torch.no_grad():
        for n in (90, 91, 128, 129):
            args = (q, k_all[:, :n], v_all[:, :n])
            got = [flash_attn_with_kvcache(*args, cache_seqlens=n, cache_leftpad=pads, causal=True) for _ in range(2)]
            assert kvcache._steps
            want = _full_path(flash_attn_with_kvcache, *args, cache_seqlens=n, cache_leftpad=pads, causal=True)
            assert torch.equal(got[0], want) and torch.equal(got[1], want)
        for b in range(2):
            ref = reference_attention(q[b:b + 1], k_all[b:b + 1, pads[b]:n], v_all[b:b + 1, pads[b]:n])[0]
            torch.testing.assert_close(got[1][b:b + 1].double(), ref.double(), atol=1e-5, rtol=1e-5)
        flash_attn_with_kvcache(*args, cache_seqlens=n, cache_leftpad=pads, causal=True)
        with pytest.raises(ValueError, match="cache_leftpad must lie"):
            flash_attn_with_kvcache(*args, cache_seqlens=n, cache_leftpad=torch.tensor([3, n + 1], dtype=torch.int32))


def test_decode_refuses_bad_input_after_a_repeated_call(gen):
    q, k_cache, v_cache = _decode_inputs(gen)
    with torch.no_grad():
        for _ in range(2):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100)
        assert kvcache._steps  # the calls below would take the repeated-call path
        with pytest.raises(checks.CapacityError, match="exceeds"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=301)
        with pytest.raises(ValueError, match=">= 0"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=-1)
        with pytest.raises(checks.CapacityError):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([5, 301], dtype=torch.int32))
        with pytest.raises(ValueError, match="same shape"):
            flash_attn_with_kvcache(q, k_cache, v_cache[:, :200], cache_seqlens=100)
        with pytest.raises(TypeError):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100, causal=1)
        with pytest.raises(ValueError):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([5, 6, 7], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="forward only"):
        flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, cache_seqlens=100)


def test_decode_refuses_what_the_kernel_checks_after_a_repeated_call(gen):
    """The repeated-call key leaves dtypes, devices and strides to the kernel's own argument
    checks: what they refuse must still get the full path's error, and a q it cannot read in
    place (last stride 2) the full path's copy."""
    q, k_cache, v_cache = _decode_inputs(gen)
    with torch.no_grad():
        for _ in range(2):
            want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100)
        with pytest.raises(TypeError, match="v_cache has dtype torch.float64"):
            flash_attn_with_kvcache(q, k_cache, v_cache.double(), cache_seqlens=100)
        with pytest.raises(ValueError, match="contiguous last dimension"):
            flash_attn_with_kvcache(q, k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3),
                                    cache_seqlens=100)
        with pytest.raises(ValueError, match="same shape"):
            flash_attn_with_kvcache(q, k_cache, v_cache[:, :, :1], cache_seqlens=100)
        spread = torch.zeros(*q.shape[:-1], 2 * q.shape[-1])
        spread[..., ::2] = q
        assert torch.equal(flash_attn_with_kvcache(spread[..., ::2], k_cache, v_cache, cache_seqlens=100), want)
        half = flash_attn_with_kvcache(q.half(), k_cache.half(), v_cache.half(), cache_seqlens=100)
        torch.testing.assert_close(half.float(), want, atol=2e-3, rtol=2e-3)  # (another dtype: another kernel)


def test_forward_repeats_match_the_full_path(gen):
    q, k, v = random_inputs(gen, 1, 21, 21, 4, 2, 64, "float32")
    with torch.inference_mode():
        first = flash_attn_func(q, k, v, causal=True, softcap=5.0)
        assert torch_op._calls
        again, lse, _ = flash_attn_func(q, k, v, causal=True, softcap=5.0, return_attn_probs=True)
    want, want_lse, _ = _full_path(flash_attn_func, q, k, v, causal=True, softcap=5.0, return_attn_probs=True)
    assert torch.equal(first, want) and torch.equal(again, want) and torch.equal(lse, want_lse)


def test_forward_repeats_keep_autograd_autocast_and_checks(gen):
    q, k, v = random_inputs(gen, 1, 21, 21, 4, 2, 64, "float32")
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True)
    assert torch_op._calls
    leaf = q.clone().requires_grad_()
    out = flash_attn_func(leaf, k, v, causal=True)  # same shapes, now with a gradient to record
    out.sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flash_attn_func(q, k, v, causal=True).dtype == torch.bfloat16
    with pytest.raises(TypeError):
        flash_attn_func(q, k, v, causal=1)
    with pytest.raises(ValueError, match="dropout"):
        flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
    with pytest.raises((TypeError, ValueError)):
        flash_attn_func(q, k.double(), v, causal=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_repeats_match_the_full_path(gen, seed, monkeypatch, dtype):
    """A training step's layers repeat a call that autograd records: its forward and backward run
    without the checks (_RepeatedTraining) and give the full path's out, lse and gradients, bit
    for bit; the backward still refuses an LSE too large to recompute from and a second
    derivative."""
    backwards = []
    original = torch_op._ForwardCall.backward
    monkeypatch.setattr(torch_op._ForwardCall, "backward",
                        lambda self, *a: backwards.append(1) or original(self, *a))
    options = dict(causal=True, softcap=5.0, return_attn_probs=True)
    first = random_inputs(gen, 1, 21, 21, 4, 2, 64, dtype, requires_grad=True)
    flash_attn_func(*first, **options)[0].sum().backward()
    assert torch_op._calls
    leaves = random_inputs(gen, 1, 21, 21, 4, 2, 64, dtype, requires_grad=True)
    dout = torch.randn(leaves[0].shape, generator=gen).to(leaves[0].dtype)
    out, lse, _ = flash_attn_func(*leaves, **options)
    grads = torch.autograd.grad(out, leaves, dout)
    assert backwards == [1]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    want_out, want_lse, _ = _full_path(flash_attn_func, *copies, **options)
    want = torch.autograd.grad(want_out, copies, dout)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = reference_attention(*doubles, True, softcap=5.0)
    ref_grads = torch.autograd.grad(ref, doubles, dout.double())
    plain = [t.detach().requires_grad_() for t in leaves]  # plain PyTorch in the same dtype
    same, _ = reference_attention(*plain, True, softcap=5.0, dtype=leaves[0].dtype)
    same_grads = torch.autograd.grad(same, plain, dout)
    magnitude = reference_magnitudes(*(t.detach() for t in leaves), dout, lse=ref_lse.detach())
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
        assert_flash_rule(name, g, r, p, leaves[0].dtype, seed, magnitude=magnitude[name])

    flash_attn_func(*first, causal=True)  # (without softcap, which bounds the scores and the LSE)
    huge = [(t.detach() * 1e5).requires_grad_() if i < 2 else t for i, t in enumerate(leaves)]
    with pytest.raises(ValueError, match="log-sum-exp reached"):
        flash_attn_func(*huge, causal=True).sum().backward()
    assert backwards == [1, 1]
    dq, = torch.autograd.grad(flash_attn_func(*leaves, causal=True).sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (dq.pow(2).sum() + leaves[0].sum()).backward()


def test_op_bodies_repeat_checked_calls(gen, monkeypatch):
    """The ops' bodies, which torch.compile's graphs call every layer and step: a repeat of a
    checked call skips the checks and gives the full path's results bit for bit; another scale
    is another call; the backward still refuses an LSE too large to recompute from."""
    full = []
    original = torch_op._run_forward
    monkeypatch.setattr(torch_op, "_run_forward", lambda *a: full.append(1) or original(*a))
    q, k, v = random_inputs(gen, 2, 37, 37, 4, 2, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    forward, backward = torch.ops.tvmflash.flash_attn_forward, torch.ops.tvmflash.flash_attn_backward

    def op_call(q, k, v, dout, scale=0.2):
        args = (None, None, None, scale, 9, 0, 5.0, False, False, None)
        out, lse = forward(q, k, v, *args)
        return out, lse, *backward(dout, q, k, v, out, lse, *args)

    want = _full_path(op_call, q, k, v, dout)
    op_call(q, k, v, dout)
    full.clear()
    q2, k2, v2 = (t + 1 for t in (q, k, v))
    got = op_call(q2, k2, v2, dout)
    assert not full  # the repeat skipped the checks
    want2 = _full_path(op_call, q2, k2, v2, dout)
    assert all(torch.equal(a, b) for a, b in zip(got, want2))
    assert not all(torch.equal(a, b) for a, b in zip(got, want))
    full.clear()
    assert all(torch.equal(a, b) for a, b in zip(op_call(q, k, v, dout, 0.3), _full_path(op_call, q, k, v, dout, 0.3)))
    assert full
    out, lse, *_ = op_call(q, k, v, dout)
    lse = lse.clone()
    lse[1, 3, 36] = 2.0**16
    with pytest.raises(ValueError, match="log-sum-exp reached"):
        backward(dout, q, k, v, out, lse, None, None, None, 0.2, 9, 0, 5.0, False, False, None)


def test_steering_variables_are_read_fresh_on_every_call(monkeypatch):
    """The fast paths' memo keys read the steering environment variables through
    settings.EnvironmentValues: a change made through os.environ (set, changed, removed) shows
    in the next read, as os.environ.get would show it."""
    from tvmflash import settings

    name = "TVMFLASH_TEST_STEERING_VALUE"
    values = settings.EnvironmentValues(name, "HOME")
    monkeypatch.delenv(name, raising=False)
    unset = values()
    assert unset[0] is None and unset[1] is not None
    monkeypatch.setenv(name, "a")
    first = values()
    monkeypatch.setenv(name, "b")
    second = values()
    assert None not in (first[0], second[0]) and first[0] != second[0] and first[1] == second[1]
    monkeypatch.setenv(name, "a")
    assert values() == first
    monkeypatch.delenv(name)
    assert values() == unset


def test_forward_repeats_from_two_threads_keep_their_own_results(gen):
    """Repeated calls share one cached plan: calls from two threads at once each get the
    attention of their own inputs (a fresh output each)."""
    inputs = [[torch.randn(1, 37, 4, 32, generator=gen) for _ in range(3)] for _ in range(2)]
    want = [reference_attention(q, k, v, causal=True, dtype=torch.float64)[0] for q, k, v in inputs]
    errors = []

    def run(i):
        with torch.inference_mode():
            for _ in range(30):
                out = flash_attn_func(*inputs[i], causal=True)
                errors.append(float((out.double() - want[i]).abs().max()))

    in_two_threads(run)
    assert len(errors) == 60 and max(errors) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_repeats_match_the_full_path(gen, monkeypatch, dtype):
    """A model's layers repeat one left-padded call (the integration's rows read in place: the
    same shapes, row runs and options): its checks and plan run once (torch_op._calls), and a
    repeat gives the full path's out and gradients bit for bit, the uniform rows included. Other
    runs are another call."""
    pytest.importorskip("transformers")
    from tvmflash.integrations import transformers as tvm_hf

    plans = []
    original = torch_op._checked_row_runs_call
    monkeypatch.setattr(torch_op, "_checked_row_runs_call", lambda *a, **kw: plans.append(1) or original(*a, **kw))
    batch, n, heads, heads_k, dim = 3, 37, 4, 2, 64
    opts = {"softmax_scale": dim ** -0.5, "causal": True, "window_size": (-1, 0), "softcap": 0.0}

    def padded(pads):
        mask = torch.ones(batch, n, dtype=torch.bool)
        for b, pad in enumerate(pads):
            mask[b, :pad] = False
        return mask

    def leaves():
        q = torch.randn(batch, n, heads, dim, generator=gen).to(dtype).requires_grad_()
        return [q, *(torch.randn(batch, n, heads_k, dim, generator=gen).to(dtype).requires_grad_() for _ in range(2))]

    def run(tensors, mask, dout):
        out = tvm_hf._padded_attention(*tensors, mask, opts)
        return out, torch.autograd.grad(out, tensors, dout)

    for pads in ((0, 5, 19), (3, 0, 36)):
        mask = padded(pads)
        tensors = leaves()
        dout = torch.randn(batch, n, heads, dim, generator=gen).to(dtype)
        want_out, want_grads = _full_path(run, [t.detach().clone().requires_grad_() for t in tensors], mask, dout)
        plans.clear()
        run(leaves(), mask, dout)  # (other inputs, the same call: planned once)
        out, grads = run(tensors, mask, dout)
        assert len(plans) == 1 and torch_op._calls
        assert torch.equal(out, want_out) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        ref = reference_attention(*(t.detach()[0:1, pads[0]:] for t in tensors), causal=True, dtype=torch.float64)[0]
        torch.testing.assert_close(out[0:1, pads[0]:].double(), ref, atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=2e-2 if dtype != torch.float32 else 1e-5)

