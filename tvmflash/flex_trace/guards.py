"""The user's function as it is *now*: dynamo decides when a trace is stale.

torch's own eager flex_attention runs the score_mod through ``torch.compile(backend="eager",
fullgraph=True)``; we do the same with a backend that only records dynamo's graph and the
tensors it reads. Dynamo's guards check everything the function reads (closure cells, partial
and default arguments, bound ``self``, globals, dict entries, a helper's globals, module
attributes) and re-trace only when one of them changed; the tensors it reads arrive as graph
inputs on every call, so this call's tensors are passed to the kernel. Python floats are
constants of dynamo's graph (it guards on them); those that are operands of arithmetic,
comparisons and ``where`` become one more input (``_numbers_as_inputs``), so a new value is a
new dynamo graph (~50 ms) but the same trace and kernel. Other numbers stay constants: a new
value compiles another kernel.

One compiled wrapper per kind takes the user's function as an argument (dynamo caches per
code object and guards on the function), so a cached call costs one guard check (~30 us).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import threading
import weakref

import torch

from .lower import TracedMaskMod, TracedScoreMod
from .trace import trace_mask_mod, trace_score_mod
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


@functools.cache
def _examples(kind: str) -> tuple[torch.Tensor, ...]:
    # shape (1,): with 0-d tensors dynamo turns `table[h]` into data-dependent control flow.
    # Made once: dynamo guards on their metadata only, the values are never used.
    indices = [torch.zeros(1, dtype=INDEX_DTYPE) for _ in range(4)]
    return tuple(([torch.zeros(1, dtype=SCORE_DTYPE)] if kind == "score_mod" else []) + indices)


def dynamo_graph(kind: str, fn) -> tuple[torch.fx.GraphModule, tuple] | None:
    """(dynamo's graph of ``fn`` as it is now, this call's graph inputs), or None where dynamo
    cannot trace it or ``fn`` does not return the graph's one output (the caller traces ``fn``
    itself, which names the cause)."""
    from torch._dynamo.utils import disable_cache_limit

    _last_call.value = None
    examples = _examples(kind)
    try:
        with disable_cache_limit():  # every new value of a constant is one more cache entry
            result = _compiled_call(kind)(fn, *examples)
    except Exception:  # noqa: BLE001 - the direct trace reports what is wrong
        return None
    found = _last_call.value
    _last_call.value = None
    # the graph's output comes back as our backend's None; anything else was made outside it
    if found is None or result is not None or any(not isinstance(a, torch.Tensor) for a in found[1]):
        return None
    return found


_CELL = re.compile(r"fn_closure_(\d+)_cell_contents")


def _friendly_name(placeholder: str, fn=None) -> str:
    """A kernel buffer name from dynamo's placeholder name (`G_LIVE_table_` -> `LIVE_table`; a
    closure cell of ``fn``: its variable's name, `L_fn_closure_0_cell_contents` -> `slopes`: a
    score_mod's and a mask_mod's cells were both `captured`, which the kernel took for one)."""
    freevars = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    placeholder = _CELL.sub(lambda m: freevars[int(m[1])] if int(m[1]) < len(freevars) else m[0], placeholder)
    noise = {"L", "G", "fn", "closure", "cell", "contents", "kwdefaults", "defaults", "parameters", "buffers",
             "keywords", "args", "self", "func", "modules", "globals", "getitem", "import", "main"}
    kept = [p for p in re.split(r"_+", placeholder) if p and p not in noise and not p.isdigit()]
    return "_".join(kept) or "captured"


@dataclasses.dataclass
class _GraphTrace:
    traced: TracedScoreMod | TracedMaskMod
    positions: list[int | None]  # per captured tensor: its graph input, or None (made in the body)
    last: tuple = ((), None)  # (graph inputs, the trace rebound to them): most calls pass the same

    def rebound(self, args: tuple) -> TracedScoreMod | TracedMaskMod:
        """The trace holding these graph inputs (this call's tensors)."""
        last_args, last = self.last
        if len(last_args) == len(args) and all(a is b for a, b in zip(args, last_args)):
            return last
        traced = self.traced
        rebound = traced.__class__.__new__(traced.__class__)
        rebound.__dict__.update(traced.__dict__)
        rebound.captured = [c if p is None else dataclasses.replace(c, tensor=args[p])
                            for c, p in zip(traced.captured, self.positions)]
        self.last = (args, rebound)
        return rebound


# Operators whose Python-number operand may be a 0-d tensor of the result's dtype instead, with
# the same result (torch casts the number to that dtype); other numbers stay constants.
_NUMBER_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.lt, operator.le, operator.gt,
               operator.ge, torch.add, torch.sub, torch.mul, torch.div, torch.where}
_NUMBER_METHODS = {"add", "sub", "mul", "div"}


