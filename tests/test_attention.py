"""Correctness of flash_attn_func (forward and gradients) against a float64 reference.

The rule is flash-attn's: our error vs float64 <= 2 x the error of plain PyTorch attention in
the same dtype, plus a few ulps. Shapes are drawn at random per run (odd lengths, seqlen 1,
seqlen_q != seqlen_k both ways, GQA/MQA), so every run checks sizes that are no multiple of any
tile size.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, random_inputs
from tvmflash import flash_attn_func

# (dtype, head_dim, causal): every dtype with and without mask at the common head dim, and head
# dims from 32 to 256 (40: not a multiple of the 16-float vector width).
VARIANTS = [
    ("float32", 64, False),
    ("float32", 64, True),
    ("float16", 64, False),
    ("float16", 64, True),
    ("bfloat16", 64, False),
    ("bfloat16", 64, True),
    ("float32", 32, True),
    ("float16", 40, False),
    ("bfloat16", 128, True),
    ("float32", 256, False),
]


def draw_shape(gen: torch.Generator):
    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    heads_k = randint(1, 3)
    lengths = [1, randint(2, 9), randint(10, 150), randint(150, 300)]
    seqlen_q = lengths[randint(0, 3)]
    seqlen_k = lengths[randint(0, 3)]
    return dict(batch=randint(1, 2), seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads_k * randint(1, 3),
                heads_k=heads_k)


def check_against_reference(shape: dict, dtype: str, head_dim: int, causal: bool, gen, seed, scale=None):
    q, k, v = random_inputs(gen, head_dim=head_dim, dtype=dtype, requires_grad=True, **shape)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)

    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_reference(f"{shape} {dtype} d={head_dim} causal={causal}", (q, k, v, dout),
                             (out, lse, dq, dk, dv), causal, seed, scale)


@pytest.mark.parametrize("dtype,head_dim,causal", VARIANTS)
def test_random_shapes(dtype, head_dim, causal, gen, seed):
    for _ in range(3):
        check_against_reference(draw_shape(gen), dtype, head_dim, causal, gen, seed)


@pytest.mark.parametrize(
    "shape",
    [
        dict(batch=1, seqlen_q=1, seqlen_k=1, heads=1, heads_k=1),  # smallest problem
        dict(batch=2, seqlen_q=64, seqlen_k=128, heads=4, heads_k=4),  # exact tile multiples
        dict(batch=1, seqlen_q=65, seqlen_k=127, heads=2, heads_k=1),  # one past / short of a tile
        dict(batch=1, seqlen_q=37, seqlen_k=300, heads=6, heads_k=2),  # causal with seqlen_q < seqlen_k
        dict(batch=1, seqlen_q=200, seqlen_k=70, heads=3, heads_k=1),  # causal: first rows see no key (MQA)
        dict(batch=3, seqlen_q=1, seqlen_k=257, heads=8, heads_k=2),  # decoding-like single query
    ],
    ids=["1x1", "tile-multiples", "tile-plus-minus-1", "q-shorter", "q-longer-mqa", "single-query"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_edge_shapes(shape, causal, gen, seed):
    check_against_reference(shape, "float32", 64, causal, gen, seed)


def test_rows_without_keys_are_zero_not_nan(gen):
    """Causal, seqlen_q > seqlen_k: the first rows see no key: out = 0, lse = -inf, grads 0."""
    q, k, v = random_inputs(gen, 1, 100, 30, 2, 2, 64, "float32", requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    blind = 100 - 30  # rows 0..69 see no key
    assert torch.all(out[:, :blind] == 0) and torch.all(lse[:, :, :blind] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, blind:]).all()
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert torch.all(q.grad[:, :blind] == 0)


def test_softmax_scale(gen, seed):
    shape = dict(batch=1, seqlen_q=50, seqlen_k=80, heads=2, heads_k=2)
    check_against_reference(shape, "float32", 64, True, gen, seed, scale=0.37)


def test_long_sequence_accumulation(gen, seed):
    """Errors that grow with length (fp16 stats, fp16 accumulators) would show at 2K keys."""
    shape = dict(batch=1, seqlen_q=300, seqlen_k=2049, heads=1, heads_k=1)
    check_against_reference(shape, "bfloat16", 64, False, gen, seed)
