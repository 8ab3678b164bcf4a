"""The values the translator computes with: dtypes, torch-like casts, lazily indexed tensors,
gradient scatter-adds, and the table of transcendental functions (``INTRINSICS``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from tvm import tirx

# Bump when the emitted expressions change for the same traced graphs: it is part of every key.
# 2: the graphs are traced with torch's decompositions (ops.DECOMPOSITIONS).
TRANSLATOR_VERSION = "2"

# Index and score dtypes the functions are traced with (those of torch's flex_attention).
INDEX_DTYPE = torch.int32
SCORE_DTYPE = torch.float32

# Expanding a non-scalar value element by element (a small reduction, a gradient landing on a
# whole small tensor) is allowed up to this many elements.
_MAX_UNROLL = 256


class FlexTraceError(ValueError):
    """A score_mod / mask_mod that tvmflash cannot turn into a kernel; the message says why."""


_TVM_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.bool: "bool",
}
_TORCH_DTYPES = {v: k for k, v in _TVM_DTYPES.items()}


def _tvm_dtype(dtype: torch.dtype) -> str:
    try:
        return _TVM_DTYPES[dtype]
    except KeyError:
        raise FlexTraceError(f"tvmflash cannot compute with {dtype} values") from None


def _dtype_of(expr) -> str:
    return str(expr.ty.dtype)


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _opmath(dtype: str) -> str:
    """Dtype an elementwise op computes in: float32 for half types (torch's CPU 'opmath')."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _const(value, dtype: str) -> tirx.PrimExpr:
    if dtype == "bool":
        return tirx.const(bool(value), "bool")
    if _is_float(dtype):
        return tirx.const(float(value), dtype)
    return tirx.const(int(value), dtype)


def _int_range(dtype: str) -> tuple[int, int]:
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


def _cast(expr, dtype: str) -> tirx.PrimExpr:
    """Convert like torch's ``.to(dtype)``, but well defined where C is not.

    To bool: ``x != 0``. Float to integer: truncation toward zero, saturated into the integer
    range and NaN -> 0 (out of range is undefined behaviour in C/LLVM and could reach an index).
    """
    src = _dtype_of(expr)
    if src == dtype:
        return expr
    if isinstance(expr, (tirx.IntImm, tirx.FloatImm)):
        value = expr.value
        if dtype == "bool":
            return tirx.const(bool(value), "bool")
        if _is_float(dtype):
            return tirx.const(float(value), dtype)
        if isinstance(value, float):
            if math.isnan(value):
                value = 0
            lo, hi = _int_range(dtype)
            value = int(min(max(value, lo), hi)) if math.isfinite(value) else (hi if value > 0 else lo)
        return tirx.const(int(value), dtype)
    if dtype == "bool":
        return tirx.NE(expr, _const(0, src))
    if src == "bool":
        return tirx.Cast(dtype, expr)
    if _is_float(src) and not _is_float(dtype):
        wide = "float32" if src in ("float16", "bfloat16") else src
        np_wide = np.float32 if wide == "float32" else np.float64
        lo, hi = _int_range(dtype)
        hi_f = np_wide(hi)
        if int(hi_f) > hi:  # 2**31 - 1 rounds up to 2**31 in float32: take the float below
            hi_f = np.nextafter(hi_f, np_wide(0))
        x = tirx.Cast(wide, expr) if wide != src else expr
        clamped = tirx.min(tirx.max(x, _const(lo, wide)), _const(float(hi_f), wide))
        return tirx.Select(tirx.isnan(x), _const(0, dtype), tirx.Cast(dtype, clamped))
    return tirx.Cast(dtype, expr)


# ----------------------------------------------------------------------------------------------
# The intrinsic table (substitute fast vectorizable versions here or per emit call)


def _taylor(x, coeffs):
    """sum_k coeffs[k] * x**k by Horner's rule."""
    dt = _dtype_of(x)
    acc = _const(coeffs[-1], dt)
    for c in reversed(coeffs[:-1]):
        acc = acc * x + _const(c, dt)
    return acc


def _expm1(x):
    """exp(x) - 1 (TIR has no expm1): Taylor polynomial for |x| < 1/2, where exp(x) - 1 cancels."""
    dt = _dtype_of(x)
    series = x * _taylor(x, [1.0 / math.factorial(k + 1) for k in range(10)])
    return tirx.Select(tirx.abs(x) < _const(0.5, dt), series, tirx.exp(x) - _const(1.0, dt))


def _sinh(x):
    """tirx.sinh/cosh have no LLVM lowering inside vectorized loops: from exp (Taylor near 0)."""
    dt = _dtype_of(x)
    x2 = x * x
    series = x * _taylor(x2, [1.0 / math.factorial(2 * k + 1) for k in range(6)])
    return tirx.Select(tirx.abs(x) < _const(0.5, dt), series, (tirx.exp(x) - tirx.exp(-x)) * _const(0.5, dt))


def _cosh(x):
    return (tirx.exp(x) + tirx.exp(-x)) * _const(0.5, _dtype_of(x))


INTRINSICS: dict[str, Callable[..., tirx.PrimExpr]] = {
    # float -> float, applied in the op's compute dtype (float32 for float16/bfloat16 inputs)
    "exp": tirx.exp,
    "exp2": tirx.exp2,
    "expm1": _expm1,
    "log": tirx.log,
    "log2": tirx.log2,
    "log10": tirx.log10,
    "log1p": tirx.log1p,
    "sqrt": tirx.sqrt,
    "rsqrt": tirx.rsqrt,
    "tanh": tirx.tanh,
    "sigmoid": tirx.sigmoid,
    "erf": tirx.erf,
    "sin": tirx.sin,
    "cos": tirx.cos,
    "tan": tirx.tan,
    "asin": tirx.asin,
    "acos": tirx.acos,
    "atan": tirx.atan,
    "sinh": _sinh,
    "cosh": _cosh,
    "atan2": tirx.atan2,
    "pow": tirx.power,
    "fmod": tirx.truncmod,  # float operands: LLVM frem (tirx.fmod has no CPU lowering)
    "floor": tirx.floor,
    "ceil": tirx.ceil,
    "trunc": tirx.trunc,
    "round": tirx.nearbyint,  # torch.round: half to even
}


# ----------------------------------------------------------------------------------------------
# Values of the translated graph


class _T:
    """A lazily indexed tensor: static shape, torch dtype, and the element at an index.

    ``const`` is the Python value when every element is known to equal it (zeros from
    ``new_zeros``, the upstream gradient 1.0 of ``emit_grad``); ``mul`` by 1 folds with it.
    """

    __slots__ = ("shape", "dtype", "_at", "const")

    def __init__(self, shape, dtype: torch.dtype, at: Callable, const=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self._at = at
        self.const = const

    @classmethod
    def scalar(cls, expr, dtype: torch.dtype, const=None) -> _T:
        return cls((), dtype, lambda idx: expr, const)

    @classmethod
    def full(cls, shape, dtype: torch.dtype, value) -> _T:
        expr = _const(value, _tvm_dtype(dtype))
        return cls(shape, dtype, lambda idx: expr, value)

    def at(self, idx) -> tirx.PrimExpr:
        return self._at(tuple(idx))

    @property
    def expr(self) -> tirx.PrimExpr:
        return self._at(())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tvm_dtype(self) -> str:
        return _tvm_dtype(self.dtype)


class _Acc:
    """A gradient being scattered into a tensor: sum over terms of value at index, zero elsewhere.

    What ``new_zeros`` + ``index_put(..., accumulate=True)`` describe in the vjp graph.
    """

    __slots__ = ("shape", "dtype", "terms")

    def __init__(self, shape, dtype: torch.dtype, terms):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.terms = list(terms)  # [(tuple of index exprs, value expr)]


def _all_indices(shape) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in ix) for ix in np.ndindex(*shape)] if shape else [()]


