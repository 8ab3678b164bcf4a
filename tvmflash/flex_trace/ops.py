"""The op table: what torch's decompositions lower for us, and a handler (aten op -> TIR) for
each op they leave.

``DECOMPOSITIONS`` is the table ``make_fx`` traces with (``trace.py``), chosen op by op with
``get_decompositions``. Not ``core_aten_decompositions()`` whole: it keeps ``gelu`` and
``leaky_relu`` (core ops) and lowers ``slice_backward`` to ``slice_scatter`` and ``empty_like``
to ``empty_permuted``, each needing a handler again (tried on the test galleries). Not torch's
whole table either: it decomposes ``tanh``/``sigmoid``/``exp`` into prims (the kernels substitute
polynomials for those ops, ``INTRINSICS``), and its refs of ``relu``, ``nan_to_num``, ``sign``,
``copysign``, ``where.Scalar*``, ``mean`` leave ``prims.*`` ops. Every op listed lowers to ops
handled below (the galleries in tests/test_flex_trace.py trace each one). Kept as handlers:

* ``index`` / ``index_put`` / ``select_backward`` / ``slice_backward``: reads of captured
  tensors clamp their indices into range, and their gradients are scatter-add terms (``_Acc``);
  torch's decompositions of the backward ops give ``select_scatter`` / ``slice_scatter``.
* ``div`` with a rounding mode, ``remainder``, ``fmod``: integer division by zero gives 0
  (torch raises), float floor division is exact; torch's refs go to prims.
* ``relu``, ``nan_to_num``, ``copysign``, ``sign``, ``mean``: see above (prims).
* ``exp``, ``exp2``, ``tanh``, ``sigmoid`` and the other float functions: through ``INTRINSICS``.
* ``pow``: small integer exponents as products, +-1/2 as sqrt/rsqrt, like torch's kernel.
* ``_to_copy``: float -> int casts saturate (undefined in C).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from tvm import tirx

from .values import (
    _MAX_UNROLL,
    FlexTraceError,
    _Acc,
    _all_indices,
    _broadcast_index,
    _cast,
    _const,
    _dtype_of,
    _is_float,
    _opmath,
    _T,
    _tvm_dtype,
)

_aten = torch.ops.aten
# Ops that torch's own decompositions lower to ops handled below (overloads included).
DECOMPOSED_OPS = (
    # the vjp graph's backward ops (silu_backward: torch lowers it itself, to sigmoid)
    _aten.tanh_backward, _aten.sigmoid_backward, _aten.threshold_backward, _aten.gelu_backward,
    _aten.softplus_backward, _aten.leaky_relu_backward,
    # activations and composite float functions
    _aten.gelu, _aten.silu, _aten.softplus, _aten.leaky_relu, _aten.logaddexp, _aten.lerp,
    _aten.clamp_min, _aten.clamp_max, _aten.frac, _aten.sgn, _aten.isposinf, _aten.isneginf,
    # arithmetic, selection, constants and views
    _aten.rsub, _aten.floor_divide, _aten.masked_fill, _aten.fill, _aten.zeros, _aten.ones,
    _aten.zeros_like, _aten.ones_like, _aten.new_zeros, _aten.new_ones, _aten.new_full, _aten.arange.default,
    _aten.arange.start, _aten.transpose, _aten.t, _aten.detach, _aten._unsafe_view,
)
DECOMPOSITIONS = get_decompositions(list(DECOMPOSED_OPS))


class _Ctx:
    """What the handlers may read: the node, its meta, the intrinsic table, the captured sizes."""

    def __init__(self, what: str, intrinsics: Mapping[str, Callable]):
        self.what = what
        self.intrinsics = intrinsics
        self.node: fx.Node | None = None

    def fn(self, name: str) -> Callable:
        return self.intrinsics[name]

    @property
    def out_meta(self):
        return self.node.meta.get("val")

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.out_meta.shape)

    @property
    def out_dtype(self) -> torch.dtype:
        return self.out_meta.dtype

    def fail(self, message: str):
        raise FlexTraceError(f"{self.what}: {message}")


_HANDLERS: dict[str, Callable] = {}


def _handles(*names: str):
    def register(fn):
        for name in names:
            _HANDLERS[name] = fn
        return fn

    return register


# --- helpers for handlers ---------------------------------------------------------------------


def _is_num(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, _T)


def _elem(x, idx, out_shape, dtype: str) -> tirx.PrimExpr:
    """Element of operand ``x`` (a _T or a Python number) at ``idx`` of the broadcast output."""
    if isinstance(x, _T):
        return _cast(x.at(_broadcast_index(idx, x.shape, out_shape)), dtype)
    return _const(x, dtype)


def _meta_of(x):
    if isinstance(x, _T):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _result_type(*xs) -> str:
    """torch's type promotion of the operands (0-d vs dimensioned tensors vs Python numbers)."""
    dtype = None
    metas = [_meta_of(x) for x in xs if x is not None]
    if len(metas) == 1:
        m = metas[0]
        return _tvm_dtype(m.dtype if isinstance(m, torch.Tensor) else torch.tensor(m).dtype)
    acc = metas[0]
    for m in metas[1:]:
        dtype = torch.result_type(acc, m)
        acc = torch.empty((), dtype=dtype, device="meta") if not isinstance(acc, torch.Tensor) or acc.dim() == 0 \
            else torch.empty(acc.shape, dtype=dtype, device="meta")
    return _tvm_dtype(dtype)


