"""Shared test helpers: float64 reference attention, the flash-attn tolerance rule, random shapes.

Every test draws fresh random inputs. The seed is printed with each failure; set
TVMFLASH_TEST_SEED=<seed> to replay one.
"""

from __future__ import annotations

import os
import secrets
import threading

import pytest
import torch

import tvmflash
from tvmflash.reference import (flash_rule, reference_attention, reference_magnitudes,  # noqa: F401 - re-exported
                                window_mask)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("TVMFLASH_TEST_SEED", secrets.randbits(31)))
    print(f"random seed: {value} (replay with TVMFLASH_TEST_SEED={value})")  # shown on failure
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def kernels_d32():
    """This CPU's fp32 kernels for head dim 32 (full and causal: masks are per call)."""
    return tvmflash.compile("llvm", head_dim=32, dtype="float32")


def causal_mask(seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    return window_mask(seqlen_q, seqlen_k, causal=True)


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def assert_flash_rule(name: str, ours, ref64, same_dtype, dtype: torch.dtype, seed: int, ulps: float = 4.0,
                      magnitude: float = 1.0):
    """``tvmflash.reference.flash_rule`` as an assertion (the seed in the message)."""
    result = flash_rule(ours, ref64, same_dtype, dtype, magnitude, ulps)
    assert "error" not in result, f"{name}: {result.get('error')} (seed {seed})"
    assert result["ok"], (f"{name}: max error {result['err']:.3g} > 2 x PyTorch's {result['err_torch']:.3g} + "
                          f"{ulps} ulp(={result['bound']:.3g}) (seed {seed})")


def in_two_threads(run) -> None:
    """run(0) and run(1) at once, each on a thread of its own."""
    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def count_calls(monkeypatch, owner, name: str) -> list:
    """``owner.name`` replaced by a wrapper that calls it and appends 1 to the returned list."""
    calls, original = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def random_inputs(gen: torch.Generator, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype,
                  requires_grad=False):
    def draw(*shape):
        t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(DTYPES.get(dtype, dtype))
        return t.requires_grad_(requires_grad)

    return (draw(batch, seqlen_q, heads, head_dim), draw(batch, seqlen_k, heads_k, head_dim),
            draw(batch, seqlen_k, heads_k, head_dim))


def assert_matches_reference(tag: str, inputs, results, causal: bool, seed: int, scale=None, **variant):
    """out, lse, dq, dk, dv of (q, k, v, dout) vs float64, by the flash-attn rule (each tensor).
    ``variant``: reference_attention's window_size / softcap / alibi_slopes."""
    q, k, v, dout = (t.detach() for t in inputs)
    dtype = q.dtype
    ref = {}
    for name, dt in (("f64", torch.float64), ("same", dtype)):
        leaves = [t.to(dt, copy=True).requires_grad_() for t in (q, k, v)]
        o, lse_ref = reference_attention(*leaves, causal, scale, dtype=dt, **variant)
        ref[name] = (o, lse_ref, *torch.autograd.grad(o, leaves, dout.to(dt)))
    magnitude = reference_magnitudes(q, k, v, dout, scale, lse=ref["f64"][1].detach())
    for i, (name, ours) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), results)):
        f64, same = ref["f64"][i].detach(), ref["same"][i].detach()
        if name == "lse":  # -inf rows (no visible key) must match exactly; compare the rest
            finite = torch.isfinite(f64)
            assert torch.equal(torch.isfinite(ours), finite), f"{tag}: lse -inf pattern differs (seed {seed})"
            ours, f64, same = ours[finite], f64[finite], same[finite]
            if ours.numel() == 0:
                continue
            assert_flash_rule(f"{tag} lse", ours, f64, same, torch.float32, seed, magnitude=magnitude["lse"])
            continue
        assert ours.dtype == dtype and ours.shape == f64.shape
        assert_flash_rule(f"{tag} {name}", ours, f64, same, dtype, seed, magnitude=float(magnitude.get(name, 1.0)))
