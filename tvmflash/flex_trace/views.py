"""Handlers for views, indexing, small reductions, and the scatter-adds that are the gradients of
captured-tensor reads (``index_put``, ``select_backward``, ``slice_backward``).

Indices into captured tensors follow torch where torch defines them (negative indices wrap) and
clamp into range where torch raises, so a kernel never reads or writes out of bounds.
"""

from __future__ import annotations

import math

import torch
from tvm import tirx

from .ops import _as_acc, _Ctx, _elem, _handles, _is_num, _opmath
from .values import (
    _MAX_UNROLL,
    _Acc,
    _all_indices,
    _broadcast_index,
    _cast,
    _const,
    _dtype_of,
    _is_float,
    _reshape_index,
    _T,
    _tvm_dtype,
)


# --- views and indexing ------------------------------------------------------------------------


def _normalize_index(ctx: _Ctx, i, size: int) -> tirx.PrimExpr:
    """torch semantics for an index into a dim of ``size``: negative wraps; out of range clamps."""
    if _is_num(i):
        i = _const(int(i), "int64")
    if isinstance(i, tirx.IntImm):
        v = i.value
        if not -size <= v < size:
            ctx.fail(f"index {v} is out of range for a dimension of size {size}")
        return _const(v + size if v < 0 else v, _dtype_of(i))
    dt = _dtype_of(i)
    if dt == "bool" or _is_float(dt):
        ctx.fail(f"indexing with a {dt} tensor (use integer index tensors)")
    n = _const(size, dt)
    wrapped = tirx.Select(i < _const(0, dt), i + n, i)
    return tirx.max(tirx.min(wrapped, _const(size - 1, dt)), _const(0, dt))


def _view_of(ctx, a, mapper, shape=None) -> _T:
    """A view: element idx of the result is element mapper(idx) of ``a``."""
    shape = ctx.out_shape if shape is None else shape
    if isinstance(a, _Acc):
        ctx.fail(f"{ctx.node.target} of a gradient")
    if a.const is not None:
        return _T.full(shape, a.dtype, a.const)
    if shape == ():
        return _T.scalar(a.at(mapper(())), a.dtype)
    return _T(shape, a.dtype, lambda idx: a.at(mapper(idx)))


@_handles("aten.view", "aten.squeeze", "aten.unsqueeze")
def _reshape(ctx, a, *args, **kwargs):
    shape = ctx.out_shape
    if isinstance(a, _Acc):
        return _Acc(shape, a.dtype, [(_reshape_index(i, a.shape, shape), v) for i, v in a.terms])
    if a.shape == shape:
        return a
    return _view_of(ctx, a, lambda idx: _reshape_index(idx, shape, a.shape))


@_handles("aten.expand")
def _expand(ctx, a, *args, **kwargs):
    shape = ctx.out_shape
    if isinstance(a, _Acc):
        ctx.fail("expanding a gradient")
    if a.shape == shape:
        return a
    return _view_of(ctx, a, lambda idx: _broadcast_index(idx, a.shape, shape))


@_handles("aten.permute")
def _permute(ctx, a, dims):
    rank = len(a.shape)
    dims = [d % rank for d in dims] if rank else []
    if isinstance(a, _Acc):  # the vjp of a permuted read of a captured tensor: permute the terms
        return _Acc(ctx.out_shape, a.dtype, [(tuple(idx[d] for d in dims), v) for idx, v in a.terms])
    inverse = [dims.index(k) for k in range(rank)]
    return _view_of(ctx, a, lambda idx: tuple(idx[inverse[k]] for k in range(rank)))


@_handles("aten.select")
def _select(ctx, a, dim, index):
    dim %= len(a.shape)
    i = _normalize_index(ctx, index, a.shape[dim])
    return _view_of(ctx, a, lambda idx: tuple(idx[:dim]) + (i,) + tuple(idx[dim:]))


@_handles("aten.slice")
def _slice(ctx, a, dim=0, start=None, end=None, step=1):
    dim %= len(a.shape)
    r = range(a.shape[dim])[slice(start, end, step)]
    first, stride = r.start, r.step
    return _view_of(ctx, a, lambda idx: tuple(idx[:dim]) + (
        _const(first, "int64") + _cast(idx[dim], "int64") * _const(stride, "int64") if not _is_num(idx[dim])
        else first + idx[dim] * stride,) + tuple(idx[dim + 1:]))


