"""Repeated calls launched from C (``launch.c``): the same results as their Python path, every
call unlike the checked one refused (the full path then checks it), the thread limit shared
with the Python launches, and the Python path where the launcher cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import tvmflash
from conftest import assert_flash_rule, random_inputs, reference_attention, reference_magnitudes
from tvmflash import compiler, flash_attn_func, flash_attn_with_kvcache, kvcache, launch, threads, torch_op

pytestmark = pytest.mark.skipif(launch.module() is None, reason="the C launcher cannot be built here")


def _fresh_memos():
    kvcache.forget_steps()
    torch_op.forget_calls()


def _repeated(fn, times=3):
    """fn()'s results of ``times`` calls (the first checked, the rest repeats), as a list."""
    return [fn() for _ in range(times)]


def _counted(monkeypatch, module, name: str) -> list:
    """A list that grows by one at each call of ``module.name``, which still runs."""
    took, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: took.append(len(took)) or original(*a))
    return took


def _assert_second_derivative_refused(out, q, dout):
    """A create_graph backward gives the gradient of a plain one, and differentiating it again
    raises (the backward op has no autograd formula) rather than dropping the second-order terms."""
    want, = torch.autograd.grad(out, q, dout, retain_graph=True)
    dq, = torch.autograd.grad(out, q, dout, create_graph=True)
    assert torch.equal(dq, want)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (dq.pow(2).sum() + q.sum()).backward()


def _layer_draws(gen, batch: int, n: int, dtype, autocast: bool, layers: int = 3) -> list:
    """Each layer's (q, k, v) as transformers passes them (q a transposed view of its projection,
    k and v heads-first; 8 query heads, 2 kv heads, head dim 64) and the gradient of its out."""
    draws = []
    for _ in range(layers):
        q = torch.randn(batch, n, 8, 64, generator=gen).to(dtype).transpose(1, 2)
        k, v = (torch.randn(batch, 2, n, 64, generator=gen).to(dtype) for _ in range(2))
        dout = torch.randn(batch, n, 8, 64, generator=gen).to(torch.bfloat16 if autocast else dtype)
        draws.append(((q, k, v), dout))
    return draws


def _layer_call(layer, qkv, dout, autocast: bool, mask=None, **kwargs) -> tuple:
    """out and the gradients of q, k, v of the transformers integration's attention function
    (scaling 0.125) on leaves made from ``qkv``, under bf16 autocast or not."""
    from tvmflash.integrations import transformers as tvm_hf

    leaves = [t.detach().requires_grad_() for t in qkv]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = tvm_hf.attention_forward(layer, *leaves, mask, scaling=0.125, **kwargs)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _training(q, k, v, dout, **options):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, **options)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launched_calls_equal_the_python_path_bitwise(gen, dtype, monkeypatch):
    """Forward (no grad, with lse), training (forward and backward) and decode steps: the C
    launches' results are bitwise the Python path's, call after call."""
    q, k, v = random_inputs(gen, 2, 45, 45, 4, 2, 64, dtype)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    k_cache, v_cache = (torch.randn(2, 150, 2, 64, generator=gen).to(q.dtype) for _ in range(2))
    q1 = q[:, :1]

    def run_all():
        with torch.no_grad():
            forward = _repeated(lambda: flash_attn_func(q, k, v, causal=True))
            with_lse = _repeated(lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2])
            decode = _repeated(lambda: flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=97,
                                                               return_softmax_lse=True))
        training = _repeated(lambda: _training(q, k, v, dout, causal=True, window_size=(20, 0)))
        return forward, with_lse, decode, training

    _fresh_memos()
    launched = run_all()
    assert any(isinstance(x, launch.module().Launch) for call in torch_op._calls.values()
               for x in call._scratch.launches.values())
    assert all(isinstance(step._scratch.launch, launch.module().Launch) for step in kvcache._steps.values())
    _fresh_memos()
    monkeypatch.setattr(launch, "make", lambda *args, **kwargs: None)
    python = run_all()
    _fresh_memos()
    for ours, theirs in zip(launched, python):
        for a, b in zip(ours, theirs):
            a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            assert all(x.is_contiguous() for x in a)


