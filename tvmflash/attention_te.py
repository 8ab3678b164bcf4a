"""The attention math, written once.

Two layers live here:

* scalar formulas (``exp2``, ``visible``, ``grad_scores``, ``lse_from_stats``) that build TIR
  expressions. The unfused TE definitions below and the fused TensorIR kernels in
  ``kernels/cpu.py`` both call them, so a mask or a gradient formula exists in one place only;
* tensor-expression (TE) definitions of the forward and backward pass over symbolic batch,
  head and sequence sizes. Compiled as they are (``create_prim_func`` + a plain schedule) they
  are "standard attention": they store the full ``(B, H, Nq, Nk)`` score and probability
  matrices. Tests use them as a second, independent implementation and benchmarks as the
  O(N^2)-memory baseline.

Conventions (those of flash-attn): tensors are ``(batch, seqlen, heads, head_dim)``; ``lse`` is
``(batch, heads, seqlen_q)`` float32 in natural-log units; a causal mask is aligned to the
bottom-right corner (query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``); a query row
that sees no key has output 0, ``lse = -inf`` and zero gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import te, tirx

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


def _f32(value: float) -> tirx.PrimExpr:
    return tirx.const(value, "float32")


def _exp2_coefficients(degree: int = 6) -> list[float]:
    """Near-minimax polynomial for 2**f on [-0.5, 0.5] (Chebyshev fit, max rel. error ~2e-9)."""
    nodes = 0.5 * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    fit = np.polynomial.chebyshev.Chebyshev.fit(nodes, 2.0**nodes, degree, domain=[-0.5, 0.5])
    return [float(c) for c in fit.convert(kind=np.polynomial.Polynomial).coef]


_EXP2_COEFFS = _exp2_coefficients()


def exp2(x: tirx.PrimExpr, *, nonpositive: bool = False, inf_from: float | None = None) -> tirx.PrimExpr:
    """2**x for float32 ``x`` <= ~1 as a polynomial that vectorizes.

    ``T.exp``/``T.exp2`` lower to scalar libm calls inside vectorized loops on CPUs, which costs
    as much as the matrix products. Here: n = round(x), f = x - n in [-0.5, 0.5], 2**f by a
    degree-6 polynomial, 2**n by writing n + 127 into the exponent bits. The kernels only
    exponentiate x = score - (running max or LSE) <= ~0, so there is no upper clamp; inputs
    below -125 give exactly 0 (x = -inf included), which the online softmax relies on.

    The expression repeats ``x`` instead of binding it with ``Let``: MetaSchedule's FLOP
    estimator cannot read ``Let``, and TVM's common-subexpression pass (and LLVM) merge the
    copies again. ``floor(x + 0.5)``, not ``nearbyint``: TVM's vectorizer scalarizes nearbyint.
    Results below 2**-125 are flushed to 0 rather than left denormal: arithmetic on denormals
    takes microcode assists (~100 cycles each) on x86 and halved the speed on extreme inputs.
    NaN in, NaN out (a NaN score must spread to its row, as in PyTorch's attention); the clamps
    keep the integer conversion away from NaN and infinities, whose result LLVM leaves undefined.
    ``nonpositive``: the caller guarantees x <= 0 or NaN (``masked_log2_exponent``), so the upper
    clamp is dropped; that pays for the NaN test LLVM could drop while the cap turned NaN into 0.
    ``inf_from`` (<= 128): the caller guarantees x >= 0 and handles NaN itself (``score_mods.tanh``):
    no lower clamp, no NaN test, and +inf from x >= inf_from on, in the compare the flush to 0 costs.
    """
    if inf_from is not None:
        clamped = tirx.min(x, _f32(128.0))
    else:
        clamped = tirx.max(x, _f32(-125.0))
        if not nonpositive:
            clamped = tirx.min(clamped, _f32(128.0))
    n = tirx.floor(clamped + _f32(0.5))
    frac = clamped - n
    poly = _f32(_EXP2_COEFFS[-1])
    for c in reversed(_EXP2_COEFFS[:-1]):
        poly = poly * frac + _f32(c)
    biased = tirx.Cast("int32", n) + tirx.const(127, "int32")
    value = poly * tirx.reinterpret("float32", tirx.shift_left(biased, tirx.const(23, "int32")))
    if inf_from is not None:
        return tirx.Select(x < _f32(inf_from), value, _f32(math.inf))
    return tirx.Select(tirx.isnan(x), x, tirx.Select(x > _f32(-125.0), value, _f32(0.0)))


def visible(i, j, seqlen_q, seqlen_k, causal: bool) -> tirx.PrimExpr:
    """Whether query ``i`` attends to key ``j``; ``j`` may be padding past the last key.

    Query rows past the end need no mask: the kernels zero-pad them (their outputs are dropped
    and their dO is 0, so they add nothing to any gradient).
    """
    if not causal:
        return j < seqlen_k
    return tirx.all(j < seqlen_k, j <= i + (seqlen_k - seqlen_q))


def in_window(q, k, seqlen_k, diagonal, window_left, window_right) -> tirx.PrimExpr:
    """flash-attn's mask: query ``q`` sees key ``k`` iff k < seqlen_k and
    ``q + diagonal - window_left <= k <= q + diagonal + window_right``; ``diagonal`` is
    ``seqlen_k - seqlen_q`` for flash-attn's bottom-right alignment. Causal is ``window_right =
    0``; no limit is ``spec.UNLIMITED_WINDOW``."""
    return tirx.all(k < seqlen_k, k <= q + diagonal + window_right, k >= q + diagonal - window_left)


def visible_keys(q, seqlen_k, diagonal, window_left, window_right):
    """``in_window`` for one query as an interval: the keys ``(first, last)`` query ``q`` sees
    (empty where first > last)."""
    return q + diagonal - window_left, tirx.min(q + diagonal + window_right, seqlen_k - 1)


def visible_queries(k, seqlen_q, seqlen_k, diagonal, window_left, window_right):
    """``in_window`` for one key as an interval: the queries ``(first, last)`` below ``seqlen_q``
    that see key ``k`` (empty for a key past ``seqlen_k``)."""
    first, last = k - diagonal - window_right, tirx.min(k - diagonal + window_left, seqlen_q - 1)
    return first, tirx.Select(k < seqlen_k, last, first - 1)


def grad_scores(p, dp, delta) -> tirx.PrimExpr:
    """dS = P * (dP - Delta), Delta_i = sum_d dO_id * O_id (the softmax Jacobian-vector product)."""
    return p * (dp - delta)


def lse_from_stats(row_max_log2, row_sum) -> tirx.PrimExpr:
    """Natural-log LSE from a base-2 running max and its (rescaled) denominator.

    Evaluated in float64 (once per row, so free) and rounded once: the backward recomputes P
    from this fp32 number, and every extra rounding here would scale a whole row of P.
    A row that sees no key has ``row_sum == 0`` and gets -inf; a NaN anywhere stays NaN.
    """
    m64 = tirx.Cast("float64", row_max_log2)
    lse = (m64 + tirx.log2(tirx.Cast("float64", row_sum))) * tirx.const(LN2, "float64")
    return tirx.Select(row_sum == _f32(0.0), _f32(NEG_INF), tirx.Cast("float32", lse))


def normalizer(row_sum) -> tirx.PrimExpr:
    """1 / row_sum for the output, 0 for rows that see no key (NaN stays NaN)."""
    return tirx.Select(row_sum == _f32(0.0), _f32(0.0), _f32(1.0) / row_sum)


def _split_f32(exact) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """A float64 value as float32 hi + lo (hi + lo equals it to ~2^-48 relative)."""
    hi = tirx.Cast("float32", exact)
    return hi, tirx.Cast("float32", exact - tirx.Cast("float64", hi))


def scale_log2_parts(softmax_scale) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """softmax_scale * log2(e) (float64 argument) as a float32 pair: scores -> log2 units."""
    return _split_f32(tirx.Cast("float64", softmax_scale) * tirx.const(LOG2E, "float64"))


def log2_exponent(score, scale_parts, shift_parts) -> tirx.PrimExpr:
    """score * scale - shift in log2 units, with both constants as (hi, lo) pairs.

    ``score * scale_hi - shift_hi`` is one fused multiply-add (LLVM contracts it) of two nearly
    equal numbers for the probabilities that matter, so it is exact before its one rounding; the
    lo parts add the rest. This keeps the exponents as accurate as the scores themselves, also
    for large logits, where rounding a pre-scaled q or k would perturb every exponent.
    """
    (c_hi, c_lo), (m_hi, m_lo) = scale_parts, shift_parts
    return (score * c_hi - m_hi) + (score * c_lo - m_lo)


FLT_MAX = float(np.finfo(np.float32).max)


def masked_log2_exponent(score, scale_parts, shift_parts) -> tirx.PrimExpr:
    """``log2_exponent`` where a masked score (-inf) gives -inf, so that 2^x is exactly 0.

    The lo part of the scale may be 0 or negative, and -inf times it is NaN or +inf: the lo term
    reads the score clamped to the finite range. The shift must not be -inf (rows without keys
    get an LSE of +inf in the backward). Capped at 0: a probability is at most 1, and where
    |scaled scores| exceed 2^24 the fp32 LSE the backward reads is rounded by more than 1 (it would
    otherwise push 2^x past the fp32 range). NaN stays NaN: TVM lowers ``min(a, b)`` to ``a < b ? a :
    b``, so the cap is written ``min(0, x)``; ``min(x, 0)`` turned a NaN exponent into 0, i.e. P = 1
    (a NaN in q or k left dV finite in the backward and vanished from decode outputs).
    """
    (c_hi, c_lo), (m_hi, m_lo) = scale_parts, shift_parts
    return tirx.min(_f32(0.0), (score * c_hi - m_hi) + (tirx.max(score, _f32(-FLT_MAX)) * c_lo - m_lo))


def shifted_log2_exponent(score, row_max, scale_parts) -> tirx.PrimExpr:
    """(score - row_max) * c in log2 units, c = scale * log2(e) as an fp32 hi + lo pair.

    The forward's exponents: the max is taken over raw scores, so the difference is exact for
    the scores that matter (those near the max) and the max itself gets exactly 2^0, at any
    scale (a max taken after scaling would be rounded to fp32 first: at large scales its rounding
    error alone overflows 2^x). A masked score (-inf) gives -inf, with the lo term clamped as in
    ``masked_log2_exponent``.
    """
    c_hi, c_lo = scale_parts
    diff = score - row_max
    return diff * c_hi + tirx.max(diff, _f32(-FLT_MAX)) * c_lo


def lse_from_raw_max(row_max, scale_log2, row_sum) -> tirx.PrimExpr:
    """Natural-log LSE from a running max of raw scores and its denominator: (max * c +
    log2(sum)) * ln 2, in float64 (``scale_log2`` is c as a float64 expression), rounded once;
    -inf for rows that see no key, NaN stays NaN."""
    m64 = tirx.Cast("float64", row_max) * scale_log2
    lse = (m64 + tirx.log2(tirx.Cast("float64", row_sum))) * tirx.const(LN2, "float64")
    return tirx.Select(row_sum == _f32(0.0), _f32(NEG_INF), tirx.Cast("float32", lse))


def lse_log2_parts(lse) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """LSE * log2(e) as a float32 pair (hi, lo) with hi + lo exact to ~float64 precision.

    The backward needs P = 2**(S2 - LSE2) with S2 in log2 units. Rounding LSE2 to one float32
    would add up to half an ulp of ~10 (5e-7) to every exponent of the row; subtracting hi, then
    lo, keeps that error out.
    """
    return _split_f32(tirx.Cast("float64", lse) * tirx.const(LOG2E, "float64"))


@dataclass
class Shapes:
    """The symbolic sizes shared by every kernel signature."""

    batch: tirx.Var
    seqlen_q: tirx.Var
    seqlen_k: tirx.Var
    heads: tirx.Var
    heads_k: tirx.Var

    @classmethod
    def symbolic(cls) -> Shapes:
        return cls(*(tirx.Var(n, "int64") for n in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_k")))


def _qkv_placeholders(shapes: Shapes, head_dim: int, dtype: str):
    s = shapes
    q = te.placeholder((s.batch, s.seqlen_q, s.heads, head_dim), dtype, name="q")
    k = te.placeholder((s.batch, s.seqlen_k, s.heads_k, head_dim), dtype, name="k")
    v = te.placeholder((s.batch, s.seqlen_k, s.heads_k, head_dim), dtype, name="v")
    return q, k, v


def _scores(q, k, scale, shapes: Shapes, head_dim: int, causal: bool):
    """S[b, h, i, j] = scale * q_i . k_j, -inf where masked (natural-log units)."""
    s = shapes
    group = s.heads // s.heads_k
    d = te.reduce_axis((0, head_dim), name="d")
    dot = te.compute(
        (s.batch, s.heads, s.seqlen_q, s.seqlen_k),
        lambda b, h, i, j: te.sum(
            q[b, i, h, d].astype("float32") * k[b, j, h // group, d].astype("float32"), axis=d
        ),
        name="qk",
    )
    return te.compute(
        dot.shape,
        lambda b, h, i, j: tirx.Select(
            visible(i, j, s.seqlen_q, s.seqlen_k, causal), dot[b, h, i, j] * scale, _f32(NEG_INF)
        ),
        name="scores",
    )


def forward_te(head_dim: int, dtype: str, causal: bool):
    """Standard attention forward. Returns ``(args, shapes)`` with args = q, k, v, out, lse, scale."""
    s = Shapes.symbolic()
    group = s.heads // s.heads_k
    q, k, v = _qkv_placeholders(s, head_dim, dtype)
    scale = tirx.Var("softmax_scale", "float32")
    scores = _scores(q, k, scale, s, head_dim, causal)
    j = te.reduce_axis((0, s.seqlen_k), name="j")
    row_max = te.compute(
        (s.batch, s.heads, s.seqlen_q), lambda b, h, i: te.max(scores[b, h, i, j], axis=j), name="row_max"
    )
    # te.max starts from the lowest finite float, so a row that sees no key has a finite max and
    # exp(-inf - max) = 0 everywhere: row_sum = 0 marks it (out = 0, lse = -inf below).
    probs_unnorm = te.compute(
        scores.shape, lambda b, h, i, jj: te.exp(scores[b, h, i, jj] - row_max[b, h, i]), name="p_unnorm"
    )
    j2 = te.reduce_axis((0, s.seqlen_k), name="j2")
    row_sum = te.compute(
        row_max.shape, lambda b, h, i: te.sum(probs_unnorm[b, h, i, j2], axis=j2), name="row_sum"
    )
    j3 = te.reduce_axis((0, s.seqlen_k), name="j3")
    pv = te.compute(
        (s.batch, s.seqlen_q, s.heads, head_dim),
        lambda b, i, h, dd: te.sum(
            probs_unnorm[b, h, i, j3] * v[b, j3, h // group, dd].astype("float32"), axis=j3
        ),
        name="pv",
    )
    out = te.compute(
        pv.shape,
        lambda b, i, h, dd: tirx.Select(
            row_sum[b, h, i] > _f32(0.0), pv[b, i, h, dd] / row_sum[b, h, i], _f32(0.0)
        ).astype(dtype),
        name="out",
    )
    lse = te.compute(
        row_max.shape,
        lambda b, h, i: tirx.Select(
            row_sum[b, h, i] > _f32(0.0), row_max[b, h, i] + te.log(row_sum[b, h, i]), _f32(NEG_INF)
        ),
        name="lse",
    )
    return [q, k, v, out, lse, scale], s


def backward_te(head_dim: int, dtype: str, causal: bool):
    """Standard attention backward (stores P and dS, N x N each).

    Returns ``(args, shapes)`` with args = dout, q, k, v, out, lse, dq, dk, dv, scale.
    """
    s = Shapes.symbolic()
    group = s.heads // s.heads_k
    q, k, v = _qkv_placeholders(s, head_dim, dtype)
    dout = te.placeholder((s.batch, s.seqlen_q, s.heads, head_dim), dtype, name="dout")
    out = te.placeholder((s.batch, s.seqlen_q, s.heads, head_dim), dtype, name="out")
    lse = te.placeholder((s.batch, s.heads, s.seqlen_q), "float32", name="lse")
    scale = tirx.Var("softmax_scale", "float32")
    f32 = "float32"

    dd = te.reduce_axis((0, head_dim), name="dd")
    delta = te.compute(
        (s.batch, s.heads, s.seqlen_q),
        lambda b, h, i: te.sum(dout[b, i, h, dd].astype(f32) * out[b, i, h, dd].astype(f32), axis=dd),
        name="delta",
    )
    scores = _scores(q, k, scale, s, head_dim, causal)
    probs = te.compute(
        scores.shape,
        lambda b, h, i, j: tirx.Select(
            scores[b, h, i, j] == _f32(NEG_INF), _f32(0.0), te.exp(scores[b, h, i, j] - lse[b, h, i])
        ),
        name="probs",
    )
    d1 = te.reduce_axis((0, head_dim), name="d1")
    dprobs = te.compute(
        scores.shape,
        lambda b, h, i, j: te.sum(
            dout[b, i, h, d1].astype(f32) * v[b, j, h // group, d1].astype(f32), axis=d1
        ),
        name="dprobs",
    )
    dscores = te.compute(
        scores.shape,
        lambda b, h, i, j: grad_scores(probs[b, h, i, j], dprobs[b, h, i, j], delta[b, h, i]),
        name="dscores",
    )
    jq = te.reduce_axis((0, s.seqlen_k), name="jq")
    dq_sum = te.compute(
        q.shape,
        lambda b, i, h, d: te.sum(dscores[b, h, i, jq] * k[b, jq, h // group, d].astype(f32), axis=jq),
        name="dq_sum",
    )
    # K/V head hk receives the gradients of every query head of its group (GQA/MQA).
    gk = te.reduce_axis((0, group), name="gk")
    ik = te.reduce_axis((0, s.seqlen_q), name="ik")
    dk_sum = te.compute(
        k.shape,
        lambda b, j, hk, d: te.sum(
            dscores[b, hk * group + gk, ik, j] * q[b, ik, hk * group + gk, d].astype(f32), axis=[gk, ik]
        ),
        name="dk_sum",
    )
    gv = te.reduce_axis((0, group), name="gv")
    iv = te.reduce_axis((0, s.seqlen_q), name="iv")
    dv_sum = te.compute(
        v.shape,
        lambda b, j, hk, d: te.sum(
            probs[b, hk * group + gv, iv, j] * dout[b, iv, hk * group + gv, d].astype(f32), axis=[gv, iv]
        ),
        name="dv_sum",
    )
    dq = te.compute(q.shape, lambda *i: (scale * dq_sum(*i)).astype(dtype), name="dq")
    dk = te.compute(k.shape, lambda *i: (scale * dk_sum(*i)).astype(dtype), name="dk")
    dv = te.compute(v.shape, lambda *i: dv_sum(*i).astype(dtype), name="dv")
    return [dout, q, k, v, out, lse, dq, dk, dv, scale], s


def standard_forward(head_dim: int, dtype: str, causal: bool) -> tirx.PrimFunc:
    args, _ = forward_te(head_dim, dtype, causal)
    return te.create_prim_func(args).with_attr("global_symbol", "standard_fwd")


def standard_backward(head_dim: int, dtype: str, causal: bool) -> tirx.PrimFunc:
    args, _ = backward_te(head_dim, dtype, causal)
    return te.create_prim_func(args).with_attr("global_symbol", "standard_bwd")