@_handles("aten.index")
def _index(ctx, a, indices):
    if not isinstance(a, _T):
        ctx.fail("indexing a gradient")
    indices = list(indices)
    if len(indices) > len(a.shape):
        ctx.fail(f"too many indices ({len(indices)}) for a tensor of shape {tuple(a.shape)}")
    pos = [k for k, ix in enumerate(indices) if ix is not None]
    for k in pos:
        ix = indices[k]
        if isinstance(ix, _T) and ix.dtype in (torch.bool, torch.uint8):
            ctx.fail("boolean-mask indexing (data-dependent shape); use torch.where")
        if isinstance(ix, _T) and _is_float(ix.tvm_dtype):
            ctx.fail(f"indexing with a {ix.dtype} tensor (use integer index tensors)")
    ix_shape = tuple(torch.broadcast_shapes(*[indices[k].shape for k in pos])) if pos else ()
    contiguous = pos == list(range(pos[0], pos[-1] + 1)) if pos else True
    rest = list(range(len(indices), len(a.shape)))  # trailing dims, not indexed
    sliced = [k for k, ix in enumerate(indices) if ix is None] + rest
    n_ix = len(ix_shape)
    if contiguous and pos:
        before = [k for k in sliced if k < pos[0]]
        after = [k for k in sliced if k > pos[-1]]
        layout = [("dim", k) for k in before] + [("ix", j) for j in range(n_ix)] + [("dim", k) for k in after]
    else:
        layout = [("ix", j) for j in range(n_ix)] + [("dim", k) for k in sliced]
    shape = tuple(a.shape[k] if kind == "dim" else ix_shape[k] for kind, k in layout)
    if shape != ctx.out_shape:
        ctx.fail(f"unsupported indexing pattern (result shape {shape} vs torch's {ctx.out_shape})")

    def mapper(idx):
        src = [None] * len(a.shape)
        ix_idx = [idx[p] for p, (kind, _) in enumerate(layout) if kind == "ix"]
        for p, (kind, k) in enumerate(layout):
            if kind == "dim":
                src[k] = idx[p]
        for k in pos:
            t = indices[k]
            raw = _elem(t, ix_idx, ix_shape, _tvm_dtype(t.dtype)) if isinstance(t, _T) else t
            src[k] = _normalize_index(ctx, raw, a.shape[k])
        return tuple(src)

    return _view_of(ctx, a, mapper, shape)


# --- reductions (small static tensors, or gradients) -------------------------------------------


def _reduce(kind: str):
    def handler(ctx, a, dim=None, keepdim=False, *, dtype=None):
        if isinstance(dim, int):
            dim = [dim]
        rank = len(a.shape)
        dims = sorted({d % rank for d in dim}) if dim else list(range(rank))
        shape = ctx.out_shape
        if isinstance(a, _Acc):
            if kind != "sum":
                ctx.fail(f"{kind} of a gradient")
            out = _tvm_dtype(ctx.out_dtype)
            terms = []
            for idx, v in a.terms:
                kept = [(_const(0, "int64") if keepdim else None) if k in dims else i for k, i in enumerate(idx)]
                terms.append((tuple(i for i in kept if i is not None), _cast(v, out)))
            return _Acc(shape, ctx.out_dtype, terms)
        if a.numel > _MAX_UNROLL and any(a.shape[d] > 1 for d in dims):
            ctx.fail(f"aten.{kind} over {math.prod(a.shape[d] for d in dims)} elements of a tensor of shape "
                     f"{a.shape} (reductions are unrolled, up to {_MAX_UNROLL} elements)")
        out = _tvm_dtype(ctx.out_dtype)
        compute = _opmath(out)
        red_shape = [a.shape[d] for d in dims]

        def at(idx):
            it = iter(idx)
            base = []
            for k in range(rank):
                if k in dims:
                    base.append(None)
                    if keepdim:
                        next(it)
                else:
                    base.append(next(it))
            acc = None
            for r in _all_indices(red_shape):
                full = list(base)
                for d, v in zip(dims, r):
                    full[d] = _const(v, "int64")
                x = _cast(a.at(full), compute)
                if acc is None:
                    acc = x
                elif kind in ("sum", "mean"):
                    acc = acc + x
                elif kind == "amax":
                    acc = tirx.max(acc, x)
                else:
                    acc = tirx.min(acc, x)
            if kind == "mean":
                acc = acc / _const(math.prod(red_shape), compute)
            return _cast(acc, out)

        return _T.scalar(at(()), ctx.out_dtype) if shape == () else _T(shape, ctx.out_dtype, at)

    return handler


