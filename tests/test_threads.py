"""One thread pool (tvmflash/threads.py): the CPU kernels' parallel loops run on torch's OpenMP
threads, follow ``torch.set_num_threads``, start no thread of their own, and work after fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from conftest import random_inputs, reference_attention
from tvmflash import flash_attn_func, flash_attn_with_kvcache, threads, torch_op

pytestmark = pytest.mark.skipif(threads.torch_openmp() is None, reason="torch does not run on GNU OpenMP here")


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _attention(gen):
    q, k, v = random_inputs(gen, 2, 203, 203, 4, 2, 64, "float32")  # 8 query tiles per head: work for 2 threads
    return q, k, v, flash_attn_func(q, k, v, causal=True)


def test_kernels_run_on_torch_threads(gen, torch_threads):
    torch.set_num_threads(2)
    q, k, v, _ = _attention(gen)  # compiled, loaded, routed
    assert torch_op.kernels_for(q)._on_torch_threads
    torch.randn(1 << 18).exp_()  # a parallel torch op: torch's OpenMP workers exist
    workers = _os_threads()
    _, _, launches = threads.last_launch()
    out = flash_attn_func(q, k, v, causal=True)
    team, tids, after = threads.last_launch()
    assert after > launches, "the kernel's parallel loop did not go through torch's OpenMP region"
    assert team == 2 and len(set(tids)) == 2
    assert {str(t) for t in tids} <= workers, "tasks ran on threads that are not torch's"
    assert _os_threads() == workers, "the kernel started threads of its own (TVM's pool)"
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=True)[0].double(),
                               atol=1e-5, rtol=1e-5)

    torch.set_num_threads(1)
    single = flash_attn_func(q, k, v, causal=True)
    team, tids, _ = threads.last_launch()
    assert team == 1 and tids == [threading.get_native_id()]
    assert torch.equal(single, out)  # the kernels' results do not depend on the thread count


def test_short_sequence_kernels_run_on_torch_threads(gen, torch_threads):
    """The kernels with tiles for short sequences (compiled at a call's first short length) are
    routed like the others: their tasks run on torch's OpenMP workers, no thread of their own."""
    torch.set_num_threads(2)
    q, k, v = random_inputs(gen, 2, 15, 15, 4, 2, 64, "float32")
    flash_attn_func(q, k, v)  # compiled (or loaded), routed
    kernels = torch_op.kernels_for(q, seqlens=(15, 15))
    assert kernels.configs["forward"].block_q == 16 and kernels._on_torch_threads
    torch.randn(1 << 18).exp_()  # torch's OpenMP workers exist
    workers = _os_threads()
    _, _, launches = threads.last_launch()
    with torch.inference_mode():  # (the repeated-call path too)
        for _ in range(2):
            out = flash_attn_func(q, k, v)
    team, tids, after = threads.last_launch()
    assert after >= launches + 2 and team == 2 and {str(t) for t in tids} <= workers
    assert _os_threads() == workers, "the kernel started threads of its own (TVM's pool)"
    torch.testing.assert_close(out.double(), reference_attention(q, k, v)[0].double(), atol=1e-5, rtol=1e-5)


def test_decode_runs_on_torch_threads(gen, torch_threads):
    torch.set_num_threads(2)
    k_cache = torch.randn(1, 700, 2, 64, generator=gen)
    v_cache = torch.randn(1, 700, 2, 64, generator=gen)
    q = torch.randn(1, 1, 8, 64, generator=gen)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=690)
        _, _, launches = threads.last_launch()
        torch.set_num_threads(1)
        single = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=690)
        team, tids, after = threads.last_launch()
    assert after > launches and team == 1 and tids == [threading.get_native_id()]
    ref = reference_attention(q, k_cache[:, :690], v_cache[:, :690])[0]
    torch.testing.assert_close(single.double(), ref.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(single, out, atol=1e-6, rtol=1e-6)  # other splits: rounding only


def _run(script: str, timeout: float = 300) -> str:
    env = {**os.environ, "TVMFLASH_QUIET": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_kernels_work_in_a_forked_child():
    """GNU libgomp's pool hangs in a forked child (torch's own ops too): the kernels run on the
    child's calling thread instead. The child is killed if it takes more than 60 s."""
    out = _run("""
        import os, signal, time
        import numpy as np, torch
        from tvmflash import flash_attn_func, threads
        torch.set_num_threads(2)
        q, k, v = (torch.randn(1, 203, 4, 64) for _ in range(3))
        parent = flash_attn_func(q, k, v, causal=True)  # libgomp's workers exist now
        assert threads.last_launch()[0] == 2
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a hang ends the child
            child = flash_attn_func(q, k, v, causal=True)
            team = threads.last_launch()[0]
            os._exit(0 if team == 1 and np.array_equal(child.numpy(), parent.numpy()) else 3)
        deadline = time.monotonic() + 90
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise SystemExit("the forked child hung")
            time.sleep(0.05)
        print("child", os.waitstatus_to_exitcode(status))
        again = flash_attn_func(q, k, v, causal=True)  # the parent's pool still works
        print("parent", threads.last_launch()[0], torch.equal(again, parent))
    """)
    assert "child 0" in out and "parent 2 True" in out, out


def test_without_torch_the_kernels_keep_tvms_pool():
    """The compile API without torch (here: its import blocked; tvm_ffi imports torch when it
    is installed) runs the kernels on TVM's thread pool."""
    out = _run("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import numpy as np
        import tvmflash
        kernels = tvmflash.compile("llvm", head_dim=64, dtype="float32")
        q = np.random.default_rng(0).standard_normal((1, 100, 2, 64), dtype=np.float32)
        out, lse = np.empty_like(q), np.empty((1, 2, 100), np.float32)
        kernels.forward(q, q, q, out, lse)
        print(sys.modules["torch"] is not None, kernels._on_torch_threads, np.isfinite(out).all())
    """)
    assert out.split() == ["False", "False", "True"], out


def test_without_a_c_compiler_the_kernels_keep_tvms_pool(tmp_path):
    """The shim cannot be built: one warning, and the kernels run on TVM's pool, correctly. (Its
    source is changed a little: a shim built before, from the same source, would serve.)"""
    out = _run(f"""
        import os, pathlib, warnings
        os.environ["CC"] = "{tmp_path}/no-such-cc"
        os.environ["PATH"] = "{tmp_path}"
        import torch
        from tvmflash import c_helpers, flash_attn_func, torch_op
        source = pathlib.Path("{tmp_path}/threads.c")
        source.write_text(c_helpers.THREADS_SOURCE.read_text() + "\\n/* never built */\\n")
        c_helpers.THREADS_SOURCE = source
        q, k, v = (torch.randn(1, 70, 2, 64) for _ in range(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = flash_attn_func(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        print(torch_op.kernels_for(q)._on_torch_threads, sum("TVM's thread pool" in str(w.message) for w in caught),
              torch.allclose(out, ref.transpose(1, 2), atol=1e-5))
    """)
    assert out.split() == ["False", "1", "True"], out
