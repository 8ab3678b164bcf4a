"""Tracing a score_mod / mask_mod: ``make_fx`` with torch's decompositions, captured tensors
lifted into graph inputs, the derivative from ``torch.func.vjp``, and errors that name the
user's line."""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import os
import re
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.fx as fx
from tvm import tirx

from .lower import Captured, TracedMaskMod, TracedScoreMod, _fetch_attr, _op_name, _symbolic_inputs, _unsupported
from .ops import _HANDLERS, DECOMPOSITIONS, _Ctx
from .values import _TVM_DTYPES, INDEX_DTYPE, INTRINSICS, SCORE_DTYPE, TRANSLATOR_VERSION, FlexTraceError, _tvm_dtype

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, functools))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_library_file(path: str) -> bool:
    """torch, this package and the standard library; user code may also live in site-packages
    or in a notebook cell ('<ipython-input-...>')."""
    path = os.path.abspath(path)
    if path.startswith((_PACKAGE_DIR, _LIBRARY_DIRS[0])):
        return True
    return path.startswith(_LIBRARY_DIRS[1]) and "site-packages" not in path and "dist-packages" not in path


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
    a user's add_) become pure ones, and with torch's decompositions (``ops.DECOMPOSITIONS``).
    Not for the user function itself: TransformGetItemToIndex's autograd.Function has no
    functionalize rule; its traced graph (the user's own ops, which error messages name) is
    re-traced instead.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    table = None
    if functional:
        fn = torch.func.functionalize(fn, remove="mutations")
        table = DECOMPOSITIONS
    with TransformGetItemToIndex():
        return make_fx(fn, decomposition_table=table, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


def _check_ops(gm: fx.GraphModule, what: str, fn, example):
    """Name the first op the translator lacks, with the user's source line."""
    ctx = _Ctx(what, INTRINSICS)
    known = set(_HANDLERS) | {_op_name(op) for op in DECOMPOSITIONS}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name in known or (name.endswith("_") and name[:-1] in known):  # in-place: functionalized
            continue
        ctx.node = node
        _unsupported(ctx, name, _locate_op(fn, example, name))


def _positional(fn, arity: int):
    """``fn`` taking exactly its ``arity`` arguments: make_fx makes an input of every parameter,
    also of those with defaults (captured tensors) and of a bound method's ``self``."""
    if arity == 5:
        return lambda score, b, h, q_idx, kv_idx: fn(score, b, h, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: fn(b, h, q_idx, kv_idx)


def _trace(fn, example, what: str, device: str, names: dict[int, str] | None = None):
    """make_fx the function; lift its captured tensors into trailing inputs. -> (gm, captured).
    ``names``: id(tensor) -> its name (default: the names the function's code uses)."""
    try:
        gm = _make_fx(_positional(fn, len(example)), example)
    except FlexTraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a message naming the cause
        raise _trace_error(exc, fn, what) from exc
    names = _closure_names(fn) if names is None else names
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


def _identity_score_mod(score, b, h, q_idx, kv_idx):
    return score


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def trace_score_mod(score_mod: Callable | None, *, device: str = "cpu", names: dict[int, str] | None = None,
                    name: str | None = None) -> TracedScoreMod:
    """Trace a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` (None: identity).

    Raises ``FlexTraceError`` for functions that cannot become a kernel (message says why).
    ``device``: where captured tensors must live (the kernels' device); ``names``: id(tensor)
    -> the name of its kernel buffer (default: the names the function uses); ``name``: the
    function's name in messages.
    """
    name = name or ("identity" if score_mod is None else _fn_name(score_mod))
    fn = _identity_score_mod if score_mod is None else score_mod
    _check_callable(fn, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    example = [torch.zeros((), dtype=SCORE_DTYPE)] + _example_indices()
    raw, captured = _trace(fn, example, "score_mod", device, names)
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
            # The user's ops, not their decompositions: autograd applies torch's own derivative
            # formulas (softplus_backward selects the gradient where exp overflows; autograd
            # through the decomposed softplus would multiply 0 by inf), which are decomposed next.
            return raw(s, b, h, q_idx, kv_idx, *full)

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


def trace_mask_mod(mask_mod: Callable | None, *, device: str = "cpu", names: dict[int, str] | None = None,
                   name: str | None = None) -> TracedMaskMod:
    """Trace a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: attend everywhere);
    ``names``, ``name`` as for ``trace_score_mod``."""
    if mask_mod is None:
        return TracedMaskMod(None, [], _graph_key([TRANSLATOR_VERSION, "mask_mod", "none"]), "none")
    _check_callable(mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    raw, captured = _trace(mask_mod, _example_indices(), "mask_mod", device, names)
    _check_output(raw, "mask_mod", "mask")
    _check_ops(raw, "mask_mod", mask_mod, _example_indices())
    graph = _make_fx(raw, _example_indices() + [c.tensor.detach() for c in captured], functional=True)
    key = _graph_key([TRANSLATOR_VERSION, "mask_mod", _graph_text(graph), _captured_text(captured)])
    traced = TracedMaskMod(graph, captured, key, name or _fn_name(mask_mod))
    _, idx, buffers = _symbolic_inputs(captured)
    traced.emit(*idx, buffers)
    return traced


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


