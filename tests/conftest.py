"""Shared test helpers: float64 reference attention, the flash-attn tolerance rule, random shapes.

Every test draws fresh random inputs. The seed is printed with each failure; set
TVMFLASH_TEST_SEED=<seed> to replay one.
"""

from __future__ import annotations

import math
import os
import secrets

import pytest
import torch

from tvmflash.reference import reference_attention, window_mask  # noqa: F401 - re-exported for the tests

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("TVMFLASH_TEST_SEED", secrets.randbits(31)))
    print(f"random seed: {value} (replay with TVMFLASH_TEST_SEED={value})")  # shown on failure
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_mask(seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    return window_mask(seqlen_q, seqlen_k, causal=True)


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def assert_flash_rule(name: str, ours, ref64, same_dtype, dtype: torch.dtype, seed: int, ulps: float = 4.0,
                      magnitude: float = 1.0):
    """error(ours vs float64) <= 2 * error(plain PyTorch in the same dtype) + a few ulps.

    The ulps are those of the largest value involved: the result, or ``magnitude``, the size of
    the terms summed or cancelled on the way to it. FlashAttention rounds differently from plain
    attention at exactly those places: it recomputes P from the fp32 LSE (a relative error of a
    few ulps on every P, times the rows of V or dO it weights), and dS = P (dP - Delta)
    subtracts two numbers of size |dO| |V| even where the gradient is ~0.
    """
    assert not torch.isnan(ours).any(), f"{name}: NaN in the result (seed {seed})"
    scale = max(1.0, magnitude, ref64.abs().max().item())
    err = (ours.double() - ref64).abs().max().item()
    err_torch = (same_dtype.double() - ref64).abs().max().item()
    bound = 2 * err_torch + ulps * ulp(dtype) * scale
    assert err <= bound, (
        f"{name}: max error {err:.3g} > 2 x PyTorch's {err_torch:.3g} + {ulps} ulp(={bound:.3g}) (seed {seed})"
    )


def random_inputs(gen: torch.Generator, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype,
                  requires_grad=False):
    def draw(*shape):
        t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(DTYPES.get(dtype, dtype))
        return t.requires_grad_(requires_grad)

    return (draw(batch, seqlen_q, heads, head_dim), draw(batch, seqlen_k, heads_k, head_dim),
            draw(batch, seqlen_k, heads_k, head_dim))


def reference_magnitudes(q, k, v, dout, scale=None) -> dict:
    """Size of the terms summed or cancelled on the way to each result (an upper bound under any
    mask: masks only remove terms): out averages rows of v, dv sums P-weighted rows of dO;
    dS = P (dP - Delta) subtracts two dot products dO . v and dO . o whose rounding scales with
    sum_d |dO_d v_d|, which dq and dk then scale by |k| and |q|."""
    group = q.shape[2] // k.shape[2]
    dp = torch.einsum("bihd,bjhd->bhij", dout.double().abs(), v.double().abs().repeat_interleave(group, 2)).max()
    sm_scale = scale or q.shape[-1] ** -0.5
    return {"out": float(v.abs().max()), "lse": 1.0, "dv": float(dout.abs().max()),
            "dq": float(sm_scale * dp * k.abs().max()), "dk": float(sm_scale * dp * q.abs().max())}


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
    magnitude = reference_magnitudes(q, k, v, dout, scale)
    for i, (name, ours) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), results)):
        f64, same = ref["f64"][i].detach(), ref["same"][i].detach()
        if name == "lse":  # -inf rows (no visible key) must match exactly; compare the rest
            finite = torch.isfinite(f64)
            assert torch.equal(torch.isfinite(ours), finite), f"{tag}: lse -inf pattern differs (seed {seed})"
            ours, f64, same = ours[finite], f64[finite], same[finite]
            if ours.numel() == 0:
                continue
            assert_flash_rule(f"{tag} lse", ours, f64, same, torch.float32, seed)
            continue
        assert ours.dtype == dtype and ours.shape == f64.shape
        assert_flash_rule(f"{tag} {name}", ours, f64, same, dtype, seed, magnitude=float(magnitude.get(name, 1.0)))
