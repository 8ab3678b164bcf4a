"""Attention sinks (gpt-oss's ``s_aux``, ``tvmflash/sinks.py``): a logit per query head in every
row's softmax, with no value. Against float64 math with the sink as one more column of the
softmax (``reference_attention(sinks=...)``, as transformers' eager gpt-oss computes it), on
every path of the padded op (rows read in place, holes gathered, a window over holes on
flex_attention, documents by position_ids) and on the decode kernel; padding query rows get
exactly 0, as eager gives them. The gpt-oss model itself: ``test_transformers.py``."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from conftest import assert_flash_rule, count_calls, in_two_threads, random_inputs, reference_magnitudes
from tvmflash import flash_attn_with_kvcache, kvcache, padded, torch_op
from tvmflash import sinks as sinks_module
from tvmflash.runtime import SinkKernels
from tvmflash.flex import flex_attention_forward
from tvmflash.reference import reference_attention

BATCH, N, HEADS, HEADS_K = 3, 37, 4, 2  # (no multiple of a tile)


def _masks() -> dict[str, torch.Tensor]:
    every = torch.ones(BATCH, N, dtype=torch.bool)
    padded_rows = every.clone()
    padded_rows[0, :9] = False  # left
    padded_rows[2, -6:] = False  # right
    holes = padded_rows.clone()
    holes[1, 12:14] = False
    return {"every": every, "padded": padded_rows, "holes": holes}


def _documents() -> torch.Tensor:
    """position_ids of documents packed into rows: 3 documents in row 0, 2 in row 1, 1 in row 2."""
    starts = {0: (0, 10, 29), 1: (0, 21), 2: (0,)}
    positions = torch.arange(N).repeat(BATCH, 1)
    for row, bounds in starts.items():
        for start in bounds:
            positions[row, start:] = torch.arange(N - start)
    return positions


def _document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, n, n): query i sees key j of its own document."""
    document = (positions == 0).cumsum(1)
    return (document[:, :, None] == document[:, None, :])[:, None]


