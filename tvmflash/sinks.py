"""Attention sinks (gpt-oss's ``s_aux``): one learned logit per query head that joins every
row's softmax and carries no value, so that a row can give part of its weight to nothing (all of
it where the row sees no key).

Exact from an attention's out and fp32 lse, the attention kernels unchanged (rows i, keys j, head h)::

    lse'_i  = logaddexp(lse_i, sink_h)               the row's log-sum-exp with the sink (fp32)
    out'_i  = out_i exp(lse_i - lse'_i)              the keys' share of the row's weight
    dq, dk, dv = the attention's backward on (out', lse', dO')
    dsink_h = -sum_i exp(sink_h - lse'_i) Delta'_i,  Delta'_i = rowsum(dO'_i out'_i)

The backward recomputes P'_ij = exp(S_ij - lse'_i) = P_ij exp(lse_i - lse'_i), the probabilities
with the sink, and Delta' = sum_j P'_ij dP_ij: with the sink's value 0 its dP is 0, so dS = P'
(dP - Delta') is the gradient with the sink, and the sink's own is its probability times (0 -
Delta'). out' is rounded to the storage dtype once (rule 3): the forward body gives out in
float32 for 16-bit inputs (its fp32 accumulator divided by the row's sum), which the rescale
multiplies in float32 before the one cast.

Query rows that are padding get 0 (lse' = the sink alone), as transformers' ``eager`` gpt-oss
gives them: their keys masked to the dtype's minimum, the sink takes their whole weight.

On CPU tensors the rescale and dsink are one kernel each (``kernels/sinks.py``: ~10 small torch
ops apiece, whose cost is per op); CUDA tensors and TVM's runtime alone (prebuilt kernels) take
the same formulas as torch ops.

``SinkOps`` makes the two ops of an attention with sinks from its forward and backward bodies
(``padded.py``'s, which serve every mask and documents): differentiable, seen by
torch.compile as ops, eager calls without torch's dispatcher (``torch_op.OpPair``'s rule).
"""

from __future__ import annotations

import threading

import torch

from . import compiler, launch, settings, torch_op
from .spec import AttentionSpec


def check(sinks, heads: int, device: torch.device) -> None:
    """A clear error unless ``sinks`` is a floating (heads,) tensor on ``device``."""
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor of shape ({heads},), one logit per query head, got "
                        f"{type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},), one logit per query head, got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}")


