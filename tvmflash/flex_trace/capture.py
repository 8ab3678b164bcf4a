"""The user's function as it is *now*: dynamo decides when a trace is stale.

torch's own eager flex_attention runs the score_mod through ``torch.compile(backend="eager",
fullgraph=True)``; we do the same with a backend that only records dynamo's graph and the
tensors it reads. Dynamo's guards check everything the function reads (closure cells, partial
and default arguments, bound ``self``, globals, dict entries, a helper's globals, module
attributes) and re-trace only when one of them changed; the tensors it reads arrive as graph
inputs on every call, so this call's tensors are passed to the kernel. Python numbers are
constants of dynamo's graph (it guards on them), so a new value traces a new graph (and
compiles a kernel: the constants are in the kernel's key).

One compiled wrapper per kind takes the user's function as an argument (dynamo caches per
code object and guards on the function), so a cached call costs one guard check (~35 us).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import weakref

import torch

from .lower import TracedMaskMod, TracedScoreMod
from .trace import check_callable, trace_mask_mod, trace_score_mod
from .values import INDEX_DTYPE, SCORE_DTYPE, FlexTraceError

_ARGS = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}


def _call_score_mod(fn, score, b, h, q_idx, kv_idx):
    return fn(score, b, h, q_idx, kv_idx)


def _call_mask_mod(fn, b, h, q_idx, kv_idx):
    return fn(b, h, q_idx, kv_idx)


_last_call = threading.local()  # (dynamo's graph, this call's graph inputs), set by the backend


def _record_backend(gm: torch.fx.GraphModule, example_inputs):
    outputs = len(list(gm.graph.nodes)[-1].args[0])

    def record(*args):
        _last_call.value = (gm, args)
        return (None,) * outputs  # the traced values are not needed, only what was read

    return record


_compiled: dict[str, object] = {}


def _compiled_call(kind: str):
    if kind not in _compiled:
        call = _call_score_mod if kind == "score_mod" else _call_mask_mod
        # dynamic=False: no SymInt inputs (an int read by the function stays a constant; a new
        # value re-traces, and compiles a kernel: ints change the indexing)
        _compiled[kind] = torch.compile(call, backend=_record_backend, fullgraph=True, dynamic=False)
    return _compiled[kind]


def _examples(kind: str) -> list[torch.Tensor]:
    # shape (1,): with 0-d tensors dynamo turns `table[h]` into data-dependent control flow
    indices = [torch.zeros(1, dtype=INDEX_DTYPE) for _ in range(4)]
    return ([torch.zeros(1, dtype=SCORE_DTYPE)] if kind == "score_mod" else []) + indices


def dynamo_graph(kind: str, fn) -> tuple[torch.fx.GraphModule, tuple] | None:
    """(dynamo's graph of ``fn`` as it is now, this call's graph inputs), or None where dynamo
    cannot trace it (the caller traces ``fn`` itself, which names the cause if it fails too)."""
    from torch._dynamo.utils import disable_cache_limit

    _last_call.value = None
    try:
        with disable_cache_limit():  # every new value of a constant is one more cache entry
            _compiled_call(kind)(fn, *_examples(kind))
    except Exception:  # noqa: BLE001 - the direct trace reports what is wrong
        return None
    found = _last_call.value
    _last_call.value = None
    if found is None or any(not isinstance(a, torch.Tensor) for a in found[1]):
        return None
    return found


def _friendly_name(placeholder: str) -> str:
    """A kernel buffer name from dynamo's placeholder name (`G_LIVE_table_` -> `LIVE_table`)."""
    noise = {"L", "G", "fn", "closure", "cell", "contents", "kwdefaults", "defaults", "parameters", "buffers",
             "keywords", "args", "self", "func", "modules", "globals", "getitem"}
    kept = [p for p in re.split(r"_+", placeholder) if p and p not in noise and not p.isdigit()]
    return "_".join(kept) or "captured"


@dataclasses.dataclass
class _GraphTrace:
    traced: TracedScoreMod | TracedMaskMod
    positions: list[int | None]  # per captured tensor: its graph input, or None (made in the body)


# dynamo's graph -> {values of the 0-d tensors it reads (inlined constants): trace}
_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trace_graph(kind: str, fn, gm, args, device: str) -> _GraphTrace:
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    roles = {f"L_{a}_": i for i, a in enumerate(_ARGS[kind])}

    def as_mod(*mod_args):  # the graph with the tensors it read as constants: make_fx lifts them
        inputs = [mod_args[roles[p]] if p in roles else a for p, a in zip(placeholders, args)]
        return gm(*inputs)[0]

    names = {id(a): _friendly_name(p) for p, a in zip(placeholders, args) if p not in roles}
    trace = trace_score_mod if kind == "score_mod" else trace_mask_mod
    try:
        traced = trace(as_mod, device=device, names=names, name=_name(fn))
    except FlexTraceError:
        trace(fn, device=device)  # the error again, naming the user's own source line
        raise
    positions = [next((i for i, a in enumerate(args) if a is c.tensor), None) for c in traced.captured]
    return _GraphTrace(traced, positions)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def capture(kind: str, fn, *, device: str = "cpu") -> TracedScoreMod | TracedMaskMod:
    """``trace_score_mod`` / ``trace_mask_mod`` of ``fn`` as it is now, holding the tensors it
    reads now; traced again only when dynamo's guards say something it reads has changed."""
    check_callable(fn, kind)
    found = dynamo_graph(kind, fn)
    if found is None:  # dynamo cannot trace it: no guards, so trace it on every call
        return (trace_score_mod if kind == "score_mod" else trace_mask_mod)(fn, device=device)
    gm, args = found
    constants = tuple(a.item() for a in args if a.dim() == 0 and not a.requires_grad)
    by_constants = _traces.setdefault(gm, {})
    key = (device, constants)
    if key not in by_constants:
        by_constants[key] = _trace_graph(kind, fn, gm, args, device)
    cached = by_constants[key]
    traced = cached.traced
    rebound = traced.__class__.__new__(traced.__class__)
    rebound.__dict__.update(traced.__dict__)
    rebound.captured = [c if p is None else dataclasses.replace(c, tensor=args[p])
                        for c, p in zip(traced.captured, cached.positions)]
    return rebound
