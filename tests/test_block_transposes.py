"""16 x 16 blocks transposed in registers (``schedules/llvm_transpose.py``): the fp32 forward's
query load and output store, the backward's K^T and V^T packs; taken for whole tiles where inputs
(and the forward's output) and products are fp32 and the tile and head dim are multiples of 16;
element loops everywhere else. Against float64, with q, v and out strided views into larger
poisoned tensors (the helpers take their row strides at run time) and tiles of 16, 32 and 64
rows, whole and partial; and the schedules must leave the module they start from as it was
(MetaSchedule replays their traces on it)."""

from __future__ import annotations

import math

import pytest
import torch
import tvm
from tvm import s_tir

import tvmflash
from conftest import assert_flash_rule, assert_matches_reference, reference_attention, reference_magnitudes
from tvmflash.config import default_cpu_config
from tvmflash.kernels.cpu import Kernel, fused_backward, fused_forward
from tvmflash.schedules import llvm as llvm_schedules
from tvmflash.schedules import llvm_transpose
from tvmflash.spec import AttentionSpec


@pytest.mark.parametrize("dtype,head_dim,seqlen,taken", [
    ("float32", 64, 40, True), ("float32", 16, 100, True), ("float32", 128, 300, True),
    ("float32", 24, 40, False),  # (head dim not a multiple of 16)
    ("bfloat16", 64, 40, False),  # (bf16 output: the store rounds)
])
def test_which_kernels_transpose_blocks(dtype, head_dim, seqlen, taken):
    spec = AttentionSpec(head_dim, dtype)
    for kernel, build in (("forward", fused_forward), ("backward", fused_backward)):
        cfg = default_cpu_config(kernel, True, seqlen_q=seqlen, seqlen_k=seqlen)
        assert Kernel(spec, cfg, backward=kernel == "backward").block_transposes == taken
        func = build(spec, cfg)
        script = func.script()
        assert (llvm_transpose.LOAD in script) == taken
        # the element loops stay for partial tiles and other kernels
        names = ("load_q", "store_o") if kernel == "forward" else ("pack_vt",)
        assert all(f'"{name}"' in script for name in names)
        # scheduling leaves the module it starts from unchanged (an `if` between scheduled
        # blocks outside an opaque parent of its own was edited in place: DEVELOPING.md)
        mod = tvm.IRModule({"main": func})
        before = mod.script()
        llvm_schedules.SCHEDULES[kernel](s_tir.Schedule(mod), cfg)
        assert mod.script() == before, f"scheduling the {kernel} edited its module in place"


@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", [
    (16, 16, 64),  # one whole 16-row tile
    (40, 40, 64),  # two whole 16-row tiles and a partial one
    (77, 90, 32),  # 32-row tiles, the last partial
    (300, 300, 128),  # 64-row tiles, two 16 x 16 blocks along the query tile, eight along the head dim
])
@pytest.mark.parametrize("causal", [False, True])
def test_block_transposes_match_float64_with_strided_q_and_out(gen, seed, seqlen_q, seqlen_k, head_dim, causal):
    heads, heads_k, batch = 4, 2, 2
    kernels = tvmflash.compile("llvm", head_dim=head_dim, dtype="float32", seqlen=(seqlen_q, seqlen_k))
    # q and out: every third head of wider tensors, so their row stride is not heads x head_dim
    q_wide = torch.randn(batch, seqlen_q, 3 * heads, head_dim, generator=gen)
    q = q_wide[:, :, ::3]
    k, v = (torch.randn(batch, seqlen_k, heads_k, head_dim, generator=gen) for _ in range(2))
    out_wide = torch.full((batch, seqlen_q, 3 * heads, head_dim), math.nan)
    out = out_wide[:, :, 1::3]
    lse = torch.full((batch, heads, seqlen_q), math.nan)
    kernels.forward(q, k, v, out, lse, causal=causal)

    untouched = torch.ones(3 * heads, dtype=torch.bool)
    untouched[1::3] = False
    assert out_wide[:, :, untouched].isnan().all(), "the store wrote outside out's rows"
    leaves = (q.contiguous(), k, v)
    want, want_lse = reference_attention(*leaves, causal)  # (float64)
    same, same_lse = reference_attention(*leaves, causal, dtype=torch.float32)
    magnitude = reference_magnitudes(*leaves, torch.zeros_like(q), lse=want_lse)
    assert_flash_rule("out", out, want, same, torch.float32, seed, magnitude=magnitude["out"])
    assert_flash_rule("lse", lse, want_lse, same_lse, torch.float32, seed, magnitude=magnitude["lse"])


@pytest.mark.parametrize("seqlen", [40, 150])  # 16- and 32-row tiles, the last partial
def test_backward_packs_with_strided_v(gen, seed, seqlen):
    heads, heads_k, head_dim = 4, 2, 64
    kernels = tvmflash.compile("llvm", head_dim=head_dim, dtype="float32", seqlen=seqlen)
    q, k, dout = (torch.randn(1, seqlen, h, head_dim, generator=gen) for h in (heads, heads_k, heads))
    v = torch.randn(1, seqlen, 3 * heads_k, head_dim, generator=gen)[:, :, ::3]  # rows at a stride of 3 heads
    out, lse = torch.empty(q.shape), torch.empty(1, heads, seqlen)
    kernels.forward(q, k, v, out, lse, causal=True)
    grads = [torch.full(t.shape, math.nan) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads, causal=True)
    assert_matches_reference(f"seqlen {seqlen}", (q, k, v, dout), (out, lse, *grads), True, seed)