@dataclasses.dataclass
class _Numbers:
    """Dynamo's graph with its float constants read from one more input, ``numbers`` (float64,
    one per constant): graphs that differ in these values only are one kernel, which reads them
    at run time."""
    gm: torch.fx.GraphModule
    numbers: torch.Tensor | None  # None: no such constant
    code: str  # the structure, the same for every value of the numbers


def _numbers_as_inputs(gm: torch.fx.GraphModule) -> _Numbers:
    graph, env, values = torch.fx.Graph(), {}, []
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda a: env[a])
    numbers = graph.placeholder("numbers")

    def as_input(number, dtype):
        values.append(number)
        item = graph.call_function(operator.getitem, (numbers, len(values) - 1))
        return graph.call_method("to", (item, dtype))

    for node in nodes:
        if node.op == "placeholder":
            continue
        copy = graph.node_copy(node, lambda a: env[a])
        env[node] = copy
        if not (node.op == "call_function" and node.target in _NUMBER_OPS
                or node.op == "call_method" and node.target in _NUMBER_METHODS):
            continue
        operands = node.args[1:] if node.target is torch.where else node.args  # not where's condition
        dtypes = [a.meta["example_value"].dtype for a in operands
                  if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)]
        if not dtypes:
            continue
        dtype = functools.reduce(torch.promote_types, dtypes)
        dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()  # int tensor * 0.5
        if dtype not in (torch.float32, torch.float64):  # torch keeps the number in float32 there
            continue
        with graph.inserting_before(copy):
            copy.args = tuple(as_input(a, dtype) if type(a) is float and (i > 0 or node.target is not torch.where)
                              else a for i, a in enumerate(copy.args))
    if not values:
        return _Numbers(gm, None, gm.code)
    new_gm = torch.fx.GraphModule(gm, graph)
    return _Numbers(new_gm, torch.tensor(values, dtype=torch.float64), new_gm.code)


# dynamo's graph -> its numbers as inputs; (the structure, its inputs' kinds) -> trace
_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_traces: dict[tuple, _GraphTrace] = {}


def _trace_graph(kind: str, fn, gm, args, device: str) -> _GraphTrace:
    """``gm``: dynamo's graph, numbers as inputs or not; ``args``: its inputs."""
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    roles = {f"L_{a}_": i for i, a in enumerate(_ARGS[kind])}

    def as_mod(*mod_args):  # the graph with the tensors it read as constants: make_fx lifts them
        inputs = [mod_args[roles[p]] if p in roles else a for p, a in zip(placeholders, args)]
        return gm(*inputs)[0]

    names = {id(a): f"{kind}_numbers" if p == "numbers" else _friendly_name(p, fn)
             for p, a in zip(placeholders, args) if p not in roles}
    trace = trace_score_mod if kind == "score_mod" else trace_mask_mod
    try:
        traced = trace(as_mod, device=device, names=names, name=_name(fn))
    except FlexTraceError:
        trace(fn, device=device)  # the error again, naming the user's own source line
        raise
    positions = [next((i for i, a in enumerate(args) if a is c.tensor), None) for c in traced.captured]
    return _GraphTrace(traced, positions)


def _reads_values(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph reads a tensor's values as Python numbers (``.item()``), which its trace
    holds as constants and dynamo's guards do not watch: a later in-place change went unseen."""
    return any(n.op == "call_method" and n.target in ("item", "tolist") or n.op == "call_function"
               and n.target in (torch.Tensor.item, torch.Tensor.tolist, torch.ops.aten._local_scalar_dense.default)
               for n in gm.graph.nodes)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def capture(kind: str, fn, *, device: str = "cpu") -> TracedScoreMod | TracedMaskMod:
    """``trace_score_mod`` / ``trace_mask_mod`` of ``fn`` as it is now, holding the tensors it
    reads now; traced again only when dynamo's guards say something it reads has changed."""
    found = dynamo_graph(kind, fn)
    if found is None:  # dynamo cannot trace it (the direct trace names why): no guards, trace every call
        return (trace_score_mod if kind == "score_mod" else trace_mask_mod)(fn, device=device)
    gm, args = found
    if _reads_values(gm):  # (the trace holds the numbers read now: traced again every call)
        return (trace_score_mod if kind == "score_mod" else trace_mask_mod)(fn, device=device)
    if gm not in _numbers:
        _numbers[gm] = _numbers_as_inputs(gm)
    numbered = _numbers[gm]
    if numbered.numbers is not None:
        args = (*args, numbered.numbers)
    # what dynamo guards on and the code does not show: the inputs' kinds; the values of 0-d
    # tensors (the trace inlines those as constants)
    key = (kind, device, numbered.code, tuple((a.shape, a.dtype, a.requires_grad, a.device) for a in args),
           tuple(a.item() for a in args if a.dim() == 0 and not a.requires_grad))
    if key not in _traces:
        _traces[key] = _trace_graph(kind, fn, numbered.gm, args, device)
    return _traces[key].rebound(args)