def _reference(q, k, v, sinks, dout, mask4d, real, causal, window, softcap, dtype):
    """out (real rows; 0 elsewhere) and dq, dk, dv, dsinks in ``dtype`` (the padding rows' dout
    0), and the size of dsinks' terms: the root sum of squares over the rows of p_sink (dO . out)
    summed in absolute value (rounding errors of independent rows add as such), the largest head's."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    out, lse = reference_attention(*leaves[:3], causal, window_size=window, softcap=softcap, mask=mask4d,
                                   sinks=leaves[3], dtype=dtype)
    rows = real[:, :, None, None]
    with torch.no_grad():
        sink_share = torch.exp(leaves[3][None, :, None] - lse)  # (batch, heads, n)
        terms = sink_share * (dout * rows * out).abs().sum(-1).transpose(1, 2)
        size = float(terms.square().sum((0, 2)).sqrt().max())
    return (out * rows, *torch.autograd.grad(out, leaves, (dout * rows).to(dtype))), size


def _formulation(monkeypatch, formulation: str) -> dict[str, list]:
    """The sink math as ``formulation`` says: "kernels" (CPU's, ``kernels/sinks.py``, launched
    from C), "packed calls" (the kernels without the C launcher) or "torch ops" (CUDA's and TVM's
    runtime alone's: no sink kernels); the kernels' runs, counted by name."""
    if formulation == "torch ops":
        monkeypatch.setattr(sinks_module, "kernels", lambda dtype, head_dim: None)
    if formulation == "packed calls":
        monkeypatch.setattr(sinks_module, "_thread_launch", lambda *args: None)
    runs, original = {"rescale": [], "gradient": []}, sinks_module._ran

    def counted(name, *args):
        found = original(name, *args)
        runs[name] += [] if found is None else [1]
        return found

    monkeypatch.setattr(sinks_module, "_ran", counted)
    return runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["every causal", "every bidirectional softcap", "padded causal window",
                                  "holes causal", "holes causal window", "documents causal window",
                                  "padded causal, torch ops", "holes causal window, torch ops",
                                  "padded causal window, packed calls"])
def test_sinks_match_float64(gen, seed, dtype, case, monkeypatch):
    """out on the real rows and dq, dk, dv, dsinks against float64 by the flash-attn rule;
    padding rows exactly 0. GQA, head dim 64; sinks of a size that takes a real share of the
    rows' weight (gpt-oss's trained ones reach a few units). The sink math on its CPU kernels
    (launched from C, or by packed calls: ", packed calls"), and as torch ops (", torch ops")."""
    formulation = case.split(", ")[1] if ", " in case else "kernels"
    kernel_calls = _formulation(monkeypatch, formulation)
    kind, causal = case.split()[0], "causal" in case
    window = (6, 0) if "window" in case else (-1, -1)
    softcap = 3.0 if "softcap" in case else 0.0
    q, k, v = random_inputs(gen, BATCH, N, N, HEADS, HEADS_K, 64, dtype, requires_grad=True)
    sinks = (torch.randn(HEADS, generator=gen) * 2 + 1).requires_grad_()
    positions = None
    if kind == "documents":
        positions = _documents()
        mask, mask4d = torch.ones(BATCH, N, dtype=torch.bool), _document_mask(positions)
    else:
        mask = _masks()[kind]
        mask4d = mask[:, None, None, :]
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    out = padded.attention(q, k, v, mask, position_ids=positions, causal=causal, window_size=window, softcap=softcap,
                           sinks=sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))  # padding rows: 0, as eager's
    ours = (out * mask[:, :, None, None], *torch.autograd.grad(out, (q, k, v, sinks), dout))
    want, sink_terms = _reference(q, k, v, sinks, dout, mask4d, mask, causal, window, softcap, torch.float64)
    same, _ = _reference(q, k, v, sinks, dout, mask4d, mask, causal, window, softcap, q.dtype)
    magnitude = {**reference_magnitudes(q, k, v, dout), "dsinks": sink_terms}
    for name, got, ref, yardstick in zip(("out", "dq", "dk", "dv", "dsinks"), ours, want, same):
        # (dsinks in the sinks' fp32, from out and dO in q's dtype: ulps of q's dtype)
        assert_flash_rule(f"{case} {name}", got, ref.detach(), yardstick.detach(), q.dtype, seed,
                          magnitude=magnitude[name])
    ran = 0 if formulation == "torch ops" else 1
    assert {name: len(calls) for name, calls in kernel_calls.items()} == {"rescale": ran, "gradient": ran}


@pytest.mark.parametrize("dtype, case", [(dtype, case) for case in ("every", "padded window",
                                                                     "padded window create_graph")
                                         for dtype in ("float32", "bfloat16")] + [("float32", "every autocast")])
def test_repeated_training_calls_match_float64(gen, seed, dtype, case, monkeypatch):
    """A model's later layers repeat its first layer's checked call with sinks (the integration's
    ``_repeated_call``: C launches on transformers' layout, ``sinks.repeated_training``): the
    first call and a repeat on new inputs each give out and dq, dk, dv, dsinks within the
    flash-attn rule of float64, padding rows exactly 0 (their dO NaN, ignored). With
    ``create_graph`` the repeat's backward is the op's (the same values; a second derivative
    raises); under autocast the call runs in bf16 on fp32 leaves."""
    from tvmflash.integrations import transformers as tvm_hf

    kind, create_graph, autocast = case.split()[0], "create_graph" in case, "autocast" in case
    window = (6, 0) if "window" in case else (-1, -1)
    mask = _masks()[kind]
    module = type("Attention", (), {"is_causal": True})()
    ops = count_calls(monkeypatch, type(padded._sink_ops), "__call__")
    repeats = count_calls(monkeypatch, sinks_module, "repeated_training")
    torch_op.forget_calls()  # (the mask of all keys is one tensor per shape: no earlier case's call to repeat)
    for layer in range(2):
        q, k, v = random_inputs(gen, BATCH, N, N, HEADS, HEADS_K, 64, dtype, requires_grad=True)
        sinks = (torch.randn(HEADS, generator=gen) * 2 + 1).requires_grad_()
        dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16 if autocast else q.dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = tvm_hf.attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)),
                                              None if kind == "every" else mask, scaling=0.125,
                                              sliding_window=7 if window[0] > 0 else None, s_aux=sinks)
        assert out.shape == q.shape and out.dtype == dout.dtype
        assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
        # (padding rows carry no gradient, whatever their dO holds)
        poisoned = dout.masked_fill(~mask[:, :, None, None], float("nan"))
        grads = torch.autograd.grad(out, (q, k, v, sinks), poisoned, create_graph=create_graph)
        assert [g.dtype for g in grads] == [t.dtype for t in (q, k, v, sinks)]
        if autocast:  # (the attention's inputs as autocast casts them)
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        ours = (out * mask[:, :, None, None], *grads)
        args = (q, k, v, sinks, dout, mask[:, None, None, :], mask, True, window, 0.0)
        (want, sink_terms), (same, _) = _reference(*args, torch.float64), _reference(*args, q.dtype)
        magnitude = {**reference_magnitudes(q, k, v, dout), "dsinks": sink_terms}
        for name, got, ref, yardstick in zip(("out", "dq", "dk", "dv", "dsinks"), ours, want, same):
            assert_flash_rule(f"{case} layer {layer} {name}", got.to(q.dtype if name != "dsinks" else got.dtype),
                              ref.detach(), yardstick.detach(), q.dtype, seed, magnitude=magnitude[name])
        if create_graph:
            with pytest.raises(RuntimeError, match="second derivatives"):
                grads[3].sum().backward()
    # (the first layer's call on the op; under autocast it calls itself again, with the region off)
    assert (len(ops), len(repeats)) == (2 if autocast else 1, 1)


def test_repeated_calls_with_sinks_from_two_threads_keep_their_own_results(gen, monkeypatch):
    """The repeats' launches are each thread's own (the attention's and the sink kernels'): two
    threads repeating training calls and decode steps with sinks at once each get what their
    inputs gave alone, bitwise (the CPU kernels are deterministic)."""
    tvm_hf = pytest.importorskip("tvmflash.integrations.transformers")
    module = type("Attention", (), {"is_causal": True})()

    def inputs(n_q, n_k):
        q, k, v = (t.transpose(1, 2) for t in random_inputs(gen, 2, n_q, n_k, HEADS, HEADS_K, 64, "bfloat16"))
        return q, k, v, (torch.randn(HEADS, generator=gen) * 2 + 1).bfloat16(), torch.randn(2, n_q, HEADS, 64,
                                                                                          generator=gen).bfloat16()

    def call(q, k, v, sinks, dout):
        if q.shape[2] == 1:
            with torch.no_grad():
                return tvm_hf.attention_forward(module, q, k, v, None, scaling=0.125, s_aux=sinks)[0],
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        out = tvm_hf.attention_forward(module, *leaves[:3], None, scaling=0.125, s_aux=leaves[3])[0]
        return out.detach(), *torch.autograd.grad(out, leaves, dout)

    cases = [[inputs(n, n), inputs(1, n)] for n in (29, 41)]  # (each thread its own shapes and values)
    alone = [[call(*case) for case in thread] for thread in cases]
    alone = [[call(*case) for case in thread] for thread in cases]  # (the repeats')
    mismatches, finished = [], []
    repeats = count_calls(monkeypatch, sinks_module, "repeated_training")

    def run(i):
        for _ in range(10):
            for case, want in zip(cases[i], alone[i]):
                got = call(*case)
                mismatches.extend(j for j, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b))
        finished.append(i)

    in_two_threads(run)
    # (a thread's first call is checked, on the op: it makes that thread's launches)
    assert not mismatches and sorted(finished) == [0, 1] and len(repeats) == 18


def test_launched_sink_kernels_write_what_packed_calls_write(gen, monkeypatch):
    """The sink kernels launched from C (this thread's launch for the shapes, every stride free)
    write what their packed calls write, bitwise, on strided views too; another shape gets a
    launch of its own."""
    monkeypatch.setattr(sinks_module, "_threads", threading.local())  # (no launch of earlier tests)
    packed = count_calls(monkeypatch, SinkKernels, "rescale")
    made = count_calls(monkeypatch, sinks_module.launch, "make")
    for n in (N, N, 9):
        out32 = torch.randn(BATCH, HEADS, n, 64, generator=gen).transpose(1, 2)  # (strided)
        lse = torch.randn(BATCH, HEADS, n, generator=gen)
        sinks, real = torch.randn(HEADS, generator=gen), _masks()["padded"][:, :n]
        scaled, with_sink = sinks_module.renormalized(out32, lse, sinks, real, torch.bfloat16)
        dout = torch.randn(scaled.shape, generator=gen).bfloat16()
        dsinks = sinks_module.sink_gradient(dout, scaled, with_sink, sinks)
        found = sinks_module.kernels(torch.bfloat16, 64)
        want = torch.empty_like(scaled), torch.empty_like(with_sink), torch.empty(HEADS)
        found.rescale(out32, lse, sinks, real.view(torch.uint8), *want[:2])
        found.gradient(dout, scaled, with_sink, sinks, want[2])
        assert torch.equal(scaled, want[0]) and torch.equal(with_sink, want[1]) and torch.equal(dsinks, want[2])
    assert len(packed) == 3 and len(made) == 4  # (the test's own packed calls; launches: 2 kernels x 2 shapes)


def test_sinks_change_the_result_and_a_very_low_sink_changes_nothing(gen):
    """A guard on the test above: sinks of -inf give plain attention exactly (the renormalization
    is a no-op), sinks of a few units move every output."""
    q, k, v = random_inputs(gen, BATCH, N, N, HEADS, HEADS_K, 64, "float32")
    mask = _masks()["padded"]
    plain = padded.attention(q, k, v, mask, causal=True)
    low = padded.attention(q, k, v, mask, causal=True, sinks=torch.full((HEADS,), float("-inf")))
    high = padded.attention(q, k, v, mask, causal=True, sinks=torch.full((HEADS,), 3.0))
    real = mask[:, :, None, None].expand_as(plain)
    assert torch.equal(low[real], plain[real])
    assert (high - plain)[real].abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["full", "left padded", "holes"])
def test_decode_steps_with_sinks_match_float64(gen, seed, dtype, cache, monkeypatch):
    """generate()'s new tokens through the transformers integration: one query per row against
    the cache, on the decode kernel where the cache is full or left-padded (its lse renormalized),
    on the padded op where the mask has holes; bottom-right aligned, a sliding window; the same
    under torch.compile (its decode op). The cache grows by a token a step, as generate()'s
    does: after the first call the steps repeat the checked one (``repeated_heads_first_step``,
    ``repeated_decode_step``: its fp32 out and lse, then the rescale)."""
    tvm_hf = pytest.importorskip("tvmflash.integrations.transformers")
    kernel_calls = count_calls(monkeypatch, tvm_hf, "flash_attn_with_kvcache")
    repeated = []
    for name in ("repeated_heads_first_step", "repeated_decode_step"):
        monkeypatch.setattr(tvm_hf, name, lambda *a, original=getattr(tvm_hf, name), **kw: (
            lambda out: repeated.append(out is not None) or out)(original(*a, **kw)))
    kvcache.forget_steps()  # (no earlier test's step to repeat)
    module = torch.nn.Module()
    module.is_causal = True
    steps = 3
    for step in range(steps):
        n = 45 + step
        q, k, v = (t.transpose(1, 2) for t in random_inputs(gen, 2, 1, n, HEADS, HEADS_K, 64, dtype))
        sinks = torch.randn(HEADS, generator=gen) * 2 + 1
        mask = torch.ones(2, n, dtype=torch.bool)
        if cache != "full":
            mask[1, :13] = False
        if cache == "holes":
            mask[0, 20:23] = False
        out, _ = tvm_hf.attention_forward(module, q, k, v, None if cache == "full" else mask, scaling=0.125,
                                          sliding_window=30, s_aux=sinks)
        # the op a compiled generate() calls: the same paths, bit for bit
        op_out = tvm_hf._decode_sinks_op(*(t.transpose(1, 2) for t in (q, k, v)), None if cache == "full" else mask,
                                         sinks, 0.125, True, 29, 0, 0.0)
        assert torch.equal(op_out, out)
        window = torch.arange(n) >= n - 30  # (the window counts positions in the row)
        keys = (mask & window)[:, None, None, :]
        want, same = (reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), True, 0.125, mask=keys,
                                          sinks=sinks, dtype=dt)[0] for dt in (torch.float64, dtype))
        assert_flash_rule(f"{cache} decode, step {step}", out, want, same, dtype, seed,
                          magnitude=float(v.abs().max()))
    took = sum(repeated)
    # (the integration's call and the op's a step, of which only the first is checked)
    assert (len(kernel_calls), took) == ((0, 0) if cache == "holes" else (1, 2 * steps - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcache_with_sinks_matches_float64(gen, seed, dtype):
    """``flash_attn_with_kvcache(sinks=)``: new tokens written at per-row lengths, three queries
    per row (causal at each row's length), GQA, softcap; out and softmax_lse (the sink counted)
    against float64, the caches updated as without sinks; the same call again on q's new values
    (a decode loop's next step reads them); bad sinks named."""
    batch, capacity, new, lengths = 2, 50, 3, (17, 41)
    q, k_new, v_new = random_inputs(gen, batch, new, new, HEADS, HEADS_K, 64, dtype)
    k_cache, v_cache = (torch.randn(batch, capacity, HEADS_K, 64, generator=gen).to(dtype) for _ in range(2))
    sinks = torch.randn(HEADS, generator=gen) * 2 + 1
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    ends = torch.tensor(lengths)[:, None, None, None] + new  # (each row's keys after the update)
    key, query = torch.arange(capacity), torch.arange(new)[:, None]
    keys = (key < ends) & (key <= query + ends - new)  # (bottom-right causal at the row's length)
    for step in ("first", "again"):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                           softcap=3.0, return_softmax_lse=True, sinks=sinks)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert torch.equal(k_cache[0, 17:20], k_new[0]) and torch.equal(v_cache[1, 41:44], v_new[1])
        want, same = (reference_attention(q, k_cache, v_cache, False, softcap=3.0, mask=keys, sinks=sinks, dtype=dt)
                      for dt in (torch.float64, dtype))
        assert_flash_rule(f"kvcache out, {step}", out, want[0], same[0], dtype, seed,
                          magnitude=float(v_cache.abs().max()))
        assert (lse - want[1]).abs().max() < 1e-5 * want[1].abs().max()  # (fp32 row statistics)
        q.neg_()
    with pytest.raises(ValueError, match=r"shape \(4,\), one logit per query head"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, sinks=torch.zeros(HEADS_K))


def _rounded_once_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest |ours - exact| in units of half an ulp of ``exact`` in ours' dtype (1: the
    correctly rounded value; a second rounding gives up to 2)."""
    bits = 1 - round(math.log2(torch.finfo(ours.dtype).eps))  # (significant bits: 8 in bf16)
    exponent = torch.frexp(exact.abs().clamp_min(torch.finfo(ours.dtype).tiny))[1]  # (exact = m 2^e, m in [1/2, 1))
    half_ulp = torch.ldexp(torch.ones_like(exact), exponent - bits - 1)
    return float(((ours.double() - exact).abs() / half_ulp).max())


def _fp32_attention(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out (float32, 0 at padding) and lse of causal attention over each row's real tokens, from
    the varlen op with fp32 results (ring attention's): the kernels' fp32 values, before any
    rounding to q's dtype."""
    lengths = mask.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    out, lse = torch.ops.tvmflash.flash_attn_forward(q[mask], k[mask], v[mask], cu, cu, None, scale, -1, 0, 0.0,
                                                     False, True, None)
    full = out.new_zeros(q.shape)
    full[mask] = out
    rows = lse.new_full((q.shape[0], q.shape[1], q.shape[2]), float("-inf"))
    rows[mask] = lse.T
    return full, rows.transpose(1, 2)


@pytest.mark.parametrize("formulation", ["kernels", "packed calls", "torch ops"])
@pytest.mark.parametrize("case", ["every", "padded", "holes", "holes window", "decode"])
def test_sinks_round_out_once(gen, case, formulation, monkeypatch):
    """Rule 3: out' = out sigmoid(lse - sink) is rounded to bf16 once, from the fp32 accumulator's
    out (the kernels' fp32 results: the varlen op's that ring attention calls; a decode step's
    from ``flash_attn_with_kvcache(fp32_results=True)``), not the kernel's bf16 out rounded
    again: every element is the correctly rounded value of the exact product (ties aside: the
    kernels' fp32 values on other tiles differ in the last bits)."""
    kernel_calls = _formulation(monkeypatch, formulation)["rescale"]
    scale = 0.125
    sinks = torch.randn(HEADS, generator=gen) * 2 + 1
    if case == "decode":
        tvm_hf = pytest.importorskip("tvmflash.integrations.transformers")
        n = 45
        q, k, v = random_inputs(gen, 2, 1, n, HEADS, HEADS_K, 64, "bfloat16")
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, :13] = False
        module = torch.nn.Module()
        module.is_causal = True
        ours = tvm_hf.attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), mask, scaling=scale,
                                        s_aux=sinks)[0]
        # (the decode kernel's fp32 values: its products differ from the varlen kernel's)
        out32, lse = flash_attn_with_kvcache(q, k, v, cache_leftpad=torch.tensor([0, 13], dtype=torch.int32),
                                             softmax_scale=scale, return_softmax_lse=True, fp32_results=True)
        real = torch.ones(2, 1, dtype=torch.bool)
    else:
        q, k, v = random_inputs(gen, BATCH, N, N, HEADS, HEADS_K, 64, "bfloat16")
        real = _masks()[case.split()[0]]
        window = (6, 0) if "window" in case else (-1, 0)
        with torch.no_grad():
            ours = padded.attention(q, k, v, real, window_size=window, softmax_scale=scale, sinks=sinks)
        if "window" in case:  # (a window over holes: flex_attention's forward, its fp32 results)
            views, options = padded._flex_inputs(q, k, v, real, scale, *window, 0.0)
            out32, lse = flex_attention_forward(*views, fp32_results=True, **options)
            out32 = out32.transpose(1, 2) * real[:, :, None, None]
        else:
            out32, lse = _fp32_attention(q, k, v, real, scale)
    assert out32.dtype == torch.float32 and not torch.equal(out32, out32.bfloat16().float())  # (not rounded yet)
    share = torch.sigmoid(lse.double() - sinks.double()[None, :, None]).transpose(1, 2)[..., None]
    exact = out32.double() * share
    assert _rounded_once_error(ours[real], exact[real]) <= 1.001  # (a second rounding: up to 2)
    assert len(kernel_calls) == (formulation != "torch ops")


