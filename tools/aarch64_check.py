"""Correctness of the CPU kernels on aarch64, run under qemu-user by ``tools/aarch64_test.sh``.

Only TVM and numpy are needed (no torch): the kernels are compiled here for this (emulated)
CPU and called on DLPack arrays; references are float64 numpy. Cases: fp32 forward+backward
(full and causal), GQA, varlen forward, and bf16 inputs (BFDOT products where the target has
FEAT_BF16). Speed under emulation means nothing.
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np
import tvm

import tvmflash
from tvmflash import target as targets

RNG = np.random.default_rng(0)


def reference(q, k, v, causal, dout=None):
    """float64 attention over (seq, heads, dim) arrays (GQA: heads of k/v repeat)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool), s.shape[2] - s.shape[1]), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p, v)
    if dout is None:
        return out, lse
    do = np.asarray(dout, np.float64)
    dv = np.einsum("hqk,qhd->khd", p, do)
    dp = np.einsum("qhd,khd->hqk", do, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("hqk,khd->qhd", ds, k)
    dk = np.einsum("hqk,qhd->khd", ds, q)
    sumk = lambda x: x.reshape(x.shape[0], -1, group, x.shape[-1]).sum(2)  # noqa: E731
    return out, lse, dq, sumk(dk), sumk(dv)


def arr(x, dtype="float32"):
    x = np.ascontiguousarray(x)
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16)
    else:
        x = x.astype(dtype)
    return tvm.runtime.tensor(x)


def err(got, want):
    return float(np.max(np.abs(np.asarray(got.numpy(), np.float64) - want)))


def check(name, value, limit):
    ok = value <= limit
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max err {value:.2e} (limit {limit:.0e})", flush=True)
    return ok


def case(kernels, sq, sk, h, hk, d, causal, dtype, backward, tol):
    q, k, v, do = (RNG.standard_normal(s).astype(np.float32) for s in ((sq, h, d), (sk, hk, d), (sk, hk, d), (sq, h, d)))
    if dtype == "bfloat16":  # the references see the rounded inputs
        q, k, v, do = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v, do))
    want = reference(q, k, v, causal, do if backward else None)
    out, lse = arr(np.zeros((1, sq, h, d)), dtype), arr(np.zeros((1, h, sq)))
    args = [arr(x[None], dtype) for x in (q, k, v)]
    kernels.forward(*args, out, lse, causal=causal)
    tag = f"{dtype} {'causal' if causal else 'full'} sq={sq} sk={sk} h={h}/{hk} d={d}"
    ok = check(f"forward {tag} out", err(out, want[0][None]), tol)
    ok &= check(f"forward {tag} lse", err(lse, want[1][None]), tol)
    if backward:
        grads = [arr(np.zeros(x[None].shape), dtype) for x in (q, k, v)]
        kernels.backward(arr(do[None], dtype), *args, out, lse, *grads, causal=causal)
        for gname, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
            ok &= check(f"backward {tag} {gname}", err(got, ref[None]), tol * 4)
    return ok


def varlen(kernels, tol):
    """Two packed sequences (40 and 30 rows), causal, forward + backward."""
    lens, h, d = (40, 30), 2, 32
    q, k, v, do = (RNG.standard_normal((sum(lens), h, d)).astype(np.float32) for _ in range(4))
    cu = np.array([0, lens[0], sum(lens)], np.int32)
    wants = [reference(q[a:b], k[a:b], v[a:b], True, do[a:b]) for a, b in zip(cu[:-1], cu[1:])]
    want = [np.concatenate([w[i] for w in wants], axis=1 if i == 1 else 0) for i in range(5)]
    out, lse = arr(np.zeros((1, sum(lens), h, d))), arr(np.zeros((1, h, sum(lens))))
    args = [arr(x[None]) for x in (q, k, v)]
    kernels.forward(*args, out, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ok = check("forward varlen causal out", err(out, want[0][None]), tol)
    ok &= check("forward varlen causal lse", err(lse, want[1][None]), tol)
    grads = [arr(np.zeros(x[None].shape)) for x in (q, k, v)]
    kernels.backward(arr(do[None]), *args, out, lse, *grads, causal=True, cu_seqlens_q=cu,
                     cu_seqlens_k=cu)
    for gname, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        ok &= check(f"backward varlen causal {gname}", err(got, ref[None]), tol * 4)
    return ok


def main() -> int:
    t0 = time.time()
    target = targets.resolve("llvm")
    print(f"target: {target}", flush=True)
    print(f"cpuinfo features: {sorted(targets.host_isa_features() or [])}", flush=True)
    ok = True
    compile_s = 0.0
    dtypes = sys.argv[1:] or ["float32", "bfloat16"]
    for dtype, tol in (("float32", 5e-6), ("bfloat16", 1e-2)):
        if dtype not in dtypes:
            continue
        c0 = time.time()
        kernels = tvmflash.compile("llvm", head_dim=32, dtype=dtype, cache=False, tuned=False)
        compile_s += time.time() - c0
        print(f"{dtype}: {kernels}, configs {({n: (c.products, c.lanes) for n, c in kernels.configs.items()})}, "
              f"compiled in {time.time() - c0:.0f} s", flush=True)
        want = "bf16_dot" if dtype == "bfloat16" and targets.supports_bf16_dot(target) else "fp32_fma"
        ok &= check(f"{dtype} products are {want} (BFDOT where FEAT_BF16)",
                    float(any(c.products != want for c in kernels.configs.values())), 0)
        ok &= case(kernels, 70, 70, 2, 2, 32, False, dtype, True, tol)  # a whole 64-row tile (block transposes)
        ok &= case(kernels, 40, 72, 4, 2, 32, True, dtype, True, tol)  # causal, GQA, sq != sk
        if dtype == "float32":
            ok &= varlen(kernels, tol)
    print(f"{'PASSED' if ok else 'FAILED'} in {time.time() - t0:.0f} s ({compile_s:.0f} s compiling)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
