"""FlexAttention's ``score_mod`` / ``mask_mod`` as TIR expressions, derivatives included.

A user writes the functions for torch's FlexAttention API::

    def score_mod(score, b, h, q_idx, kv_idx):      # score: 0-d float, indices: 0-d int32
        return score + slopes[h] * (kv_idx - q_idx)
    def mask_mod(b, h, q_idx, kv_idx):              # -> 0-d bool (True = attend)
        return q_idx >= kv_idx

and the fused kernels need them as scalar TIR expressions at one ``(b, h, q_idx, kv_idx)``::

    traced = trace_score_mod(score_mod)
    s = traced.emit(score, b, h, i, j, buffers)              # float32 PrimExpr
    ds = traced.emit_grad(score, b, h, i, j, buffers)        # d score_mod / d score
    for name, index, value in traced.emit_captured_grads(score, b, h, i, j, upstream, buffers):
        ...                                                  # grad[name][index] += value
    allowed = trace_mask_mod(mask_mod).emit(b, h, i, j, buffers)   # bool PrimExpr

How (the way torch's own flex_attention does it, ``torch/_higher_order_ops/flex_attention.py``),
one module per step:

1. ``trace.py``: ``make_fx`` traces the function on 0-d example tensors (score float32, indices
   int32, as ``trace_flex_attention`` does) in fake-tensor mode under ``TransformGetItemToIndex``,
   which turns ``table[h, q_idx]`` into ``aten.index.Tensor``. Fake mode never runs the function
   on real data, so an index out of range for the example values does not fail tracing.
   Tensors the function closes over appear as ``get_attr`` constants; 0-d tensors that do not
   require grad are inlined as constants, every other tensor becomes a ``Captured`` kernel
   input (in order of first use) and an explicit graph input ("lifted"). The derivative comes
   from torch: ``make_fx`` traces ``torch.func.vjp`` of the lifted graph with respect to
   ``score`` and every captured tensor that requires grad (the joint graph), whose captured
   gradients are ``new_zeros`` + ``index_put(..., accumulate=True)`` scatter-adds. Both graphs
   are traced with torch's decompositions (``ops.DECOMPOSITIONS``: the ``*_backward`` ops,
   ``silu``, ``softplus``, ``lerp``, ``logaddexp``, ``masked_fill``, ...), so what is left is a
   small set of core aten ops.
2. ``ops.py`` / ``views.py``: one handler per remaining aten op. Every value is a lazily
   indexed tensor (``values._T``: shape, dtype, element function), so views of captured tensors
   (``table[h]`` then ``[q_idx]``) cost nothing; the result is one scalar expression. Types
   follow torch: the dtype of every node is the one the tracer recorded, integer math stays
   integer (floor/trunc division and remainders as torch defines them), and float16/bfloat16
   ops compute in float32 and round, like torch's CPU kernels.
3. ``lower.py``: the graphs evaluated node by node into TIR (``TracedScoreMod.emit*``,
   ``TracedMaskMod.emit``).
4. ``reference.py``: ``apply_score_mod_dense`` / ``dense_mask`` evaluate the user functions with
   plain torch over all ``(b, h, q_idx, kv_idx)``: the dense reference for tests.

Indices into captured tensors: negative indices wrap like torch; indices still out of range
(torch raises IndexError) are clamped into range, so a kernel never reads or writes out of
bounds; gradients of such reads go to the clamped element. A constant index out of range is a
trace-time error. Integer division or remainder by zero gives 0 (torch raises).

Transcendental functions go through ``INTRINSICS`` (``tirx.exp``, ``tirx.tanh``, ...). On CPUs
those become scalar libm calls inside vectorized loops; pass ``intrinsics={"exp": fast_exp}``
to any ``emit*`` method (or edit the table) to substitute vectorizable versions (the kernels
do, ``score_mods.FAST_INTRINSICS``). The decomposition table keeps ``exp``, ``exp2``, ``tanh``
and ``sigmoid`` as ops for this reason (``silu`` becomes ``x * sigmoid(x)``, the backward of
``tanh`` ``g * (1 - y * y)``).

Ops (``supported_ops()`` lists the aten ops; torch functions that torch lowers to them, e.g.
``square``, ``clip``, ``true_divide``, ``F.gelu``, ``F.leaky_relu``, in-place forms, work too):
arithmetic, integer and float division with rounding modes, remainders, powers, min/max/clamp,
the float functions of ``INTRINSICS``, ``nan_to_num``, comparisons and logic (bitwise ops
logical on bools), ``where``, conversions, constants and ``arange``, views and advanced
indexing of captured tensors, sums and amax/amin over small static tensors (unrolled), and the
vjp graph's ops (``index_put`` with accumulate, ``select_backward``, ``slice_backward``).

Where the TIR differs from torch on purpose: out-of-range indices clamp (torch raises), integer
division/remainder by zero gives 0 (torch raises), float -> int casts saturate and map NaN to 0
(undefined in C; x86 torch gives INT_MIN), and min/max/clamp follow TVM's ``Max``/``Min`` for
NaN operands (torch propagates NaN).
"""

from __future__ import annotations

from .guards import capture
from .lower import Captured, TracedMaskMod, TracedScoreMod, supported_ops
from .reference import apply_score_mod_dense, dense_mask
from .trace import trace_mask_mod, trace_score_mod
from .values import INTRINSICS, TRANSLATOR_VERSION, FlexTraceError  # noqa: F401

__all__ = [
    "Captured",
    "FlexTraceError",
    "INTRINSICS",
    "TracedMaskMod",
    "TracedScoreMod",
    "apply_score_mod_dense",
    "capture",
    "dense_mask",
    "supported_ops",
    "trace_mask_mod",
    "trace_score_mod",
]