def test_autocast_second_derivatives_and_bad_sinks(gen):
    """Under a CPU autocast region fp32 leaves get gradients (the attention in bf16, sinks fp32);
    a second derivative raises rather than drops terms; sinks of the wrong shape or kind are
    named."""
    q, k, v = random_inputs(gen, 2, 19, 19, HEADS, HEADS_K, 32, "float32", requires_grad=True)
    sinks = torch.randn(HEADS, generator=gen).requires_grad_()
    mask = torch.ones(2, 19, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = padded.attention(q, k, v, mask, causal=True, sinks=sinks)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)

    out = padded.attention(q, k, v, mask, causal=True, sinks=sinks)
    dsinks, = torch.autograd.grad(out.square().sum(), sinks, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        dsinks.sum().backward()

    with pytest.raises(ValueError, match=r"shape \(4,\), one logit per query head"):
        padded.attention(q, k, v, mask, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="floating-point"):
        padded.attention(q, k, v, mask, sinks=torch.zeros(HEADS, dtype=torch.int64))


def test_sink_ops_opcheck(gen, monkeypatch):
    """The ops torch.compile's graphs call: fakes agree with the bodies (q, k, v in transformers'
    layout). The ops have no autograd formula (the Function over them has): inputs without
    gradients."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in random_inputs(gen, 2, 21, 21, HEADS, HEADS_K, 32, "float32"))
    sinks = torch.randn(HEADS, generator=gen)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, :4] = False
    torch.library.opcheck(padded._sink_ops.forward, (q, k, v, sinks, mask, 0.2, -1, 0, 0.0))
    out, lse = padded._sink_ops.forward(q, k, v, sinks, mask, 0.2, -1, 0, 0.0)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(padded._sink_ops.backward, (dout, q, k, v, out, lse, sinks, mask, 0.2, -1, 0, 0.0))
    # eager calls skip the dispatcher (the bodies): the op's result, bit for bit, and its gradients
    assert torch_op._eager_path(q, k, v, sinks) == "body"
    assert torch.equal(padded.attention(q, k, v, mask, softmax_scale=0.2, causal=True, sinks=sinks), out)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    assert torch_op._eager_path(*leaves) == "autograd"
    eager = padded.attention(*leaves[:3], mask, softmax_scale=0.2, causal=True, sinks=leaves[3])
    want = padded._sink_ops.backward(dout, q, k, v, out, lse, sinks, mask, 0.2, -1, 0, 0.0)
    for got, ref in zip(torch.autograd.grad(eager, leaves, dout), want):
        assert torch.equal(got, ref)
    # a module's sinks are an nn.Parameter: still the bodies, not the ops (the dispatcher)
    monkeypatch.setattr(padded._sink_ops, "_through_ops", None)
    param = torch.nn.Parameter(sinks.clone())
    by_module = padded.attention(*leaves[:3], mask, softmax_scale=0.2, causal=True, sinks=param)
    assert torch.equal(by_module, eager)
    assert torch.equal(torch.autograd.grad(by_module, param, dout)[0], want[3])


def test_documents_by_cu_seq_lens_are_those_of_position_ids(gen):
    """DataCollatorWithFlattening's cu_seq_lens kwargs with sinks: the documents' positions, the
    same result as by position_ids, bit for bit, and float64's (each document to itself)."""
    tvm_hf = pytest.importorskip("tvmflash.integrations.transformers")
    lengths = [11, 4, 22]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 11, 15, 37], dtype=torch.int32)
    q, k, v = (t.transpose(1, 2) for t in random_inputs(gen, 1, N, N, HEADS, HEADS_K, 64, "float32"))
    sinks = torch.randn(HEADS, generator=gen)
    module = torch.nn.Module()
    by_cu, _ = tvm_hf.attention_forward(module, q, k, v, None, scaling=0.125, s_aux=sinks, cu_seq_lens_q=cu,
                                        cu_seq_lens_k=cu, max_length_q=22, max_length_k=22)
    by_positions, _ = tvm_hf.attention_forward(module, q, k, v, None, scaling=0.125, s_aux=sinks,
                                               position_ids=positions)
    assert torch.equal(by_cu, by_positions)
    want, _ = reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), True, 0.125,
                                  mask=_document_mask(positions), sinks=sinks)
    assert (by_cu.double() - want).abs().max() <= 1e-5
