"""``flex_attention`` with torch's FlexAttention API, forward *and* backward fused on the CPU.

    from tvmflash import flex_attention, create_block_mask

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)

    block_mask = create_block_mask(sliding_window, None, None, 4096, 4096)
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)   # (B, H, N, D)
    out.sum().backward()                                                    # fused backward

The user's ``score_mod(score, b, h, q_idx, kv_idx)`` and the block mask's ``mask_mod(b, h,
q_idx, kv_idx)`` are traced with torch's own tracer (``flex_trace``: ``make_fx``, the
derivative from ``torch.func.vjp``), translated to TIR and compiled into the fused kernels
(``kernels/cpu.py``): the score_mod runs on every score of every tile, the mask_mod only on the
tiles the block mask marks partial, and the tiles it leaves empty are skipped in the forward
and the backward. Tensors the functions capture are kernel inputs; those that require grad get
their gradient from the backward kernel (scatter-added per thread, summed in a fixed order).

Kernels are compiled once per traced graph (the graph's key: its code, constants, and the
captured tensors' shapes and dtypes) and cached in memory and on disk like every kernel.
What the functions read is read on every call; dynamo's guards say when to trace again
(``flex_trace.capture``), and floats they compute with are run-time kernel inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch

from . import checks, compiler, plan, torch_op
from .runtime import FlashKernels
from .spec import MAX_HEAD_DIM, AttentionSpec

_PRIMITIVES = (bool, int, float, str, type(None))


# --- the traced mods ---------------------------------------------------------------------------
def _traced(kind: str, fn, device: str = "cpu", under_dynamo: bool = False):
    """The traced ``fn`` (``kind``: "score_mod" / "mask_mod") holding the tensors it reads now.

    Eagerly through ``flex_trace.capture``: dynamo's guards say when what ``fn`` reads has
    changed (a new value of a Python number it reads traces again). While dynamo traces a
    caller (``under_dynamo``), that caller's own guards do (``_read_under_dynamo``): traced
    directly, once per trace of the caller.
    """
    if fn is None:
        return None
    from . import flex_trace  # (TVM's IR: imported where a mod is traced)

    if isinstance(fn, (flex_trace.TracedScoreMod, flex_trace.TracedMaskMod)):
        return fn  # (traced by the caller: padded.py's mods read nothing but the tensors they hold)
    if under_dynamo:
        trace = flex_trace.trace_score_mod if kind == "score_mod" else flex_trace.trace_mask_mod
        return trace(fn, device=device)
    return flex_trace.capture(kind, fn, device=device)


def _read_under_dynamo(score_mod, mask_mod) -> None:
    """Under torch.compile: run the mods on tiny tensors inside the compiled region, so that
    dynamo guards on everything they read (numbers, closure cells, globals, attributes) and
    traces the call again when one changes; the values are unused (dead code in the graph).
    Not for a mod whose tensors are read through its closure cells (dynamo fails on that): its
    closure tensors are still read on each call, the numbers it reads are not guarded."""
    index = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    if score_mod is not None:
        score_mod(torch.zeros(1), *index)
    if mask_mod is not None:
        mask_mod(*index)


# --- block masks -------------------------------------------------------------------------------
def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128, _compile=False):
    """torch's ``create_block_mask`` with the CPU as default device (torch's default is cuda).

    Returns torch's own ``BlockMask``; ``flex_attention`` (torch's or ours) takes it.
    """
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    return torch_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE,
                                   _compile=_compile)


EMPTY, PARTIAL, FULL = plan.EMPTY, plan.PARTIAL, plan.FULL


def _block_states(block_mask) -> torch.Tensor:
    """(B, H, q blocks, kv blocks) int8: EMPTY / PARTIAL (mask_mod evaluated) / FULL."""
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    states = torch.zeros(idx.shape, dtype=torch.int8)
    if block_mask.full_kv_num_blocks is not None:
        _mark(states, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
    _mark(states, num, idx, PARTIAL)
    return states


def _mark(states, num, idx, value) -> None:
    """states[b, h, q, idx[b, h, q, n]] = value for n < num[b, h, q] (one scatter)."""
    num, idx = num.cpu().long(), idx.cpu().long()
    valid = torch.arange(idx.shape[-1])[None, None, None, :] < num[..., None]
    blocks = states.shape[-1]
    marks = torch.zeros((*states.shape[:-1], blocks + 1), dtype=torch.bool)  # column `blocks`: invalid entries
    marks.scatter_(-1, torch.where(valid, idx, blocks).expand(*states.shape[:-1], -1), True)
    states.masked_fill_(marks[..., :blocks], value)


def tile_maps(block_mask, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int):
    """The block mask at the kernel's tile size: (tile states int8 (B, H, q tiles, kv tiles),
    kv ranges int32 (B, H, q tiles, 2): the first and past-the-last non-empty key tile).

    A kernel tile covering several mask blocks is empty if all are, full if all are, partial
    otherwise; with torch's default 128 x 128 blocks and 64 x 64 tiles each tile lies in one
    block, so the states are the block mask's own.
    """
    bq_mask, bk_mask = block_mask.BLOCK_SIZE
    states = _block_states(block_mask)
    q_tiles, k_tiles = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    q_blocks = _covered(q_tiles, block_q, bq_mask, seqlen_q, states.shape[2])
    k_blocks = _covered(k_tiles, block_k, bk_mask, seqlen_k, states.shape[3])
    low = torch.full((*states.shape[:2], q_tiles, k_tiles), FULL, dtype=torch.int8)
    high = torch.full_like(low, EMPTY)
    for qb in q_blocks:
        for kb in k_blocks:
            picked = states.index_select(2, qb).index_select(3, kb)
            low, high = torch.minimum(low, picked), torch.maximum(high, picked)
    tiles = torch.where(low == high, low, torch.full_like(low, PARTIAL))
    nonempty = tiles != EMPTY
    k_index = torch.arange(k_tiles, dtype=torch.int32)
    first = torch.where(nonempty, k_index, k_tiles).amin(-1)
    end = torch.where(nonempty, k_index + 1, 0).amax(-1)
    ranges = torch.stack([first, torch.maximum(end, first)], -1).to(torch.int32)
    return tiles.contiguous(), ranges.contiguous()


def query_ranges(tile_state: torch.Tensor) -> torch.Tensor:
    """For each key tile of the tile states (B, H, q tiles, kv tiles): the first and
    past-the-last query tile that is not empty, int32 (B, H, kv tiles, 2). The CUDA backward
    walks only those (it works per key tile); computed where the states are (torch ops)."""
    nonempty = tile_state != EMPTY
    q_tiles = tile_state.shape[2]
    q_index = torch.arange(q_tiles, dtype=torch.int32, device=tile_state.device)[:, None]
    first = torch.where(nonempty, q_index, q_tiles).amin(-2)
    end = torch.where(nonempty, q_index + 1, 0).amax(-2)
    return torch.stack([first, torch.maximum(end, first)], -1).to(torch.int32).contiguous()


def _covered(tiles: int, tile: int, block: int, length: int, blocks: int) -> list[torch.Tensor]:
    """For each kernel tile, the mask blocks it covers, as index tensors: one per offset (plain
    integer arithmetic, so that under torch.compile they are constants of the graph)."""
    first = [t * tile // block for t in range(tiles)]
    last = [max(min(t * tile + tile, length) - 1, 0) // block for t in range(tiles)]
    span = max([0] + [b - a for a, b in zip(first, last)]) + 1
    return [torch.tensor([min(a + o, b, blocks - 1) for a, b in zip(first, last)], dtype=torch.long)
            for o in range(span)]


# --- the ops -------------------------------------------------------------------------------------
_specs: dict[str, AttentionSpec] = {}


def _register_spec(spec: AttentionSpec) -> str:
    key = spec.digest()
    _specs.setdefault(key, spec)
    return key


def _spec_of(spec_key: str) -> AttentionSpec:
    """The spec a key names: a registered spec's digest, or ``<digest>+lse<D>``, that spec at head
    dim D (the lse gradient's wider inputs, ``_autograd_backward``). A compiled backward loaded
    from torch's caches in another process names it without having run that Python: only the
    forward's registration, which runs where dynamo traces the call, is there."""
    base, _, lse_head_dim = spec_key.partition("+lse")
    spec = _specs[base]
    return dataclasses.replace(spec, head_dim=int(lse_head_dim)) if lse_head_dim else spec


def _kernels(q: torch.Tensor, spec_key: str) -> FlashKernels:
    return _kernels_for_device(q.device.type, spec_key)


def _kernels_for_device(device: str, spec_key: str) -> FlashKernels:
    return compiler.compile_spec(torch_op.device_target(torch.device(device)), _spec_of(spec_key))


def _layout(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> the kernels' (B, N, H, D): a view where the kernels can read it in place."""
    return torch_op.kernel_layout(t.transpose(1, 2))


@torch.library.custom_op("tvmflash::flex_forward", mutates_args=())
def _flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, captured: list[torch.Tensor],
                  tile_state: torch.Tensor | None, kv_range: torch.Tensor | None, scale: float,
                  spec_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seqlen_q, _ = q.shape
    out = torch.empty(q.shape, dtype=_out_dtype(spec_key), device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    kernels = _kernels(q, spec_key)
    kernels.forward(_layout(q), _layout(k), _layout(v), out.transpose(1, 2), lse, scale,
                    window_size=(-1, -1), mod_inputs=[c.contiguous() for c in captured],
                    block_mask=None if tile_state is None else (tile_state, kv_range), diagonal=0)
    return out, lse


@_flex_forward.register_fake
def _(q, k, v, captured, tile_state, kv_range, scale, spec_key):
    # contiguous, as the op returns them (empty_like would copy the strides of a transposed q)
    return q.new_empty(q.shape, dtype=_out_dtype(spec_key)), q.new_empty(q.shape[:3], dtype=torch.float32)


def _out_dtype(spec_key: str) -> torch.dtype:
    return getattr(torch, _spec_of(spec_key).out_dtype)


@torch.library.custom_op("tvmflash::flex_backward", mutates_args=())
def _flex_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, captured: list[torch.Tensor], tile_state: torch.Tensor | None,
                   scale: float, spec_key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    spec = _spec_of(spec_key)
    # the CPU kernels write these, the CUDA kernels add into them
    fill = torch.zeros if q.device.type == "cuda" else torch.empty
    grads = [fill(math.prod(i.shape), dtype=torch.float32, device=q.device) for i in spec.grad_inputs]
    kernels = _kernels(q, spec_key)
    kernels.backward(*(_layout(t) for t in (dout, q, k, v)), out.transpose(1, 2), lse, dq.transpose(1, 2),
                     dk.transpose(1, 2), dv.transpose(1, 2), scale, window_size=(-1, -1),
                     mod_inputs=[c.contiguous() for c in captured], mod_grads=grads,
                     block_mask=_backward_block_mask(tile_state), diagonal=0)
    return dq, dk, dv, grads


def _backward_block_mask(tile_state: torch.Tensor | None):
    """The CPU backward reads the tile states; the CUDA one also each key tile's query range."""
    if tile_state is None:
        return None
    return (tile_state, query_ranges(tile_state)) if tile_state.device.type == "cuda" else (tile_state,)


@_flex_backward.register_fake
def _(dout, q, k, v, out, lse, captured, tile_state, scale, spec_key):
    spec = _spec_of(spec_key)
    grads = [q.new_empty(math.prod(i.shape), dtype=torch.float32) for i in spec.grad_inputs]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grads  # (contiguous, as the op's)


def _setup_context(ctx, inputs, output):
    q, k, v, captured, tile_state, kv_range, scale, spec_key = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, tile_state, *captured)
    ctx.scale, ctx.spec_key, ctx.n_captured = scale, spec_key, len(captured)
    ctx.set_materialize_grads(False)  # no zero-filled gradients (torch_op._setup_context says why)


def _autograd_backward(ctx, dout, dlse):
    if dout is None and dlse is None:  # nothing downstream used out or lse
        return None, None, None, [None] * ctx.n_captured, None, None, None, None
    q, k, v, out, lse, tile_state, *captured = ctx.saved_tensors
    spec_key, head_dim = ctx.spec_key, q.shape[-1]
    if dlse is None:
        dout = dout.contiguous()
    else:  # lse is differentiable in torch's flex_attention too
        spec_key = f"{spec_key}+lse{_lse_grad_head_dim(q)}"
        if tile_state is not None and _backward_tiles(q, spec_key) != _backward_tiles(q, ctx.spec_key):
            raise NotImplementedError("a gradient through flex_attention's lse with a block mask needs the wider "
                                      "head dim's backward kernel on the forward's tiles")
        dout, q, k, v, out = _with_lse_grad(dout, q, k, v, out, dlse, _spec_of(spec_key).head_dim)
    dq, dk, dv, grads = _flex_backward(dout, q, k, v, out, lse, captured, tile_state, ctx.scale, spec_key)
    if dlse is not None:
        dq, dk, dv = (g[..., :head_dim] for g in (dq, dk, dv))
    spec = _spec_of(spec_key)
    by_name = dict(zip((i.name for i in spec.grad_inputs), grads))
    captured_grads = []
    for info, tensor in zip(spec.mod_inputs, captured):
        g = by_name.get(info.name)
        captured_grads.append(None if g is None else g.reshape(tensor.shape).to(tensor.dtype))
    return dq, dk, dv, captured_grads, None, None, None, None


_flex_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _backward_tiles(q: torch.Tensor, spec_key: str) -> tuple[int, int]:
    config = _kernels(q, spec_key).configs["backward"]
    return config.block_q, config.block_k


def _lse_grad_head_dim(q: torch.Tensor) -> int:
    """The head dim of ``_with_lse_grad``'s inputs: two columns more, in the kernels' unit."""
    unit, largest = (16, 128) if q.device.type == "cuda" else (8, MAX_HEAD_DIM)
    wider = -(-(int(q.shape[-1]) + 2) // unit) * unit  # (int: a SymInt under torch.compile's dynamic shapes)
    if wider > largest:
        raise NotImplementedError(f"a gradient through flex_attention's lse needs head_dim + 2 <= {largest} "
                                  f"on {q.device.type} tensors (two more columns), got head_dim {q.shape[-1]}")
    return wider


def _with_lse_grad(dout, q, k, v, out, dlse, head_dim: int) -> tuple:
    """(dout, q, k, v, out) whose plain backward also takes lse's gradient. d lse_i / d s_ij = P_ij,
    so the scores' gradient is P (dP - Delta) with Delta = rowsum(dO * O) - dlse instead of
    rowsum(dO * O): the backward's own row statistic, on inputs with more head-dim columns:
    zeros in q, k and v (scores, P, dP and the mods' gradients unchanged), ones in dO where O
    holds -dlse (as hi + lo parts in two columns: one bf16 column alone would round it)."""
    pad = head_dim - q.shape[-1]
    widen = [torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v)]
    dlse = -dlse.to(torch.float32)
    hi = dlse.to(out.dtype)
    parts = torch.stack([hi, (dlse - hi.float()).to(out.dtype)], -1)
    out = torch.cat([out, parts, out.new_zeros(*out.shape[:-1], pad - 2)], -1)
    upstream = torch.zeros_like(q) if dout is None else dout
    ones = upstream.new_ones(*upstream.shape[:-1], 2)
    dout = torch.cat([upstream, ones, upstream.new_zeros(*upstream.shape[:-1], pad - 2)], -1)
    return dout, *widen, out


def _captured_tensors(mods) -> dict[str, torch.Tensor]:
    """The kernel inputs of the mods' captured tensors by name, in ``spec.mod_inputs`` order."""
    by_name: dict[str, torch.Tensor] = {}
    for mod in mods:
        for c in mod.captured:
            if c.name in by_name and by_name[c.name] is not c.tensor:
                raise ValueError(f"score_mod and mask_mod capture two different tensors named `{c.name}`; "
                                 "rename one of them")
            by_name[c.name] = c.tensor
    return by_name


# --- where captured tensors live (so that torch.compile can read them) -----------------------------
# Tensors a mod creates in its own body (torch.arange(...) inside score_mod), by (spec key, name).
_body_tensors: dict[tuple, torch.Tensor] = {}


def _find_paths(fn, wanted: set[int]) -> dict[int, tuple]:
    """id(tensor) -> the steps from ``fn`` to it: ("cell", i), ("default", i), ("kwdefault", name), ("global", name),
    ("attr", name), ("self",), ("func",), ("arg", i), ("kwarg", name). Each step is plain attribute
    or item access, which dynamo follows, so a compiled graph reads the tensors the user's
    function holds *now* (as eager calls do) rather than copies from the first trace."""
    found: dict[int, tuple] = {}
    seen: set[int] = set()

    def children(obj):
        if isinstance(obj, functools.partial):
            yield ("func",), obj.func
            yield from ((("arg", i), a) for i, a in enumerate(obj.args))
            yield from ((("kwarg", k), a) for k, a in obj.keywords.items())
        elif inspect.ismethod(obj):
            yield ("self",), obj.__self__
            yield ("func",), obj.__func__
        elif inspect.isfunction(obj):
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    yield ("cell", i), cell.cell_contents
                except ValueError:  # an empty cell
                    continue
            yield from ((("default", i), d) for i, d in enumerate(obj.__defaults__ or ()))
            yield from ((("kwdefault", n), d) for n, d in (obj.__kwdefaults__ or {}).items())
            yield from ((("global", n), obj.__globals__[n]) for n in obj.__code__.co_names if n in obj.__globals__)
        elif isinstance(obj, (list, tuple)):
            yield from ((("item", i), x) for i, x in enumerate(obj))
        elif isinstance(obj, dict):
            yield from ((("item", k), x) for k, x in obj.items() if isinstance(k, (str, int)))
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor)) and not inspect.ismodule(obj):
            if isinstance(obj, torch.nn.Module):
                yield from ((("attr", n), t) for n, t in obj.named_parameters(recurse=False))
                yield from ((("attr", n), t) for n, t in obj.named_buffers(recurse=False))
                yield from ((("attr", n), m) for n, m in obj.named_children())
            yield from ((("attr", n), v) for n, v in vars(obj).items() if not n.startswith("_"))
            call = getattr(type(obj), "__call__", None)
            if inspect.isfunction(call):
                yield ("call",), call

    frontier = [((), fn)]
    for _ in range(5):  # depth
        following = []
        for path, obj in frontier:
            for step, child in children(obj):
                if isinstance(child, torch.Tensor):
                    if id(child) in wanted:
                        found.setdefault(id(child), (*path, step))
                elif id(child) not in seen and not isinstance(child, _PRIMITIVES):
                    seen.add(id(child))
                    following.append(((*path, step), child))
        frontier = following
    return found


