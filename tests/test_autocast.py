"""Under ``torch.autocast`` the flash-attn functions follow it as SDPA does: q, k, v cast to the
region's dtype, the output in that dtype, gradients back to the fp32 leaves."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_matches_reference
from tvmflash import flash_attn_func, flash_attn_varlen_func, torch_op


def _leaves(gen, *shapes):
    return [torch.randn(*s, generator=gen).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_the_kernels_in_the_regions_dtype(gen, seed, dtype):
    q, k, v = _leaves(gen, (2, 77, 4, 32), (2, 93, 2, 32), (2, 93, 2, 32))
    slopes = torch.rand(4, generator=gen)  # fp32, as the kernels read them: not cast
    dout = torch.randn(2, 77, 4, 32, generator=gen).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out, lse = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    assert out.dtype == dtype
    out.backward(dout)
    grads = [t.grad for t in (q, k, v)]
    assert all(g.dtype == torch.float32 for g in grads)

    # the same as calling it on inputs cast by hand, bit for bit
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    expected = flash_attn_func(*low, causal=True, alibi_slopes=slopes)
    expected.backward(dout)
    assert torch.equal(out, expected)
    for g, e in zip(grads, low):
        assert torch.equal(g, e.grad.float())

    # and right: against float64 math on the rounded inputs
    assert_matches_reference(f"autocast {dtype}", (*low, dout), (out, lse, *(t.grad for t in low)), True, seed,
                             alibi_slopes=slopes)


class _SeeTheOp(torch.overrides.TorchFunctionMode):
    """A mode that changes nothing: under it every call goes through the op and its autocast rule."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_autocast_training_repeats_skip_the_dispatcher(gen, monkeypatch):
    """Under a CPU autocast region a training call applies the op's autocast rule itself and then
    takes the paths without torch's dispatcher: a model's repeated layers plan once
    (``_RepeatedTraining``), as outside autocast. Out, lse and the fp32 leaves' gradients equal
    the op's (under a mode, which sees the op and its rule) bit for bit; fp64 stays fp64."""
    backwards = []
    original = torch_op._RepeatedTraining.backward
    monkeypatch.setattr(torch_op._RepeatedTraining, "backward",
                        staticmethod(lambda ctx, *a: backwards.append(1) or original(ctx, *a)))
    shapes = (1, 29, 4, 64), (1, 29, 2, 64), (1, 29, 2, 64)
    dout = torch.randn(shapes[0], generator=gen).to(torch.bfloat16)
    results = []
    for see_the_op in (False, False, True):
        seeded = (torch.Generator().manual_seed(i) for i in range(3))  # the same inputs each time
        leaves = [torch.randn(s, generator=g).requires_grad_() for s, g in zip(shapes, seeded)]
        with torch.autocast("cpu", dtype=torch.bfloat16), (_SeeTheOp() if see_the_op else torch.enable_grad()):
            out, lse = flash_attn_func(*leaves, causal=True, return_lse=True)
        grads = torch.autograd.grad(out, leaves, dout)
        results.append((out, lse, grads))
    assert backwards == [1]  # the second call: the repeated call's backward; the op's is not it
    (first, first_lse, first_grads), (again, lse, grads), (op, op_lse, op_grads) = results
    assert again.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    assert torch.equal(again, op) and torch.equal(lse, op_lse) and torch.equal(first, op)
    assert all(torch.equal(g, w) for g, w in zip(grads, op_grads))
    assert all(torch.equal(g, w) for g, w in zip(first_grads, op_grads))
    double = [t.detach().double() for t in leaves]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="float64"):
        flash_attn_func(*double, causal=True)  # (autocast leaves fp64 alone; the kernels take no fp64)