def _map(ctx: _Ctx, operands, fn, compute: str | None = None, shape=None, dtype=None) -> _T:
    """Elementwise op: operands cast to ``compute`` (default: the output's opmath dtype)."""
    shape = ctx.out_shape if shape is None else shape
    dtype = ctx.out_dtype if dtype is None else dtype
    out = _tvm_dtype(dtype)
    compute = _opmath(out) if compute is None else compute

    def at(idx):
        return _cast(fn(*[_elem(x, idx, shape, compute) for x in operands]), out)

    if shape == ():
        return _T.scalar(at(()), dtype)
    return _T(shape, dtype, at)


def _float_compute(ctx: _Ctx) -> str:
    out = _tvm_dtype(ctx.out_dtype)
    if not _is_float(out):
        ctx.fail(f"expected a floating-point result, got {ctx.out_dtype}")
    return _opmath(out)


def _any_acc(*xs) -> bool:
    return any(isinstance(x, _Acc) for x in xs)


# --- gradient accumulators ---------------------------------------------------------------------


def _acc_scale(ctx: _Ctx, acc: _Acc, other, op) -> _Acc:
    """acc * other or acc / other, elementwise: each term's value times other at its index."""
    out = _tvm_dtype(ctx.out_dtype)
    compute = _opmath(out)
    if isinstance(other, _T) and len(other.shape) > len(acc.shape):
        ctx.fail("a gradient is broadcast to a larger shape")
    terms = []
    for idx, value in acc.terms:
        o = _elem(other, idx, acc.shape, compute) if isinstance(other, _T) else _const(other, compute)
        terms.append((idx, _cast(op(_cast(value, compute), o), out)))
    return _Acc(acc.shape, ctx.out_dtype, terms)


def _as_acc(ctx: _Ctx, x) -> _Acc:
    """A dense value joining a gradient sum: zeros vanish, small tensors become terms."""
    if isinstance(x, _Acc):
        return x
    if isinstance(x, _T) and x.const == 0:
        return _Acc(x.shape, x.dtype, [])
    if isinstance(x, _T) and x.numel <= _MAX_UNROLL:
        terms = []
        for ix in _all_indices(x.shape):
            ix = tuple(_const(i, "int64") for i in ix)
            terms.append((ix, x.at(ix)))
        return _Acc(x.shape, x.dtype, terms)
    ctx.fail("a gradient mixes a scatter-add with a large dense tensor")


def _acc_add(ctx: _Ctx, a, b, alpha) -> _Acc:
    """a + alpha * b where either is a gradient scatter-add: the terms of both."""
    a, b = _as_acc(ctx, a), _as_acc(ctx, b)
    out = _tvm_dtype(ctx.out_dtype)
    terms = [(i, _cast(v, out)) for i, v in a.terms]
    for i, v in b.terms:
        v = _cast(v, out)
        terms.append((i, v if alpha == 1 else v * _const(alpha, out)))
    return _Acc(ctx.out_shape, ctx.out_dtype, terms)


# --- arithmetic -------------------------------------------------------------------------------


@_handles("aten.add")
def _add(ctx, a, b, *, alpha=1):
    if _any_acc(a, b):
        return _acc_add(ctx, a, b, alpha)
    if alpha != 1:
        return _map(ctx, [a, b], lambda x, y: x + y * _const(alpha, _dtype_of(y)))
    if isinstance(b, _T) and b.const == 0 and b.shape == ctx.out_shape == () and isinstance(a, _T):
        return _map(ctx, [a], lambda x: x)
    return _map(ctx, [a, b], lambda x, y: x + y)


