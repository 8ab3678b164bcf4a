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


def test_compile_arguments_are_checked(kernels_d32):
    """What the compile API would otherwise ignore, misread or fail on deep inside."""
    with pytest.raises(ValueError, match="LLVM knows no CPU 'notacpu'"):  # (LLVM would compile for a generic CPU)
        tvmflash.compile({"kind": "llvm", "mcpu": "notacpu"}, head_dim=32)
    for seqlen, error in (("x", TypeError), (1.5, TypeError), ((10,), ValueError), (-5, ValueError)):
        with pytest.raises(error, match="seqlen"):
            tvmflash.compile(head_dim=32, seqlen=seqlen)
    forward = kernels_d32.configs["forward"]
    with pytest.raises(ValueError, match="config names a kernel 'fwd'"):  # (a typo lost the config silently)
        tvmflash.compile(head_dim=32, config={"fwd": forward})
    with pytest.raises(TypeError, match="config.'backward'. must be"):
        tvmflash.compile(head_dim=32, config={"backward": forward})
    for args, match in ((("sideways", 1, 10, 10, 2, 2), "'forward' or 'backward'"),
                        (("forward", 1, -10, 10, 2, 2), "seqlen_q must be >= 0"),
                        (("backward", 1, 10, 10, 3, 2), "multiple of heads_k"),
                        (("backward", 1, 10, 10, 2, 0), "heads_k must be >= 1")):
        with pytest.raises(ValueError, match=match):
            kernels_d32.workspace_bytes(*args)


def test_forward_mode_ad_is_refused_not_dropped():
    """The ops have no jvp: a dual tensor's tangent would be dropped (a zero JVP, silently)."""
    import torch.autograd.forward_ad as fwAD

    q = torch.randn(1, 12, 2, 16)
    for requires_grad in (False, True):
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
            tvmflash.flash_attn_func(fwAD.make_dual(q.clone().requires_grad_(requires_grad), torch.randn_like(q)), q,
                                     q, causal=True)
    with fwAD.dual_level():  # a dual level alone, no tangent: runs
        assert tvmflash.flash_attn_func(q, q, q, causal=True).shape == q.shape


def test_meta_tensors_get_meta_outputs():
    q = torch.randn(2, 12, 4, 16, device="meta")
    out, lse = tvmflash.flash_attn_func(q, q[:, :, :2], q[:, :, :2], causal=True, return_lse=True)
    assert out.device.type == lse.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 4, 12)
