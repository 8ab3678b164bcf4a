"""Score and mask mods as TIR expressions: what the fused kernels apply to each score.

``emitters(spec)`` composes the spec's mods into one ``Emitters`` object the kernels call:

* ``score(s, ctx)``: the modified score, mods applied in order (s is the scaled dot product);
* ``score_grad(s, ctx)``: d score / d s by the chain rule (the backward multiplies dS by it);
* ``captured_grads(s, ctx, upstream)``: scatter-adds for captured tensors that require grad;
* ``mask(ctx)``: the mask_mod (True = keep).

Built-in mods are flash-attn's ``softcap`` and ``alibi_slopes``; traced mods (``flex_trace``)
bring their own emitters. ``ctx`` carries the indices of the score: batch (sequence) ``b``,
query head ``h``, ``q_idx``/``kv_idx`` within the sequence, its diagonal (``plan.py``), and the
buffers of the mod inputs by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .attention_te import LOG2E, exp2, scale_log2_parts
from .spec import Alibi, AttentionSpec, Softcap


@dataclass
class ModContext:
    b: tirx.PrimExpr
    h: tirx.PrimExpr
    q_idx: tirx.PrimExpr
    kv_idx: tirx.PrimExpr
    diagonal: tirx.PrimExpr  # query q's diagonal is key q + diagonal (plan.py)
    buffers: dict


def _f32(x: float):
    return tirx.const(x, "float32")


def _odd_tanh_coefficients(limit: float = 0.625, degree: int = 6) -> list[float]:
    """tanh(x) = x (1 + x^2 p(x^2)) near 0: Chebyshev fit of p on [0, limit^2], float64."""
    t = (limit**2) * 0.5 * (1 + np.cos(np.pi * (np.arange(64) + 0.5) / 64))
    x = np.sqrt(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = np.where(t > 0, (np.tanh(x) / x - 1) / t, -1.0 / 3.0)
    fit = np.polynomial.chebyshev.Chebyshev.fit(t, target, degree, domain=[0, limit**2])
    return [float(c) for c in fit.convert(kind=np.polynomial.Polynomial).coef]


_TANH_SMALL = 0.625
_TANH_COEFFS = _odd_tanh_coefficients(_TANH_SMALL)
# torch's fp32 tanh is +-1 exactly from |x| = 9.0108404 on (the correctly rounded tanh from 9.0109138):
# from there on tanh is +-1 here too, so softcap's derivative 1 - tanh^2 is 0 where torch's is.
_TANH_ONE = 9.01084041595459
_TANH_E = float(np.float32(2.0 * LOG2E))
# The exponent 2 |x| log2(e) at |x| = _TANH_ONE, rounded as the kernels compute it (fp32 products
# are monotonic and this one is injective near 9, so y >= this is |x| >= _TANH_ONE)
_TANH_ONE_EXPONENT = float(np.float32(_TANH_ONE) * np.float32(_TANH_E))


def tanh(x: tirx.PrimExpr, exp2_fn=exp2) -> tirx.PrimExpr:
    """tanh for float32 that vectorizes (``T.tanh`` becomes a libm call per element on CPUs) and
    stays accurate under ``nvcc --use_fast_math`` (which makes CUDA's ``tanhf`` the
    ``tanh.approx`` instruction, relative error 2^-11: 1.5 % of P at softcap 30).

    |x| < 0.625: x (1 + x^2 p(x^2)), an odd polynomial (no cancellation near 0); beyond,
    1 - 2 / (e + 1), e = 2^(2|x| log2 e) by ``exp2_fn(y, inf_from=...)`` (the kernels' polynomial;
    the GPU's ex2), which is +inf from torch's saturation point on: exactly +-1 there, as in torch
    (+-inf included). NaN takes the small branch (its test is false), so NaN in, NaN out, as in
    torch's softcap. Relative error ~1.6e-7 (tested against float64).
    """
    ax = tirx.abs(x)
    t = x * x
    poly = _f32(_TANH_COEFFS[-1])
    for c in reversed(_TANH_COEFFS[:-1]):
        poly = poly * t + _f32(c)
    small = x + x * t * poly
    e = exp2_fn(ax * _f32(_TANH_E), inf_from=_TANH_ONE_EXPONENT)
    large = _f32(1.0) - _f32(2.0) / (e + _f32(1.0))
    signed = tirx.Select(x < _f32(0.0), -large, large)
    return tirx.Select(ax >= _f32(_TANH_SMALL), signed, small)


def _native_exp2(y: tirx.PrimExpr, inf_from: float) -> tirx.PrimExpr:
    """tanh's exp2 on GPUs: ex2.approx (2 ulp), +inf from ``inf_from`` on."""
    return tirx.Select(y < _f32(inf_from), tirx.exp2(y), _f32(math.inf))


_LOG2E_HI = float(np.float32(LOG2E))
_LOG2E_LO = LOG2E - _LOG2E_HI


def fast_exp(x: tirx.PrimExpr, exp2_fn=exp2) -> tirx.PrimExpr:
    """e^x through the kernels' polynomial exp2 (vectorizes; ``T.exp`` is a libm call per element):
    x log2(e) with log2(e) as an fp32 hi + lo pair, relative error ~1e-7."""
    return exp2_fn(x * _f32(_LOG2E_HI) + x * _f32(_LOG2E_LO))


def fast_sigmoid(x: tirx.PrimExpr, exp2_fn=exp2) -> tirx.PrimExpr:
    return _f32(1.0) / (_f32(1.0) + fast_exp(-x, exp2_fn))


# Vectorizable versions of the transcendental functions traced score_mods use most (the rest
# stay libm calls: correct, slower).
FAST_INTRINSICS = {"exp": fast_exp, "exp2": exp2, "tanh": tanh, "sigmoid": fast_sigmoid}
# GPUs: the same formulas on the hardware's exp2 (ex2.approx, 2 ulp), whatever nvcc's flags.
NATIVE_INTRINSICS = {"exp": lambda x: fast_exp(x, tirx.exp2), "exp2": tirx.exp2, "tanh": lambda x: tanh(x, _native_exp2),
                     "sigmoid": lambda x: fast_sigmoid(x, tirx.exp2)}


class _Softcap:
    """s -> c tanh(s / c), c = softcap[0]."""

    def __init__(self, intrinsics):
        self.tanh = intrinsics["tanh"]

    def _c(self, ctx):
        return ctx.buffers["softcap"][0]

    def score(self, s, ctx):
        return self._c(ctx) * self.tanh(s / self._c(ctx))

    def grad(self, s, ctx):
        t = self.tanh(s / self._c(ctx))
        return _f32(1.0) - t * t

    def captured_grads(self, s, ctx, upstream):
        return []


class _Alibi:
    """s -> s - slope[b, h] |q + diagonal - k| (flash-attn's ALiBi: diagonal = seqlen_k - seqlen_q)."""

    def _slope(self, ctx):
        slopes = ctx.buffers["alibi_slopes"]
        rows = slopes.shape[0]
        return slopes[tirx.min(ctx.b, rows - 1), ctx.h]

    def score(self, s, ctx):
        distance = tirx.abs(ctx.q_idx + ctx.diagonal - ctx.kv_idx)
        return s - self._slope(ctx) * tirx.Cast("float32", distance)

    def grad(self, s, ctx):
        return _f32(1.0)

    def captured_grads(self, s, ctx, upstream):
        return []


class _Traced:
    """A mod traced by ``flex_trace``: it emits its own expressions."""

    def __init__(self, traced, intrinsics):
        self.traced, self.intrinsics = traced, intrinsics

    def score(self, s, ctx):
        return self.traced.emit(s, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx, ctx.buffers, intrinsics=self.intrinsics)

    def grad(self, s, ctx):
        return self.traced.emit_grad(s, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx, ctx.buffers, intrinsics=self.intrinsics)

    def captured_grads(self, s, ctx, upstream):
        return self.traced.emit_captured_grads(s, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx, upstream, ctx.buffers,
                                               intrinsics=self.intrinsics)


def _emitter(mod, intrinsics):
    if isinstance(mod, Softcap):
        return _Softcap(intrinsics)
    if isinstance(mod, Alibi):
        return _Alibi()
    return _Traced(mod, intrinsics)


class Emitters:
    def __init__(self, spec: AttentionSpec, intrinsics):
        self.mods = [_emitter(m, intrinsics) for m in spec.score_mods]
        self.mask_mod = spec.mask_mod
        self.intrinsics = intrinsics
        self.grad_shapes = {i.name: i.shape for i in spec.grad_inputs}

    def _chain(self, s, ctx):
        """The score before each mod: [s, f1(s), f2(f1(s)), ...]."""
        values = [s]
        for mod in self.mods:
            values.append(mod.score(values[-1], ctx))
        return values

    def score(self, s, ctx):
        return self._chain(s, ctx)[-1]

    def score_grad(self, s, ctx):
        values = self._chain(s, ctx)
        grad = _f32(1.0)
        for mod, value in zip(self.mods, values):
            grad = grad * mod.grad(value, ctx)
        return grad

    def captured_grads(self, s, ctx, upstream):
        """(buffer name, indices, value) scatter-adds: upstream times d score / d captured."""
        values = self._chain(s, ctx)
        adds = []
        for k, mod in enumerate(self.mods):
            outer = upstream
            for later, value in zip(self.mods[k + 1:], values[k + 1:]):
                outer = outer * later.grad(value, ctx)
            adds += mod.captured_grads(values[k], ctx, outer)
        return adds

    def flat_captured_grads(self, s, ctx, upstream):
        """``captured_grads`` with each index flattened (row-major) into its tensor, clamped into
        range (as the reads are): (buffer name, flat int64 index, value)."""
        adds = []
        for name, indices, value in self.captured_grads(s, ctx, upstream):
            flat = tirx.const(0, "int64")
            for index, size in zip(indices, self.grad_shapes[name]):
                flat = flat * size + tirx.min(tirx.max(tirx.Cast("int64", index), 0), size - 1)
            adds.append((name, flat, value))
        return adds

    def mask(self, ctx):
        if self.mask_mod is None:
            return tirx.const(True, "bool")
        return self.mask_mod.emit(ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx, ctx.buffers, intrinsics=self.intrinsics)


def exponent_constant(spec: AttentionSpec, softmax_scale):
    """c of 2^(x c - max) as an fp32 hi + lo pair (attention_te.scale_log2_parts): x is the raw
    dot product without score mods (the scale folds into c), the modded natural-log score with them."""
    return scale_log2_parts(tirx.const(1.0, "float64") if spec.score_mods else softmax_scale)


def kernel_argument(name: str, shape, dtype: str):
    """A buffer argument added to the prim_func being parsed (called inside its body)."""
    buf = T.match_buffer(T.arg(name, T.handle()), shape, dtype)
    IRBuilder.name(name, buf)
    return buf


def declare_inputs(spec: AttentionSpec, grads: bool) -> tuple[dict, dict]:
    """The mod inputs as kernel arguments in the spec's order (sizes given as None become
    symbolic), then, with ``grads``, a flat fp32 gradient buffer for each that requires one.
    Returns the two by input name."""
    inputs, grad_buffers = {}, {}
    for i in spec.mod_inputs:
        shape = tuple(tirx.Var(f"{i.name}_d{d}", "int64") if n is None else n for d, n in enumerate(i.shape))
        inputs[i.name] = kernel_argument(i.name, shape, i.dtype)
    if grads:
        for i in spec.grad_inputs:
            grad_buffers[i.name] = kernel_argument(f"{i.name}_grad", (math.prod(i.shape),), "float32")
    return inputs, grad_buffers


def emitters(spec: AttentionSpec, intrinsics=FAST_INTRINSICS) -> Emitters:
    """The spec's mods as TIR; ``intrinsics``: how exp, exp2, tanh, sigmoid are computed
    (``FAST_INTRINSICS``: polynomials that vectorize on CPUs; ``NATIVE_INTRINSICS``: GPUs)."""
    return Emitters(spec, intrinsics)
