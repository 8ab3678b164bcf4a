"""The PyTorch op: registration (opcheck), torch.compile, layouts, edge sizes, input errors."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_inputs, reference_attention
from tvmflash import flash_attn_func, torch_op

fwd_op = torch.ops.tvmflash.flash_attn_forward.default
bwd_op = torch.ops.tvmflash.flash_attn_backward.default


@pytest.mark.parametrize("window,softcap,alibi", [((-1, 0), 0.0, False), ((5, 3), 12.0, True)],
                         ids=["causal", "window-softcap-alibi"])
def test_opcheck_forward_and_backward(gen, window, softcap, alibi):
    """The ops as torch.library sees them; they have no autograd formula (``_OpAttention``, which
    calls them, has), so their inputs need no gradient here."""
    q, k, v = random_inputs(gen, 1, 20, 33, 4, 2, 64, "float32")
    slopes = torch.rand(4, generator=gen) if alibi else None
    args = (None, None, slopes, 0.125, *window, softcap, False, False, None)
    torch.library.opcheck(fwd_op, (q, k, v, *args))
    out, lse = fwd_op(q, k, v, *args)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(bwd_op, (dout, q, k, v, out, lse, *args))


@pytest.mark.parametrize("variant", [{}, {"window_size": (7, 3), "softcap": 9.0}, {"alibi": True}],
                         ids=["causal", "window-softcap", "alibi"])
def test_torch_compile_fullgraph_matches_eager(gen, variant):
    q, k, v = random_inputs(gen, 2, 40, 40, 2, 1, 64, "float32", requires_grad=True)
    w = torch.randn(2, 40, 2, 64, generator=gen)
    kwargs = dict(variant)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, generator=gen)

    def loss_fn(q, k, v):
        return (flash_attn_func(torch.tanh(q), k, v, causal=True, **kwargs) * w).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager_loss = loss_fn(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    compiled_loss = compiled(q, k, v)
    compiled_grads = torch.autograd.grad(compiled_loss, (q, k, v))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_dynamic_shapes_vmap_and_export_see_the_op(gen):
    """torch.compile(dynamic=True, fullgraph=True) (floats become SymFloats: the checks compare
    them, nothing else), torch.func.vmap and torch.export (tensors without storage) take the op."""
    q, k, v = random_inputs(gen, 2, 17, 17, 4, 2, 32, "float32")

    def attention(q, k, v, scale):
        return flash_attn_func(q, k, v, causal=True, softcap=9.0, softmax_scale=scale)

    compiled = torch.compile(attention, dynamic=True, fullgraph=True, backend="aot_eager")
    for n, scale in ((17, 0.2), (23, 0.3)):
        q2, k2, v2 = random_inputs(gen, 2, n, n, 4, 2, 32, "float32")
        torch.testing.assert_close(compiled(q2, k2, v2, scale), attention(q2, k2, v2, scale))
    batched = torch.func.vmap(lambda q: attention(q, k, v, 0.2))(torch.stack([q, q * 2]))
    assert torch.equal(batched[1], attention(q * 2, k, v, 0.2))

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q, k, v, 0.2)

    exported = torch.export.export(Layer(), (q, k, v))
    torch.testing.assert_close(exported.module()(q, k, v), attention(q, k, v, 0.2))


@pytest.mark.parametrize("op", ["flash_attn_forward", "flash_attn_backward", "flash_attn_documents_forward",
                                "flash_attn_documents_backward", "flash_attn_padded_forward",
                                "flash_attn_padded_backward", "transformers_decode"])
def test_the_ops_have_no_python_autograd_layer(op):
    """The ops inductor's graphs call every layer carry no Python Autograd kernel (custom_op's
    costs ~20-40 us a call warm): their autograd is the Function that calls them (the decode
    op has none: it is taken where no gradient is recorded)."""
    import tvmflash.documents  # noqa: F401  (defines the documents ops)
    import tvmflash.padded  # noqa: F401  (the padded batch's)

    if op == "transformers_decode":
        pytest.importorskip("transformers")
        import tvmflash.integrations.transformers  # noqa: F401

    name = f"tvmflash::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU")


def test_torch_func_grad_and_vjp_match_autograd(gen):
    """torch.func's transforms differentiate through the op path (``_OpAttention`` has the
    setup_context form functorch needs; custom_op's generated Function had not)."""
    q, k, v = random_inputs(gen, 2, 19, 23, 4, 2, 32, "float32", requires_grad=True)
    w = torch.randn(2, 19, 4, 32, generator=gen)

    def loss(q, k, v):
        return (flash_attn_func(q, k, v, causal=True, softcap=5.0) * w).sum()

    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for ours, want in zip(torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v), expected):
        torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    _, vjp = torch.func.vjp(lambda q: flash_attn_func(q, k, v, causal=True, softcap=5.0), q)
    torch.testing.assert_close(vjp(w)[0], expected[0], rtol=0, atol=1e-6)