@_handles("aten.sub")
def _sub(ctx, a, b, *, alpha=1):
    if _any_acc(a, b):
        return _acc_add(ctx, a, b, -alpha)
    return _map(ctx, [a, b], lambda x, y: x - (y * _const(alpha, _dtype_of(y)) if alpha != 1 else y))


@_handles("aten.mul")
def _mul(ctx, a, b):
    if isinstance(a, _Acc) and isinstance(b, _Acc):
        ctx.fail("a product of two gradients")
    if isinstance(a, _Acc):
        return _acc_scale(ctx, a, b, lambda x, y: x * y)
    if isinstance(b, _Acc):
        return _acc_scale(ctx, b, a, lambda x, y: y * x)
    for one, other in ((a, b), (b, a)):
        is_one = (one.const if isinstance(one, _T) else one) == 1 and not isinstance(one, bool)
        if is_one and isinstance(other, _T) and other.shape == ctx.out_shape and (
            not isinstance(one, _T) or one.shape == ()
        ):
            return _map(ctx, [other], lambda x: x)
    return _map(ctx, [a, b], lambda x, y: x * y)


def _guard_zero(num, den, op):
    """Integer a // b etc. with b == 0 -> 0 instead of a crash (torch raises)."""
    if isinstance(den, tirx.IntImm):
        if den.value == 0:
            return _const(0, _dtype_of(num))
        return op(num, den)
    zero = _const(0, _dtype_of(den))
    is_zero = tirx.EQ(den, zero)
    safe = tirx.Select(is_zero, _const(1, _dtype_of(den)), den)
    return tirx.Select(is_zero, _const(0, _dtype_of(num)), op(num, safe))


def _float_floor_div(x, y, fmod):
    """torch's floor division of floats (div_floor_floating): exact where floor(x / y) is not,
    e.g. 1.0 // 0.1 is 9 (the quotient rounds up to 10.0 before the floor)."""
    dt = _dtype_of(x)
    zero = _const(0, dt)
    mod = fmod(x, y)
    div = (x - mod) / y
    div = tirx.Select(tirx.And(tirx.NE(mod, zero), _bool_xor(y < zero, mod < zero)), div - _const(1, dt), div)
    floored = tirx.floor(div)
    floored = tirx.Select(div - floored > _const(0.5, dt), floored + _const(1, dt), floored)
    result = tirx.Select(tirx.NE(div, zero), floored, tirx.copysign(zero, x / y))
    return tirx.Select(tirx.EQ(y, zero), x / y, result)


@_handles("aten.div")
def _div(ctx, a, b, *, rounding_mode=None):
    if isinstance(b, _Acc):
        ctx.fail("division by a gradient")
    if isinstance(a, _Acc):
        if rounding_mode is not None:
            ctx.fail("rounded division of a gradient")
        return _acc_scale(ctx, a, b, lambda x, y: x / y)
    out = _tvm_dtype(ctx.out_dtype)
    if rounding_mode is None:
        if isinstance(b, _T) and b.const == 1 and b.shape == () and isinstance(a, _T) and a.shape == ctx.out_shape:
            return _map(ctx, [a], lambda x: x)
        return _map(ctx, [a, b], lambda x, y: x / y)
    if _is_float(out):
        if rounding_mode == "trunc":
            return _map(ctx, [a, b], lambda x, y: ctx.fn("trunc")(x / y))
        return _map(ctx, [a, b], lambda x, y: _float_floor_div(x, y, ctx.fn("fmod")))
    op = tirx.truncdiv if rounding_mode == "trunc" else tirx.floordiv
    return _map(ctx, [a, b], lambda x, y: _guard_zero(x, y, op))


@_handles("aten.remainder")
def _remainder(ctx, a, b):
    out = _tvm_dtype(ctx.out_dtype)
    if not _is_float(out):
        return _map(ctx, [a, b], lambda x, y: _guard_zero(x, y, tirx.floormod))
    fmod = ctx.fn("fmod")

    def rem(x, y):  # torch: m = fmod(x, y); m += y where m != 0 and sign(m) != sign(y)
        m = fmod(x, y)
        zero = _const(0, _dtype_of(m))
        fix = tirx.And(tirx.NE(m, zero), _bool_xor(m < zero, y < zero))
        return tirx.Select(fix, m + y, m)

    return _map(ctx, [a, b], rem)