def test_a_launch_refuses_every_call_unlike_its_own(gen):
    """A Launch of a checked forward returns None (and writes nothing) for tensors of another
    dtype, shape or strides, a subclass, a meta tensor, a count of arguments, or inputs that
    need a gradient recorded; the public call then takes the full path (the results below)."""
    q, k, v = random_inputs(gen, 1, 40, 40, 4, 4, 64, "float32")
    _fresh_memos()
    with torch.no_grad():
        for _ in range(2):
            want = flash_attn_func(q, k, v, causal=True)
    (call,) = torch_op._calls.values()
    (made,) = call._scratch.launches.values()
    assert torch.equal(made(q, k, v), want)

    class Sub(torch.Tensor):
        pass

    wide = torch.randn(1, 40, 4, 128, generator=gen)[..., :64]  # other strides
    refused = [(q.double(), k, v), (q[:, :39], k, v), (wide, k, v), (q.as_subclass(Sub), k, v),
               (q.to("meta"), k, v), (q, k), (q.requires_grad_(), k, v)]
    for args in refused:
        assert made(*args) is None
    q.requires_grad_(False)
    with torch.no_grad():  # grad mode off: a tensor that requires grad records nothing
        assert torch.equal(made(q.detach().requires_grad_(), k, v), want)
    assert torch.equal(flash_attn_func(wide, k, v, causal=True),
                       flash_attn_func(wide.contiguous(), k, v, causal=True))


def test_decode_launch_checks_the_caches_reach_the_lengths(gen):
    """The decode launch leaves the caches' length free (a growing cache) but not below the
    lengths its tables were planned for: the full path's CapacityError, not a read past the end."""
    q, k_cache, v_cache = (torch.randn(1, n, 2, 64, generator=gen) for n in (1, 100, 100))
    _fresh_memos()
    for _ in range(2):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=90)
    (step,) = kvcache._steps.values()
    assert step._scratch.launch(q, k_cache[:, :89], v_cache[:, :89]) is None
    assert step._scratch.launch(q, k_cache, v_cache[:, :89]) is None
    with pytest.raises(ValueError, match="exceeds"):
        flash_attn_with_kvcache(q, k_cache[:, :89], v_cache[:, :89], cache_seqlens=90)
    grown = torch.cat([k_cache, k_cache[:, :5]], dim=1), torch.cat([v_cache, v_cache[:, :5]], dim=1)
    assert torch.equal(flash_attn_with_kvcache(q, *grown, cache_seqlens=90),
                       flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=90))


def test_decode_launch_checks_the_caches_reach_the_lengths_of_a_grown_step(gen):
    """A step whose lengths grew within their key tile rewrites its tables' ends only; the
    launch's least cache length must follow them (it kept the planned lengths: a 34-key cache
    with cache_seqlens=40 read six rows past its end, silently)."""
    q, k_cache, v_cache = (torch.randn(2, n, 2, 64, generator=gen) for n in (1, 100, 100))
    _fresh_memos()
    for seqlen in (33, 33, 40):  # (checked, the launch made, the ends rewritten)
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlen)
    for cache_seqlens in (40, torch.full((2,), 40, dtype=torch.int32)):
        with pytest.raises(ValueError, match="exceeds"):
            flash_attn_with_kvcache(q, k_cache[:, :34].clone(), v_cache[:, :34].clone(), cache_seqlens=cache_seqlens)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=34)  # (shorter again: a 34-key cache serves)
    short = k_cache[:, :34].clone(), v_cache[:, :34].clone()
    assert torch.equal(flash_attn_with_kvcache(q, *short, cache_seqlens=34),
                       flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=34))


def test_thread_limit_is_shared_with_the_python_launches(gen, monkeypatch):
    """A C launch sets the shim's per-thread limit (a one-unit decode step: 1); the next Python
    launch must set its own, even the value it set last (no memo of it may skip the call)."""
    if not torch_op.kernels_for(torch.randn(1, 2, 1, 64))._on_torch_threads:
        pytest.skip("the kernels run on TVM's pool here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    _fresh_memos()
    try:
        q1, k_cache, v_cache = torch.randn(1, 1, 8, 64), torch.randn(1, 64, 2, 64), torch.randn(1, 64, 2, 64)
        for _ in range(3):  # (its C launch made)
            flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=10)
        monkeypatch.setattr(launch, "make", lambda *args, **kwargs: None)  # forwards in Python from here
        q, k, v = random_inputs(gen, 2, 203, 203, 4, 2, 64, "float32")
        for _ in range(3):
            flash_attn_func(q, k, v, causal=True)  # the Python launch's limit: 2
            assert threads.last_launch()[0] == 2
            flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=10)  # the C launch's: 1
            assert threads.last_launch()[0] == 1
    finally:
        torch.set_num_threads(before)
        _fresh_memos()


