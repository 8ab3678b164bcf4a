"""Lowering traced graphs to TIR: each node through its handler (``ops.py``, ``views.py``), and
the traced functions' ``emit*`` methods the kernels call."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from tvm import tirx

from . import views  # noqa: F401 - registers the view, indexing and scatter handlers
from .ops import _HANDLERS, DECOMPOSED_OPS, _as_acc, _Ctx
from .values import (
    INDEX_DTYPE,
    INTRINSICS,
    SCORE_DTYPE,
    _TORCH_DTYPES,
    FlexTraceError,
    _cast,
    _const,
    _dtype_of,
    _is_float,
    _T,
    _tvm_dtype,
)


def supported_ops() -> list[str]:
    """The aten/prims ops the translator handles, itself or through torch's decompositions
    (overloads of each included; torch functions that torch itself lowers to these work too)."""
    return sorted(set(_HANDLERS) | {_op_name(op) for op in DECOMPOSED_OPS})


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        return f"{packet._qualified_op_name.split('::')[0]}.{packet.__name__}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.split('::')[0]}.{target.__name__}"
    return getattr(target, "__qualname__", None) or str(target)


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
        """It returns its score unchanged (no score_mod, or ``lambda s, *_: s``): nothing to apply.
        Read from the graph, not the name: a user's mod may be called ``identity``."""
        nodes = list(self.graph.graph.nodes)
        return nodes[-1].args[0] is next(n for n in nodes if n.op == "placeholder")

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