@_handles("aten.fmod")
def _fmod(ctx, a, b):
    out = _tvm_dtype(ctx.out_dtype)
    if not _is_float(out):
        return _map(ctx, [a, b], lambda x, y: _guard_zero(x, y, tirx.truncmod))
    return _map(ctx, [a, b], ctx.fn("fmod"))


@_handles("aten.neg")
def _neg(ctx, a):
    if isinstance(a, _Acc):
        return _acc_scale(ctx, a, -1, lambda x, y: x * y)
    if ctx.out_dtype == torch.bool:
        ctx.fail("negation of a bool tensor (use ~ / logical_not)")
    return _map(ctx, [a], lambda x: -x)


@_handles("aten.abs")
def _abs(ctx, a):
    return _map(ctx, [a], tirx.abs)


@_handles("aten.sign")
def _sign(ctx, a):
    def sign(x):
        dt = _dtype_of(x)
        if dt == "bool":
            return x
        zero = _const(0, dt)
        return tirx.Select(x > zero, _const(1, dt), tirx.Select(x < zero, _const(-1, dt), x if _is_float(dt) else zero))

    return _map(ctx, [a], sign)


@_handles("aten.reciprocal")
def _reciprocal(ctx, a):
    c = _float_compute(ctx)
    return _map(ctx, [a], lambda x: _const(1, c) / x, compute=c)


def _pow_scalar_exponent(ctx, base, e):
    """x ** e for a constant e: x*x etc. for small integers (as torch's pow kernel), sqrt/rsqrt."""
    out = _tvm_dtype(ctx.out_dtype)
    compute = _opmath(out)
    if math.isfinite(e) and float(e) == int(e) and abs(e) <= 4 and (_is_float(out) or e >= 0):
        n = int(abs(e))

        def ipow(x):
            if n == 0:
                return _const(1, _dtype_of(x))
            r = x
            for _ in range(n - 1):
                r = r * x
            return _const(1, _dtype_of(x)) / r if e < 0 else r

        return _map(ctx, [base], ipow)
    if not _is_float(out):
        ctx.fail(f"integer power with exponent {e}")
    if e == 0.5:
        return _map(ctx, [base], ctx.fn("sqrt"))
    if e == -0.5:
        return _map(ctx, [base], ctx.fn("rsqrt"))
    return _map(ctx, [base], lambda x: ctx.fn("pow")(x, _const(e, compute)))


@_handles("aten.pow")
def _pow(ctx, a, b):
    if _is_num(b):
        return _pow_scalar_exponent(ctx, a, b)
    if isinstance(b, _T) and b.const is not None and b.shape == ():
        return _pow_scalar_exponent(ctx, a, b.const)
    out = _tvm_dtype(ctx.out_dtype)
    if not _is_float(out):
        ctx.fail("integer power with a tensor exponent")
    if _is_num(a) and float(a) == 2.0:
        return _map(ctx, [b], ctx.fn("exp2"))
    return _map(ctx, [a, b], ctx.fn("pow"))


def _unary_float(name: str):
    def handler(ctx, a):
        c = _float_compute(ctx)
        return _map(ctx, [a], ctx.fn(name), compute=c)

    return handler


for _name in ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "tanh", "sigmoid", "erf",
              "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh"):
    _handles(f"aten.{_name}")(_unary_float(_name))


def _rounding(name: str):
    def handler(ctx, a, *rest, decimals=0):
        if rest or decimals:
            ctx.fail(f"{name} with decimals")
        if not _is_float(_tvm_dtype(ctx.out_dtype)):
            return _map(ctx, [a], lambda x: x)
        return _map(ctx, [a], ctx.fn(name))

    return handler


for _name in ("floor", "ceil", "trunc", "round"):
    _handles(f"aten.{_name}")(_rounding(_name))


@_handles("aten.atan2")
def _atan2(ctx, a, b):
    c = _float_compute(ctx)
    return _map(ctx, [a, b], ctx.fn("atan2"), compute=c)


@_handles("aten.relu")
def _relu(ctx, a):
    return _map(ctx, [a], lambda x: tirx.max(x, _const(0, _dtype_of(x))))


def _minmax(fn):
    def handler(ctx, a, b):
        return _map(ctx, [a, b], fn)

    return handler