def test_two_threads_that_miss_together_load_a_library_once(monkeypatch):
    """Two threads whose first calls need the same kernels load them once: loading a library
    again pointed its parallel launch back at TVM's pool while the other thread ran a kernel of
    it (a segfault, 1 run in 3 of the two-thread tests under xdist)."""
    loads = []
    real = compiler.cache.load

    def slow_load(key, *args, **kwargs):
        loads.append(key)
        time.sleep(0.3)  # both threads miss the memory cache meanwhile
        return real(key, *args, **kwargs)

    def kernels():
        return tvmflash.compile("llvm", head_dim=64, dtype="float32")

    kernels()  # (built and on disk)
    compiler.clear_memory_cache()
    monkeypatch.setattr(compiler.cache, "load", slow_load)
    results = [None, None]
    start = threading.Barrier(2)

    def run(i):
        start.wait()
        results[i] = kernels()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(loads) == 1, loads
    assert results[0] is results[1]


def test_without_the_launcher_calls_keep_their_python_path(tmp_path):
    """No C compiler: one warning, and repeated calls give the results of the full path. (The
    source is changed a little: a launcher built before, from the same source, would serve.)"""
    script = f"""
        import os, pathlib, warnings
        os.environ["CC"] = "{tmp_path}/no-such-cc"
        os.environ["PATH"] = "{tmp_path}"
        import torch
        from tvmflash import c_helpers, flash_attn_func, launch
        source = pathlib.Path("{tmp_path}/launch.c")
        source.write_text(c_helpers.LAUNCH_SOURCE.read_text() + "\\n/* never built */\\n")
        c_helpers.LAUNCH_SOURCE = source
        q, k, v = (torch.randn(1, 70, 2, 64) for _ in range(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                outs = [flash_attn_func(q, k, v) for _ in range(3)]
        print(launch.module() is None, sum("C launcher" in str(w.message) for w in caught),
              all(torch.equal(o, outs[0]) for o in outs))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TVMFLASH_QUIET": "1"}, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["True", "1", "True"], done.stdout + done.stderr


def test_kernels_on_tvms_pool_keep_their_python_path(tmp_path):
    """A torch not on GNU OpenMP (simulated) leaves the kernels on TVM's pool, where each runs in
    fork_safe's Python wrapper while the C launcher loads: a repeated call made a launch of that
    wrapper, and every call after the first raised AttributeError (forward, backward, decode)."""
    script = """
        import torch
        from tvmflash import flash_attn_func, flash_attn_with_kvcache, launch, threads, torch_op
        threads.torch_openmp = lambda: None  # (before any kernel loads: none routed to torch's threads)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 40, 4, 32, generator=g).requires_grad_() for _ in range(3))
        kc, vc = (torch.randn(1, 50, 4, 32, generator=g) for _ in range(2))
        results = []
        for _ in range(3):
            out = flash_attn_func(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            results.append((out.detach(), *grads, flash_attn_with_kvcache(q[:, :1].detach(), kc, vc)))
        same = all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0]))
        print(launch.module() is not None, torch_op.kernels_for(q)._on_torch_threads, same)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TVMFLASH_QUIET": "1"}, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "True"], done.stdout + done.stderr


