"""Under ``torch.autocast`` the flash-attn functions follow it as SDPA does: q, k, v cast to the
region's dtype, the output in that dtype, gradients back to the fp32 leaves."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_matches_reference
from tvmflash import flash_attn_func, flash_attn_varlen_func


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


@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode])
def test_autocast_holds_for_inference_calls(gen, no_autograd):
    """Calls with nothing for autograd to record skip torch's dispatcher (per-call cost): not
    inside an autocast region, whose rule lives in the dispatcher."""
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


def test_transformers_model_under_autocast_gets_attention_in_bf16_like_sdpa(gen, monkeypatch):
    """A Llama under CPU bf16 autocast: the attention output is bf16 on sdpa and on tvmflash (RoPE
    hands both fp32 q and k), and loss and gradients agree to bf16 accuracy."""
    transformers = pytest.importorskip("transformers")
    from tvmflash.integrations import transformers as tvm_hf

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0,
                                      initializer_range=0.1)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=tvm_hf.register())
    ours.load_state_dict(sdpa.state_dict())

    seen = []

    def recording(function):
        def wrapper(*args, **kwargs):
            out = function(*args, **kwargs)
            seen.append((function.__name__, args[0].dtype, out.dtype))
            return out
        return wrapper

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        recording(torch.nn.functional.scaled_dot_product_attention))
    monkeypatch.setattr(tvm_hf, "flash_attn_func", recording(tvm_hf.flash_attn_func))

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
    assert any(inp == torch.float32 for name, inp, _ in seen if name == "flash_attn_func"), seen  # RoPE'd fp32 q
    (loss_s, grads_s), (loss_o, grads_o) = results
    torch.testing.assert_close(loss_o, loss_s, rtol=2e-2, atol=0)
    for name, g in grads_s.items():
        assert grads_o[name].dtype == torch.float32
        rel = ((grads_o[name] - g).norm() / g.norm()).item()
        assert rel < 0.1, f"{name}: gradient differs from sdpa's by {rel:.3g} (relative norm)"