def test_torch_compile_inductor(gen):
    q, k, v = random_inputs(gen, 1, 30, 30, 2, 2, 64, "float32")
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q * 2, k, v), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q * 2, k, v))


def test_layouts_strided_and_non_contiguous(gen):
    """(batch, heads, seqlen, dim) tensors transposed to flash layout, and a non-unit last stride."""
    q_bhsd, k_bhsd, v_bhsd = (torch.randn(2, 3, 50, 64, generator=gen) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (q_bhsd, k_bhsd, v_bhsd))  # strided views, dim contiguous
    out = flash_attn_func(q, k, v, causal=True)
    expected = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, expected)
    q_odd = torch.randn(2, 50, 3, 128, generator=gen)[..., ::2]  # last-dim stride 2: copied
    ref, _ = reference_attention(q_odd, k, v, False)
    torch.testing.assert_close(flash_attn_func(q_odd, k, v).double(), ref, atol=1e-5, rtol=0)


def test_return_lse_and_default_scale(gen):
    q, k, v = random_inputs(gen, 1, 17, 29, 2, 2, 64, "float32")
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 17) and lse.dtype == torch.float32
    same = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64))
    assert torch.equal(out, same)
    ref_out, ref_lse = reference_attention(q, k, v, False)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_gradient_only_for_some_inputs(gen):
    q, k, v = random_inputs(gen, 1, 20, 20, 2, 2, 64, "float32")
    q.requires_grad_()
    flash_attn_func(q, k, v).sum().backward()
    qd = q.detach().double().requires_grad_()
    ref, _ = reference_attention(qd, k, v, False)
    ref.sum().backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, atol=1e-5, rtol=0)


def test_no_torch_compute_around_the_kernels(gen):
    """forward + backward through autograd run no torch op that computes over tensors (only
    allocation, views, detach): a parallel one would wake torch's OpenMP workers, whose spinning
    then takes cores from our kernels, and a serial one is cold code inside a model (DEVELOPING.md).
    The first lse has 153,600 elements, above torch's parallel grain (2^15), so a zero fill of its
    gradient or a reduction over it would show; the second is a short call's (a repeat, too)."""
    from torch.profiler import ProfilerActivity, profile

    for shape in ((1, 300, 300, 512, 512, 8), (1, 16, 16, 8, 2, 64)):
        q, k, v = random_inputs(gen, *shape, "float32", requires_grad=True)
        dout = torch.randn(q.shape, generator=gen)
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)  # compiled, warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
        ops = {e.key for e in prof.key_averages() if e.key.startswith("aten::")}
        assert ops <= {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::alias", "aten::detach",
                       "aten::to", "aten::resolve_conj", "aten::resolve_neg", "aten::view", "aten::as_strided"}, ops


