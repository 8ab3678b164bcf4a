"""The FlashAttention claims: O(N) memory and one recompute of P in the backward.

Static checks read the kernels' IR (TVM's own allocation and FLOP analyses at concrete sizes);
the peak-memory check runs fwd+bwd at 16K tokens in a fresh process and reads its high-water mark.
"""

from __future__ import annotations

import pytest

import tvmflash
from tvmflash import analysis, memory


def _sizes(seqlen_q, seqlen_k, n_split=1):
    return dict(batch=1, heads=1, heads_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, n_split=n_split)


def _allocated(funcs, seqlen_q, seqlen_k):
    return [analysis.allocated_bytes(analysis.specialize(f, **_sizes(seqlen_q, seqlen_k))) for f in funcs]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_kernels_allocate_linear_memory(causal):
    """Scaling seqlen_q and seqlen_k by 4 each scales every fused allocation by <= 4, never 16."""
    funcs = analysis.fused_kernels(causal=causal)
    small = _allocated(funcs, 1000, 1500)
    for grown in (_allocated(funcs, 4000, 1500), _allocated(funcs, 1000, 6000), _allocated(funcs, 4000, 6000)):
        for name, a, b in zip(("forward", "backward"), small, grown):
            assert b / a <= 4.0, f"{name}: {a} -> {b} bytes"


def test_standard_attention_allocates_quadratic_memory():
    """The check above can fail: the unfused TE baseline stores N x N matrices."""
    funcs = analysis.standard_kernels()
    small, grown = _allocated(funcs, 1000, 1500), _allocated(funcs, 4000, 6000)
    for a, b in zip(small, grown):
        assert b / a > 14


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_recomputes_p_once(head_dim):
    """FLOPs: backward / forward ~ 2.5 (5 vs 2 matrix products); a second recompute would be ~3.5."""
    fwd, bwd = (analysis.specialize(f, **_sizes(1024, 1024)) for f in analysis.fused_kernels(head_dim=head_dim))
    fwd_flops, bwd_flops = analysis.flops(fwd), analysis.flops(bwd)
    matmul_flops = 4 * 1024 * 1024 * head_dim  # Q K^T and P V
    assert 1.0 <= fwd_flops / matmul_flops < 1.1  # plus mask, max, exp, sums: a few % at d=64
    assert 2.3 <= bwd_flops / fwd_flops <= 2.6, bwd_flops / fwd_flops


def test_peak_memory_of_16k_forward_backward():
    """fwd+bwd at 16K tokens (B=H=1, D=64, fp32) adds well under 256 MB to the process peak.

    Standard attention would hold at least two 16K x 16K fp32 matrices (2 GB)."""
    tvmflash.compile("llvm", head_dim=64, dtype="float32", causal=False)  # warm the disk cache
    added_mb = memory.peak_added_mb("tvmflash", 16384)
    print(f"peak memory added by fwd+bwd at N=16384: {added_mb:.1f} MB")
    assert added_mb < 128


def test_peak_memory_measurement_sees_quadratic_memory():
    """The measurement above can fail: standard attention at 2K adds > 2 N^2 fp32 (32 MB)."""
    assert memory.peak_added_mb("standard", 2048) > 32
