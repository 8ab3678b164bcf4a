"""PyTorch binding: flash-attn 2's Python functions, as ``torch.library`` ops.

Two ops, ``tvmflash::flash_attn_forward`` -> (out, lse) and ``tvmflash::flash_attn_backward``
-> (dq, dk, dv), each with a fake (meta) implementation, tie the compiled kernels into PyTorch:
autograd through an autograd.Function over them (``_OpAttention``: no Python autograd kernel on
the ops, whose calls inductor's graphs pay every layer), ``torch.compile(fullgraph=True)``
through the fakes, and ``torch.library.opcheck`` passes. Eager calls on plain tensors skip the
dispatcher (~30-100 us a call): inference calls run the forward's body, training calls an autograd
Function over the same bodies (``_EagerAttention``); compile, modes and transforms see the
ops. In a CPU autocast region an eager call applies the forward op's autocast rule itself
(``_cpu_autocast_applies``) and then takes the same paths. Tensors reach the kernels through
DLPack without a copy; outputs are allocated by PyTorch and written in place by the kernels.

The public functions have flash-attn 2's names, positional order and return values:
``flash_attn_func``, ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` on
``(batch, seqlen, heads, head_dim)`` tensors and the ``*_varlen_*`` forms on packed
``(total_tokens, heads, head_dim)`` tensors with ``cu_seqlens``.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd import forward_ad

from . import checks, compiler, launch, threads, uniform_rows, version
from .config import LONG_TILES, tile_class
from .runtime import FlashKernels
from .spec import SUPPORTED_DTYPES, Alibi, AttentionSpec, Softcap
from .uniform_rows import UniformRows

version.require("torch", torch.__version__, version.MIN_TORCH)

def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def kernels_for(q: torch.Tensor, *, causal: bool = False, deterministic: bool = False, softcap: bool = False,
                alibi: bool = False, fp32_results: bool = False, seqlens: tuple[int, int] | None = None
                ) -> FlashKernels:
    """The compiled kernels for q's device, head dim and dtype with these features (cached).

    ``fp32_results``: out (forward) and dq, dk, dv (backward) in float32 for 16-bit inputs, for
    callers that sum partial results (ring attention). CUDA kernels run on torch's current stream
    (tvm-ffi reads it from the tensors). Kernels take the mask per call; ``causal`` is the default.
    ``seqlens``: (queries, keys) of the call's sequences, if known: CPU kernels with tiles for
    that length (16 or 32 rows where 64-row tiles pad much, ``config.tile_edge``; compiled at the first
    call of each size class, then cached like the others).
    """
    tiles = None
    if seqlens is not None and q.device.type == "cpu":
        tiles = tile_class(seqlens)
        if tiles == LONG_TILES:
            tiles = None  # the kernels for long or unknown lengths
    memo = (q.device, q.dtype, q.shape[-1], causal, deterministic, softcap, alibi, fp32_results, tiles,
            compiler.request_state())
    found = _kernels.get(memo)
    if found is None:
        dtype = _dtype_name(q)
        mods = (Softcap(),) * softcap + (Alibi(),) * alibi
        spec = AttentionSpec(q.shape[-1], dtype, "float32" if fp32_results else dtype, score_mods=mods)
        found = _kernels[memo] = compiler.compile_spec(device_target(q.device), spec, causal=causal,
                                                       deterministic=deterministic, seqlen=tiles)
    return found


# kernels_for's answers, keyed by what selects them (compile_spec's own memo costs ~20 us a call:
# it serializes the target and hashes the spec)
_kernels: dict[tuple, FlashKernels] = {}


def device_target(device: torch.device) -> dict:
    """The compile target for tensors on ``device``: this CPU, or the GPU's architecture."""
    if device.type == "cpu":
        return {"kind": "llvm"}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    raise ValueError(f"tvmflash runs on cpu and cuda tensors, got {device}")


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    if varlen:  # (total, heads, dim) -> flash-attn's (heads, total)
        return (q.shape[1], q.shape[0])
    batch, seqlen_q, heads, _ = q.shape
    return (batch, heads, seqlen_q)


def _as_batch(t: torch.Tensor | None) -> torch.Tensor | None:
    """Packed (total, heads, dim) tensors as the kernels' (1, total, heads, dim) view."""
    return None if t is None else t.unsqueeze(0)


def _mod_inputs(q: torch.Tensor, softcap: float, alibi_slopes: torch.Tensor | None) -> list:
    mods = []
    if softcap > 0:
        mods.append(torch.tensor([softcap], dtype=torch.float32, device=q.device))  # read by the kernels
    if alibi_slopes is not None:
        mods.append(alibi_slopes.reshape(-1, alibi_slopes.shape[-1]).contiguous())
    return mods


def _call_seqlens(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, cu_seqlens_k) -> tuple[int, int] | None:
    """(queries, keys) per sequence of the call, which choose its kernels' tiles: a batched call's
    lengths, or the longest of packed sequences (their cu_seqlens read on CPUs, where a padded
    batch of short prompts then gets short tiles too: 4 sequences of 10-31 tokens, forward +
    backward 1064 -> 690 us); None (the tiles for long sequences) for GPU tensors and for
    cu_seqlens that the checks will refuse."""
    if cu_seqlens_q is None:
        return (q.shape[1], k.shape[1])
    if not q.is_cpu:
        return None
    longest = []
    for cu in (cu_seqlens_q, cu_seqlens_k):
        if not (type(cu) is torch.Tensor and cu.is_cpu and cu.dtype == torch.int32 and cu.dim() == 1
                and cu.numel() >= 2):
            return None
        bounds = cu.tolist()
        longest.append(max(b - a for a, b in zip(bounds, bounds[1:])))
    return longest[0], longest[1]


def _empty_problem(q: torch.Tensor, k: torch.Tensor, varlen: bool) -> bool:
    return q.numel() == 0 or k.numel() == 0 or (not varlen and k.shape[1] == 0)


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, alibi_slopes: torch.Tensor | None, softmax_scale: float,
                  window_left: int, window_right: int, softcap: float, deterministic: bool, fp32_results: bool,
                  diagonal: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right, softcap,
            deterministic, fp32_results, diagonal)
    key = _op_call_key(*args)
    call = _calls.get(key) if key is not None else None
    if call is not None:  # (the op's body, as torch.compile's graphs run it: a call checked before)
        return call.forward_and_lse(q, k, v)
    out, lse = _run_forward(None, *args)
    if key is not None and not _empty_problem(q, k, False):
        options = checks.FlashOptions(softmax_scale, False, (window_left, window_right), softcap, deterministic)
        _remember_call(key, (*q.shape[:3], k.shape[2]), q, k, options, False, args[6:])
    return out, lse


def _op_call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right,
                 softcap, deterministic, fp32_results, diagonal) -> tuple | None:
    """The ``_calls`` key of an op call (the ops' bodies: torch.compile's graphs call them every
    layer and step) whose checks depend on nothing but these: plain CPU tensors of a batched
    call, read in place; else None."""
    if (cu_seqlens_q is not None or cu_seqlens_k is not None or alibi_slopes is not None or fp32_results
            or diagonal is not None or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or not q.is_cpu):
        return None
    return ("op", q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, k.is_cpu, v.shape, v.stride(), v.dtype,
            v.is_cpu, type(softmax_scale), softmax_scale, window_left, window_right, type(softcap), softcap,
            deterministic, compiler.request_state())