def _follow(obj, path: tuple):
    """The object at ``path`` from ``obj`` (see ``_find_paths``)."""
    for step in path:
        kind = step[0]
        if kind == "cell":
            obj = obj.__closure__[step[1]].cell_contents
        elif kind == "default":
            obj = obj.__defaults__[step[1]]
        elif kind == "kwdefault":
            obj = obj.__kwdefaults__[step[1]]
        elif kind == "global":
            obj = obj.__globals__[step[1]]
        elif kind == "attr":
            obj = getattr(obj, step[1])
        elif kind in ("item", "arg"):
            obj = (obj.args if kind == "arg" else obj)[step[1]]
        elif kind == "kwarg":
            obj = obj.keywords[step[1]]
        elif kind == "self":
            obj = obj.__self__
        elif kind == "func":
            obj = obj.__func__ if inspect.ismethod(obj) else obj.func
        else:  # "call": the class's __call__ of a callable object
            obj = type(obj).__call__
    return obj


# --- the public function -------------------------------------------------------------------------
def _check_inputs(query, key, value, block_mask, enable_gqa, return_lse) -> None:
    """The checks that read shapes: plain Python on sizes, which dynamo follows with SymInts
    (so that a new sequence length is no new constant of ``_plan``)."""
    def as_info(t):  # kernel layout (B, N, H, D), metadata only
        perm = (0, 2, 1, 3)
        return checks.TensorInfo(tuple(t.shape[i] for i in perm), str(t.dtype).removeprefix("torch."), t.device.type,
                                 tuple(t.stride()[i] for i in perm), 0, 1)

    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"value head dim {value.shape[-1]} differs from query/key head dim "
                                  f"{query.shape[-1]}: tvmflash needs them equal")
    heads, heads_k = query.shape[1], key.shape[1]
    if heads != heads_k and not checks.require_bool("enable_gqa", enable_gqa):
        raise ValueError(f"query has {heads} heads and key {heads_k}: pass enable_gqa=True for grouped-query "
                         "attention")
    checks.require_bool("return_lse", return_lse)
    checks.check_qkv(as_info(query), as_info(key), as_info(value), names=("query", "key", "value"))
    if block_mask is not None:
        lengths = tuple(block_mask.seq_lengths)
        if lengths != (query.shape[2], key.shape[2]):
            raise ValueError(f"block_mask was made for lengths {lengths}, the inputs have "
                             f"({query.shape[2]}, {key.shape[2]})")
        # (a mask for other sizes would have its last batch or head stand in for the others)
        for name, made, size in zip(("batch size", "heads"), block_mask.kv_num_blocks.shape[:2], query.shape[:2]):
            if made not in (1, size):
                raise ValueError(f"block_mask was made for {name} {made}, the query has {size}: make it for "
                                 f"{size}, or for 1 (B or H None in create_block_mask) if it does not depend on it")


