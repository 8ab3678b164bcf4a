"""Thread count: results are bitwise independent of it, and TVMFLASH_NUM_THREADS is used and
validated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tvmflash
from conftest import random_inputs


@pytest.mark.parametrize("batch, heads, heads_k", [(1, 4, 1), (2, 6, 2)])
def test_results_do_not_depend_on_the_thread_count(gen, batch, heads, heads_k):
    """Every count deals the tasks its own way: a block of heads per thread where the threads
    divide the heads (forward: the query heads; backward: the kv heads), else cyclically."""
    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    q, k, v = random_inputs(gen, batch, 700, 650, heads, heads_k, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    results = []
    for threads in (1, 2, 3, 4, 7, 64):
        out, lse = torch.full_like(q, float("nan")), torch.full((batch, heads, 700), float("nan"))
        kernels.forward(q, k, v, out, lse, causal=True, num_threads=threads)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        kernels.backward(dout, q, k, v, out, lse, *grads, causal=True, num_threads=threads)
        results.append([out, lse, *grads])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_thread_count_setting_is_used_and_validated():
    script = ("import os, tvmflash; from tvmflash import settings; "
              "print(settings.num_threads(), os.environ['TVM_NUM_THREADS'])")
    env = {**os.environ, "TVMFLASH_NUM_THREADS": "3"}
    env.pop("TVM_NUM_THREADS", None)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout.split() == ["3", "3"], run.stderr
    env["TVMFLASH_NUM_THREADS"] = "lots"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0 and "TVMFLASH_NUM_THREADS='lots' is not a thread count" in run.stderr