def _broadcast_index(idx, shape, out_shape) -> tuple:
    """Index into a tensor of ``shape`` broadcast to ``out_shape`` (right-aligned)."""
    offset = len(out_shape) - len(shape)
    return tuple(
        0 if size == 1 and out_shape[offset + k] != 1 else idx[offset + k] for k, size in enumerate(shape)
    )


def _ravel(idx, shape):
    lin = None
    for i, size in zip(idx, shape):
        if size == 1:
            continue
        lin = i if lin is None else lin * size + i
    return lin


def _unravel(lin, shape, dtype: str) -> tuple:
    out = []
    for size in reversed(shape):
        if size == 1 or lin is None:
            out.append(_const(0, dtype))
            continue
        out.append(tirx.floormod(lin, _const(size, dtype)))
        lin = tirx.floordiv(lin, _const(size, dtype))
    return tuple(reversed(out))


def _reshape_index(idx, from_shape, to_shape) -> tuple:
    """Index of the same (contiguous, row-major) element in a reshaped tensor."""
    from_core = [(i, s) for i, s in zip(idx, from_shape) if s != 1]
    to_core = [s for s in to_shape if s != 1]
    if [s for _, s in from_core] == to_core:  # only size-1 dims differ (squeeze/unsqueeze)
        it = iter(i for i, _ in from_core)
        return tuple(_const(0, "int64") if s == 1 else next(it) for s in to_shape)
    dtype = "int64"
    lin = _ravel([_cast(i, dtype) if not isinstance(i, int) else _const(i, dtype) for i in idx], from_shape)
    return _unravel(lin, to_shape, dtype)