def _run_forward(dims, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right,
                 softcap, deterministic, fp32_results, diagonal):
    """The forward op's body; ``dims``: ``checks.check_qkv``'s result when the caller checked
    q, k, v already (``_attention``), else None."""
    varlen = cu_seqlens_q is not None
    out_dtype = torch.float32 if fp32_results else q.dtype
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    if _empty_problem(q, k, varlen):  # no keys: out = 0, lse = -inf (no kernel call)
        return out.zero_(), lse.fill_(float("-inf"))
    kernels = kernels_for(q, deterministic=deterministic, softcap=softcap > 0, alibi=alibi_slopes is not None,
                          fp32_results=fp32_results, seqlens=_call_seqlens(q, k, cu_seqlens_q, cu_seqlens_k))
    if varlen:
        q4, k4, v4, out4, lse3 = (_as_batch(t) for t in (q, k, v, out, lse))
    else:
        q4, k4, v4, out4, lse3 = q, k, v, out, lse
    # out and lse were just allocated here: only the inputs need checking (once per call)
    if dims is None:
        dims = checks.check_inputs(kernels, q4, k4, v4)
    scale = checks.softmax_scale(softmax_scale, kernels.head_dim)
    window = checks.window((window_left, window_right), False)
    kernels.launch_forward(dims, q4, k4, v4, out4, lse3, scale, window, cu_seqlens_q, cu_seqlens_k,
                           kernels._mods(q4, _mod_inputs(q, softcap, alibi_slopes)), diagonal=diagonal)
    return out, lse


# --- the ops -------------------------------------------------------------------------------------
# Defined with torch.library directly rather than torch.library.custom_op, which adds a Python
# Autograd kernel and a Python wrapper to every call: ~115 us a call with cold caches, which
# inductor's graphs pay at every layer and step (they call the ops even without autograd).
# Their autograd formula is an autograd.Function that calls them (``_OpAttention``), which
# dynamo traces into compiled graphs and torch.func can transform.
_OPS = torch.library.Library("tvmflash", "FRAGMENT")


def define_op(name: str, impl, fake) -> torch._ops.OpOverload:
    """``tvmflash::<name>``, a functional op with ``impl`` (its schema from the annotations) as
    its CPU and CUDA kernel, ``fake`` for meta tensors and tracing, and no autograd formula."""
    _OPS.define(name + torch.library.infer_schema(impl, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    for device in ("CPU", "CUDA"):
        _OPS.impl(name, impl, device)
    torch.library.register_fake(f"tvmflash::{name}", fake, lib=_OPS)
    return getattr(torch.ops.tvmflash, name).default


def _eager_path(*tensors) -> str | None:
    """How a call may skip torch's dispatcher (its Python custom-op layers cost ~30-100 us a
    call): "body", the op's implementation, where autograd records nothing; "autograd",
    ``_EagerAttention``, where it does; None (the op) for other than plain tensors, in an
    autocast region (``_attention`` turns a CPU region off after applying its rule), under
    torch.compile tracing, vmap or a dispatch/function mode that must see the op."""
    present = [t for t in tensors if t is not None]
    if (any(type(t) is not torch.Tensor for t in present) or present[0].device.type not in ("cpu", "cuda")
            or not _plain_eager(present[0].device.type)):  # (meta tensors: the op's fake kernel)
        return None
    return "autograd" if _records_grad(present) else "body"


def _records_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _plain_eager(device_type: str) -> bool:
    if torch.is_autocast_enabled(device_type):  # the op's autocast rule must see the call
        return False
    return _no_modes()


# no dispatch or function mode, no functorch transform, as (function, args, value) conditions
# that launch.eager_state reads in one C call; with CPU autocast off: _plain_eager("cpu")'s
_NO_MODES = ((torch._C._len_torch_dispatch_stack, (), 0), (torch._C._len_torch_function_stack, (), 0),
             (torch._C._functorch.maybe_current_level, (), None))
_CPU_EAGER = ((torch.is_autocast_enabled, ("cpu",), False), *_NO_MODES)


def _no_modes() -> bool:
    """Nothing that must see the op: no torch.compile tracing, dispatch or function mode, or
    functorch transform. (Backward bodies need no more: the backward op has no autocast rule.)"""
    return not torch.compiler.is_compiling() and launch.eager_state(_NO_MODES) == 0


# _no_modes's conditions and no gradient to record (a create_graph backward), in one C call
_BACKWARD_EAGER = ((torch.is_grad_enabled, (), False), *_NO_MODES)


def _direct_backward() -> bool:
    """Whether a backward body may run the kernels itself: ``_no_modes`` and no gradient to
    record; else the backward op, which create_graph, modes and transforms must see.
    (is_compiling stays Python: compiled autograd's dynamo traces the body, not a C call.)"""
    return not torch.compiler.is_compiling() and launch.eager_state(_BACKWARD_EAGER) == 0


def eager_dispatch():
    """A context for an op's body that runs torch's own tracing (``padded.py``'s flex mods, traced
    with make_fx): a compiled graph's runtime calls op bodies with the dispatch keys above the
    backend excluded (functionalization, functorch, Python), which tracing and vmap need; the
    eager call's exclusions (autocast's) stay."""
    current = torch._C._dispatch_tls_local_exclude_set()
    kept = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for key in _AUTOCAST_KEYS:
        if current.has(key):
            kept = kept.add(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), kept)


_AUTOCAST_KEYS = [key for name, key in torch._C.DispatchKey.__members__.items() if name.startswith("Autocast")]


def _cpu_autocast_applies(q, k, v) -> bool:
    """A CPU autocast region around an eager call on plain CPU tensors: the caller applies the
    op's autocast rule itself and goes on with the region off (``_with_autocast_applied``), so
    that the call can take the paths that skip torch's dispatcher, which holds the rule (a
    training call through the op and its checks costs ~100 us more at 16 tokens)."""
    return (torch.is_autocast_enabled("cpu") and type(q) is torch.Tensor and type(k) is torch.Tensor
            and type(v) is torch.Tensor and q.is_cpu and _no_modes())


def _autocast_inputs(device_type: str, q, k, v) -> tuple:
    """The op's autocast rule: q, k, v on ``device_type`` cast to the region's dtype (float64 stays
    float64, as autocast leaves it)."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.device.type == device_type and t.dtype != torch.float64 else t for t in (q, k, v))


def _with_autocast_applied(device_type: str, function, q, k, v, *args, **kwargs):
    """``function(q, k, v, ...)`` under the op's autocast rule: q, k, v cast (``_autocast_inputs``),
    then the call with the region off (its key excluded: what ``is_autocast_enabled`` reads)."""
    q, k, v = _autocast_inputs(device_type, q, k, v)
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_OFF[device_type]):
        return function(q, k, v, *args, **kwargs)


def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                  deterministic, fp32_results, diagonal):
    out = torch.empty(q.shape, dtype=torch.float32 if fp32_results else q.dtype, device=q.device)
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


_forward = define_op("flash_attn_forward", _forward_impl, _forward_fake)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                   alibi_slopes: torch.Tensor | None, softmax_scale: float, window_left: int, window_right: int,
                   softcap: float, deterministic: bool, fp32_results: bool, diagonal: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = _op_call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right,
                       softcap, deterministic, fp32_results, diagonal)
    call = _calls.get(key) if key is not None else None
    if call is not None:  # (as in _forward_impl; None: what the kernel refused, which this path names)
        grads = call.backward(dout, q, k, v, out, lse)
        if grads is not None:
            return grads
    varlen = cu_seqlens_q is not None
    grad_dtype = torch.float32 if fp32_results else q.dtype
    dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    if _empty_problem(q, k, varlen):
        return dq.zero_(), dk.zero_(), dv.zero_()
    kernels = kernels_for(q, deterministic=deterministic, softcap=softcap > 0, alibi=alibi_slopes is not None,
                          fp32_results=fp32_results, seqlens=_call_seqlens(q, k, cu_seqlens_q, cu_seqlens_k))
    inputs, grads = (dout, q, k, v, out, lse), (dq, dk, dv)
    if varlen:
        inputs, grads = (tuple(_as_batch(t) for t in ts) for ts in (inputs, grads))
    # dq, dk, dv were just allocated here (their shapes, no overlap): only the inputs need checking
    dims = checks.check_backward_inputs(kernels, *inputs)
    scale = checks.softmax_scale(softmax_scale, kernels.head_dim)
    window = checks.window((window_left, window_right), False)
    kernels.launch_backward(dims, *inputs, *grads, scale, window, cu_seqlens_q, cu_seqlens_k,
                            mod_inputs=_mod_inputs(q, softcap, alibi_slopes), diagonal=diagonal)
    return dq, dk, dv


def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left,
                   window_right, softcap, deterministic, fp32_results, diagonal):
    dtype = torch.float32 if fp32_results else q.dtype
    return tuple(torch.empty(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))


_backward = define_op("flash_attn_backward", _backward_impl, _backward_fake)


_SAVED_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "softmax_scale", "window_left", "window_right",
               "softcap", "deterministic", "fp32_results", "diagonal")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, alibi, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi)
    ctx.scalars = scalars
    ctx.mark_non_differentiable(lse)
    # No zero-filled gradient for lse: filling it ran on torch's OpenMP workers right before the
    # backward kernel, and their spinning then took cores from it (DEVELOPING.md)
    ctx.set_materialize_grads(False)


def _input_grads(ctx, dout, backward) -> tuple:
    """dq, dk, dv from what ``_setup_context`` saved, by ``backward`` (the op or its body)."""
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    return backward(kernel_layout(dout), q, k, v, out, lse, cu_q, cu_k, alibi, *ctx.scalars)


class _OpAttention(torch.autograd.Function):
    """The forward op, differentiated by the backward op: the path of calls that must be seen as
    ops (torch.compile, modes, transforms, meta tensors)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                deterministic, fp32_results, diagonal):  # (named: dynamo would pass ctx into *args)
        return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, window_left, window_right,
                        softcap, deterministic, fp32_results, diagonal)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # nothing downstream used out
            return (None,) * 13
        return *_input_grads(ctx, dout, _backward_op), None, None, None, None, None, None, None, None, None, None


