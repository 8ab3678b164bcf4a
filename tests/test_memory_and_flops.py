"""The FlashAttention claims: O(N) memory at any thread count, one recompute of P per tile pair.

Static checks read the kernels' IR (TVM's own allocation and FLOP analyses at concrete sizes);
the peak-memory checks run fwd+bwd in a fresh process and read its high-water mark.
"""

from __future__ import annotations

import pytest

import tvmflash
from tvmflash import analysis, memory, plan
from tvmflash.config import AMX, BF16_DOT, FP32_FMA


def _allocated(funcs, seqlen_q, seqlen_k, n_threads=2, heads=1, heads_k=1):
    return [analysis.allocated_bytes(analysis.specialize(f, batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                                         heads=heads, heads_k=heads_k, n_threads=n_threads))
            for f in funcs]


def test_fused_kernels_allocate_linear_memory():
    """Scaling seqlen_q and seqlen_k by 4 each scales every fused allocation by <= 4, never 16."""
    funcs = analysis.fused_kernels()
    small = _allocated(funcs, 1000, 1500)
    for grown in (_allocated(funcs, 4000, 1500), _allocated(funcs, 1000, 6000), _allocated(funcs, 4000, 6000)):
        for name, a, b in zip(("forward", "backward"), small, grown):
            assert b / a <= 4.0, f"{name}: {a} -> {b} bytes"


def test_standard_attention_allocates_quadratic_memory():
    """The check above can fail: the unfused TE baseline stores N x N matrices."""
    small, grown = ([analysis.standard_allocated_bytes(f, batch=1, seqlen_q=nq, seqlen_k=nk, heads=1, heads_k=1)
                     for f in analysis.standard_kernels()] for nq, nk in ((1000, 1500), (4000, 6000)))
    for a, b in zip(small, grown):
        assert b / a > 14


@pytest.mark.parametrize("shape", [dict(batch=1, seqlen_q=16384, seqlen_k=16384, heads=8, heads_k=1),
                                   dict(batch=2, seqlen_q=1000, seqlen_k=777, heads=4, heads_k=2),
                                   dict(batch=1, seqlen_q=77, seqlen_k=130, heads=2, heads_k=2)])
@pytest.mark.parametrize("dtype,products", [("float32", FP32_FMA), ("bfloat16", BF16_DOT), ("bfloat16", AMX)])
def test_workspace_formula_is_what_the_kernels_allocate(shape, dtype, products):
    """plan.*_workspace_bytes (what FlashKernels.workspace_bytes reports) equals TVM's own count of
    the kernels' allocations, byte for byte (per-thread buffers once: the analysis counts sites),
    with fp32 FMAs, with bf16 dot products (2-byte operands, P and dS as pair words) and with AMX
    tiles (transposed operands, products adding into the sums: compiled for no CPU here)."""
    seqs = plan.batched(shape["batch"], shape["seqlen_q"], shape["seqlen_k"], block_q=64, block_k=64,
                        heads_k=shape["heads_k"])
    sizes = dict(heads=shape["heads"], heads_k=shape["heads_k"], head_dim=64, block_q=64, block_k=64, threads=1,
                 products=products)
    forward, backward = (analysis.allocated_bytes(analysis.specialize(f, n_threads=1, **shape))
                         for f in analysis.fused_kernels(dtype=dtype, products=products))
    assert forward == plan.forward_workspace_bytes(seqs, **sizes)
    assert backward == plan.backward_workspace_bytes(seqs, **sizes)


@pytest.mark.parametrize("threads", [2, 64, 256])
def test_backward_workspace_is_bounded_at_any_thread_count(threads):
    """Issue 9: B1 N16K H8 H_kv1 D64 fp32, planned for 2, 64 and 256 threads: at most 8 fp32
    copies of q (the split backward of tvmflash 0.1 needed splits + 3: ~130 copies at 64 cores)."""
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="float32")
    q_bytes = 1 * 16384 * 8 * 64 * 4
    workspace = kernels.workspace_bytes("backward", 1, 16384, 16384, 8, 1, num_threads=threads)
    assert workspace <= 8 * q_bytes, workspace / q_bytes
    shared = kernels.workspace_bytes("backward", 1, 16384, 16384, 8, 1, num_threads=1)
    assert workspace - shared < 1e6 * threads  # what grows with threads: each thread's tile buffers
    print(f"{threads} threads: workspace {workspace / q_bytes:.2f} fp32 copies of q")


def test_backward_recomputes_p_once_and_runs_five_products_from_it():
    """Rule 2, read from the kernels' IR: per (query tile, key tile) step the backward evaluates
    the scores product and the probabilities once, and runs five matrix products (S, dV, dP, dK,
    dQ), each 2 * 64 * 64 * D FLOPs; the forward runs two. A second recompute would show as a
    second scores/probs stage and 6 products."""
    for head_dim in (64, 128):
        forward, backward = analysis.fused_kernels(head_dim)
        product = 2.0 * 64 * 64 * head_dim
        fwd, bwd = analysis.pair_flops(forward), analysis.pair_flops(backward)
        assert {n for n, f in fwd.items() if f == product} == {"scores", "pv"}
        assert {n for n, f in bwd.items() if f == product} == {"scores", "dv", "dprobs", "dk", "dq"}
        for name in ("scores", "probs"):
            assert analysis.count_blocks(backward, name) == 1
        assert sum(f for n, f in bwd.items() if f == product) == 5 * product


def test_peak_memory_of_16k_forward_backward():
    """fwd+bwd at 16K tokens (B=H=1, D=64, fp32) adds what workspace_bytes says, and well under
    what standard attention holds (two 16K x 16K fp32 matrices: 2 GB)."""
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="float32", causal=False)  # warm the disk cache
    added_mb = memory.peak_added_mb("tvmflash", 16384)
    planned_mb = max(kernels.workspace_bytes(k, 1, 16384, 16384, 1, 1) for k in ("forward", "backward")) / 2**20
    print(f"peak memory added by fwd+bwd at N=16384: {added_mb:.1f} MB (workspace_bytes: {planned_mb:.1f} MB)")
    assert 0.9 * planned_mb < added_mb < 1.1 * planned_mb + 1
    assert added_mb < 64


def test_peak_memory_measurement_sees_quadratic_memory():
    """The measurement above can fail: standard attention at 2K adds > 2 N^2 fp32 (32 MB)."""
    assert memory.peak_added_mb("standard", 2048) > 32