def _constant_head_dim(query) -> int:
    """The head dim as a Python int, also where dynamo made it a SymInt (dynamic=True): a
    comparison per candidate, each a guard (the kernels are compiled per head dim anyway)."""
    if not torch.compiler.is_compiling():
        return query.shape[-1]
    return next(d for d in range(8, checks.MAX_HEAD_DIM + 1, 8) if query.shape[-1] == d)


@torch._dynamo.assume_constant_result
def _plan(score_mod, mask_mod, block_sparse: bool, head_dim: int, dtype: torch.dtype, device: str, scale) -> tuple:
    """Under torch.compile: ``_prepare`` while dynamo traces, a constant of the graph (dynamo
    guards on its arguments; none of them is a shape but the head dim). Returns (spec key,
    scale, tile, paths to the captured tensors: ("score_mod" | "mask_mod" | "body", steps...)),
    which the graph follows to read the tensors the functions hold on each call."""
    # Leave dynamo's tracing context: our own tracer (make_fx in a fake mode of its own) would
    # otherwise pick up dynamo's fake mode and refuse the real captured tensors.
    with torch._guards.tracing(None):
        spec_key, scale, tile, captured = _prepare(score_mod, mask_mod, block_sparse, head_dim, dtype, device, scale,
                                                   under_dynamo=True)
        paths = []
        for name, tensor in captured.items():
            for kind, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
                path = _find_paths(fn, {id(tensor)}).get(id(tensor)) if fn is not None else None
                if path is not None:
                    paths.append((kind, *path))
                    break
            else:  # made inside the function body: the same values every call
                _body_tensors[(spec_key, name)] = tensor
                paths.append(("body", spec_key, name))
        return spec_key, scale, tile, tuple(paths)