def _backward_op(dout, q, k, v, *rest):
    """The backward op (``refusing_second_derivatives``: it has no autograd formula)."""
    return refusing_second_derivatives(_backward(dout, q, k, v, *rest), q, k, v, dout)


def refusing_second_derivatives(grads: tuple, *depends_on) -> tuple:
    """The gradients (dq, dk, dv, ...) of a backward without an autograd formula. Under
    create_graph=True they stay connected to what they depend on (``_NoSecondDerivative``: q, k,
    v, dout, ...), so that differentiating them again raises rather than takes them for constants."""
    return _NoSecondDerivative.apply(len(grads), *grads, *depends_on) if torch.is_grad_enabled() else grads


def differentiable_pair(forward, backward, name: str, backward_body=None) -> type:
    """An autograd.Function over a forward ``(q, k, v, keys_seen, softmax_scale, window_left,
    window_right, softcap) -> (out, lse[, plan])`` and its backward ``(dout, q, k, v, out, lse,
    plan, softmax_scale, window_left, window_right, softcap) -> (dq, dk, dv)``, where ``keys_seen``
    says which keys each query sees (position_ids, a padding mask) and ``plan`` is what the
    backward reads of it: the forward's third output, else ``keys_seen`` itself. Over two ops it
    adds no Python autograd kernel to them (see ``_OpAttention``); dynamo traces the Function.
    ``backward_body``: the backward op's body, run instead of it where no mode must see the op
    and no second derivative is recorded (``_EagerAttention``'s rule)."""

    def forward_fn(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap):
        return forward(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap)

    def setup_context(ctx, inputs, output):
        q, k, v, keys_seen, *scalars = inputs
        out, lse, *plan = output
        ctx.save_for_backward(q, k, v, out, lse, *plan or (keys_seen,))
        ctx.scalars = scalars
        ctx.mark_non_differentiable(lse, *plan)
        ctx.set_materialize_grads(False)  # (_setup_context says why)

    def backward_fn(ctx, dout, *_):
        if dout is None:
            return (None,) * 8
        q, k, v, out, lse, plan = ctx.saved_tensors
        direct = backward_body is not None and _direct_backward()
        with torch.no_grad():  # (create_graph=True: the torch ops inside record nothing; the result is refused below)
            grads = (backward_body if direct else backward)(kernel_layout(dout), q, k, v, out, lse, plan,
                                                            *ctx.scalars)
        return *refusing_second_derivatives(grads, q, k, v, dout), None, None, None, None, None

    return function_class(name, forward_fn, setup_context, backward_fn, ctx_form=backward_body is not None)