def logits(sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as detached fp32 (heads,) logits (the kernels' input; ``[:, None]`` broadcasts
    them against (batch, heads, n) row statistics)."""
    return sinks.detach().to(torch.float32)


def kernels(dtype: torch.dtype, head_dim: int):
    """The sink kernels (``runtime.SinkKernels``) for CPU tensors of ``dtype`` (out' and dO) and
    ``head_dim``, compiled at the first use (~0.1 s) and cached; None where TVM's compiler is
    absent (its runtime alone), no earlier process cached them and ``$TVMFLASH_PREBUILT`` holds
    none. (Kept whatever ``compiler.request_state`` says later: no tuning record or product choice
    changes their code; where they come from, the cache or prebuilt directory, is in the key.)"""
    key = (dtype, head_dim, *_steering_values())
    found = _kernels.get(key, False)
    if found is False:
        found = _kernels[key] = compiler.compile_sinks(torch_op.device_target(torch.device("cpu")),
                                                       AttentionSpec(head_dim, str(dtype).removeprefix("torch.")))
    return found


_kernels: dict[tuple, object] = {}
_steering_values = settings.EnvironmentValues("TVMFLASH_CACHE_DIR", "TVMFLASH_PREBUILT")
_EVERY_ROW = torch.ones((1, 1), dtype=torch.uint8)  # (expanded: every query row is real)
_FUNCTIONS = {"rescale": "sink_rescale", "gradient": "sink_gradient"}  # (SinkKernels' method: its function)


def _ran(name: str, dtype: torch.dtype, tensors: tuple, outputs: tuple, tasks: int) -> tuple | None:
    """The outputs of the sink kernel ``name`` (``runtime.SinkKernels``' method) for ``dtype`` on
    these CPU tensors, ``outputs`` ((shape, dtype), ...) as it writes them; None where it cannot
    run (then nothing was written). Launched from C by this thread's launch for their shapes (a
    decode step's and a training call's repeat theirs), made at the first such call, else a
    packed call (~15 us more a call: Python's argument packing and allocations)."""
    found = kernels(dtype, tensors[0].shape[-1])
    if found is None:
        return None
    made = _thread_launch(found, name, tensors, outputs, tasks)
    result = None if made is None else made(*tensors)
    if result is not None:
        return result if isinstance(result, tuple) else (result,)
    written = tuple(torch.empty(shape, dtype=dt) for shape, dt in outputs)
    try:  # (the generated function's argument checks run before it writes anything)
        getattr(found, name)(*tensors, *written)
    except (ValueError, TypeError):
        return None
    return written


_threads = threading.local()  # (a C launch belongs to one thread: launch.py)


def _thread_launch(found, name: str, tensors: tuple, outputs: tuple, tasks: int):
    """This thread's C launch of ``found``'s kernel ``name`` for tensors of these shapes (every
    stride free: the kernel's own argument checks read them), or None without the C launcher."""
    n_threads = found.plan_threads()
    key = (found, name, tensors[0].shape, n_threads)
    launches = getattr(_threads, "launches", None)
    if launches is None:
        launches = _threads.launches = {}
    made = launches.get(key, False)
    if made is False:
        if len(launches) >= 16:  # (shapes that keep changing)
            launches.clear()
        found._check_runs_here(f"the sink kernel {name}")  # (the packed call checks it on every call)
        template = (*(("in", i) for i in range(len(tensors))), *(("out", j) for j in range(len(outputs))))
        made = launches[key] = launch.make(
            found._functions[_FUNCTIONS[name]], template, tuple((t, 0, (1 << t.dim()) - 1) for t in tensors),
            tuple(torch.empty(shape, dtype=dt) for shape, dt in outputs),
            team=min(n_threads, max(1, tasks)) if found._on_torch_threads else 0, refuse_grad=False, guards=())
    return made


def renormalized(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, real_rows: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of the module docstring, out' in ``dtype``: out (batch, n, heads, head_dim)
    float32 (the attention's own new tensor, which the torch ops scale in place; rounded once
    either way), lse (batch, heads, n) fp32, sinks (heads,); ``real_rows`` (batch, n) bool,
    False at padding query rows, or None."""
    if out.dtype == torch.float32 and out.is_cpu:
        real = _EVERY_ROW.expand(out.shape[:2]) if real_rows is None else real_rows.view(torch.uint8)
        found = _ran("rescale", dtype, (out, lse, logits(sinks), real),
                     ((out.shape, dtype), (lse.shape, torch.float32)), out.shape[0] * out.shape[1])
        if found is not None:
            return found
    sink = logits(sinks)[:, None]
    share, with_sink = keys_share(lse, sink), torch.logaddexp(lse, sink)
    if real_rows is not None:
        real = real_rows[:, None, :]
        share, with_sink = share * real, torch.where(real, with_sink, sink)
    return rescaled(out, share, dtype), with_sink


def keys_share(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """exp(lse - lse') = sigmoid(lse - sink): the share of a row's weight its keys keep."""
    return torch.sigmoid(lse - sink)


def rescaled(out: torch.Tensor, share: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out (batch, n, heads, head_dim, float32) times the (batch, heads, n) ``share``, in place,
    then rounded once to ``dtype``."""
    if out.dtype != torch.float32:
        raise TypeError(f"out must be float32 (the kernels' fp32 results), got {out.dtype}: a 16-bit out would be "
                        "rounded twice")
    # (the share in out's layout: the product's strides follow its inputs', out's must stay out's)
    return out.mul_(share.transpose(1, 2).contiguous()[..., None]).to(dtype)


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dsinks from dO', out' and lse' (the module docstring), in the sinks' dtype."""
    if dout.is_cpu and dout.dtype == out.dtype:
        found = _ran("gradient", out.dtype, (dout, out, lse, logits(sinks)), ((sinks.shape, torch.float32),),
                     sinks.shape[0])
        if found is not None:
            return found[0].to(sinks.dtype)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, n)
    sink_share = torch.exp(logits(sinks)[:, None] - lse)
    return (-(sink_share * delta).sum((0, 2))).to(sinks.dtype)


class _RepeatedTraining(torch.autograd.Function):
    """A training call with sinks like a checked one before it (``padded.repeated_heads_first_training``):
    q, k, v in transformers' ``(batch, heads, n, head_dim)`` layout, read in place by ``launches``
    (``torch_op._ForwardCall.heads_first_launches`` of ``calls``, (the forward's, float32 out,
    the backward's)); out' in the kernels' ``(batch, n, heads, head_dim)``, the gradients in q,
    k and v's layout. ``real``: (batch, n) bool, False at padding query rows, or None (every row
    real). ``fallback(dout, q, k, v, out', lse', sinks, *keep)`` on kernel-layout tensors: the
    backward op that made the call, where the launches' cannot run (create_graph, a mode, what
    the kernel refused). What the op's forward and backward bodies do, without their lookups and
    the transposed views' autograd nodes (~100 us a call of 16 tokens, bf16)."""

    @staticmethod
    def forward(ctx, calls, launches, real, fallback, keep, q, k, v, sinks):
        found = launches[0](q, k, v)
        if found is None:  # (a steering value changed since the launch took them)
            found = calls[0].forward_and_lse(*torch_op._kernel_views(launches, q, k, v))
        # (rows outside the row runs, the padding, hold 0: no blind rows' means, which out' zeroes)
        out, lse = renormalized(*found, sinks, real, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *keep)
        ctx.call, ctx.launch, ctx.real, ctx.fallback = calls[1], launches[1], real, fallback
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, *keep = ctx.saved_tensors
        if ctx.real is not None:  # (a padding row's out' is 0 and carries no gradient)
            dout = dout.masked_fill(~ctx.real[:, :, None, None], 0)
        grads = None
        if torch_op._direct_backward():
            grads = ctx.call.backward_heads_first(ctx.launch, dout, q, k, v, out, lse)
        if grads is None:
            views = torch_op._kernel_views(ctx.launch, q, k, v)
            with torch.no_grad():  # (create_graph: the torch ops inside record nothing; the result is refused below)
                found = ctx.fallback(torch_op.kernel_layout(dout), *views, out, lse, sinks, *keep)
            *grads, dsinks = torch_op.refusing_second_derivatives(found, *views, sinks, dout)
            return None, None, None, None, None, *torch_op._kernel_views(ctx.launch, *grads), dsinks
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[8] else None
        return None, None, None, None, None, *grads, dsinks


repeated_training = torch_op._c_apply(_RepeatedTraining)


class SinkOps:
    """``tvmflash::<name>_forward (q, k, v, sinks, keys_seen, softmax_scale, window_left,
    window_right, softcap) -> (out', lse')`` and ``_backward (dout, q, k, v, out', lse', sinks,
    keys_seen, ...) -> (dq, dk, dv, dsinks)`` over an attention's bodies: ``forward_body (q, k, v,
    keys_seen, ...) -> (out, lse)``, out in float32, ``backward_body (dout, q, k, v, out, lse,
    keys_seen, ...) -> (dq, dk, dv)``, and ``real_rows (keys_seen, n_queries)``, the query rows
    that are not padding ((batch, n) bool, or None). Called like ``torch_op.OpPair``."""

    def __init__(self, name: str, forward_body, backward_body, real_rows):
        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, keys_seen: torch.Tensor,
                    softmax_scale: float, window_left: int, window_right: int, softcap: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            scalars = (softmax_scale, window_left, window_right, softcap)
            out, lse = forward_body(q, k, v, keys_seen, *scalars)
            return renormalized(out, lse, sinks, real_rows(keys_seen, q.shape[1]), q.dtype)

        def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, sinks: torch.Tensor, keys_seen: torch.Tensor, softmax_scale: float,
                     window_left: int, window_right: int, softcap: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            real = real_rows(keys_seen, q.shape[1])
            if real is not None:  # (a padding row's out' is 0 and carries no gradient)
                dout = dout.masked_fill(~real[:, :, None, None], 0)
            grads = backward_body(dout, q, k, v, out, lse, keys_seen, softmax_scale, window_left, window_right, softcap)
            return *grads, sink_gradient(dout, out, lse, sinks)

        def forward_fake(q, k, v, sinks, keys_seen, softmax_scale, window_left, window_right, softcap):
            batch, n, heads, _ = q.shape
            return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((batch, heads, n), dtype=torch.float32)

        def backward_fake(dout, q, k, v, out, lse, sinks, keys_seen, softmax_scale, window_left, window_right,
                          softcap):
            return *(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), torch.empty_like(sinks)

        self._forward_body, self._backward_body = forward, backward
        self.forward = torch_op.define_op(f"{name}_forward", forward, forward_fake)
        self.backward = torch_op.define_op(f"{name}_backward", backward, backward_fake)
        title = "".join(word.title() for word in name.split("_"))
        self._through_ops = self._function(f"_{title}", self.forward, self.backward)
        self._through_bodies = self._function(f"_{title}Eager", forward, self.backward, backward)
        self._apply_bodies = torch_op._c_apply(self._through_bodies)  # (the "autograd" path: no mode or transform)

    def __call__(self, q, k, v, sinks, keys_seen, softmax_scale: float, window_left: int, window_right: int,
                 softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out', lse') of kernel-layout q, k, v (``torch_op.kernel_layout``)."""
        args = (keys_seen, softmax_scale, window_left, window_right, softcap)
        if torch_op._cpu_autocast_applies(q, k, v):
            return torch_op._with_autocast_applied("cpu", self, q, k, v, sinks, *args)
        path = torch_op._eager_path(q, k, v)
        if type(sinks) not in (torch.Tensor, torch.nn.Parameter):  # (a module's sinks are its Parameter)
            path = None
        elif path == "body" and torch_op._records_grad((sinks,)):
            path = "autograd"
        if path == "body":
            return self._forward_body(q, k, v, sinks, *args)
        return (self._apply_bodies if path == "autograd" else self._through_ops.apply)(q, k, v, sinks, *args)

    @staticmethod
    def _function(name: str, forward, backward_op, backward_body=None) -> type:
        """The autograd.Function over ``forward`` and the backward op (its body where no mode must
        see it and no second derivative is recorded: ``torch_op._direct_backward``)."""

        def forward_fn(q, k, v, sinks, keys_seen, softmax_scale, window_left, window_right, softcap):
            return forward(q, k, v, sinks, keys_seen, softmax_scale, window_left, window_right, softcap)

        def setup_context(ctx, inputs, output):
            q, k, v, sinks, keys_seen, *scalars = inputs
            out, lse = output
            ctx.save_for_backward(q, k, v, out, lse, sinks, keys_seen)
            ctx.scalars = scalars
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)

        def backward_fn(ctx, dout, _dlse):
            if dout is None:
                return (None,) * 9
            q, k, v, out, lse, sinks, keys_seen = ctx.saved_tensors
            direct = backward_body is not None and torch_op._direct_backward()
            with torch.no_grad():
                grads = (backward_body if direct else backward_op)(torch_op.kernel_layout(dout), q, k, v, out, lse,
                                                                   sinks, keys_seen, *ctx.scalars)
            return *torch_op.refusing_second_derivatives(grads, q, k, v, sinks, dout), None, None, None, None, None

        return torch_op.function_class(name, forward_fn, setup_context, backward_fn,
                                       ctx_form=backward_body is not None)