def test_autocast_padded_rows_skip_the_dispatcher(gen, monkeypatch):
    """The integration's left-padded rows read in place (``padded.attention``'s row runs) under
    autocast: the same plan path as outside it, on q, k, v cast by the op's rule; the result
    equals the call on inputs cast by hand, bit for bit, the rows that see no key included."""
    from tvmflash import padded

    plans = []
    original = torch_op._checked_row_runs_call
    monkeypatch.setattr(torch_op, "_checked_row_runs_call", lambda *a, **kw: plans.append(1) or original(*a, **kw))
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, :6] = False
    opts = dict(softmax_scale=0.125, causal=True, window_size=(-1, 0), softcap=0.0)
    leaves = [torch.randn(2, 23, h, 64, generator=gen).requires_grad_() for h in (4, 2, 2)]
    dout = torch.randn(2, 23, 4, 64, generator=gen).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = padded.attention(*leaves, mask, **opts)
    assert out.dtype == torch.bfloat16 and plans == [1]
    grads = torch.autograd.grad(out, leaves, dout)
    low = [t.detach().bfloat16().requires_grad_() for t in leaves]
    want = padded.attention(*low, mask, **opts)
    assert plans == [1]  # (the same call: bf16 inputs, the same runs)
    assert torch.equal(out, want)
    assert all(torch.equal(g, w.float()) for g, w in zip(grads, torch.autograd.grad(want, low, dout)))


@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode])
def test_autocast_holds_for_inference_calls(gen, no_autograd):
    """Calls with nothing for autograd to record skip torch's dispatcher (per-call cost); inside
    an autocast region they still get its rule, which the call applies itself before."""
    q, k, v = (torch.randn(1, 45, 2, 32, generator=gen) for _ in range(3))
    with no_autograd(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    with no_autograd():
        expected = flash_attn_func(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=True)
    assert torch.equal(out, expected)


def test_autocast_leaves_other_devices_and_disabled_regions_alone(gen):
    q, k, v = _leaves(gen, (1, 40, 2, 16), (1, 40, 2, 16), (1, 40, 2, 16))
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert flash_attn_func(q, k, v).dtype == torch.float32  # CPU tensors: a CUDA region does not apply
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert flash_attn_func(q, k, v).dtype == torch.float32
    for key in ("AutocastCPU", "AutocastCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("tvmflash::flash_attn_forward", key)


def test_autocast_varlen_and_compiled(gen):
    q, k, v = _leaves(gen, (61, 4, 16), (61, 2, 16), (61, 2, 16))
    cu = torch.tensor([0, 20, 61], dtype=torch.int32)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed = flash_attn_varlen_func(q, k, v, cu, cu, 41, 41, causal=True)
        batched = compiled(q[None], k[None], v[None])
    assert packed.dtype == batched.dtype == torch.bfloat16
    expected = flash_attn_func(*(t.detach().bfloat16()[None] for t in (q, k, v)), causal=True)
    assert torch.equal(batched, expected)


def test_flex_attention_follows_autocast_as_torchs_does(gen):
    """torch's flex_attention under autocast casts query, key and value to the region's dtype and
    nothing else (captured tensors stay fp32): ours too, eager and compiled, with gradients back
    to each leaf in its own dtype."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    from tvmflash import flex_attention

    q, v = _leaves(gen, (2, 4, 37, 16), (2, 4, 45, 16))
    k = torch.randn(2, 4, 45, 16, generator=gen).bfloat16().requires_grad_()  # already bf16: left as it is
    bias = torch.randn(4, generator=gen).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx) / 8

    dout = torch.randn(2, 4, 37, 16, generator=gen).bfloat16()
    compiled = torch.compile(flex_attention, fullgraph=True)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    low_bias = bias.detach().requires_grad_()
    expected = flex_attention(*low, score_mod=lambda s, b, h, i, j: s + low_bias[h] * (i - j) / 8)
    expected.backward(dout)
    for attention in (flex_attention, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention(q, k, v, score_mod=score_mod)
            with torch.no_grad():
                torchs = torch_flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod)
        assert out.dtype == torchs.dtype == torch.bfloat16
        grads = torch.autograd.grad(out, (q, k, v, bias), dout)
        assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
        assert torch.equal(out, expected)
        for g, e in zip(grads, (*low, low_bias)):
            assert torch.equal(g, e.grad.to(g.dtype))
    assert flex_attention(q, k.float(), v, score_mod=score_mod).dtype == torch.float32  # outside the region


def _tiny_llamas(reference: str):
    """Two 2-layer Llamas with the same random weights: on transformers' ``reference``
    attention and on tvmflash's."""
    transformers = pytest.importorskip("transformers")
    from tvmflash.integrations import transformers as tvm_hf

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0,
                                      initializer_range=0.1)
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=tvm_hf.register())
    ours.load_state_dict(other.state_dict())
    return other, ours