def function_class(name: str, forward, setup_context, backward, *, ctx_form: bool) -> type:
    """An autograd.Function of ``forward(*inputs)``, ``setup_context(ctx, inputs, output)`` and
    ``backward(ctx, *grads)``: with ``ctx_form`` as ``forward(ctx, *inputs)`` (over op bodies,
    eager only; the setup_context form binds its arguments by inspect, ~30 us a call), else in
    the setup_context form that dynamo and torch.func's transforms trace (over ops)."""
    if not ctx_form:
        methods = {"forward": forward, "setup_context": setup_context, "backward": backward}
    else:
        def forward_with_ctx(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        methods = {"forward": forward_with_ctx, "backward": backward}
    return type(name, (torch.autograd.Function,), {key: staticmethod(f) for key, f in methods.items()})


class OpPair:
    """``tvmflash::<name>_forward`` and ``_backward`` (``define_op``) from their bodies and fakes,
    differentiable (``differentiable_pair``), and called as ``flash_attn_func`` calls its ops: an
    eager call on plain tensors skips torch's dispatcher (``_eager_path``: the forward's body
    itself where autograd records nothing, else the same Function over the bodies), and applies
    a CPU autocast region's rule itself; torch.compile, modes and transforms see the ops."""

    def __init__(self, name: str, forward_body, forward_fake, backward_body, backward_fake):
        self.forward = define_op(f"{name}_forward", forward_body, forward_fake)
        self.backward = define_op(f"{name}_backward", backward_body, backward_fake)
        self._forward_body = forward_body
        title = "".join(word.title() for word in name.split("_"))
        self._through_ops = differentiable_pair(self.forward, self.backward, f"_{title}")
        self._through_bodies = differentiable_pair(forward_body, self.backward, f"_{title}Eager", backward_body)
        self._apply_bodies = _c_apply(self._through_bodies)  # (_eager_path's "autograd": no mode or transform)

    def __call__(self, q, k, v, keys_seen, softmax_scale: float, window_left: int, window_right: int,
                 softcap: float) -> tuple:
        """(out, lse[, plan]) of the forward on kernel-layout q, k, v (``kernel_layout``)."""
        args = (keys_seen, softmax_scale, window_left, window_right, softcap)
        if _cpu_autocast_applies(q, k, v):  # (as in _attention)
            return _with_autocast_applied("cpu", self, q, k, v, *args)
        path = _eager_path(q, k, v)
        if path == "body":
            return self._forward_body(q, k, v, *args)
        return (self._apply_bodies if path == "autograd" else self._through_ops.apply)(q, k, v, *args)


def _op_attention(*args):
    """``_OpAttention`` under the forward's autocast rule (``_follow_autocast``), applied here:
    autograd must record the casts before the Function (its inputs are what it saves)."""
    device_type = args[0].device.type
    if device_type in _AUTOCAST_OFF and torch.is_autocast_enabled(device_type):
        q, k, v = _autocast_inputs(device_type, *args[:3])
        with torch.autocast(device_type, enabled=False):
            return _OpAttention.apply(q, k, v, *args[3:])
    return _OpAttention.apply(*args)


class _EagerAttention(torch.autograd.Function):
    """The forward op with its autograd, without torch's custom-op layers, for eager calls on
    plain tensors that autograd records (``_eager_path``): the op's own bodies, saved
    tensors and backward, ~100 us less per training call at 16 tokens (torch.compile, modes and
    transforms still see the op)."""

    @staticmethod
    def forward(ctx, dims, *args):
        out, lse = _run_forward(dims, *args)
        _setup_context(ctx, args, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 14
        # the op where a mode must see it, and with create_graph=True (_backward_op)
        direct = _direct_backward()
        return None, *_input_grads(ctx, dout, _backward_impl if direct else _backward_op), *(None,) * 10


def row_runs_call(q, k, v, row_runs: tuple, *, softmax_scale, causal: bool, window_size, softcap: float,
                  fp32_results: bool = False) -> _ForwardCall | None:
    """The kernels' checked call for attention within ``row_runs`` of plain CPU tensors read in
    place (each run ``(row, start, end)`` a sequence of positions ``start .. end - 1`` of a batch
    row, its queries and keys alike: a padded batch, ``padded.py``, or documents packed into rows,
    ``documents.py``; no gather into packed sequences and scatter back, which cost more than the
    kernels: 4 left-padded rows, fp32 forward + backward, 256 tokens 17.6 -> 12.1 ms, 1024 140 ->
    77), remembered per shapes, options and runs; None where it does not apply (other tensors,
    head dims the kernels pad). ``fp32_results``: as ``kernels_for``'s (out and the gradients in
    float32)."""
    row_runs = tuple(row_runs)
    key = _call_key(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, False, False)
    if key is not None:
        key += (row_runs, fp32_results)
    call = _calls.get(key) if key is not None else None
    if call is None:
        call = _checked_row_runs_call(q, k, v, row_runs, key, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap, fp32_results=fp32_results)
    return call


def _checked_row_runs_call(q, k, v, row_runs: tuple, key, *, softmax_scale, causal, window_size, softcap,
                           fp32_results: bool):
    """``row_runs_call``'s checks and plan (remembered under ``key`` + the runs), or None."""
    options = checks.flash_options(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap)
    tensors = (q, k, v)
    if (any(type(t) is not torch.Tensor or not t.is_cpu or t.dtype != q.dtype or t.stride(-1) != 1 for t in tensors)
            or checks.head_dim_padding([q.shape[-1]]) or q.shape[1] != k.shape[1]):
        return None
    longest = max((end - start for _, start, end in row_runs), default=0)
    kernels = kernels_for(q, softcap=options.softcap > 0, fp32_results=fp32_results, seqlens=(longest, longest))
    dims = checks.check_inputs(kernels, q, k, v)
    kernels._check_runs_here()
    call = _ForwardCall(kernels, dims, k.shape[1], checks.softmax_scale(options.softmax_scale, kernels.head_dim),
                        checks.window(options.window, False), _mod_inputs(q, options.softcap, None),
                        row_runs=row_runs, softcap=options.softcap)
    if key is not None:
        _remember(key, call)
    return call


def row_runs_forward(call: _ForwardCall, uniform: UniformRows | None, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of ``call`` (a ``row_runs_call``), the ``uniform`` rows' means added to out."""
    out, lse = call.forward_and_lse(q, k, v)
    add_uniform_means(call, uniform, out, v)
    return out, lse


def row_runs_backward(call: _ForwardCall, uniform: UniformRows | None, dout, q, k, v, out, lse) -> tuple:
    """dq, dk, dv of ``row_runs_forward``."""
    grad_out = kernel_layout(dout)
    grads = call.backward(grad_out, q, k, v, out, lse)
    if grads is None:  # what the kernel refused: the checked launch names it
        grads = tuple(call.new_output(t.shape, call.out_dtype) for t in (q, k, v))
        call.kernels.launch_backward(call.dims, grad_out, q, k, v, out, lse, *grads, call.scale, call.window, None,
                                     None, mod_inputs=call.mods, row_runs=call.row_runs)
    add_uniform_gradients(call, uniform, grads, q, k, v, grad_out)
    return grads


def add_uniform_means(call: _ForwardCall, uniform: UniformRows | None, out, v) -> None:
    """out (kernel layout) += the ``uniform`` rows' means of v: one kernel where ``call``'s kernels
    have it, else torch ops. Those rows of out must hold 0 (outside ``call``'s row runs)."""
    if uniform is not None:
        span = out[:, uniform.first:uniform.end]
        if not call.kernels.add_uniform_means(span, v, uniform.weight):
            uniform_rows.add_means(span, v, uniform)


def add_uniform_gradients(call: _ForwardCall, uniform: UniformRows | None, grads: tuple, q, k, v, dout) -> None:
    """dq, dk, dv (``grads``, kernel layout) += the ``uniform`` rows' gradients (their rows of dq
    hold 0 so far: outside the runs; fp32 sums, one rounding)."""
    if uniform is not None:
        span = dout[:, uniform.first:uniform.end]
        if call.softcap or not call.kernels.add_uniform_grads(*grads, q, k, v, span, uniform.first, uniform.weight,
                                                              call.scale):
            uniform_rows.add_gradients(*grads, q, k, v, span, uniform, call.scale, call.softcap)


class _NoSecondDerivative(torch.autograd.Function):
    """The first ``count`` tensors (gradients) connected to all of them (what they depend on), so
    that differentiating them again raises (the backward has no autograd formula) instead of
    taking them for constants and dropping the second-order terms."""

    @staticmethod
    def forward(count, *tensors):
        return tensors[:count]

    @staticmethod
    def setup_context(ctx, inputs, output):  # (the form torch.func's transforms need)
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("tvmflash's attention backward has no autograd formula: second derivatives are not "
                           "supported")


def _follow_autocast(device_type: str) -> None:
    """Under ``torch.autocast(device_type, dtype)`` the forward runs on q, k, v cast to ``dtype``
    and returns ``dtype``, as ``scaled_dot_product_attention`` does (it is on autocast's
    lower-precision list), so a model gets the same attention precision from either. Not
    ``torch.library.register_autocast``: it casts to one fixed dtype, and every float input
    (the fp32 ALiBi slopes too); here only q, k, v follow the region's dtype. The casts are
    autograd ops, so gradients reach the fp32 leaves; the backward has no autocast rule."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    _AUTOCAST_OFF[device_type] = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def forward_under_autocast(q, k, v, *rest):
        return _with_autocast_applied(device_type, _forward, q, k, v, *rest)

    _AUTOCAST_LIBRARY.impl("flash_attn_forward", forward_under_autocast, key)


_AUTOCAST_LIBRARY = torch.library.Library("tvmflash", "IMPL")
_AUTOCAST_OFF: dict[str, torch._C.DispatchKeySet] = {}  # excluded: the region is off (is_autocast_enabled reads it)
for _device_type in ("cpu", "cuda"):
    _follow_autocast(_device_type)


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself if the kernels can read it in place, else a copy.

    CPU kernels read any batch/seq/head strides; only head_dim must be unit-stride. CUDA kernels
    copy tiles with 16-byte vector loads: 16-byte aligned data and strides of 8 elements too.
    """
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return t.contiguous()
    if t.device.type == "cuda":
        return _cuda_readable(t)
    return t


def _cuda_readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the CUDA kernels can read it in place, else a copy in a fresh allocation.

    Not ``contiguous()``: it returns ``t`` itself whenever torch calls it contiguous, which a
    tensor with a storage offset that is not 16-byte aligned still is.
    """
    if checks.cuda_layout_problem(checks.info(t)) is None:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# --- flash-attn's Python surface --------------------------------------------------------------------
def _check_tensors(tensors: dict) -> list:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return [checks.info(t, name) for name, t in tensors.items()]  # sparse and other layouts


def _refuse_tangents(*tensors) -> None:
    if any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("tvmflash has no forward-mode AD (jvp): its attention would drop the tangents; "
                                  "use reverse mode (backward, torch.autograd.grad)")


def _check_alibi(alibi_slopes, q: torch.Tensor, heads: int, batch: int | None) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor of shape (heads,) or (batch, heads)")
    allowed = [(heads,)] + ([(batch, heads)] if batch is not None else [])
    if tuple(alibi_slopes.shape) not in allowed:
        raise ValueError(f"alibi_slopes must have shape {' or '.join(map(str, allowed))}, got {tuple(alibi_slopes.shape)}")


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap,
               alibi_slopes, deterministic, return_attn_probs, *, fp32_results=False, diagonal=None):
    if forward_ad._current_level >= 0:  # (a dual level is open: the op has no jvp, and would drop tangents)
        _refuse_tangents(q, k, v)
    if _cpu_autocast_applies(q, k, v):  # (the op's rule, here: the call can then skip the dispatcher)
        return _with_autocast_applied("cpu", _attention, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs, fp32_results=fp32_results, diagonal=diagonal)
    fast = (cu_seqlens_q is None and cu_seqlens_k is None and alibi_slopes is None and not fp32_results
            and diagonal is None and not torch.compiler.is_compiling())  # (compiled: the op, traced)
    if fast:
        key = _call_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                        return_attn_probs)
        call = _calls.get(key) if key is not None else None
        if call is not None:  # (the key: plain CPU tensors)
            state = launch.eager_state(_CPU_EAGER, q, k, v)  # (_plain_eager("cpu") and _records_grad in one)
            if state == 1 and return_attn_probs:
                out, lse = _apply_repeated_training(call, q, k, v)
                return out, lse, None
            if state == 1:
                return _apply_repeated_training_out(call, q, k, v)
            found = call(q, k, v) if state == 0 else None
            if found is not None:
                return found
    varlen = cu_seqlens_q is not None
    tensors = {"q": q, "k": k, "v": v}
    infos = _check_tensors(tensors)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes),
                    ("k", k), ("v", v)):
        # (the custom op sends a call with any meta tensor to its shape-only implementation)
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: every tensor argument must be on q's device")
    heads = q.shape[-2] if q.dim() >= 2 else 0
    batch = (cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else None) if varlen else (
        q.shape[0] if q.dim() == 4 else None)
    head_dim = q.shape[-1] if q.dim() else 0
    options = checks.flash_options(head_dim, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, deterministic=deterministic,
                                   return_attn_probs=return_attn_probs)
    _check_alibi(alibi_slopes, q, heads, batch)
    given = (q, k, v)
    padded = _padded_head_dims(q, k, v)
    if padded[0] is not q:
        q, k, v = padded
        infos = [checks.info(t, n) for n, t in zip("qkv", padded)]
    tensors = {"q": q, "k": k, "v": v}
    if varlen:
        for name, t in tensors.items():
            if t.dim() != 3:
                raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim) for the varlen "
                                 f"functions, got shape {tuple(t.shape)}")
        dims = checks.check_qkv(*(checks.info(t.unsqueeze(0), n) for n, t in tensors.items()))
    else:
        dims = checks.check_qkv(*infos)
    if q.dtype not in tuple(getattr(torch, d) for d in SUPPORTED_DTYPES):
        raise TypeError(f"dtype {q.dtype} is not supported")
    left, right = options.window
    q, k, v = (kernel_layout(t) for t in (q, k, v))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options.softmax_scale, left, right, options.softcap,
            options.deterministic, fp32_results, diagonal)
    path = _eager_path(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    if path == "body":
        out, lse = _run_forward(dims, *args)
    elif path == "autograd":
        out, lse = _EagerAttention.apply(dims, *args)
    else:
        out, lse = _op_attention(*args)
    in_place = all(a is b for a, b in zip((q, k, v), given))  # no padding, no copy
    if path is not None and fast and key is not None and in_place and not _empty_problem(q, k, False):
        _remember_call(key, dims, q, k, options, return_attn_probs, args[6:])
    out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


# --- calls seen before ----------------------------------------------------------------------
# A model calls flash_attn_func once per layer and step with the same shapes and options. The
# checks (~40 us of Python, as much as the kernel at 16 tokens) depend on nothing else: a call
# whose tensors' types, shapes, strides, dtypes and whose options (exact types: True == 1 in a
# key, not for the checks) equal those of a checked dispatcher-free call runs as it did. What
# can still differ is checked per call (_plain_eager: autocast, compile, modes; gradients, which
# decide between the forward alone and _RepeatedTraining's forward and backward). Calls with
# packed sequences, ALiBi or padded head dims take the full path. row_runs_call's calls (a
# left-padded batch read in place) are kept here too, under the key with their row runs added.
_calls: dict[tuple, _ForwardCall] = {}
_MAX_CALLS = 256
# flash_attn_func's calls by their options alone (their _call_key without the tensors and the
# request state, which each call's C launch checks itself): for transformers' training calls,
# whose q, k, v come in (batch, heads, n, head_dim) (repeated_heads_first_training)
_calls_by_options: dict[tuple, list[_ForwardCall]] = {}
_CALLS_PER_OPTIONS = 4
_OPTION_TYPES = (float, int, type(None))


def _call_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs):
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or type(dropout_p) not in _OPTION_TYPES or type(softmax_scale) not in _OPTION_TYPES
            or type(softcap) not in _OPTION_TYPES or type(causal) is not bool or type(deterministic) is not bool
            or type(return_attn_probs) is not bool or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    tensors = launch.meta_key(q, k, v)
    if tensors is None:  # (no strides: sparse and other layouts; the checks name them)
        return None
    return (tensors, type(dropout_p), dropout_p, type(softmax_scale), softmax_scale, type(softcap), softcap, causal,
            window_size, deterministic, return_attn_probs, compiler.request_state())


def options_key(softmax_scale, causal, window_size, softcap) -> tuple:
    """A call's options as the caller gave them, as a memo key (the scale's exact type: an int
    and a float of one value are one key otherwise); of the calls that padded.py and
    documents.py keep on a mask or position_ids for the model's next layers."""
    return type(softmax_scale), softmax_scale, causal, window_size, softcap


def _remember_call(key, dims, q, k, options, return_attn_probs, op_scalars) -> None:
    """Remember a checked call of CPU tensors that the kernels read in place (no copy, no padding);
    ``op_scalars``: the op's arguments after the tensors (a backward the repeat cannot run takes them)."""
    if not q.is_cpu:
        return
    kernels = kernels_for(q, deterministic=options.deterministic, softcap=options.softcap > 0,
                          seqlens=_call_seqlens(q, k, None, None))
    call = _ForwardCall(kernels, dims, k.shape[1], checks.softmax_scale(options.softmax_scale, kernels.head_dim),
                        checks.window((options.window[0], options.window[1]), False),
                        _mod_inputs(q, options.softcap, None), return_attn_probs=return_attn_probs,
                        op_scalars=op_scalars)
    _remember(key, call)
    if not return_attn_probs:
        calls = _calls_by_options.setdefault(key[1:-1], [])
        if len(calls) >= _CALLS_PER_OPTIONS:
            del calls[0]
        calls.append(call)


def _remember(key, call: _ForwardCall) -> None:
    if len(_calls) >= _MAX_CALLS:
        forget_calls()
    _calls[key] = call


def forget_calls() -> None:
    """Forget every checked call: the next calls run the full checks."""
    global calls_generation
    _calls.clear()
    _calls_by_options.clear()
    calls_generation += 1


# how many times forget_calls ran: the checked calls kept elsewhere (padded.py's, on a mask) are
# kept under it, so that they are forgotten with these
calls_generation = 0


def repeat_records(q, k, v) -> bool:
    """Whether a repeated training call of q, k, v may run from C (``launched_training``):
    autograd records it, and no mode, transform or forward-mode AD must see it."""
    return forward_ad._current_level < 0 and launch.eager_state(_NO_MODES, q, k, v) == 1


def repeated_heads_first_training(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
                                  causal: bool, window_size: tuple[int, int], softcap: float) -> torch.Tensor | None:
    """``flash_attn_func``'s out for a call that autograd records, like one checked before, with
    q, k, v as transformers' attention functions get them: ``(batch, heads, n, head_dim)``, read
    in place by C launches that transpose them in their views (out ``(batch, n, heads,
    head_dim)``, the gradients in q, k and v's layout). Three transposed views with gradients
    are three autograd nodes in the forward and three in the backward, each ~5 us where a
    model's products have just evicted the interpreter's data. None where no checked call's
    launch takes them, for a call that records no gradient, or under a mode, transform or
    forward-mode AD. (Under autocast the caller casts q, k, v to its dtype first, as
    ``_attention``'s autocast rule would.)"""
    calls = _calls_by_options.get((float, 0.0, type(softmax_scale), softmax_scale, type(softcap), softcap, causal,
                                   window_size, False, False))
    if not calls or not repeat_records(q, k, v):
        return None
    for call in calls:
        out = launched_training(call, None, call.flash_backward_op, (), q, k, v, heads_first=True)
        if out is not None:
            return out
    return None


class _ForwardCall:
    """A checked forward call's kernels and tables, for calls with the same ``_call_key``, and
    its backward's (planned at the first backward or heads-first launch). ``row_runs``:
    ``row_runs_call``'s (then the rows outside the runs of out, lse and the gradients are 0: no
    kernel writes them)."""

    def __init__(self, kernels, dims, seqlen_k: int, scale: float, window: tuple, mods: list, *,
                 return_attn_probs=False, op_scalars=(), row_runs: tuple | None = None, softcap: float = 0.0):
        batch, seqlen_q, heads, heads_k = dims
        seqs, tables = kernels._sequences("forward", batch, seqlen_q, seqlen_k, heads_k, None, None, row_runs=row_runs)
        # plain tuples: torch.empty(*shape) parses ~2x faster than a torch.Size (~2-3 us a call)
        self.kernels, self.dims = kernels, tuple(dims)
        self.out_dtype = getattr(torch, kernels.out_dtype)  # (of out and the gradients: q's, or fp32 results)
        self.out_shape, self.lse_shape = (batch, seqlen_q, heads, kernels.head_dim), (batch, heads, seqlen_q)
        self.kv_shape = (batch, seqlen_k, heads_k, kernels.head_dim)
        self.scale, self.window, self.softcap = scale, window, softcap
        self.tables, self.mods, self.return_attn_probs = tables[:3], mods, return_attn_probs
        self.tasks = max(seqs.query_tiles * heads, seqs.key_tiles * heads_k)
        self.seqlen_k, self.op_scalars, self.row_runs = seqlen_k, op_scalars, row_runs
        # rows outside the runs: 0, lse too (a memset of the whole tensor costs less than writing
        # those rows slice by slice: 2 against 11 us at 4 x 16 tokens, 30 against 18 at 4 x 512);
        # none where the runs cover every row (documents packed into rows)
        self.zeroed = row_runs is not None and sum(end - start for _, start, end in row_runs) < batch * seqlen_q
        self._allocate = torch.zeros if self.zeroed else torch.empty
        self._launches = row_runs is None or any(end > start for _, start, end in row_runs)
        self.function = kernels._functions["flash_fwd"]
        self.device = torch.device("cpu")
        self._scratch = threading.local()  # each thread's lse when the caller does not want it
        self._backward_tables = None

    def __call__(self, q, k, v):
        """The result of a call that records no gradient (None where one would be recorded)."""
        launched = self._launch("call", q, k, v)
        if launched is not None:
            return launched(q, k, v)
        if _records_grad((q, k, v)):
            return None
        if self.return_attn_probs:
            lse = self.new_lse()
            return self.forward(q, k, v, lse), lse, None
        return self.forward(q, k, v, self._scratch.lse)

    def new_lse(self) -> torch.Tensor:
        return self._allocate(*self.lse_shape, dtype=torch.float32, device=self.device)

    def new_output(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return self._allocate(*shape, dtype=dtype, device=self.device)

    def forward_and_lse(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """out and lse (new tensors)."""
        launched = self._launch("forward", q, k, v)
        found = None if launched is None else launched(q, k, v)
        if found is not None:
            return found
        lse = self.new_lse()
        return self.forward(q, k, v, lse), lse

    def forward(self, q, k, v, lse: torch.Tensor) -> torch.Tensor:
        """out, with the row statistics written into ``lse``."""
        kernels = self.kernels
        out = self.new_output(self.out_shape, self.out_dtype)
        if not self._launches:  # (row runs all empty)
            return out
        n_threads = kernels.plan_threads()
        if kernels._on_torch_threads:
            threads.limit(min(n_threads, self.tasks))
        self.function(q, k, v, out, lse, self.scale, *self.window, n_threads, *self.tables, *self.mods)
        return out

    def backward(self, dout, q, k, v, out, lse) -> tuple | None:
        """dq, dk, dv of this call's forward (out, lse), or None where the full backward must run."""
        kernels = self.kernels
        self._plan_backward(q)
        launched = self._launch("backward", dout, q, k, v, out, lse)
        if launched is not None:
            grads = launched(dout, q, k, v, out, lse)
            if grads is not None:
                return grads
        dout = kernel_layout(dout)
        dq = self.new_output(self.out_shape, self.out_dtype)
        dk = self.new_output(self.kv_shape, self.out_dtype)
        dv = self.new_output(self.kv_shape, self.out_dtype)
        if not self._launches:
            return dq, dk, dv
        n_threads = kernels.plan_threads()
        if kernels._on_torch_threads:
            threads.limit(n_threads)
        try:  # (the kernel's own argument checks: what they refuse, the full backward names)
            kernels._functions["flash_bwd"](dout, q, k, v, out, lse, dq, dk, dv, self.scale, *self.window, n_threads,
                                            *self._backward_tables)
        except Exception:
            return None
        return dq, dk, dv

    def _plan_backward(self, q) -> None:
        if self._backward_tables is None:
            kernels = self.kernels
            batch, seqlen_q, _, heads_k = self.dims
            seqs, tables = kernels._sequences("backward", batch, seqlen_q, self.seqlen_k, heads_k, None, None,
                                              row_runs=self.row_runs)
            self._backward_tables = (seqs.rounds, seqs.super_tile, *tables, *kernels._mods(q, self.mods, ()))

    def _launch(self, kind: str, *example):
        """This thread's C launch (``launch.py``) of ``kind`` for the current thread count, made at
        its first use from ``example`` (the call's tensors, which passed the checks or match a
        call that did), or None where there is none: the Python above then does the same.

        "call": a forward that records no gradient (out; lse too with return_attn_probs, else
        into this thread's scratch); "forward": out and lse; "backward": dq, dk, dv. The outputs
        of calls of row runs are zeroed first (the kernels write only the runs' rows)."""
        n_threads = self.kernels.plan_threads()
        launches = self._thread_launches()
        key = (kind, n_threads)
        if key not in launches:
            if len(launches) >= 8:  # (a thread count that keeps changing)
                launches.clear()
            launches[key] = self._new_launch(kind, n_threads, example) if self._launches else None
        return launches[key]

    def _thread_launches(self) -> dict:
        scratch = self._scratch
        launches = getattr(scratch, "launches", None)
        if launches is None:
            launches = scratch.launches = {}
            scratch.lse = self.new_lse()
        return launches

    def heads_first_launches(self, q, k, v, backward: _ForwardCall | None = None) -> tuple | None:
        """This thread's (forward, backward) launches for q, k, v in transformers' ``(batch,
        heads, n, head_dim)`` layout (``repeated_heads_first_training``): made from the first q,
        k, v whose kernel-layout views the thread's own forward launch (made from a checked
        call) takes, the backward's for dout, q, k, v, out, lse then, planned ahead (its
        lookup would cost another ~15 us where a model's backward has evicted the interpreter's
        data); None until then, or without the C launcher. (The backward's may run on another
        thread, as autograd's engine may: a launch that is never ``set`` can be shared.)
        ``backward``: the call whose backward launch pairs with this call's forward (default
        this call): one of the same checked tensors whose gradients are in q's dtype, where
        this call's out is float32 (``fp32_results``: ``sinks.py`` scales it, then rounds it
        once); its out and lse are then q's dtype and float32."""
        n_threads = self.kernels.plan_threads()
        launches = self._thread_launches()
        backward = backward or self
        key = ("heads first", n_threads, backward is self)
        if key not in launches:
            own = launches.get(("forward", n_threads))
            if own is None or not own.accepts(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)):
                return None
            if len(launches) >= 8:
                launches.clear()
            backward._plan_backward(q)
            out = torch.empty(*self.out_shape, dtype=q.dtype)  # (the forward's: contiguous)
            made = (self._new_launch("forward", n_threads, (q, k, v), heads_first=True),
                    backward._new_launch("backward", n_threads, (out, q, k, v, out, backward.new_lse()),
                                         heads_first=True))
            launches[key] = None if None in made else made
        return launches[key]

    def backward_heads_first(self, made, dout, q, k, v, out, lse) -> tuple | None:
        """``backward`` for q, k, v in transformers' layout by ``made`` (``heads_first_launches``'):
        dq, dk, dv in that layout too."""
        grads = made(dout, q, k, v, out, lse)
        if grads is not None:
            return grads
        grads = self.backward(dout, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out, lse)
        return None if grads is None else tuple(g.transpose(1, 2) for g in grads)

    def flash_backward_op(self, dout, q, k, v, out, lse) -> tuple:
        """The backward op of a ``flash_attn_func`` call with this call's scalars, on kernel-layout
        tensors (``launched_training``'s fallback; not for calls of row runs)."""
        return _backward(dout, q, k, v, out, lse, None, None, None, *self.op_scalars)

    def _new_launch(self, kind: str, n_threads: int, example: tuple, heads_first: bool = False):
        dtype = self.out_dtype
        out = torch.empty(*self.out_shape, dtype=dtype)
        lse = torch.empty(*self.lse_shape, dtype=torch.float32)
        scalars = (("float", self.scale), *(("int", w) for w in self.window), ("int", n_threads))
        if kind == "backward":
            kv = torch.empty(*self.kv_shape, dtype=dtype)
            outputs, tail = (out, kv, kv), self._backward_tables
            team = n_threads
            inputs = ((example[0], 0, (1 << example[0].dim()) - 1), *((t, 0, 0, heads_first) for t in example[1:4]),
                      *((t, 0, 0) for t in example[4:]))
            template = (*(("in", i) for i in range(6)), *(("out", j) for j in range(3)), *scalars)
            function = self.kernels._functions["flash_bwd"]
        else:
            lse_entry = ("out", 1) if kind == "forward" or self.return_attn_probs else ("tensor", self._scratch.lse)
            outputs = (out, lse) if lse_entry[0] == "out" else (out,)
            tail, team = (*self.tables, *self.mods), min(n_threads, self.tasks)
            inputs = tuple((t, 0, 0, heads_first) for t in example)
            template = (("in", 0), ("in", 1), ("in", 2), ("out", 0), lse_entry, *scalars)
            function = self.function
        template += tuple(("tensor", torch.from_dlpack(x)) if hasattr(x, "__dlpack__") else ("int", int(x))
                          for x in tail)  # (the tables are TVM's tensors: torch views of them)
        # (heads first: the gradients in q, k and v's layout; row runs: the rows outside them 0, as _allocate's)
        gradients_heads_first = heads_first and kind == "backward"
        if gradients_heads_first or self.zeroed:
            outputs = tuple((t.transpose(1, 2) if gradients_heads_first else t, gradients_heads_first, self.zeroed)
                            for t in outputs)
        made = launch.make(function, template, inputs, outputs, team=team if self.kernels._on_torch_threads else 0,
                           refuse_grad=kind == "call", guards=compiler.request_guards())
        if made is None or kind != "call" or not self.return_attn_probs:
            return made
        return lambda q, k, v: _with_no_dropout_mask(made(q, k, v))


def _with_no_dropout_mask(result):
    return None if result is None else (*result, None)


class _RepeatedTraining(torch.autograd.Function):
    """A repeated call (``_calls``) that autograd records: its forward and backward without the
    checks, which ``_EagerAttention`` runs every call (a training step's layers repeat their
    shapes; forward + backward at B1 N16 H8/2 D64 fp32: 400 -> 190-230 us)."""

    @staticmethod
    def forward(ctx, call, q, k, v):
        out, lse = call.forward_and_lse(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (see _setup_context)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        grads = None
        if _direct_backward():
            grads = ctx.call.backward(dout, q, k, v, out, lse)
        if grads is None:  # create_graph, a mode, or what the kernel refused: the op (see _EagerAttention)
            grads = _backward_op(kernel_layout(dout), q, k, v, out, lse, None, None, None, *ctx.call.op_scalars)
        return None, *grads


class _RepeatedTrainingOut(torch.autograd.Function):
    """``_RepeatedTraining`` for calls that return out alone: one output, no lse to mark
    non-differentiable nor gradients to leave unmaterialized (two context calls less).
    (``_LaunchedTraining`` with its launches None computes the same, ~7 us a call slower at B1
    N16 H8/2 D64 fp32, 90 against 83 us forward + backward: four more inputs and context
    attributes for autograd's C apply; measured 2026-12-06, so it stays.)"""

    @staticmethod
    def forward(ctx, call, q, k, v):
        out, lse = call.forward_and_lse(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        return _RepeatedTraining.backward(ctx, dout, None)


def _c_apply(function: type):
    """``function.apply`` without autograd.Function.apply's Python layer (its functorch checks and
    unwrapping, which callers that checked ``_no_modes`` need not: no transform is active):
    torch's C apply, ~15 us less a call where a model's products have evicted the interpreter's
    data. ``function.apply`` itself where torch has no such entry."""
    found = vars(getattr(torch._C, "_FunctionBase", object)).get("apply")
    return found.__get__(None, function) if hasattr(found, "__get__") else function.apply


class _LaunchedTraining(torch.autograd.Function):
    """A checked call (``_ForwardCall``: ``flash_attn_func``'s, or a ``row_runs_call``) that
    autograd records, by its launches: ``launches``, this thread's ``heads_first_launches`` (q, k,
    v and the gradients in transformers' layout), or None (``forward_and_lse`` and ``backward`` on
    kernel-layout tensors); the ``uniform`` rows' terms added; and where the call's backward
    cannot run (create_graph, a mode, what the kernel refused) ``fallback(dout, q, k, v, out, lse,
    *keep)`` in kernel layout: the op that made the call (``keep``: its tensors, saved with the
    others). Kernel-layout views of heads-first tensors are made only where those need them."""

    @staticmethod
    def forward(ctx, call, launches, uniform, fallback, keep, q, k, v):
        found = None if launches is None else launches[0](q, k, v)
        if found is None:  # (kernel layout, or a steering value changed since the launch took them)
            found = call.forward_and_lse(*_kernel_views(launches, q, k, v))
        out, lse = found
        if uniform is not None:
            add_uniform_means(call, uniform, out, _kernel_views(launches, v)[0])
        ctx.save_for_backward(q, k, v, out, lse, *keep)
        ctx.call, ctx.launch, ctx.uniform, ctx.fallback = call, launches and launches[1], uniform, fallback
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *keep = ctx.saved_tensors
        call, launched = ctx.call, ctx.launch
        grads = None
        if _direct_backward():
            grads = (call.backward(kernel_layout(dout), q, k, v, out, lse) if launched is None
                     else call.backward_heads_first(launched, dout, q, k, v, out, lse))
        if grads is None:
            views = _kernel_views(launched, q, k, v)
            with torch.no_grad():  # (create_graph: the torch ops inside record nothing; the result is refused below)
                grads = ctx.fallback(kernel_layout(dout), *views, out, lse, *keep)
            grads = _kernel_views(launched, *refusing_second_derivatives(grads, *views, dout))
        elif ctx.uniform is not None:
            add_uniform_gradients(call, ctx.uniform, _kernel_views(launched, *grads), *_kernel_views(launched, q, k, v),
                                  kernel_layout(dout))
        return None, None, None, None, None, *grads


def _kernel_views(launches, *tensors) -> tuple:
    """``tensors`` as the kernels' layout has them: heads-first ones (``launches`` given)
    transposed, views of each other's (dimensions 1 and 2 swapped both ways)."""
    return tensors if launches is None else tuple(t.transpose(1, 2) for t in tensors)


_apply_launched_training = _c_apply(_LaunchedTraining)


def launched_training(call: _ForwardCall, uniform: UniformRows | None, fallback, keep: tuple, q, k, v,
                      heads_first: bool = False) -> torch.Tensor | None:
    """out of a checked call whose q, k, v autograd records, with ``_LaunchedTraining``'s
    backward; ``heads_first``: q, k, v in transformers' ``(batch, heads, n, head_dim)`` layout
    (None where this thread's launches do not take them yet). The caller has checked that no
    mode, transform or forward-mode AD is active (``launch.eager_state``)."""
    launches = None
    if heads_first:
        launches = call.heads_first_launches(q, k, v)
        if launches is None or not launches[0].accepts(q, k, v):
            return None
    return _apply_launched_training(call, launches, uniform, fallback, keep, q, k, v)


_apply_repeated_training = _c_apply(_RepeatedTraining)
_apply_repeated_training_out = _c_apply(_RepeatedTrainingOut)


def _padded_head_dims(q, k, v):
    """flash-attn's rule for a head dim that is no multiple of 8 (the kernels' unit): q, k and v
    zero-padded to the next one. The scores and the first head_dim columns of the output are
    unchanged; autograd through the padding slices the gradients back. Costs a copy of each."""
    padding = checks.head_dim_padding(t.shape[-1] for t in (q, k, v) if t.dim())
    if not padding:
        return q, k, v
    return tuple(torch.nn.functional.pad(t, (0, padding)) for t in (q, k, v))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False):
    """Exact attention ``softmax(q k^T * scale + masks) v``, FlashAttention style (flash-attn 2's API).

    q ``(batch, seqlen_q, heads, head_dim)``, k and v ``(batch, seqlen_k, heads_k, head_dim)``
    with ``heads % heads_k == 0`` (GQA/MQA); float32/float16/bfloat16; head_dim up to 256 (other
    than multiples of 8 zero-padded to one, as flash-attn does: a copy). ``softmax_scale``
    defaults to ``1/sqrt(head_dim)`` (any finite value > 0).
    Masks align to the bottom-right corner: query i sees key j iff ``i + seqlen_k - seqlen_q -
    left <= j <= i + seqlen_k - seqlen_q + right`` for ``window_size = (left, right)`` (-1: no
    limit); ``causal`` is right = 0. ``softcap > 0``: scores become ``softcap * tanh(s /
    softcap)``; ``alibi_slopes`` (heads,) or (batch, heads) fp32 add ``-slope * |i + seqlen_k -
    seqlen_q - j|``. A query that sees no key gets output 0, lse -inf and zero gradients.
    Returns ``out`` (like q), or ``(out, softmax_lse, None)`` with ``return_attn_probs=True``
    (lse ``(batch, heads, seqlen_q)`` float32, natural log; dropout is not supported, so there
    is no dropout mask). CUDA tensors (float16/bfloat16, head_dim a multiple of 16 up to 128)
    run the tensor-core kernels on the current stream;
    ``deterministic=True`` makes their backward bitwise reproducible. CPU kernels are always
    deterministic, whatever the thread count.
    """
    return_lse = checks.require_bool("return_lse", return_lse)
    result = _attention(q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs or return_lse)
    if return_lse and not return_attn_probs:  # tvmflash 0.1's keyword: (out, lse)
        return result[0], result[1]
    return result


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on qkv ``(batch, seqlen, 3, heads, head_dim)`` (views, no copy)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, heads, head_dim), got {getattr(qkv, 'shape', qkv)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` with kv ``(batch, seqlen_k, 2, heads_k, head_dim)``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, heads_k, head_dim), got {getattr(kv, 'shape', kv)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over packed sequences: q ``(total_q, heads, head_dim)``, k and v ``(total_k,
    heads_k, head_dim)``; sequence b is rows ``cu_seqlens[b] ... cu_seqlens[b + 1] - 1`` (int32).
    Masks, softcap and ALiBi (slopes (heads,) or (batch, heads)) apply per sequence, as in
    ``flash_attn_func``. No padding is materialised: the kernels walk each sequence's tiles.
    ``max_seqlen_*`` are accepted for compatibility (the kernels read the lengths themselves).
    Returns ``out`` ``(total_q, heads, head_dim)``, or ``(out, softmax_lse, None)`` with lse
    ``(heads, total_q)``.

    Paged KV (chunked prefill against a serving engine's cache), as in flash-attn: with
    ``block_table`` (batch, max_blocks) int32, k and v are the paged caches (num_blocks,
    page_block_size, heads_k, head_dim) and sequence b's keys are its first ``cu_seqlens_k[b + 1]
    - cu_seqlens_k[b]`` logical rows, row j in page ``block_table[b, j // page_block_size]``.
    The used rows are gathered into packed k and v first (one ``index_select`` each: a copy of
    the keys attended to, O(total_k) memory and time, small next to the attention's
    O(total_q x total_k)); gradients flow back into the pages through it."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if block_table is not None:
        k, v = _gather_pages(k, v, cu_seqlens_k, block_table)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def _gather_pages(k_cache, v_cache, cu_seqlens_k, block_table):
    """The keys and values of each sequence, read through ``block_table`` out of paged caches, as
    packed (total_k, heads_k, head_dim) tensors (``flash_attn_varlen_func``). Checks the table:
    dtype, shape, capacity against ``cu_seqlens_k``, page indices in range for the blocks in use."""
    for name, t in (("k", k_cache), ("v", v_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("with block_table, k and v are paged caches (num_blocks, page_block_size, heads_k, "
                         f"head_dim) of one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, t in (("v", v_cache), ("block_table", block_table), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k on {k_cache.device}: they must be on one device")
    num_blocks, page = k_cache.shape[:2]
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int32 tensor (batch, max_blocks), got {block_table.dtype} "
                         f"with shape {tuple(block_table.shape)}")
    if block_table.is_meta or k_cache.is_meta:
        raise ValueError("block_table and the paged caches must hold data (meta tensors have none): "
                         "the keys are read through the table")
    cu = checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, int(cu_seqlens_k[-1]) if cu_seqlens_k.numel() else 0)
    batch = len(cu) - 1
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, cu_seqlens_k describes {batch} sequences")
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.int64)
    capacity = block_table.shape[1] * page
    if int(lengths.max()) > capacity:
        raise checks.CapacityError(f"a sequence of cu_seqlens_k has {int(lengths.max())} keys, more than block_table "
                                   f"addresses (max_blocks * page_block_size = {block_table.shape[1]} * {page} = "
                                   f"{capacity})")
    table = block_table.cpu().long()
    used = torch.arange(table.shape[1])[None, :] < (lengths[:, None] + page - 1) // page
    named = table[used]
    if named.numel() and (int(named.min()) < 0 or int(named.max()) >= num_blocks):
        raise ValueError(f"block_table holds page indices outside [0, {num_blocks}) for blocks in use")
    # row j of sequence b -> page table[b, j // page], offset j % page
    seq = torch.repeat_interleave(torch.arange(batch), lengths)
    j = torch.arange(int(lengths.sum())) - torch.tensor(cu[:-1], dtype=torch.int64)[seq]
    rows = (table[seq, j // page] * page + j % page).to(k_cache.device)
    return tuple(c.flatten(0, 1).index_select(0, rows) for c in (k_cache, v_cache))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on qkv ``(total, 3, heads, head_dim)``."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, heads, head_dim), got {getattr(qkv, 'shape', qkv)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_func`` with kv ``(total_k, 2, heads_k, head_dim)``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, heads_k, head_dim), got {getattr(kv, 'shape', kv)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