_handles("aten.maximum", "aten.fmax")(_minmax(tirx.max))
_handles("aten.minimum", "aten.fmin")(_minmax(tirx.min))


@_handles("aten.clamp")
def _clamp(ctx, a, min=None, max=None):  # noqa: A002 - torch's argument names
    def clamp(x, lo=None, hi=None):
        if lo is not None:
            x = tirx.max(x, lo)
        if hi is not None:
            x = tirx.min(x, hi)
        return x

    operands = [a] + [v for v in (min, max) if v is not None]
    if min is not None and max is not None:
        return _map(ctx, operands, lambda x, lo, hi: clamp(x, lo, hi))
    if min is not None:
        return _map(ctx, operands, lambda x, lo: clamp(x, lo=lo))
    if max is not None:
        return _map(ctx, operands, lambda x, hi: clamp(x, hi=hi))
    return _map(ctx, [a], lambda x: x)


@_handles("aten.copysign")
def _copysign(ctx, a, b):
    return _map(ctx, [a, b], tirx.copysign, compute=_float_compute(ctx))


@_handles("aten.nan_to_num")
def _nan_to_num(ctx, a, nan=None, posinf=None, neginf=None):
    out = _tvm_dtype(ctx.out_dtype)
    if not _is_float(out):
        return _map(ctx, [a], lambda x: x)
    finfo = torch.finfo(ctx.out_dtype)
    hi = finfo.max if posinf is None else posinf
    lo = finfo.min if neginf is None else neginf

    def fix(x):
        dt = _dtype_of(x)
        x = tirx.Select(tirx.isnan(x), _const(0.0 if nan is None else nan, dt), x)
        x = tirx.Select(tirx.EQ(x, _const(math.inf, dt)), _const(hi, dt), x)
        return tirx.Select(tirx.EQ(x, _const(-math.inf, dt)), _const(lo, dt), x)

    return _map(ctx, [a], fix, compute=out)


# --- comparisons and logic --------------------------------------------------------------------


def _bool_xor(x, y):
    return tirx.NE(tirx.Cast("int8", x), tirx.Cast("int8", y))  # not NE on bools: see _compare


def _compare(op):
    def handler(ctx, a, b):
        compute = _result_type(a, b)
        if compute == "bool":  # TVM's LLVM codegen emits fcmp for == / != on bools: compare as int8
            compute = "int8"
        if compute in ("float16", "bfloat16"):
            compute = "float32"  # exact: both operands are representable
        return _map(ctx, [a, b], op, compute=compute)

    return handler


_handles("aten.eq")(_compare(tirx.EQ))
_handles("aten.ne")(_compare(tirx.NE))
_handles("aten.lt")(_compare(lambda x, y: x < y))
_handles("aten.le")(_compare(lambda x, y: x <= y))
_handles("aten.gt")(_compare(lambda x, y: x > y))
_handles("aten.ge")(_compare(lambda x, y: x >= y))


def _float_test(fn):
    def handler(ctx, a):
        dt = _tvm_dtype(a.dtype) if isinstance(a, _T) else "float64"
        if not _is_float(dt):
            return _map(ctx, [a], lambda x: tirx.const(fn is tirx.isfinite, "bool"), compute=dt)
        return _map(ctx, [a], fn, compute=_opmath(dt))

    return handler


_handles("aten.isnan")(_float_test(tirx.isnan))
_handles("aten.isinf")(_float_test(tirx.isinf))


@_handles("aten.logical_and")
def _logical_and(ctx, a, b):
    return _map(ctx, [a, b], tirx.And, compute="bool")


@_handles("aten.logical_or")
def _logical_or(ctx, a, b):
    return _map(ctx, [a, b], tirx.Or, compute="bool")


@_handles("aten.logical_xor")
def _logical_xor(ctx, a, b):
    return _map(ctx, [a, b], _bool_xor, compute="bool")


@_handles("aten.logical_not")
def _logical_not(ctx, a):
    return _map(ctx, [a], tirx.Not, compute="bool")


def _bitwise(bool_op, int_op):
    def handler(ctx, a, b):
        if ctx.out_dtype == torch.bool:
            return _map(ctx, [a, b], bool_op, compute="bool")
        if _is_float(_tvm_dtype(ctx.out_dtype)):
            ctx.fail("bitwise op on floating-point values")
        return _map(ctx, [a, b], int_op)

    return handler