def test_transformers_model_under_autocast_gets_attention_in_bf16_like_sdpa(gen, monkeypatch):
    """A Llama under CPU bf16 autocast: the attention runs in bf16 on sdpa and on tvmflash (RoPE
    hands both fp32 q and k), and loss and gradients agree to bf16 accuracy; so do the decode
    steps of a cached forward (the KV-cache kernel, which does not follow autocast itself)."""
    from tvmflash.integrations import transformers as tvm_hf

    sdpa, ours = _tiny_llamas("sdpa")

    seen = []

    def recording(function):
        def wrapper(*args, **kwargs):
            out = function(*args, **kwargs)
            seen.append((function.__name__, args[0].dtype, out.dtype))
            return out
        return wrapper

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        recording(torch.nn.functional.scaled_dot_product_attention))
    monkeypatch.setattr(torch_op, "flash_attn_func", recording(torch_op.flash_attn_func))  # (documents.attention's)

    ids = torch.randint(0, 128, (2, 45), generator=gen)
    results = []
    for model in (sdpa, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))

    names = {name for name, _, _ in seen}
    assert names == {"scaled_dot_product_attention", "flash_attn_func"}, seen
    assert all(out == torch.bfloat16 for _, _, out in seen), seen
    # RoPE hands both fp32 q and k: sdpa casts them to bf16, the integration too, before the call
    assert any(inp == torch.float32 for name, inp, _ in seen if name == "scaled_dot_product_attention"), seen
    assert all(inp == torch.bfloat16 for name, inp, _ in seen if name == "flash_attn_func"), seen
    (loss_s, grads_s), (loss_o, grads_o) = results
    torch.testing.assert_close(loss_o, loss_s, rtol=2e-2, atol=0)
    for name, g in grads_s.items():
        assert grads_o[name].dtype == torch.float32
        rel = ((grads_o[name] - g).norm() / g.norm()).item()
        assert rel < 0.1, f"{name}: gradient differs from sdpa's by {rel:.3g} (relative norm)"

    monkeypatch.setattr(tvm_hf, "flash_attn_with_kvcache", recording(tvm_hf.flash_attn_with_kvcache))
    seen.clear()
    logits = []
    for model in (sdpa, ours):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            prefix = model(input_ids=ids[:, :30], use_cache=True)
            step = model(input_ids=ids[:, 30:31], cache=prefix.cache, use_cache=True)  # (transformers 5's names)
        logits.append(step.logits.float())
    decode = [(inp, out) for name, inp, out in seen if name == "flash_attn_with_kvcache"]
    assert decode and all(inp == out == torch.bfloat16 for inp, out in decode), seen
    rel = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    assert rel < 0.02, f"decode-step logits differ from sdpa's by {rel:.3g} (relative norm)"


@pytest.mark.parametrize("holes", [False, True])
def test_transformers_padded_batch_trains_under_autocast(gen, holes):
    """A padded batch under CPU bf16 autocast: left padding (rows read in place) and a mask with
    holes (the packed path: a gather, the varlen function and a scatter, which once built its
    zeros in q's fp32 and failed on the bf16 output). Loss and gradients agree with the same
    model's without autocast to bf16 accuracy (labels -100 on the padding), and without holes
    with eager's (the last padding position predicts the first real token, and rows that see no
    key take eager's uniform softmax; with holes the padding rows get 0, as flash-attn's unpadding
    gives them, where eager attends from them)."""
    eager, ours = _tiny_llamas("eager")
    ids = torch.randint(1, 128, (3, 33), generator=gen)
    mask = torch.ones(3, 33, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    mask[2, :3] = 0
    if holes:
        mask[2, 15:18] = 0  # pad tokens inside the row
    labels = ids.masked_fill(mask == 0, -100)

    def loss_and_grads(model, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def assert_close(got, want, rtol):
        torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
        for name, g in want[1].items():
            rel = ((got[1][name] - g).norm() / g.norm()).item()
            assert rel < rtol * 5, f"{name}: gradients differ by {rel:.3g} (relative norm)"

    fp32 = loss_and_grads(ours, False)
    assert_close(loss_and_grads(ours, True), fp32, 2e-2)
    if not holes:
        assert_close(fp32, loss_and_grads(eager, False), 1e-5)
