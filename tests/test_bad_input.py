"""Unusual or wrong inputs get a clear error naming the problem: read-only, empty or strided arrays,
sparse tensors, non-bool flags, non-integer head dims, and outputs that alias the inputs or
themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tvmflash


def test_clear_errors_for_unusual_inputs(kernels_d32):
    q = np.random.randn(1, 8, 1, 32).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((1, 1, 8), np.float32)
    readonly = q.copy()
    readonly.setflags(write=False)
    with pytest.raises(ValueError, match="q is a read-only array"):
        kernels_d32.forward(readonly, q, q, out, lse)
    empty = np.empty((1, 0, 1, 32), np.float32)
    with pytest.raises(ValueError, match="q is empty"):
        kernels_d32.forward(empty, q, q, np.empty_like(empty), np.empty((1, 1, 0), np.float32))
    strided_lse = np.empty((1, 8, 2), np.float32)[:, :, :1].transpose(0, 2, 1)
    with pytest.raises(ValueError, match="lse must be contiguous"):
        kernels_d32.forward(q, q, q, out, np.ascontiguousarray(np.empty((1, 1, 16), np.float32))[:, :, ::2])
    assert strided_lse.shape == (1, 1, 8)
    sparse = torch.randn(1, 8, 1, 32).to_sparse()
    with pytest.raises(TypeError, match="to_dense"):
        tvmflash.flash_attn_func(sparse, sparse, sparse)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tvmflash.flash_attn_func(torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32),
                                 causal="False")
    with pytest.raises(TypeError, match="causal must be True or False"):
        tvmflash.compile("llvm", 32, "float32", causal="False")


def test_numpy_integer_head_dim_is_accepted():
    assert tvmflash.compile("llvm", head_dim=np.int64(32), dtype="float32").head_dim == 32
    with pytest.raises(TypeError, match="head_dim must be an integer"):
        tvmflash.compile("llvm", head_dim=32.0, dtype="float32")


def test_outputs_that_alias_inputs_or_themselves_are_rejected(kernels_d32):
    q, k, v = (torch.randn(1, 8, 1, 32) for _ in range(3))
    lse = torch.empty(1, 1, 8)
    with pytest.raises(ValueError, match="out overlaps q"):
        kernels_d32.forward(q, k, v, q, lse)
    with pytest.raises(ValueError, match="overlapping elements"):
        kernels_d32.forward(q, k, v, torch.empty(1, 1, 1, 32).expand(1, 8, 1, 32), lse)
    packed = torch.randn(1, 8, 2, 1, 32)
    with pytest.raises(ValueError, match="dq overlaps"):
        kernels_d32.backward(q, q, k, v, q.clone(), lse, packed[:, :, 0], packed[:, :, 1], torch.empty_like(v))