_handles("aten.sum")(_reduce("sum"))
_handles("aten.mean")(_reduce("mean"))
_handles("aten.amax")(_reduce("amax"))
_handles("aten.amin")(_reduce("amin"))


@_handles("aten.max", "aten.min")
def _max_min(ctx, a, *args, **kwargs):
    if args or kwargs:
        ctx.fail("max/min along a dimension (returns indices); use amax/amin")
    return _reduce("amax" if ctx.node.target.overloadpacket is torch.ops.aten.max else "amin")(ctx, a)


# --- gradients scattered into captured tensors (the vjp of reading them) --------------------


@_handles("aten.index_put", "aten.index_put_", "aten._index_put_impl", "aten._index_put_impl_")
def _index_put(ctx, dest, indices, values, accumulate=False, *args):
    """The vjp of ``captured[idx]``: scatter ``values`` into zeros (or into a gradient sum)."""
    if isinstance(dest, _T) and dest.const == 0:
        dest = _Acc(dest.shape, dest.dtype, [])
    if not isinstance(dest, _Acc):
        ctx.fail("index_put into a non-zero tensor (in-place updates are not supported)")
    if not accumulate and dest.terms:
        ctx.fail("index_put without accumulate into a non-empty gradient")
    indices = list(indices)
    if any(ix is None for ix in indices) or any(isinstance(ix, _T) and ix.shape != () for ix in indices):
        ctx.fail("index_put with slices or non-scalar index tensors")
    fixed = tuple(_normalize_index(ctx, ix.expr if isinstance(ix, _T) else ix, dest.shape[k])
                  for k, ix in enumerate(indices))
    out = _tvm_dtype(ctx.out_dtype)
    rest_shape = dest.shape[len(fixed):]
    terms = list(dest.terms)
    if isinstance(values, _Acc):
        if values.shape != rest_shape:
            ctx.fail("index_put of a gradient with a mismatched shape")
        terms += [(fixed + tuple(i), _cast(v, out)) for i, v in values.terms]
    else:
        if not isinstance(values, _T):
            values = _T.full((), ctx.out_dtype, values)
        if values.const == 0:
            return _Acc(dest.shape, ctx.out_dtype, terms)
        if math.prod(rest_shape) > _MAX_UNROLL:
            ctx.fail("index_put of a large slice")
        for ix in _all_indices(rest_shape):
            ix = tuple(_const(i, "int64") for i in ix)
            terms.append((fixed + ix, _cast(values.at(_broadcast_index(ix, values.shape, rest_shape)), out)))
    return _Acc(dest.shape, ctx.out_dtype, terms)


@_handles("aten.select_backward")
def _select_backward(ctx, g, input_sizes, dim, index):
    shape = tuple(int(s) for s in input_sizes)
    dim %= len(shape)
    i = _normalize_index(ctx, index, shape[dim])
    acc = _as_acc(ctx, g)
    return _Acc(shape, ctx.out_dtype, [(tuple(ix[:dim]) + (i,) + tuple(ix[dim:]), v) for ix, v in acc.terms])


@_handles("aten.slice_backward")
def _slice_backward(ctx, g, input_sizes, dim, start, end, step):
    shape = tuple(int(s) for s in input_sizes)
    dim %= len(shape)
    r = range(shape[dim])[slice(start, end, step)]
    acc = _as_acc(ctx, g)
    terms = []
    for ix, v in acc.terms:
        j = _cast(ix[dim], "int64") * _const(r.step, "int64") + _const(r.start, "int64")
        terms.append((tuple(ix[:dim]) + (j,) + tuple(ix[dim + 1:]), v))
    return _Acc(shape, ctx.out_dtype, terms)

