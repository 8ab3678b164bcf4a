"""The fp32 forward's query load and output store as 16 x 16 blocks transposed in registers
(``schedules/llvm_transpose.py``): taken for whole query tiles where inputs, output and products
are fp32 and the tile and head dim are multiples of 16; element loops everywhere else. Against
float64, with q and out strided views into larger poisoned tensors (the helpers take their row
strides at run time) and tiles of 16, 32 and 64 rows, whole and partial."""

from __future__ import annotations

import math

import pytest
import torch

import tvmflash
from conftest import assert_flash_rule, reference_attention, reference_magnitudes
from tvmflash.config import default_cpu_config
from tvmflash.kernels.cpu import Kernel, fused_forward
from tvmflash.schedules import llvm_transpose
from tvmflash.spec import AttentionSpec


@pytest.mark.parametrize("dtype,head_dim,seqlen,taken", [
    ("float32", 64, 40, True), ("float32", 16, 100, True), ("float32", 128, 300, True),
    ("float32", 24, 40, False),  # (head dim not a multiple of 16)
    ("bfloat16", 64, 40, False),  # (bf16 output: the store rounds)
])
def test_which_kernels_transpose_blocks(dtype, head_dim, seqlen, taken):
    spec = AttentionSpec(head_dim, dtype)
    cfg = default_cpu_config("forward", True, seqlen_q=seqlen, seqlen_k=seqlen)
    assert Kernel(spec, cfg, backward=False).block_transposes == taken
    script = fused_forward(spec, cfg).script()
    assert (llvm_transpose.LOAD in script and llvm_transpose.STORE_SCALED in script) == taken
    assert "load_q\"" in script and "store_o\"" in script  # (the element loops: partial tiles, other kernels)


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