def test_calls_without_autograd_skip_the_dispatcher_but_not_modes(gen):
    """An inference call runs the op's body directly (torch's custom-op layers cost more than a
    small kernel); the result is the op's, and a dispatch mode (tracing, profiling) still sees
    the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = random_inputs(gen, 2, 37, 53, 4, 2, 64, "float32")
    seen: list[str] = []
    with torch.no_grad():
        direct = flash_attn_func(q, k, v, causal=True)
        with Record():
            traced = flash_attn_func(q, k, v, causal=True)
    via_op = torch.ops.tvmflash.flash_attn_forward(q, k, v, None, None, None, 0.125, -1, 0, 0.0, False, False,
                                                   None)[0]
    assert any("tvmflash.flash_attn_forward" in name for name in seen), seen
    assert torch.equal(direct, traced) and torch.equal(direct, via_op)
    torch.testing.assert_close(direct.double(), reference_attention(q, k, v, causal=True)[0], atol=1e-5, rtol=1e-5)


def test_training_calls_skip_the_op_layers_with_the_ops_results(gen):
    """A call autograd records runs as an autograd Function over the op's own bodies (the op's
    layers cost ~100 us a call); outputs and gradients equal the op's bit for bit, and a mode
    still sees the op (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = random_inputs(gen, 2, 37, 53, 4, 2, 64, "float32", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen)
    direct = flash_attn_func(q, k, v, causal=True)
    assert "tvmflash" not in type(direct.grad_fn.next_functions[0][0]).__name__  # not the op's node
    direct_grads = torch.autograd.grad(direct, (q, k, v), dout)
    via_op, _ = torch_op._OpAttention.apply(q, k, v, None, None, None, 0.125, -1, 0, 0.0, False, False, None)
    assert torch.equal(direct, via_op)
    for ours, op in zip(direct_grads, torch.autograd.grad(via_op, (q, k, v), dout)):
        assert torch.equal(ours, op)
    seen: list[str] = []
    recorded_before = flash_attn_func(q, k, v, causal=True)
    with Record():
        traced = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(traced, (q, k, v), dout)
        torch.autograd.grad(recorded_before, (q, k, v), dout)  # its backward under the mode
    assert "tvmflash.flash_attn_forward.default" in seen
    assert seen.count("tvmflash.flash_attn_backward.default") == 2, seen


def test_a_second_derivative_is_refused_not_dropped(gen):
    """create_graph=True: the gradients stay connected to the inputs and differentiating them
    again raises. Taking them for constants would drop the second-order terms silently."""
    q, k, v = random_inputs(gen, 1, 16, 16, 2, 2, 64, "float32", requires_grad=True)
    dq, = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (dq.pow(2).sum() + q.sum()).backward()


def test_empty_sizes():
    q, k = torch.randn(0, 5, 2, 64), torch.randn(0, 7, 2, 64)
    assert flash_attn_func(q, k, k).shape == (0, 5, 2, 64)
    q, k = torch.randn(1, 5, 2, 64, requires_grad=True), torch.randn(1, 0, 2, 64, requires_grad=True)
    out, lse = flash_attn_func(q, k, k, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.sum().backward()
    assert torch.all(q.grad == 0)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((torch.randn(5, 2, 64),) * 3, {}, ValueError, "q must have 4 dimensions"),
        ((torch.randn(1, 5, 2, 64), torch.randn(2, 5, 2, 64), torch.randn(2, 5, 2, 64)), {}, ValueError, "batch"),
        ((torch.randn(1, 5, 4, 64), torch.randn(1, 5, 3, 64), torch.randn(1, 5, 3, 64)), {}, ValueError, "multiple"),
        ((torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 32), torch.randn(1, 5, 2, 32)), {}, ValueError, "head dims"),
        ((torch.randn(1, 5, 2, 0),) * 3, {}, ValueError, "head_dim 0"),
        ((torch.randn(1, 5, 2, 264),) * 3, {}, ValueError, "head_dim 264"),
        ((torch.randn(1, 5, 2, 64, dtype=torch.float64),) * 3, {}, TypeError, "float64"),
        ((torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 64).half(), torch.randn(1, 5, 2, 64)), {}, TypeError,
         "same dtype"),
        ((torch.ones(1, 5, 2, 64, dtype=torch.int32),) * 3, {}, TypeError, "int32"),
        ((torch.randn(1, 5, 2, 64),) * 3, {"dropout_p": 0.1}, ValueError, "dropout"),
        ((torch.randn(1, 5, 2, 64),) * 3, {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        (([1.0],) * 3, {}, TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*args, **kwargs)