_handles("aten.bitwise_and")(_bitwise(tirx.And, tirx.bitwise_and))
_handles("aten.bitwise_or")(_bitwise(tirx.Or, tirx.bitwise_or))
_handles("aten.bitwise_xor")(_bitwise(_bool_xor, tirx.bitwise_xor))


@_handles("aten.bitwise_not")
def _bitwise_not(ctx, a):
    if ctx.out_dtype == torch.bool:
        return _map(ctx, [a], tirx.Not, compute="bool")
    return _map(ctx, [a], tirx.bitwise_not)


@_handles("aten.where")
def _where_op(ctx, cond, a, b):
    if _any_acc(a, b):
        # where(c, grad, 0) on a scatter-add: each term keeps its value where c holds.
        acc, other, keep_true = (a, b, True) if isinstance(a, _Acc) else (b, a, False)
        if not ((_is_num(other) and other == 0) or (isinstance(other, _T) and other.const == 0)):
            ctx.fail("torch.where between a gradient and a non-zero value")
        out = _tvm_dtype(ctx.out_dtype)
        terms = []
        for idx, value in acc.terms:
            c = _elem(cond, idx, acc.shape, "bool")
            v = _cast(value, out)
            terms.append((idx, tirx.Select(c, v, _const(0, out)) if keep_true else tirx.Select(c, _const(0, out), v)))
        return _Acc(acc.shape, ctx.out_dtype, terms)
    compute = _tvm_dtype(ctx.out_dtype)
    shape = ctx.out_shape

    def at(idx):
        c = _elem(cond, idx, shape, "bool")
        return tirx.Select(c, _elem(a, idx, shape, compute), _elem(b, idx, shape, compute))

    return _T.scalar(at(()), ctx.out_dtype) if shape == () else _T(shape, ctx.out_dtype, at)


# --- type conversions, copies, constants -------------------------------------------------------


@_handles("aten._to_copy", "prims.convert_element_type")
def _convert(ctx, a, *args, **kwargs):
    dtype = ctx.out_dtype
    if isinstance(a, _Acc):
        out = _tvm_dtype(dtype)
        return _Acc(a.shape, dtype, [(i, _cast(v, out)) for i, v in a.terms])
    if not isinstance(a, _T):
        return _T.full(ctx.out_shape, dtype, a)
    if a.dtype == dtype:
        return a
    out = _tvm_dtype(dtype)
    if a.const is not None:
        return _T.full(a.shape, dtype, _cast(_const(a.const, a.tvm_dtype), out).value)
    return _T(a.shape, dtype, lambda idx: _cast(a.at(idx), out)) if a.shape else _T.scalar(_cast(a.expr, out), dtype)


@_handles("aten.copy")
def _copy(ctx, dest, src, *args):
    return _map(ctx, [src], lambda x: x)


@_handles("aten.clone", "aten.alias", "aten.lift_fresh_copy", "aten.lift_fresh")
def _identity(ctx, a, *args, **kwargs):
    return a


@_handles("aten._assert_tensor_metadata", "aten._assert_scalar", "aten._assert_async")
def _no_op(ctx, *args, **kwargs):
    return None


def _fill(ctx, value):
    if isinstance(value, _T):
        if value.const is None:
            return _map(ctx, [value], lambda x: x)
        value = value.const
    return _T.full(ctx.out_shape, ctx.out_dtype, value)


@_handles("aten.full")
def _full(ctx, size, fill_value, **kwargs):
    return _fill(ctx, fill_value)


@_handles("aten.full_like")
def _full_like(ctx, a, value, **kwargs):
    return _fill(ctx, value)


@_handles("aten.scalar_tensor")
def _scalar_tensor(ctx, value, **kwargs):
    return _fill(ctx, value)


@_handles("aten.empty_like", "aten.new_empty")
def _empty(ctx, *args, **kwargs):
    # Not decomposed (torch's refs give empty_strided). Only seen in vjp graphs as an accumulator
    # that is then fully written: zeros are safe.
    return _fill(ctx, 0)


@_handles("aten.arange")
def _arange(ctx, start, end, step=1, **kwargs):  # arange.start_step: the decompositions give only this form
    out = _tvm_dtype(ctx.out_dtype)
    c = _opmath(out)
    return _T(ctx.out_shape, ctx.out_dtype,
              lambda idx: _cast(_const(start, c) + _cast(idx[0], c) * _const(step, c), out))
