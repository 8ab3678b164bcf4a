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

How (the way torch's own flex_attention does it, ``torch/_higher_order_ops/flex_attention.py``):

1. ``make_fx`` traces the function on 0-d example tensors (score float32, indices int32, as
   ``trace_flex_attention`` does) in fake-tensor mode under ``TransformGetItemToIndex``, which
   turns ``table[h, q_idx]`` into ``aten.index.Tensor``. Fake mode never runs the function on
   real data, so an index that is out of range for the example values does not fail tracing.
2. Tensors the function closes over appear as ``get_attr`` constants of the traced graph; the
   tracer keeps the very tensor objects. 0-d tensors that do not require grad (``torch.tensor(8.)``
   inside the function, TransformGetItemToIndex's converted integer indices) are inlined as
   constants; every other tensor becomes a ``Captured`` kernel input, in order of first use in
   the graph, and is turned into an explicit graph input ("lifted").
3. The derivative comes from torch: ``make_fx`` traces ``torch.func.vjp`` of the lifted graph
   with respect to ``score`` and every captured tensor that requires grad (the joint graph).
   Its outputs are ``d score`` (``tanh_backward`` & co.) and, per captured tensor, the
   ``new_zeros`` + ``index_put(..., accumulate=True)`` scatter-adds that ``emit_captured_grads``
   turns into ``(name, index, value)`` terms.
4. Both graphs are translated node by node to TIR (``_HANDLERS``). Every value is a lazily
   indexed tensor (shape, dtype, element function), so views of captured tensors (``table[h]``
   then ``[q_idx]``) cost nothing; the result is one scalar expression. Types follow torch: the
   dtype of every node is the one the tracer recorded, integer math stays integer (floor/trunc
   division and remainders as torch defines them), and float16/bfloat16 ops compute in float32
   and round, like torch's CPU kernels.

Indices into captured tensors: negative indices wrap like torch; indices still out of range
(torch raises IndexError) are clamped into range, so a kernel never reads or writes out of
bounds; gradients of such reads go to the clamped element. A constant index out of range is a
trace-time error. Integer division or remainder by zero gives 0 (torch raises).

Transcendental functions go through ``INTRINSICS`` (``tirx.exp``, ``tirx.tanh``, ...). On CPUs
those become scalar libm calls inside vectorized loops; pass ``intrinsics={"exp": fast_exp}``
to any ``emit*`` method (or edit the table) to substitute vectorizable versions.

``apply_score_mod_dense`` / ``dense_mask`` evaluate the user functions with plain torch over
all ``(b, h, q_idx, kv_idx)`` (``torch.vmap``, float64 capable, differentiable): the dense
reference for tests.

Ops translated (``supported_ops()`` lists them; overloads and ``*_copy`` / in-place forms too):

* arithmetic: add sub rsub mul div (true, ``rounding_mode`` trunc/floor) floor_divide remainder
  fmod neg abs sign/sgn reciprocal square pow (x*x... for small integer exponents, sqrt/rsqrt
  for +-1/2) lerp copysign; min/max: maximum minimum fmax fmin clamp clamp_min clamp_max relu
* float functions (via ``INTRINSICS``): exp exp2 expm1 log log2 log10 log1p sqrt rsqrt tanh
  sigmoid erf sin cos tan asin acos atan atan2 sinh cosh floor ceil trunc round frac;
  gelu (erf/tanh) silu softplus leaky_relu logaddexp nan_to_num
* comparisons and logic: eq ne lt le gt ge isnan isinf isfinite isposinf isneginf,
  logical_and/or/xor/not, bitwise_and/or/xor/not (logical on bools), where masked_fill
* conversions and constants: _to_copy to convert_element_type type_as clone detach copy;
  full full_like fill zeros(_like) ones(_like) new_zeros/ones/full/empty scalar_tensor arange,
  Python numbers and 0-d tensor constants
* views and indexing: index.Tensor (integer tensor indices, any advanced-indexing layout),
  select slice view reshape squeeze unsqueeze flatten expand permute transpose; sum mean amax
  amin over small static tensors (unrolled)
* from the vjp graphs: tanh_backward sigmoid_backward threshold_backward gelu_backward
  silu_backward softplus_backward leaky_relu_backward, index_put (accumulate), select_backward,
  slice_backward, and sums of those

Where the TIR differs from torch on purpose: out-of-range indices clamp (torch raises), integer
division/remainder by zero gives 0 (torch raises), float -> int casts saturate and map NaN to 0
(undefined in C; x86 torch gives INT_MIN), and min/max/clamp follow TVM's ``Max``/``Min`` for
NaN operands (torch propagates NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import linecache
import math
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from tvm import tirx

__all__ = [
    "Captured",
    "FlexTraceError",
    "INTRINSICS",
    "TracedMaskMod",
    "TracedScoreMod",
    "apply_score_mod_dense",
    "dense_mask",
    "supported_ops",
    "trace_mask_mod",
    "trace_score_mod",
]

# Bump when the emitted expressions change for the same traced graphs: it is part of every key.
TRANSLATOR_VERSION = "1"

# Index and score dtypes the functions are traced with (those of torch's flex_attention).
INDEX_DTYPE = torch.int32
SCORE_DTYPE = torch.float32

# Expanding a non-scalar value element by element (a small reduction, a gradient landing on a
# whole small tensor) is allowed up to this many elements.
_MAX_UNROLL = 256


class FlexTraceError(ValueError):
    """A score_mod / mask_mod that tvmflash cannot turn into a kernel; the message says why."""


# ----------------------------------------------------------------------------------------------
# dtypes


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


# ----------------------------------------------------------------------------------------------
# The translator


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


def supported_ops() -> list[str]:
    """The aten/prims ops the translator handles (overloads of each included)."""
    return sorted(_HANDLERS)


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        return f"{packet._qualified_op_name.split('::')[0]}.{packet.__name__}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.split('::')[0]}.{target.__name__}"
    return getattr(target, "__qualname__", None) or str(target)


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, functools))


def _is_library_file(path: str) -> bool:
    """torch, this module and the standard library; user code may also live in site-packages
    or in a notebook cell ('<ipython-input-...>')."""
    path = os.path.abspath(path)
    if path == os.path.abspath(__file__) or path.startswith(_LIBRARY_DIRS[0]):
        return True
    return path.startswith(_LIBRARY_DIRS[1]) and "site-packages" not in path and "dist-packages" not in path


def _evaluate(gm: fx.GraphModule, inputs: Sequence, outputs: Sequence[int], ctx: _Ctx) -> list:
    """Translate the nodes that ``outputs`` (positions in the graph's output tuple) need."""
    nodes = list(gm.graph.nodes)
    out_node = nodes[-1]
    out_args = out_node.args[0]
    out_list = list(out_args) if isinstance(out_args, (tuple, list)) else [out_args]
    wanted = [out_list[i] for i in outputs]
    needed: set = set()
    stack = [a for a in wanted if isinstance(a, fx.Node)]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n, value in zip(placeholders, inputs):
        env[n] = value
    for n in nodes:
        if n not in needed or n.op == "placeholder":
            continue
        ctx.node = n
        if n.op == "get_attr":
            t = _fetch_attr(gm, n.target)
            if t.dim() != 0:
                ctx.fail(f"unexpected tensor constant of shape {tuple(t.shape)}")
            env[n] = _T.scalar(_const(t.item(), _tvm_dtype(t.dtype)), t.dtype, const=t.item())
            continue
        if n.op != "call_function":
            ctx.fail(f"unexpected graph node {n.op} {n.target}")
        name = _op_name(n.target)
        handler = _HANDLERS.get(name)
        if handler is None:
            _unsupported(ctx, name)
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        env[n] = handler(ctx, *args, **kwargs)
    ctx.node = None
    return [env[a] if isinstance(a, fx.Node) else a for a in wanted]


def _fetch_attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _unsupported(ctx: _Ctx, name: str, location: str = ""):
    if name in ("aten._local_scalar_dense", "aten.item") or "sym" in name:
        ctx.fail(f"uses {name} (a Python number taken from a tensor){location}, which cannot be traced; "
                 "keep values as tensors and use torch.where for conditions")
    public = [op for op in supported_ops() if "._" not in op]
    location = f" ({location.strip()})" if location else ""
    raise FlexTraceError(f"{ctx.what} uses {name}, which tvmflash cannot translate{location}; supported: "
                         f"{', '.join(public)}")


def _locate_op(fn, example, name: str) -> str:
    """' (at file.py:12: `source`)': where the function first calls aten op ``name``.

    Only on the error path: runs the function eagerly on the example tensors under a dispatch
    mode that records the Python stack at that op (make_fx keeps no user frames for plain
    functions).
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.utils._python_dispatch import TorchDispatchMode

    class Finder(TorchDispatchMode):
        stack = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if Finder.stack is None and _op_name(func).rstrip("_") == name.rstrip("_"):
                Finder.stack = traceback.extract_stack()
            return func(*args, **(kwargs or {}))

    try:
        with TransformGetItemToIndex(), Finder():
            fn(*example)
    except Exception:  # noqa: BLE001 - best effort: the message is complete without a location
        pass
    frames = [f for f in Finder.stack or [] if not _is_library_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno}: `{(f.line or '').strip()}`"


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


@_handles("aten.rsub")
def _rsub(ctx, a, b, *, alpha=1):
    return _map(ctx, [a, b], lambda x, y: y - (x * _const(alpha, _dtype_of(x)) if alpha != 1 else x))


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


@_handles("aten.div", "aten.true_divide")
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


@_handles("aten.floor_divide")
def _floor_divide(ctx, a, b):
    return _div(ctx, a, b, rounding_mode="floor")


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


@_handles("aten.sign", "aten.sgn")
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


@_handles("aten.square")
def _square(ctx, a):
    return _map(ctx, [a], lambda x: x * x)


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
_handles("aten.fix")(_rounding("trunc"))


@_handles("aten.frac")
def _frac(ctx, a):
    return _map(ctx, [a], lambda x: x - ctx.fn("trunc")(x))


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


@_handles("aten.clamp", "aten.clip")
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


@_handles("aten.clamp_min")
def _clamp_min(ctx, a, lo):
    return _clamp(ctx, a, min=lo)


@_handles("aten.clamp_max")
def _clamp_max(ctx, a, hi):
    return _clamp(ctx, a, max=hi)


@_handles("aten.lerp")
def _lerp(ctx, a, b, w):
    return _map(ctx, [a, b, w], lambda x, y, t: x + t * (y - x))


@_handles("aten.copysign")
def _copysign(ctx, a, b):
    return _map(ctx, [a, b], tirx.copysign, compute=_float_compute(ctx))


# --- activations (and the backward ops the vjp graph gives for them) --------------------------

_SQRT1_2 = math.sqrt(0.5)
_GELU_BETA = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


def _gelu_parts(ctx, x, approximate: str):
    dt = _dtype_of(x)
    c = lambda v: _const(v, dt)  # noqa: E731
    if approximate == "tanh":
        t = ctx.fn("tanh")(c(_GELU_BETA) * (x + c(_GELU_KAPPA) * x * x * x))
        return t
    return ctx.fn("erf")(x * c(_SQRT1_2))


@_handles("aten.gelu")
def _gelu(ctx, a, approximate="none"):
    def gelu(x):
        return _const(0.5, _dtype_of(x)) * x * (_const(1, _dtype_of(x)) + _gelu_parts(ctx, x, approximate))

    return _map(ctx, [a], gelu, compute=_float_compute(ctx))


@_handles("aten.gelu_backward")
def _gelu_backward(ctx, g, a, approximate="none"):
    def grad(gg, x):
        dt = _dtype_of(x)
        c = lambda v: _const(v, dt)  # noqa: E731
        if approximate == "tanh":  # torch's GeluBackward (tanh) formula
            t = _gelu_parts(ctx, x, "tanh")
            right = c(0.5) * x * (c(1) - t * t) * c(_GELU_BETA) * (c(1) + c(3 * _GELU_KAPPA) * x * x)
            return gg * (c(0.5) * (c(1) + t) + right)
        cdf = c(0.5) * (c(1) + _gelu_parts(ctx, x, "none"))
        pdf = ctx.fn("exp")(c(-0.5) * x * x) * c(1 / math.sqrt(2 * math.pi))
        return gg * (cdf + x * pdf)

    return _map(ctx, [g, a], grad, compute=_float_compute(ctx))


@_handles("aten.silu")
def _silu(ctx, a):
    return _map(ctx, [a], lambda x: x * ctx.fn("sigmoid")(x), compute=_float_compute(ctx))


@_handles("aten.silu_backward")
def _silu_backward(ctx, g, a):
    def grad(gg, x):
        sig = ctx.fn("sigmoid")(x)
        one = _const(1, _dtype_of(x))
        return gg * sig * (one + x * (one - sig))

    return _map(ctx, [g, a], grad, compute=_float_compute(ctx))


@_handles("aten.softplus")
def _softplus(ctx, a, beta=1, threshold=20):
    def softplus(x):
        dt = _dtype_of(x)
        xb = x * _const(beta, dt)
        soft = ctx.fn("log1p")(ctx.fn("exp")(xb)) / _const(beta, dt)
        return tirx.Select(xb > _const(threshold, dt), x, soft)

    return _map(ctx, [a], softplus, compute=_float_compute(ctx))


@_handles("aten.softplus_backward")
def _softplus_backward(ctx, g, a, beta=1, threshold=20):
    def grad(gg, x):
        dt = _dtype_of(x)
        xb = x * _const(beta, dt)
        z = ctx.fn("exp")(xb)
        return tirx.Select(xb > _const(threshold, dt), gg, gg * z / (z + _const(1, dt)))

    return _map(ctx, [g, a], grad, compute=_float_compute(ctx))


@_handles("aten.leaky_relu")
def _leaky_relu(ctx, a, slope=0.01):
    return _map(ctx, [a], lambda x: tirx.Select(x > _const(0, _dtype_of(x)), x, x * _const(slope, _dtype_of(x))))


@_handles("aten.leaky_relu_backward")
def _leaky_relu_backward(ctx, g, a, slope, self_is_result=False):
    def grad(gg, x):
        return tirx.Select(x > _const(0, _dtype_of(x)), gg, gg * _const(slope, _dtype_of(x)))

    return _map(ctx, [g, a], grad)


@_handles("aten.logaddexp")
def _logaddexp(ctx, a, b):
    def lae(x, y):
        same_inf = tirx.And(tirx.isinf(x), tirx.EQ(x, y))  # torch: inf + inf -> inf, -inf + -inf -> -inf
        soft = tirx.max(x, y) + ctx.fn("log1p")(ctx.fn("exp")(-tirx.abs(x - y)))
        return tirx.Select(same_inf, x, soft)

    return _map(ctx, [a, b], lae, compute=_float_compute(ctx))


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
_handles("aten.isfinite")(_float_test(tirx.isfinite))
_handles("aten.isposinf")(_float_test(lambda x: tirx.EQ(x, _const(math.inf, _dtype_of(x)))))
_handles("aten.isneginf")(_float_test(lambda x: tirx.EQ(x, _const(-math.inf, _dtype_of(x)))))


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


_handles("aten.bitwise_and", "aten.__and__")(_bitwise(tirx.And, tirx.bitwise_and))
_handles("aten.bitwise_or", "aten.__or__")(_bitwise(tirx.Or, tirx.bitwise_or))
_handles("aten.bitwise_xor", "aten.__xor__")(_bitwise(_bool_xor, tirx.bitwise_xor))


@_handles("aten.bitwise_not")
def _bitwise_not(ctx, a):
    if ctx.out_dtype == torch.bool:
        return _map(ctx, [a], tirx.Not, compute="bool")
    return _map(ctx, [a], tirx.bitwise_not)


@_handles("aten.where")
def _where_op(ctx, cond, a=None, b=None):
    if a is None:
        ctx.fail("torch.where(cond) with one argument (data-dependent shape)")
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


@_handles("aten.masked_fill")
def _masked_fill(ctx, a, mask, value):
    return _where_op(ctx, mask, value, a)


# --- type conversions, copies, constants -------------------------------------------------------


@_handles("aten._to_copy", "aten.to", "prims.convert_element_type", "aten.type_as",
          "aten._autocast_to_reduced_precision", "aten._autocast_to_full_precision")
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


@_handles("aten.clone", "aten.detach", "aten.alias", "aten.lift_fresh_copy", "aten.lift_fresh", "aten.contiguous",
          "aten.positive", "aten.conj", "aten.resolve_conj", "aten.resolve_neg", "aten._conj")
def _identity(ctx, a, *args, **kwargs):
    return a


@_handles("aten._assert_tensor_metadata", "aten._assert_scalar", "aten._assert_async")
def _no_op(ctx, *args, **kwargs):
    return None


def _full_value(ctx, value):
    return _T.full(ctx.out_shape, ctx.out_dtype, value)


def _fill(ctx, value):
    if isinstance(value, _T):
        if value.const is None:
            return _map(ctx, [value], lambda x: x)
        value = value.const
    return _full_value(ctx, value)


@_handles("aten.full")
def _full(ctx, size, fill_value, **kwargs):
    return _fill(ctx, fill_value)


@_handles("aten.new_full")
def _new_full(ctx, a, size, fill_value, **kwargs):
    return _fill(ctx, fill_value)


@_handles("aten.full_like", "aten.fill")
def _full_like(ctx, a, value, **kwargs):
    return _fill(ctx, value)


@_handles("aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.empty_like", "aten.new_empty")
def _zeros(ctx, *args, **kwargs):
    # empty_like only appears in vjp graphs as an accumulator that is then fully written; zeros is safe.
    return _full_value(ctx, 0)


@_handles("aten.ones", "aten.ones_like", "aten.new_ones")
def _ones(ctx, *args, **kwargs):
    return _full_value(ctx, 1)


@_handles("aten.scalar_tensor")
def _scalar_tensor(ctx, value, **kwargs):
    return _full_value(ctx, value)


@_handles("aten.arange")
def _arange(ctx, *args, **kwargs):
    nums = [a for a in args if _is_num(a)]
    start, step = (0, 1)
    if len(nums) == 1:
        (end,) = nums
    elif len(nums) == 2:
        start, end = nums
    else:
        start, end, step = nums[:3]
    out = _tvm_dtype(ctx.out_dtype)
    c = _opmath(out)
    return _T(ctx.out_shape, ctx.out_dtype,
              lambda idx: _cast(_const(start, c) + _cast(idx[0], c) * _const(step, c), out))


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
    if a.const is not None:
        return _T.full(shape, a.dtype, a.const)
    if shape == ():
        return _T.scalar(a.at(mapper(())), a.dtype)
    return _T(shape, a.dtype, lambda idx: a.at(mapper(idx)))


@_handles("aten.view", "aten._unsafe_view", "aten.reshape", "aten.squeeze", "aten.unsqueeze", "aten.flatten",
          "aten.unflatten", "aten.view_as", "aten.reshape_as", "aten.ravel")
def _reshape(ctx, a, *args, **kwargs):
    shape = ctx.out_shape
    if isinstance(a, _Acc):
        return _Acc(shape, a.dtype, [(_reshape_index(i, a.shape, shape), v) for i, v in a.terms])
    if a.shape == shape:
        return a
    return _view_of(ctx, a, lambda idx: _reshape_index(idx, shape, a.shape))


@_handles("aten.expand", "aten.expand_as", "aten.broadcast_to")
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
    inverse = [dims.index(k) for k in range(rank)]
    return _view_of(ctx, a, lambda idx: tuple(idx[inverse[k]] for k in range(rank)))


@_handles("aten.transpose", "aten.t")
def _transpose(ctx, a, d0=0, d1=1):
    rank = len(a.shape)
    if rank < 2:
        return a
    d0, d1 = d0 % rank, d1 % rank
    perm = list(range(rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _view_of(ctx, a, lambda idx: tuple(idx[perm[k]] for k in range(rank)))


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


# The *_copy forms of the view ops (functionalization may emit them) mean the same here.
for _name in ("view", "_unsafe_view", "squeeze", "unsqueeze", "expand", "permute", "transpose", "t", "select", "slice",
              "alias", "detach"):
    _HANDLERS[f"aten.{_name}_copy"] = _HANDLERS[f"aten.{_name}"]


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


# --- backward ops from the vjp graph -----------------------------------------------------------


@_handles("aten.tanh_backward")
def _tanh_backward(ctx, g, y):
    return _map(ctx, [g, y], lambda gg, yy: gg * (_const(1, _dtype_of(yy)) - yy * yy))


@_handles("aten.sigmoid_backward")
def _sigmoid_backward(ctx, g, y):
    return _map(ctx, [g, y], lambda gg, yy: gg * (_const(1, _dtype_of(yy)) - yy) * yy)


@_handles("aten.threshold_backward")
def _threshold_backward(ctx, g, x, threshold):
    return _map(ctx, [g, x, threshold], lambda gg, xx, t: tirx.Select(xx <= t, _const(0, _dtype_of(gg)), gg))


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


# ----------------------------------------------------------------------------------------------
# Tracing


@dataclasses.dataclass(frozen=True)
class Captured:
    """A tensor the user function closes over: a kernel input buffer (and a gradient buffer).

    ``dtype`` is the TVM dtype name (what ``tirx.decl_buffer`` takes); ``tensor`` the user's
    own tensor object (pass it to the kernel as it is on each call; its values are not part of
    the key). Gradient buffers are float32 accumulators of ``shape``.
    """

    name: str
    tensor: torch.Tensor = dataclasses.field(repr=False, compare=False)
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool

    def decl_buffer(self, name: str | None = None) -> tirx.Buffer:
        return tirx.decl_buffer(self.shape, self.dtype, name or self.name)

    def decl_grad_buffer(self, name: str | None = None) -> tirx.Buffer:
        return tirx.decl_buffer(self.shape, "float32", name or f"{self.name}_grad")


def _example_indices():
    return [torch.zeros((), dtype=INDEX_DTYPE) for _ in range(4)]


def _positional_arity(fn) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def _check_callable(fn, what: str, arity: int, signature: str):
    if not callable(fn):
        raise FlexTraceError(f"{what} must be a function {signature} or None, got {type(fn).__name__}")
    n = _positional_arity(fn)
    if n is not None and n != arity:
        other = {5: "a score_mod (score, b, h, q_idx, kv_idx)", 4: "a mask_mod (b, h, q_idx, kv_idx)"}.get(n, "")
        hint = f"; it looks like {other}" if other else ""
        raise FlexTraceError(f"{what} must take {arity} positional arguments {signature}, "
                             f"but {getattr(fn, '__name__', fn)!r} takes {n}{hint}")


def _user_frame(exc: BaseException, fn):
    """The innermost traceback frame in user code (not torch, not this module)."""
    best = None
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if not _is_library_file(tb.tb_frame.f_code.co_filename):
                best = tb
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return best


def _is_data_dependent(exc: BaseException) -> bool:
    e, seen = exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__} {e}"
        if any(s in text for s in ("GuardOnDataDependent", "DataDependent", "data-dependent", "_local_scalar_dense",
                                   "DynamicOutputShape", "data dependent")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _non_tensor_data(frame, line: str):
    """(name, value) of a list/tuple/ndarray/dict of numbers the failing source line uses."""
    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", line))
    scopes = [frame.f_locals, frame.f_globals]
    for name in sorted(names):
        for scope in scopes:
            if name in scope:
                value = scope[name]
                if isinstance(value, (list, tuple, np.ndarray, dict)) and not isinstance(value, torch.Size):
                    return name, value
                break
    return None


def _trace_error(exc: BaseException, fn, what: str) -> FlexTraceError:
    tb = _user_frame(exc, fn)
    location, line = "", ""
    if tb is not None:
        code = tb.tb_frame.f_code
        line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
        location = f" at {os.path.basename(code.co_filename)}:{tb.tb_lineno}: `{line}`"
    if tb is not None and line:
        found = _non_tensor_data(tb.tb_frame, line)
        plausible = _is_data_dependent(exc) or isinstance(exc, (TypeError, NotImplementedError, IndexError))
        if found is not None and plausible:
            name, value = found
            return FlexTraceError(
                f"{what} indexes `{name}`, a Python {type(value).__name__}, with a tensor{location}: captured data "
                f"must be a torch.Tensor of numbers (e.g. `{name} = torch.tensor({name})`), which becomes a kernel "
                "input buffer")
    if _is_data_dependent(exc):
        return FlexTraceError(
            f"{what} needs the value of a tensor while it is traced{location}: Python control flow on tensors "
            "(`if score > 0:`, `a if q_idx >= kv_idx else b`, `and`/`or`/`not`), `float(x)` / `int(x)` / `.item()`, "
            "or slicing with a tensor. tvmflash traces the function once for every (b, h, q_idx, kv_idx); write "
            "conditions with tensor ops: `torch.where(score > 0, a, b)`, `&`, `|`, `~`, and index captured tensors "
            "with tensors only (`table[h, q_idx]`)")
    return FlexTraceError(f"tracing {what} failed{location}: {type(exc).__name__}: {exc}")


def _closure_names(fn) -> dict[int, str]:
    """id(tensor) -> the name the function uses for it (closure, globals, defaults)."""
    names: dict[int, str] = {}
    seen: set[int] = set()

    def visit(f, depth):
        if depth > 3 or id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            visit(f.func, depth + 1)
            for v in list(f.args) + list(f.keywords.values()):
                if callable(v):
                    visit(v, depth + 1)
            return
        if isinstance(f, torch.nn.Module):
            for k, v in list(f.named_parameters()) + list(f.named_buffers()):
                names.setdefault(id(v), k.replace(".", "_"))
        if not inspect.isfunction(f):
            call = getattr(type(f), "__call__", None)
            for k, v in vars(f).items() if hasattr(f, "__dict__") else ():
                if isinstance(v, torch.Tensor):
                    names.setdefault(id(v), k)
            if inspect.isfunction(call):
                visit(call, depth + 1)
            return
        try:
            cv = inspect.getclosurevars(f)
        except (TypeError, ValueError):
            return
        scopes = [cv.nonlocals, cv.globals]
        sig_defaults = {k: p.default for k, p in inspect.signature(f).parameters.items() if p.default is not p.empty}
        scopes.append(sig_defaults)
        for scope in scopes:
            for k, v in scope.items():
                if isinstance(v, torch.Tensor):
                    names.setdefault(id(v), k)
                elif isinstance(v, (list, tuple)):
                    for item in v:
                        if callable(item) and not isinstance(item, type):
                            visit(item, depth + 1)
                elif callable(v) and not isinstance(v, type):
                    if not str(getattr(v, "__module__", "") or "").startswith("torch"):
                        visit(v, depth + 1)

    visit(fn, 0)
    return names


def _check_captured_tensor(t: torch.Tensor, name: str, what: str, device: str):
    if t.is_complex() or t.dtype not in _TVM_DTYPES:
        raise FlexTraceError(f"{what} captures `{name}` of dtype {t.dtype}; captured tensors must hold real numbers "
                             f"or bools ({', '.join(str(d).replace('torch.', '') for d in _TVM_DTYPES)})")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise FlexTraceError(f"{what} captures `{name}`, a {t.layout} tensor; captured tensors must be dense "
                             "(strided) tensors of numbers")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise FlexTraceError(f"{what} captures `{name}`, a {type(t).__name__}; captured tensors must be plain "
                             "torch.Tensor objects of numbers")
    if t.device.type != torch.device(device).type:
        raise FlexTraceError(f"{what} captures `{name}` on device {t.device}, but the kernels run on {device}: "
                             f"move it there first (`{name} = {name}.to('{device}')`)")
    if t.numel() == 0:
        raise FlexTraceError(f"{what} captures `{name}`, an empty tensor of shape {tuple(t.shape)}")


def _make_fx(fn, args, functional: bool = False):
    """make_fx in fake mode (nothing runs on real data: no IndexError on example indices).

    ``functional``: through torch.func.functionalize, so in-place ops (the vjp's masked_fill_,
    a user's add_) become pure ones. Not for the user function itself: TransformGetItemToIndex's
    autograd.Function has no functionalize rule; its traced graph is re-traced instead.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    if functional:
        fn = torch.func.functionalize(fn, remove="mutations")
    with TransformGetItemToIndex():
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


def _check_ops(gm: fx.GraphModule, what: str, fn, example):
    """Name the first op the translator lacks, with the user's source line."""
    ctx = _Ctx(what, INTRINSICS)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name in _HANDLERS or (name.endswith("_") and name[:-1] in _HANDLERS):  # in-place: functionalized
            continue
        ctx.node = node
        _unsupported(ctx, name, _locate_op(fn, example, name))


def _trace(fn, example, what: str, device: str):
    """make_fx the function; lift its captured tensors into trailing inputs. -> (gm, captured)."""
    try:
        gm = _make_fx(fn, example)
    except FlexTraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a message naming the cause
        raise _trace_error(exc, fn, what) from exc
    names = _closure_names(fn)
    lifted: dict[str, tuple[str, torch.Tensor]] = {}  # get_attr target -> (name, tensor)
    used_names: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in lifted:
            continue
        t = _fetch_attr(gm, node.target)
        if not isinstance(t, torch.Tensor):
            raise FlexTraceError(f"{what} uses {type(t).__name__} {node.target}, which is not a tensor")
        base = names.get(id(t))
        if t.dim() == 0 and not t.requires_grad:
            # An inlined constant (its value is part of the key): torch.tensor(8.0) in the function
            # body, TransformGetItemToIndex's converted integer indices, 0-d closure tensors.
            _check_captured_tensor(t, base or "a 0-d tensor", what, t.device.type)
            if t.device.type == "meta":
                raise FlexTraceError(f"{what} captures `{base or 'a 0-d tensor'}` on device {t.device}; "
                                     "a 0-d constant must hold a value (it is compiled into the kernel)")
            continue
        base = re.sub(r"\W", "_", base or "captured") or "captured"
        name = base if base not in used_names and base.isidentifier() else None
        k = 0
        while name is None or name in used_names:
            name = f"{base}{k}"
            k += 1
        used_names.add(name)
        _check_captured_tensor(t, name, what, device)
        lifted[node.target] = (name, t)
    captured = [Captured(name, t, tuple(int(s) for s in t.shape), _tvm_dtype(t.dtype), bool(t.requires_grad))
                for name, t in lifted.values()]
    # Lift: captured get_attr nodes -> trailing placeholders, in order of first use.
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda a: env[a])
    buf_nodes = {}
    for target, (name, _) in lifted.items():
        buf_nodes[target] = graph.placeholder(f"captured_{name}")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr" and node.target in lifted:
            env[node] = buf_nodes[node.target]
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
    for target, (name, t) in lifted.items():
        buf_nodes[target].meta["val"] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    lifted_gm = fx.GraphModule(gm, graph)
    return lifted_gm, captured


def _check_output(gm: fx.GraphModule, what: str, kind: str):
    out = list(gm.graph.nodes)[-1].args[0]
    if isinstance(out, (tuple, list)):
        raise FlexTraceError(f"{what} must return one tensor, but it returned a {type(out).__name__} of {len(out)}")
    if not isinstance(out, fx.Node):
        raise FlexTraceError(f"{what} must return a tensor, but it returned the Python value {out!r}; "
                             + ("return e.g. `score + 0.5` or `torch.full_like(score, 0.5)`" if kind == "score"
                                else "return e.g. `q_idx >= kv_idx` or `b.new_ones((), dtype=torch.bool)`"))
    val = out.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise FlexTraceError(f"{what} must return a tensor, but it returned {type(val).__name__}")
    if tuple(val.shape) != ():
        raise FlexTraceError(
            f"{what} must return one value per (b, h, q_idx, kv_idx), a 0-d tensor like its arguments, but it "
            f"returned shape {tuple(val.shape)} (is a captured tensor indexed with too few indices, "
            "or broadcast against a non-scalar tensor?)")
    if kind == "score" and not val.dtype.is_floating_point:
        raise FlexTraceError(f"score_mod must return a floating-point score, but it returned {val.dtype}"
                             " (a mask belongs in mask_mod; for -inf use `torch.where(keep, score, -float('inf'))`)")
    if kind == "mask" and val.dtype != torch.bool:
        raise FlexTraceError(f"mask_mod must return a bool tensor (True = attend), but it returned {val.dtype}"
                             "; use comparisons and `&`, `|`, `~`")
    return val


def _graph_key(parts: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _graph_text(gm: fx.GraphModule) -> str:
    """The graph's code plus the values of the 0-d constants it inlines."""
    parts = [gm.code]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = _fetch_attr(gm, node.target)
            parts.append(f"{node.target}={t.dtype}:{t.item()!r}")
    return "\n".join(parts)


def _captured_text(captured: list[Captured]) -> str:
    return ";".join(f"{c.name}:{c.shape}:{c.dtype}:{c.requires_grad}" for c in captured)


def _index_inputs(exprs, what: str) -> list[tirx.PrimExpr]:
    out = []
    for e in exprs:
        if isinstance(e, (bool, float)) or (not isinstance(e, int) and _is_float(_dtype_of(e))):
            raise FlexTraceError(f"{what}: indices b, h, q_idx, kv_idx must be integer PrimExprs, got {e!r}")
        out.append(_const(e, _tvm_dtype(INDEX_DTYPE)) if isinstance(e, int) else _cast(e, _tvm_dtype(INDEX_DTYPE)))
    return out


def _float_input(x, dtype: str = "float32") -> tirx.PrimExpr:
    if isinstance(x, (int, float)):
        return _const(x, dtype)
    return _cast(x, dtype)


def _buffer_values(captured: list[Captured], buffers: Mapping[str, Any] | None, what: str) -> list[_T]:
    values = []
    buffers = buffers or {}
    for c in captured:
        if c.name not in buffers:
            raise FlexTraceError(f"{what}: no buffer for captured tensor `{c.name}` (buffers has {sorted(buffers)})")
        buf = buffers[c.name]
        if not tirx.is_buffer_var(buf):
            raise FlexTraceError(f"{what}: buffers[{c.name!r}] must be a tirx.Buffer, got {type(buf).__name__}")
        if str(buf.dtype) != c.dtype:
            raise FlexTraceError(f"{what}: buffers[{c.name!r}] has dtype {buf.dtype}, the captured tensor {c.dtype}")
        shape = tuple(int(s) if isinstance(s, tirx.IntImm) else s for s in buf.shape)
        if shape != c.shape:
            raise FlexTraceError(f"{what}: buffers[{c.name!r}] has shape {shape}, the captured tensor {c.shape}")
        values.append(_buffer_tensor(buf, c))
    return values


def _buffer_tensor(buf, c: Captured) -> _T:
    dtypes = [_dtype_of(s) for s in buf.shape]
    torch_dtype = _TORCH_DTYPES[c.dtype]

    def at(idx):
        return tirx.BufferLoad(buf, [_cast(i, dt) if not isinstance(i, int) else _const(i, dt)
                                     for i, dt in zip(idx, dtypes)])

    if c.shape == ():
        return _T.scalar(at(()), torch_dtype)
    return _T(c.shape, torch_dtype, at)


def _symbolic_inputs(captured: list[Captured]):
    score = tirx.Var("score", "float32")
    idx = [tirx.Var(n, "int32") for n in ("b", "h", "q_idx", "kv_idx")]
    buffers = {c.name: c.decl_buffer() for c in captured}
    return score, idx, buffers


class TracedScoreMod:
    """A traced ``score_mod``: TIR expressions for its value, d/dscore and captured-tensor grads.

    ``graph`` is the forward graph (captured tensors as trailing inputs ``captured_<name>``),
    ``joint`` the vjp graph: inputs (score, b, h, q_idx, kv_idx, grad_out, *captured), outputs
    (d score, *d captured for those requiring grad).
    """

    def __init__(self, graph, joint, captured, key, out_dtype, name):
        self.graph: fx.GraphModule = graph
        self.joint: fx.GraphModule = joint
        self.captured: list[Captured] = captured
        self.key: str = key
        self.name = name
        self._out_dtype = out_dtype

    @property
    def is_identity(self) -> bool:
        return self.name == "identity"

    def __repr__(self):
        return f"TracedScoreMod({self.name}, key={self.key}, captured={self.captured})"

    def decl_buffers(self) -> dict[str, tirx.Buffer]:
        """``{name: tirx.decl_buffer(shape, dtype, name)}`` for the captured tensors."""
        return {c.name: c.decl_buffer() for c in self.captured}

    def _ctx(self, intrinsics):
        table = dict(INTRINSICS)
        table.update(intrinsics or {})
        return _Ctx("score_mod", table)

    def emit(self, score, b, h, q_idx, kv_idx, buffers=None, *, intrinsics=None) -> tirx.PrimExpr:
        """The modified score (float32) at one point; ``score`` is the already-scaled q.k."""
        inputs = [_T.scalar(_float_input(score), SCORE_DTYPE)]
        inputs += [_T.scalar(e, INDEX_DTYPE) for e in _index_inputs([b, h, q_idx, kv_idx], "score_mod")]
        inputs += _buffer_values(self.captured, buffers, "score_mod")
        (out,) = _evaluate(self.graph, inputs, [0], self._ctx(intrinsics))
        return _cast(out.expr, "float32")

    def _joint_inputs(self, score, b, h, q_idx, kv_idx, upstream, buffers):
        out_dtype = _tvm_dtype(self._out_dtype)
        inputs = [_T.scalar(_float_input(score), SCORE_DTYPE)]
        inputs += [_T.scalar(e, INDEX_DTYPE) for e in _index_inputs([b, h, q_idx, kv_idx], "score_mod")]
        if upstream is None:
            inputs.append(_T.scalar(_const(1, out_dtype), self._out_dtype, const=1))
        else:
            inputs.append(_T.scalar(_float_input(upstream, out_dtype), self._out_dtype))
        inputs += _buffer_values(self.captured, buffers, "score_mod")
        return inputs

    def emit_grad(self, score, b, h, q_idx, kv_idx, buffers=None, *, intrinsics=None) -> tirx.PrimExpr:
        """d score_mod(score, ...) / d score at one point (float32)."""
        inputs = self._joint_inputs(score, b, h, q_idx, kv_idx, None, buffers)
        (out,) = _evaluate(self.joint, inputs, [0], self._ctx(intrinsics))
        return _const(0, "float32") if out is None else _cast(out.expr, "float32")

    def emit_captured_grads(self, score, b, h, q_idx, kv_idx, upstream, buffers=None, *, intrinsics=None):
        """``[(name, index_exprs, value_expr)]``: ``grad[name][index_exprs] += value_expr`` (float32).

        value = upstream * d score_mod / d captured[index] at this point. A captured tensor may
        get several terms (it is read at several places), or none. Indices are wrapped and
        clamped like the reads, in the dtype of the buffer's shape.
        """
        grads = [c for c in self.captured if c.requires_grad]
        if not grads:
            return []
        ctx = self._ctx(intrinsics)
        inputs = self._joint_inputs(score, b, h, q_idx, kv_idx, upstream, buffers)
        values = _evaluate(self.joint, inputs, list(range(1, 1 + len(grads))), ctx)
        result = []
        for c, value in zip(grads, values):
            if value is None:
                continue
            acc = _as_acc(ctx, value)
            dtypes = [_dtype_of(s) for s in buffers[c.name].shape]
            for idx, v in acc.terms:
                index = [_cast(i, dt) if not isinstance(i, int) else _const(i, dt) for i, dt in zip(idx, dtypes)]
                result.append((c.name, index, _cast(v, "float32")))
        return result


class TracedMaskMod:
    """A traced ``mask_mod``: a bool TIR expression (True = attend)."""

    def __init__(self, graph, captured, key, name):
        self.graph: fx.GraphModule = graph
        self.captured: list[Captured] = captured
        self.key: str = key
        self.name = name

    @property
    def is_noop(self) -> bool:
        return self.name == "none"

    def __repr__(self):
        return f"TracedMaskMod({self.name}, key={self.key}, captured={self.captured})"

    def decl_buffers(self) -> dict[str, tirx.Buffer]:
        return {c.name: c.decl_buffer() for c in self.captured}

    def emit(self, b, h, q_idx, kv_idx, buffers=None, *, intrinsics=None) -> tirx.PrimExpr:
        if self.graph is None:
            return tirx.const(True, "bool")
        table = dict(INTRINSICS)
        table.update(intrinsics or {})
        inputs = [_T.scalar(e, INDEX_DTYPE) for e in _index_inputs([b, h, q_idx, kv_idx], "mask_mod")]
        inputs += _buffer_values(self.captured, buffers, "mask_mod")
        (out,) = _evaluate(self.graph, inputs, [0], _Ctx("mask_mod", table))
        return _cast(out.expr, "bool")


def _identity_score_mod(score, b, h, q_idx, kv_idx):
    return score


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def trace_score_mod(score_mod: Callable | None, *, device: str = "cpu") -> TracedScoreMod:
    """Trace a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` (None: identity).

    Raises ``FlexTraceError`` for functions that cannot become a kernel (message says why).
    ``device``: where captured tensors must live (the kernels' device).
    """
    name = "identity" if score_mod is None else _fn_name(score_mod)
    fn = _identity_score_mod if score_mod is None else score_mod
    _check_callable(fn, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    example = [torch.zeros((), dtype=SCORE_DTYPE)] + _example_indices()
    raw, captured = _trace(fn, example, "score_mod", device)
    out_val = _check_output(raw, "score_mod", "score")
    _check_ops(raw, "score_mod", fn, example)
    buffers_example = [c.tensor.detach() for c in captured]
    graph = _make_fx(raw, example + buffers_example, functional=True)
    grad_positions = [k for k, c in enumerate(captured) if c.requires_grad]

    def joint(score, b, h, q_idx, kv_idx, grad_out, *bufs):
        def f(s, *grad_bufs):
            full = list(bufs)
            for k, t in zip(grad_positions, grad_bufs):
                full[k] = t
            return graph(s, b, h, q_idx, kv_idx, *full)

        _, vjp_fn = torch.func.vjp(f, score, *[bufs[k] for k in grad_positions])
        return tuple(vjp_fn(grad_out))

    joint_example = example + [torch.zeros((), dtype=out_val.dtype)] + buffers_example
    try:
        joint_gm = _make_fx(joint, joint_example, functional=True)
    except Exception as exc:  # noqa: BLE001
        raise FlexTraceError(f"tracing the gradient of score_mod with torch.func.vjp failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    key = _graph_key([TRANSLATOR_VERSION, "score_mod", _graph_text(graph), _graph_text(joint_gm),
                      _captured_text(captured)])
    traced = TracedScoreMod(graph, joint_gm, captured, key, out_val.dtype, name)
    # Translate once now, symbolically: unsupported ops etc. fail here, not in the kernel builder.
    score, idx, buffers = _symbolic_inputs(captured)
    traced.emit(score, *idx, buffers)
    try:
        traced.emit_grad(score, *idx, buffers)
        traced.emit_captured_grads(score, *idx, tirx.Var("upstream", "float32"), buffers)
    except FlexTraceError as exc:
        raise FlexTraceError(f"the gradient of score_mod (traced from torch.func.vjp): {exc}") from None
    return traced


def trace_mask_mod(mask_mod: Callable | None, *, device: str = "cpu") -> TracedMaskMod:
    """Trace a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: attend everywhere)."""
    if mask_mod is None:
        return TracedMaskMod(None, [], _graph_key([TRANSLATOR_VERSION, "mask_mod", "none"]), "none")
    _check_callable(mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    raw, captured = _trace(mask_mod, _example_indices(), "mask_mod", device)
    _check_output(raw, "mask_mod", "mask")
    _check_ops(raw, "mask_mod", mask_mod, _example_indices())
    graph = _make_fx(raw, _example_indices() + [c.tensor.detach() for c in captured], functional=True)
    key = _graph_key([TRANSLATOR_VERSION, "mask_mod", _graph_text(graph), _captured_text(captured)])
    traced = TracedMaskMod(graph, captured, key, _fn_name(mask_mod))
    _, idx, buffers = _symbolic_inputs(captured)
    traced.emit(*idx, buffers)
    return traced


# ----------------------------------------------------------------------------------------------
# Dense reference evaluation (plain torch)


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