def test_the_launchers_key_names_the_python_abi_not_its_build(monkeypatch):
    """A prebuilt launcher serves another build of the same Python minor version (its key held
    sys.version, whose build date and compiler differ between two builds of 3.11)."""
    from tvmflash import c_helpers

    before = c_helpers._launch_headers()[1]
    monkeypatch.setattr(sys, "version", sys.version.split(" ")[0] + " (another build) [another compiler]")
    assert c_helpers._launch_headers()[1] == before


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_decode_steps_read_the_heads_first_layout(gen, dtype):
    """generate()'s decode steps reach the kernel in transformers' layout, read in place by the
    step's heads-first launch: the results of the kernel-layout path bitwise, on a growing cache
    and for a model whose steps differ (other heads), and float64's within the flash-attn rule."""
    from tvmflash.integrations import transformers as tvm_hf

    dtype = getattr(torch, dtype)
    layer = _Layer()
    cache = [torch.randn(2, 2, 70, 64, generator=gen).to(dtype) for _ in range(2)]  # (batch, heads_k, n, head_dim)
    _fresh_memos()
    outs = []
    for n in (40, 40, 41, 41, 70):  # checked, repeated, grown...
        q = torch.randn(2, 8, 1, 64, generator=gen).to(dtype)
        k, v = (c[:, :, :n] for c in cache)
        out, _ = tvm_hf.attention_forward(layer, q, k, v, None, scaling=0.125, position_ids=None, use_cache=True)
        want = flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=n,
                                       softmax_scale=0.125, causal=True)
        assert torch.equal(out, want) and out.shape == (2, 1, 8, 64)
        exact = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.125)[0]
        assert (out.double() - exact).abs().max() <= (0.02 if dtype == torch.bfloat16 else 1e-5)
        outs.append(out)
    steps = [s for group in kvcache._steps_by_options.values() for s in group]
    assert any(isinstance(getattr(s._scratch, "heads_first", None), launch.module().Launch) for s in steps)
    # another model's steps (4 kv heads): the same options, another step
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in ((1, 8, 1, 64), (1, 4, 30, 64), (1, 4, 30, 64)))
    for _ in range(3):
        out, _ = tvm_hf.attention_forward(layer, q, k, v, None, scaling=0.125)
        exact = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.125)[0]
        assert (out.double() - exact).abs().max() <= (0.02 if dtype == torch.bfloat16 else 1e-5)


def test_transformers_decode_fast_path_keeps_autocast_and_masks(gen):
    """Under CPU autocast the decode step runs in the region's dtype (as SDPA's), and a step with
    a mask or unknown arguments takes the full path, after steps that took the fast one."""
    from tvmflash.integrations import transformers as tvm_hf

    layer = _Layer()
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((1, 8, 1, 64), (1, 2, 50, 64), (1, 2, 50, 64)))
    _fresh_memos()
    for _ in range(3):
        fp32, _ = tvm_hf.attention_forward(layer, q, k, v, None, scaling=0.125)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = tvm_hf.attention_forward(layer, q, k, v, None, scaling=0.125)
    assert fp32.dtype == torch.float32 and mixed.dtype == torch.bfloat16
    mask = torch.ones(1, 50, dtype=torch.bool)
    mask[0, :10] = False  # left padding
    masked, _ = tvm_hf.attention_forward(layer, q, k, v, mask, scaling=0.125)
    exact = reference_attention(q.transpose(1, 2), k[:, :, 10:].transpose(1, 2), v[:, :, 10:].transpose(1, 2), True,
                                0.125)[0]
    assert (masked.double() - exact).abs().max() <= 1e-5
    sinks = torch.randn(8, generator=gen)  # (gpt-oss's attention sinks: not a step the fast path knows)
    with_sinks, _ = tvm_hf.attention_forward(layer, q, k, v, None, scaling=0.125, s_aux=sinks)
    exact = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.125, sinks=sinks)[0]
    assert (with_sinks.double() - exact).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype,autocast", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_transformers_training_reads_the_heads_first_layout(gen, seed, dtype, autocast, monkeypatch):
    """A training forward's calls reach the kernels in transformers' layout (q a transposed view
    of its projection, k and v heads-first), read in place by heads-first launches forward and
    backward from the third call of a shape on (the first is checked, the second makes the
    launches they are checked against): out and the gradients of the kernel-layout path
    bitwise, call after call, another length among them, under autocast too; float64's within
    the flash-attn rule; a second derivative still refused."""
    from tvmflash.integrations import transformers as tvm_hf

    dtype = getattr(torch, dtype)
    layer = _Layer()
    lengths = (21, 21, 21, 21, 33, 21, 33, 33)
    draws = [draw for n in lengths for draw in _layer_draws(gen, 2, n, dtype, autocast, layers=1)]

    def run():
        return [_layer_call(layer, qkv, dout, autocast, position_ids=None, use_cache=False) for qkv, dout in draws]

    took = _counted(monkeypatch, torch_op, "_apply_launched_training")
    _fresh_memos()
    fast = run()
    calls = [c for group in torch_op._calls_by_options.values() for c in group]
    pairs = [made for c in calls for key, made in c._scratch.launches.items() if key[0] == "heads first"]
    assert pairs and all(isinstance(made, launch.module().Launch) for pair in pairs for made in pair)
    assert len(took) == 4  # (calls 3, 4, 6 and 8)
    _fresh_memos()
    monkeypatch.setattr(tvm_hf, "repeated_heads_first_training", lambda *args: None)
    kernel_layout = run()
    _fresh_memos()
    assert len(took) == 4
    for (qkv, dout), ours, theirs in zip(draws, fast, kernel_layout):
        assert ours[0].shape == (2, qkv[0].shape[2], 8, 64) and all(g.shape == t.shape for g, t in zip(ours[1:], qkv))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    (q, k, v), dout = draws[-1]
    kernel = [t.transpose(1, 2).to(ours[0].dtype) for t in (q, k, v)]
    doubles = [t.double().requires_grad_() for t in kernel]
    ref, ref_lse = reference_attention(*doubles, True, 0.125)
    ref_grads = torch.autograd.grad(ref, doubles, dout.double())
    plain = [t.clone().requires_grad_() for t in kernel]
    same, _ = reference_attention(*plain, True, 0.125, dtype=kernel[0].dtype)
    same_grads = torch.autograd.grad(same, plain, dout)
    ours = fast[-1]
    magnitude = reference_magnitudes(*kernel, dout, 0.125, lse=ref_lse.detach())
    assert_flash_rule("out", ours[0], ref, same, kernel[0].dtype, seed, magnitude=magnitude["out"])
    for name, g, r, p in zip(("dq", "dk", "dv"), ours[1:], ref_grads, same_grads):
        assert_flash_rule(name, g.transpose(1, 2), r, p, kernel[0].dtype, seed, magnitude=magnitude[name])

    monkeypatch.undo()
    _fresh_memos()
    for _ in range(3):  # (the third: heads-first; a create_graph backward takes the backward op)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = tvm_hf.attention_forward(layer, *leaves, None, scaling=0.125)
    _assert_second_derivative_refused(out, leaves[0], dout)
    _fresh_memos()