@functools.cache
def _torch_noop_mask():
    from torch.nn.attention.flex_attention import noop_mask

    return noop_mask


def _prepare(score_mod, mask_mod, block_sparse: bool, head_dim: int, dtype: torch.dtype, device: str, scale,
             under_dynamo: bool = False, fp32_results: bool = False) -> tuple:
    """What the kernels need that no tensor's data or size decides: the traced mods, the spec
    (compiled here), the softmax scale, the tile size. Returns (spec key, scale, tile (block_q,
    block_k), {name: captured tensor} in the kernel's input order). ``fp32_results``: out in
    float32 (``flex_attention_forward``'s)."""
    scale = checks.softmax_scale(scale, head_dim)
    if mask_mod is _torch_noop_mask():  # torch's "attend everywhere" (a block mask made without one)
        mask_mod = None
    traced_score = _traced("score_mod", score_mod, device, under_dynamo)
    traced_mask = _traced("mask_mod", mask_mod, device, under_dynamo)
    score_mods = (traced_score,) if traced_score is not None and not traced_score.is_identity else ()
    dtype = str(dtype).removeprefix("torch.")
    spec = AttentionSpec(head_dim, dtype, "float32" if fp32_results else dtype, score_mods=score_mods,
                         mask_mod=traced_mask, block_sparse=block_sparse)
    spec_key = _register_spec(spec)
    kernels = _kernels_for_device(device, spec_key)
    forward_cfg, backward_cfg = kernels.configs["forward"], kernels.configs["backward"]
    tile = (forward_cfg.block_q, forward_cfg.block_k)
    if block_sparse and tile != (backward_cfg.block_q, backward_cfg.block_k):
        raise NotImplementedError("block masks need the forward and backward kernels on the same tiles")
    captured = _captured_tensors((*score_mods, *((traced_mask,) if traced_mask else ())))
    return spec_key, scale, tile, captured


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch's ``flex_attention`` (same arguments, layout (B, H, N, D), same results) with
    tvmflash's fused kernels: forward and backward, on CPU tensors and (float16/bfloat16) CUDA
    tensors.

    ``score_mod(score, b, h, q_idx, kv_idx) -> score`` modifies each scaled score;
    ``block_mask`` (``create_block_mask``, torch's or ours) says which tiles to compute and, on
    partial tiles, which scores to keep (its ``mask_mod``). Captured tensors that require grad
    get their gradients. Returns ``out`` (B, H, Nq, D), or ``(out, lse)`` with lse (B, H, Nq)
    in natural-log units, or with ``return_aux=AuxRequest(lse=True)`` ``(out, AuxOutput(lse=lse))``
    (``max_scores`` is not computed); lse is differentiable, as torch's is. ``kernel_options`` is accepted for compatibility and ignored.
    Works under ``torch.compile(fullgraph=True)``: the tracing and compiling happen once, when
    dynamo traces the call.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), got {tuple(t.shape)}")
    if torch.is_autocast_enabled(query.device.type):
        # torch's flex_attention under autocast: query, key and value in the region's dtype, the
        # rest (the mods, their traces, captured tensors) with the region off
        query, key, value = torch_op._autocast_inputs(query.device.type, query, key, value)
        with torch.autocast(query.device.type, enabled=False):
            return flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                  kernel_options, return_aux=return_aux)
    if block_mask is not None:
        from torch.nn.attention.flex_attention import BlockMask

        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask (from create_block_mask), got {type(block_mask).__name__}")
    mask_mod = None if block_mask is None else block_mask.mask_mod
    _check_inputs(query, key, value, block_mask, enable_gqa, return_lse)
    static = (score_mod, mask_mod, block_mask is not None, _constant_head_dim(query), query.dtype, query.device.type,
              scale)
    if torch.compiler.is_compiling():
        spec_key, scale, (block_q, block_k), paths = _plan(*static)
        # tensors made in a function body were made on the CPU when it was traced
        captured = [_body_tensors[tuple(path)].to(query.device) if kind == "body" else
                    _follow(score_mod if kind == "score_mod" else mask_mod, path) for kind, *path in paths]
        # dynamo cannot both follow a closure cell to a tensor and run the function through it
        through_cells = {kind for kind, *path in paths if any(step[0] == "cell" for step in path)}
        _read_under_dynamo(*(None if kind in through_cells else fn for kind, fn in (("score_mod", score_mod),
                                                                                     ("mask_mod", mask_mod))))
    else:
        spec_key, scale, (block_q, block_k), by_name = _prepare(*static)
        captured = [t.to(query.device) for t in by_name.values()]
    tile_state, kv_range = _tile_maps(block_mask, query, key, block_q, block_k)
    out, lse = _flex_forward(query, key, value, captured, tile_state, kv_range, scale, spec_key)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        if getattr(return_aux, "max_scores", False):
            raise NotImplementedError("return_aux=AuxRequest(max_scores=True): tvmflash does not return max scores")
        if return_lse:
            raise ValueError("pass either return_lse or return_aux, not both")
        return out, AuxOutput(lse=lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


def _tile_maps(block_mask, query, key, block_q: int, block_k: int) -> tuple:
    if block_mask is None:
        return None, None
    return tuple(t.to(query.device) for t in tile_maps(block_mask, query.shape[2], key.shape[2], block_q, block_k))


def flex_attention_forward(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, *,
                           fp32_results: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``flex_attention(..., return_lse=True)``'s (out, lse), the fused forward alone (no
    autograd), for eager code that keeps out and lse itself (an op's body, with
    ``flex_attention_backward``). ``fp32_results``: out in float32 for 16-bit inputs, for a
    caller that scales it before rounding it once (attention sinks, ``sinks.py``)."""
    spec_key, scale, captured, tile_state, kv_range = _eager_call("flex_attention_forward", "call flex_attention",
                                                                  query, key, value, score_mod, block_mask, scale,
                                                                  enable_gqa, fp32_results)
    with torch.no_grad():
        return _flex_forward(query, key, value, captured, tile_state, kv_range, scale, spec_key)


def flex_attention_backward(grad_out, query, key, value, out, lse, score_mod=None, block_mask=None, scale=None,
                            enable_gqa=False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients to query, key and value of ``flex_attention(query, key, value, score_mod,
    block_mask, scale, enable_gqa, return_lse=True)``, given the ``(out, lse)`` it returned and
    out's gradient: the fused backward alone, each P tile recomputed once. For eager code that
    keeps out and lse itself (the backward op of an op whose forward called ``flex_attention``).
    Tensors the mods capture get no gradient here; ``lse`` none either."""
    spec_key, scale, captured, tile_state, _ = _eager_call("flex_attention_backward",
                                                           "differentiate flex_attention itself", query, key, value,
                                                           score_mod, block_mask, scale, enable_gqa, False)
    dq, dk, dv, _ = _flex_backward(grad_out.contiguous(), query, key, value, out, lse, captured, tile_state, scale,
                                   spec_key)
    return dq, dk, dv


def _eager_call(name: str, compiled_instead: str, query, key, value, score_mod, block_mask, scale, enable_gqa,
                fp32_results: bool) -> tuple:
    """What an eager forward or backward alone passes its op: (spec key, scale, captured tensors,
    tile state, kv range), the inputs checked."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name} runs eagerly (an op's body); under torch.compile, {compiled_instead}")
    _check_inputs(query, key, value, block_mask, enable_gqa, False)
    mask_mod = None if block_mask is None else block_mask.mask_mod
    spec_key, scale, (block_q, block_k), by_name = _prepare(score_mod, mask_mod, block_mask is not None,
                                                            query.shape[-1], query.dtype, query.device.type, scale,
                                                            fp32_results=fp32_results)
    captured = [t.to(query.device) for t in by_name.values()]
    return spec_key, scale, captured, *_tile_maps(block_mask, query, key, block_q, block_k)


__all__ = ["create_block_mask", "flex_attention", "flex_attention_backward", "flex_attention_forward", "query_ranges",
           "tile_maps"]
