"""The dense reference: the user's score_mod / mask_mod evaluated by plain torch at every
(b, h, q_idx, kv_idx) (``torch.vmap``, float64 capable, differentiable), for tests and checks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .values import INDEX_DTYPE


def _vmap_bhqkv(fn, has_score: bool):
    """vmap over kv_idx, q_idx, h, b (innermost first), like torch's create_mask."""
    for level in range(3, -1, -1):
        dims = [None] * 4
        dims[level] = 0
        in_dims = ((0,) if has_score else ()) + tuple(dims)
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=0)
    return fn


def _call_vmapped(fn, args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - retry the way torch's flex runs it (getitem -> aten.index)
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

        with TransformGetItemToIndex():
            return fn(*args)


def _index_tensors(B, H, Nq, Nk, device):
    return [torch.arange(n, dtype=INDEX_DTYPE, device=device) for n in (B, H, Nq, Nk)]


def apply_score_mod_dense(score_mod: Callable | None, scores: torch.Tensor) -> torch.Tensor:
    """``score_mod`` applied to every element of ``scores`` (B, H, Nq, Nk): plain torch, any dtype
    (float64 included), differentiable (also with respect to captured tensors)."""
    if score_mod is None:
        return scores
    B, H, Nq, Nk = scores.shape
    fn = _vmap_bhqkv(score_mod, has_score=True)
    return _call_vmapped(fn, [scores, *_index_tensors(B, H, Nq, Nk, scores.device)])


def dense_mask(mask_mod: Callable | None, B: int, H: int, Nq: int, Nk: int, device="cpu") -> torch.Tensor:
    """``mask_mod`` at every (b, h, q_idx, kv_idx): a bool tensor (B, H, Nq, Nk)."""
    if mask_mod is None:
        return torch.ones(B, H, Nq, Nk, dtype=torch.bool, device=device)
    fn = _vmap_bhqkv(mask_mod, has_score=False)
    out = _call_vmapped(fn, _index_tensors(B, H, Nq, Nk, device))
    return out.expand(B, H, Nq, Nk)