@pytest.mark.parametrize("dtype,autocast,softcap", [("float32", False, 0.0), ("bfloat16", False, 0.0),
                                                    ("float32", True, 0.0), ("float32", False, 20.0)])
def test_padded_training_layers_repeat_the_first_in_the_heads_first_layout(gen, seed, dtype, autocast, softcap,
                                                                            monkeypatch):
    """A padded training forward's layers share one mask tensor; after the first layer's checked
    call the others repeat it in transformers' layout (``padded.repeated_heads_first_training``):
    out and the gradients of the op's path bitwise, layer after layer, on left padding (the
    blind rows' eager means and gradients added) and right padding, a new mask per forward,
    another length among them, under autocast and softcap too; a mask changed in place between
    layers is read again; the real rows within the flash-attn rule of float64; a second
    derivative still refused."""
    from tvmflash import padded
    from tvmflash.integrations import transformers as tvm_hf

    dtype = getattr(torch, dtype)
    layer = _Layer()

    def mask_of(n, side):
        mask = torch.ones(3, n, dtype=torch.bool)
        for b, pad in enumerate((0, n // 5, n // 2)):
            mask[b, slice(None, pad) if side == "left" else slice(n - pad, None)] = False
        return mask

    forwards = []  # (mask, changed in place after the first layer, the layers' q, k, v and dout)
    for n, side, changed in ((21, "left", False), (21, "right", False), (33, "left", False), (21, "left", True)):
        forwards.append((mask_of(n, side), changed, _layer_draws(gen, 3, n, dtype, autocast)))

    def run():
        results = []
        for mask, changed, draws in forwards:
            mask = mask.clone()  # (a model's mask: a new tensor per forward)
            for i, (qkv, dout) in enumerate(draws):
                if changed and i == 1:
                    mask[1, -1] = False
                results.append(_layer_call(layer, qkv, dout, autocast, mask, softcap=softcap))
        return results

    took = _counted(monkeypatch, torch_op, "_apply_launched_training")
    _fresh_memos()
    fast = run()
    assert len(took) == 2 + 2 + 2 + 1  # (each forward's second and third layer; the changed mask's third)
    _fresh_memos()
    monkeypatch.setattr(padded, "repeated_heads_first_training", lambda *args: None)
    through_op = run()
    _fresh_memos()
    for ours, theirs in zip(fast, through_op):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    (q, k, v), dout = forwards[0][2][-1]
    mask = forwards[0][0]
    kernel = [t.transpose(1, 2).to(fast[2][0].dtype) for t in (q, k, v)]
    counted = (mask | (mask.cumsum(1) == 0))[:, :, None, None]  # real rows and those that see no key

    def eager(dtype):  # transformers' eager: the mask's most negative number, a uniform softmax where it hides all
        leaves = [t.detach().to(dtype).requires_grad_() for t in kernel]
        qh, kh, vh = (t.transpose(1, 2) for t in leaves)
        kh, vh = (t.repeat_interleave(4, dim=1) for t in (kh, vh))
        scores = qh @ kh.mT * 0.125
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        seen = torch.ones(scores.shape[-2:], dtype=torch.bool).tril() & mask[:, None, None, :]
        hidden = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
        out = (torch.softmax(scores + hidden, -1) @ vh).transpose(1, 2)  # (added: the blind rows' gradients flow)
        return out * counted, *torch.autograd.grad(out, leaves, dout.to(dtype) * counted)

    ours = (fast[2][0] * counted, fast[2][1].transpose(1, 2), *(g.transpose(1, 2) for g in fast[2][2:]))
    magnitude = reference_magnitudes(*kernel, dout, 0.125)  # (the size of the terms each result sums)
    for name, got, want, same in zip(("out", "dq", "dk", "dv"), ours, eager(torch.float64), eager(kernel[0].dtype)):
        assert_flash_rule(name, got, want.detach(), same.detach(), kernel[0].dtype, seed, magnitude=magnitude[name])

    monkeypatch.undo()
    _fresh_memos()
    mask = forwards[0][0].clone()
    for _ in range(2):  # (the second: the repeat; a create_graph backward takes the backward op)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = tvm_hf.attention_forward(layer, *leaves, mask, scaling=0.125, softcap=softcap)
    _assert_second_derivative_refused(out, leaves[0], dout)
    _fresh_memos()


@pytest.mark.parametrize("dtype,autocast", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_packed_documents_training_layers_repeat_the_first_in_the_heads_first_layout(gen, dtype, autocast,
                                                                                     monkeypatch):
    """Padding-free training (documents packed into rows, told apart by position_ids): after a
    forward's first layer reads the documents in place, the others repeat its call in
    transformers' layout (``documents.repeated_heads_first_training``): out and the gradients
    bitwise those of the kernel-layout calls and of the packed varlen path, layer after layer,
    new position_ids per forward, another length among them, under autocast too; position_ids
    changed in place between layers are read again; a second derivative still refused."""
    from tvmflash import documents
    from tvmflash.integrations import transformers as tvm_hf

    dtype = getattr(torch, dtype)
    layer = _Layer()

    def positions_of(n, cuts):
        bounds = [0, *cuts, n]
        return torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])] * 2)

    forwards = []  # (position_ids, changed in place after the first layer, the layers' q, k, v and dout)
    for n, cuts, changed in ((29, (5, 17), False), (29, (11,), False), (40, (3, 20, 33), False), (29, (5, 17), True)):
        forwards.append((positions_of(n, cuts), changed, _layer_draws(gen, 2, n, dtype, autocast)))

    def run():
        results = []
        for positions, changed, draws in forwards:
            positions = positions.clone()  # (a model's: a new tensor per forward)
            for i, (qkv, dout) in enumerate(draws):
                if changed and i == 1:
                    positions[1, 8:] -= 8  # (row 1: a document starts at token 8 too)
                results.append(_layer_call(layer, qkv, dout, autocast, position_ids=positions, use_cache=False))
        return results

    took, repeat = [], documents.repeated_heads_first_training
    monkeypatch.setattr(documents, "repeated_heads_first_training",
                        lambda *a, **kw: (lambda out: took.append(out is not None) or out)(repeat(*a, **kw)))
    in_place = _counted(monkeypatch, torch_op, "_apply_launched_training")
    _fresh_memos()
    fast = run()
    assert sum(took) == 2 + 2 + 2 + 1 and len(in_place) == 4 * 3  # (the changed position_ids' third layer)
    _fresh_memos()
    with monkeypatch.context() as m:
        m.setattr(documents, "repeated_heads_first_training", lambda *args, **kwargs: None)
        kernel_layout = run()
        m.setattr(documents, "_in_rows", lambda *args: None)
        packed = run()
    _fresh_memos()
    for ours, in_rows, varlen in zip(fast, kernel_layout, packed):
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ours, in_rows, varlen))

    (q, k, v), dout = forwards[0][2][0]
    positions = forwards[0][0].clone()
    for _ in range(2):  # (the second: the repeat; a create_graph backward takes the backward op)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = tvm_hf.attention_forward(layer, *leaves, None, scaling=0.125, position_ids=positions,
                                              use_cache=False)
    _assert_second_derivative_refused(out, leaves[0], dout)
    _fresh_memos()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_runs_launches_zero_the_rows_outside_the_runs(gen, dtype, monkeypatch):
    """A left-padded batch read in place (row runs, transformers' padded training): the kernels
    write only the runs' rows and the launches zero the rest of out, lse and the gradients
    first, in memory the allocator has just had back full of NaN: bitwise the Python path's
    (torch.zeros), the blind rows' eager means and gradients added alike, call after call."""
    from tvmflash.integrations import transformers as tvm_hf

    dtype = getattr(torch, dtype)
    mask = torch.ones(3, 29, dtype=torch.bool)
    mask[1, :6] = False
    mask[2, :17] = False
    q, k, v = (torch.randn(3, 29, h, 64, generator=gen).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(3, 29, 4, 64, generator=gen).to(dtype)
    opts = {"softmax_scale": 0.125, "causal": True, "window_size": (-1, 0), "softcap": 0.0}

    def poisoned_call():
        for t in (q, k, v, q.float(), k.float()):  # (freed at once: blocks the next allocations of these sizes reuse)
            torch.full_like(t, float("nan"))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = tvm_hf._padded_attention(*leaves, mask, opts)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))

    _fresh_memos()
    launched = _repeated(poisoned_call, 4)
    runs = [c for c in torch_op._calls.values() if c.row_runs is not None]
    assert runs and all(isinstance(made, launch.module().Launch) for c in runs
                        for key, made in c._scratch.launches.items() if key[0] in ("forward", "backward"))
    _fresh_memos()
    monkeypatch.setattr(launch, "make", lambda *args, **kwargs: None)
    python = _repeated(poisoned_call, 4)
    _fresh_memos()
    for ours, theirs in zip(launched, python):
        assert all(torch.isfinite(x.float()).all() for x in ours)
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs))


def test_meta_keys_tell_apart_what_python_tells_apart(gen):
    """The C meta key equals for two calls exactly where Python's attribute reads do."""
    base = torch.randn(2, 12, 4, 64, generator=gen)
    variants = [base, base.clone(), base.double(), base[:, :11], base.transpose(1, 2).contiguous().transpose(1, 2),
                torch.randn(2, 12, 4, 128, generator=gen)[..., :64], base.to("meta"), base.bfloat16(),
                base.unsqueeze(0)]
    c_key, python_key = launch.module().meta_key, launch._python_meta_key
    for a in variants:
        for b in variants:
            assert (c_key(a, base) == c_key(b, base)) == (python_key(a, base) == python_key(b, base))
    assert c_key(base, base.to_sparse()) is None and c_key(base, 3) is None


def test_eager_state_reads_what_the_python_checks_read(gen):
    """launch.eager_state (C and its Python fallback) agrees with _plain_eager and _records_grad,
    and with what each state is: autocast, dispatch and function modes, vmap, grad mode and
    requires_grad."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    q = torch.randn(3, 4, generator=gen)
    p = q.clone().requires_grad_()

    def python(*tensors):
        return 2 if not torch_op._plain_eager("cpu") else int(torch_op._records_grad(tensors))

    def both(*tensors):
        c_state = launch.module().eager_state(torch_op._CPU_EAGER, *tensors)
        assert c_state == launch._python_eager_state(torch_op._CPU_EAGER, *tensors)  # (the fallback)
        return c_state, python(*tensors)

    assert both(q, q) == (0, 0) and both(q, p) == (1, 1)
    with torch.no_grad():
        assert both(q, p) == (0, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert both(q, q) == (2, 2)
    with TorchDispatchMode():
        assert both(q, q) == (2, 2)
    with TorchFunctionMode():
        assert both(q, q) == (2, 2)
    assert torch.vmap(lambda x: torch.tensor(both(q, q)))(torch.ones(2)).tolist() == [[2, 2], [2, 2]]
