"""flash-attn 2's ``flash_attn_with_kvcache`` on CPUs: decoding against a KV cache.

    from tvmflash import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths)

flash-attn's signature and semantics (``flash_attn_interface.flash_attn_with_kvcache``):

* ``k``/``v`` (new tokens) are written into the caches *in place* at ``cache_seqlens`` (after
  rotary embedding of ``k``), then the queries attend to keys ``cache_leftpad[b] <= j <
  cache_seqlens[b] + seqlen_new`` of their sequence's cache (``cache_batch_idx`` picks the cache
  row; a paged cache maps logical block ``j // page_size`` to a page through ``block_table``);
* causal masks and sliding windows are bottom-right aligned at that length: query ``i`` sees
  key ``j`` iff ``i + L - seqlen_q - window_left <= j <= i + L - seqlen_q + window_right``, with
  ``L = cache_seqlens[b] + seqlen_new``; ALiBi adds ``-slope |i + L - seqlen_q - j|``;
* rotary embedding (``rotary_cos``/``rotary_sin``, interleaved or GPT-NeoX) rotates the new keys
  at positions ``cache_seqlens[b] + t`` and the queries at ``cache_seqlens[b] + i`` (causal or
  local) or all at ``cache_seqlens[b]`` (otherwise);
* GQA/MQA: the query heads of a kv head read its cache rows once (the cache is never expanded).

The cache update and rotary embedding are plain torch ops on the new tokens only. Attention is
one TIR kernel (``kernels/decode.py``): each (unit, kv head) task reads its keys once for the
whole GQA group, with the keys split over threads (flash-decoding), and a merge combines the
splits through their row statistics (fp32). Forward only, like flash-attn's; CPU tensors.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

from . import checks, compiler, launch, plan, settings, version
from . import sinks as sinks_module
from . import threads as threads_module
from .spec import SUPPORTED_DTYPES, UNLIMITED_WINDOW, Alibi, AttentionSpec, Softcap

version.require("torch", torch.__version__, version.MIN_TORCH)

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]

_STEERING_ENV = ("TVMFLASH_CACHE_DIR", "TVMFLASH_PREBUILT")
_steering_values = settings.EnvironmentValues(*_STEERING_ENV)
_kernels: dict[tuple, object] = {}


def decode_kernels(head_dim: int, dtype: str, *, softcap: bool = False, alibi: bool = False,
                   fp32_results: bool = False):
    """The compiled decode kernel for this CPU (cached per process, and on disk); ``fp32_results``:
    its out in float32."""
    request = (head_dim, dtype, softcap, alibi, fp32_results, *_steering_values())
    found = _kernels.get(request)
    if found is None:
        mods = (Softcap(),) * softcap + (Alibi(),) * alibi
        spec = AttentionSpec(head_dim, dtype, "float32" if fp32_results else dtype, score_mods=mods)
        found = _kernels[request] = compiler.compile_decode({"kind": "llvm"}, spec)
    return found


# --- rotary embedding ----------------------------------------------------------------------------
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """flash-attn's rotary embedding of x (B, S, heads, D) at positions (B, S): the first
    ``rotary_dim = 2 * cos.shape[1]`` dims rotate, in pairs (2k, 2k + 1) if ``interleaved``, else
    (k, k + rotary_dim / 2) (GPT-NeoX); the rest pass through. Computed in fp32, cast once."""
    rot = 2 * cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (B, S, 1, rot / 2)
    s = sin[positions].float().unsqueeze(2)
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)


# --- checks ----------------------------------------------------------------------------------------
def _tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: tvmflash's flash_attn_with_kvcache runs on CPU tensors")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return t


def _int_vector(name: str, t, batch: int) -> list[int]:
    t = _tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},), got {t.dtype} {tuple(t.shape)}")
    return t.tolist()


# --- the function ----------------------------------------------------------------------------------
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            sinks=None, fp32_results=False):
    """Attention of a few new queries per sequence against a KV cache, updating it in place.

    q: (batch, seqlen_q, nheads, headdim), headdim up to 256 (other than multiples of 8 zero-
    padded to one, caches included: copies, as flash-attn makes). k_cache, v_cache:
    (batch_cache, seqlen_cache, nheads_k, headdim), or (num_blocks, page_block_size, nheads_k,
    headdim) with ``block_table`` (batch, max_blocks) int32 (paged; ``page_block_size`` a
    multiple of the kernel's key tile, 64). k, v: (batch, seqlen_new, nheads_k, headdim) new
    tokens, written into the caches at ``cache_seqlens`` (int or (batch,) int32; default: the
    caches are full). rotary_cos/sin: (seqlen_ro, rotary_dim / 2) in q's dtype, with k and v.
    cache_batch_idx (batch,) int32: the cache row of each sequence. cache_leftpad (batch,)
    int32: first valid key. softmax_scale (default 1/sqrt(headdim)), causal, window_size,
    softcap, alibi_slopes ((nheads,) or (batch, nheads) fp32): as in ``flash_attn_func``.
    num_splits: key splits per sequence (0: chosen from the problem and the thread count).
    Returns out (batch, seqlen_q, nheads, headdim), and
    softmax_lse (batch, nheads, seqlen_q) fp32 if ``return_softmax_lse``. Forward only.
    Not flash-attn 2's: ``sinks`` (nheads,): gpt-oss's attention sinks, a logit per query head in
    every row's softmax with no value (``sinks.py``; out from the kernel's fp32 results, rounded
    once; softmax_lse with the sink). ``fp32_results``: out in float32 whatever q's dtype.
    """
    if sinks is not None:
        return _with_sinks(sinks, q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                           cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                           block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                           alibi_slopes=alibi_slopes, num_splits=num_splits, return_softmax_lse=return_softmax_lse,
                           fp32_results=fp32_results)
    if (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and block_table is None and alibi_slopes is None):
        # a decode step of the kind every model makes (shapes and options seen before): checked once
        options = None
        if type(cache_seqlens) is int and cache_leftpad is None:
            options = _options_key(True, softmax_scale, causal, window_size, softcap, num_splits, rotary_interleaved,
                                   return_softmax_lse, fp32_results)
            result = _launched_step(options, q, k_cache, v_cache, cache_seqlens, None, None)
            if result is not None:
                return result
        key = _step_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_size,
                        softcap, rotary_interleaved, num_splits, return_softmax_lse, fp32_results)
        step = _steps.get(key) if key is not None else None
        if step is not None:
            result = step(q, k_cache, v_cache, cache_seqlens, cache_leftpad)
            if result is not None:
                _remember_options(options, step)
                return result  # (None: something the checks below must see, and raise on)
    q = _tensor("q", q, 4)
    k_cache, v_cache = _tensor("k_cache", k_cache, 4), _tensor("v_cache", v_cache, 4)
    new_tokens = [t for t in (k, v) if isinstance(t, torch.Tensor)]
    padding = checks.head_dim_padding(t.shape[-1] for t in (q, k_cache, v_cache, *new_tokens))
    if padding:
        return _with_padded_head_dim(
            padding, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
            return_softmax_lse=return_softmax_lse, fp32_results=fp32_results)
    dtype = q.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {dtype}: use one of {', '.join(SUPPORTED_DTYPES)}")
    batch, seqlen_q, heads, head_dim = q.shape
    checks.check_kernel_params(head_dim, dtype_name)
    if batch < 1 or seqlen_q < 1:
        raise ValueError(f"q must have a positive batch size and seqlen, got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, q has {dtype}: they must match")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    heads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]}, q has {head_dim}")
    if heads_k < 1 or heads % heads_k:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the kv heads ({heads_k})")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, k_cache, v_cache)):
        raise RuntimeError("flash_attn_with_kvcache is forward only (as flash-attn's): call it under "
                           "torch.no_grad() or torch.inference_mode(), or detach the inputs")
    options = checks.flash_options(head_dim, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap, return_softmax_lse=return_softmax_lse,
                                   rotary_interleaved=rotary_interleaved)
    scale, causal, (left, right), softcap = options.softmax_scale, options.causal, options.window, options.softcap
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an integer >= 0 (0: automatic), got {num_splits!r}")

    fp32_results = checks.require_bool("fp32_results", fp32_results)
    kernels = decode_kernels(head_dim, dtype_name, softcap=softcap > 0, alibi=alibi_slopes is not None,
                             fp32_results=fp32_results)
    block_k = kernels.config.block_k

    # --- the cache layout: dense rows or pages -------------------------------------------------
    paged = block_table is not None
    if paged:
        block_table = _tensor("block_table", block_table, 2)
        if block_table.dtype != torch.int32 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor of shape ({batch}, max_blocks), got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("a paged cache (block_table) does not take cache_batch_idx")
        num_blocks, page = k_cache.shape[:2]
        if page % block_k:
            raise ValueError(f"paged cache: page_block_size {page} must be a multiple of {block_k}")
        capacity = block_table.shape[1] * page
        # (a table of no blocks addresses nothing: a (batch, 0) one has strides TVM refuses)
        pages = block_table.contiguous() if block_table.shape[1] else torch.zeros(batch, 1, dtype=torch.int32)
        cache_rows = None
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] < batch:
                raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {batch}: pass cache_batch_idx")
            cache_rows = list(range(batch))
            pages = _first_rows(batch)
        else:
            cache_rows = _int_vector("cache_batch_idx", cache_batch_idx, batch)
            if any(r < 0 or r >= k_cache.shape[0] for r in cache_rows):
                raise ValueError(f"cache_batch_idx values must lie in [0, {k_cache.shape[0]})")
            pages = torch.tensor(cache_rows, dtype=torch.int32).reshape(batch, 1)

    # --- lengths ---------------------------------------------------------------------------------
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v (new tokens) go together")
    if k is not None:
        k, v = _tensor("k", k, 4), _tensor("v", v, 4)
        seqlen_new = k.shape[1]
        for name, t in (("k", k), ("v", v)):
            if t.dtype != dtype:
                raise TypeError(f"{name} has dtype {t.dtype}, q has {dtype}: they must match")
            if tuple(t.shape) != (batch, seqlen_new, heads_k, head_dim):
                raise ValueError(f"{name} must have shape {(batch, seqlen_new, heads_k, head_dim)}, "
                                 f"got {tuple(t.shape)}")
        if cache_seqlens is None:
            raise ValueError("new keys k, v need cache_seqlens (where to write them)")
    if cache_seqlens is None:
        seqlens = [capacity] * batch
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, batch)
    ends = [n + seqlen_new for n in seqlens]
    if min(seqlens) < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {seqlens}")
    if max(ends) > capacity:
        what = (f"the capacity addressable by block_table (max_blocks * page_block_size = {capacity})" if paged
                else f"the cache length {capacity}")
        raise checks.CapacityError(f"max(cache_seqlens){' + seqlen_new' if seqlen_new else ''} = {max(ends)} exceeds "
                                   f"{what}")
    if paged:  # the blocks each sequence uses must name pages (unused entries may hold anything)
        used = torch.arange(pages.shape[1])[None, :] < torch.tensor([-(-n // page) for n in ends])[:, None]
        named = pages[used]
        if named.numel() and (int(named.min()) < 0 or int(named.max()) >= num_blocks):
            raise ValueError(f"block_table holds page indices outside [0, {num_blocks}) for blocks in use")
    starts = [0] * batch if cache_leftpad is None else _int_vector("cache_leftpad", cache_leftpad, batch)
    if any(s < 0 or s > n for s, n in zip(starts, seqlens)):
        raise ValueError("cache_leftpad must lie in [0, cache_seqlens] for each sequence")

    mods = []  # the score mods' inputs (checked before anything is written)
    if softcap > 0:
        mods.append(torch.tensor([float(softcap)], dtype=torch.float32))
    if alibi_slopes is not None:
        slopes = _tensor("alibi_slopes", alibi_slopes)
        if slopes.dtype != torch.float32 or tuple(slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must be float32 of shape ({heads},) or ({batch}, {heads}), got "
                             f"{slopes.dtype} {tuple(slopes.shape)}")
        mods.append(slopes.reshape(-1, heads).contiguous())

    # --- rotary embedding and the cache update (O(new tokens), plain torch) ----------------------
    q_in = q if q.stride(-1) == 1 else q.contiguous()
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin go together")
        if k is None:
            raise ValueError("rotary embedding needs the new keys k and v (as in flash-attn)")
        cos, sin = _tensor("rotary_cos", rotary_cos, 2), _tensor("rotary_sin", rotary_sin, 2)
        if cos.dtype != dtype or sin.dtype != dtype:  # (flash-attn's rule)
            raise TypeError(f"rotary_cos and rotary_sin must have q's dtype {dtype}, got {cos.dtype} and {sin.dtype}")
        if cos.shape != sin.shape or cos.shape[1] * 2 > head_dim or cos.shape[1] < 1:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                             f"<= headdim {head_dim}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        local = causal or 0 <= left < capacity or 0 <= right < capacity
        base = torch.tensor(seqlens, dtype=torch.int64)[:, None]
        q_pos = base + (torch.arange(seqlen_q)[None, :] if local else 0) + torch.zeros(1, seqlen_q, dtype=torch.int64)
        k_pos = base + torch.arange(seqlen_new)[None, :]
        needed = max(int(q_pos.max()), int(k_pos.max()) if seqlen_new else 0) + 1
        if needed > cos.shape[0]:
            raise ValueError(f"rotary_cos/rotary_sin have {cos.shape[0]} positions, {needed} are needed")
        q_in = apply_rotary(q, cos, sin, q_pos, rotary_interleaved)
        k = apply_rotary(k, cos, sin, k_pos, rotary_interleaved)
    if seqlen_new:
        _write_new_tokens(k_cache, v_cache, k, v, seqlens, cache_rows, pages if paged else None)

    # --- attention ------------------------------------------------------------------------------
    threads = kernels.plan_threads()
    window = tuple(UNLIMITED_WINDOW if w < 0 else min(w, UNLIMITED_WINDOW) for w in (left, right))
    group = plan.decode_head_group(heads_k, block_k, head_dim, q.element_size())
    seq_info, units = plan.decode_units(starts, ends, seqlen_q=seqlen_q, window=window, block_k=block_k,
                                        heads_k=heads_k, threads=threads, num_splits=num_splits, head_group=group)
    out = torch.empty(batch, seqlen_q, heads, head_dim, dtype=torch.float32 if fp32_results else dtype)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32)
    kernels.decode(q_in, k_cache, v_cache, out, lse, scale, window, threads, torch.from_numpy(seq_info),
                   torch.from_numpy(units), pages, mods)
    if (not seqlen_new and not paged and cache_batch_idx is None and alibi_slopes is None and q_in is q
            and (cache_leftpad is None or type(cache_leftpad) is torch.Tensor)):
        key = _step_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_size,
                        softcap, rotary_interleaved, num_splits, return_softmax_lse, fp32_results)
        if key is not None:
            if len(_steps) >= _MAX_STEPS:
                forget_steps()
            _steps[key] = _DecodeStep(kernels, lse.shape, scale, window, group, num_splits, pages, mods,
                                      return_softmax_lse, batch, seqlen_q)
    return (out, lse) if return_softmax_lse else out


def _with_sinks(sinks, q, k_cache, v_cache, *, return_softmax_lse, fp32_results, **options):
    """``flash_attn_with_kvcache`` with attention sinks: the kernel's fp32 out and lse, out scaled
    by the keys' share of each row's weight and rounded once, lse with the sink (``sinks.py``)."""
    sinks_module.check(sinks, _tensor("q", q, 4).shape[2], q.device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, fp32_results=True, **options)
    out, lse = sinks_module.renormalized(out, lse, sinks, None, torch.float32 if fp32_results else q.dtype)
    return (out, lse) if return_softmax_lse else out


@functools.lru_cache(maxsize=64)
def _first_rows(batch: int) -> torch.Tensor:
    """The cache rows 0 .. batch - 1 as the kernel's (batch, 1) table (read only; a decode step
    would otherwise build it every token)."""
    return torch.arange(batch, dtype=torch.int32).reshape(batch, 1)


def _with_padded_head_dim(padding: int, **args):
    """flash-attn's rule for a head dim that is no multiple of 8: q, the caches and the new tokens
    zero-padded to one (copies of the whole caches, as flash-attn makes), the default scale and the
    rotary limit from the true head dim, the updated caches copied back into the caller's."""
    head_dim = args["q"].shape[-1]
    cos = args["rotary_cos"]
    if isinstance(cos, torch.Tensor) and cos.dim() == 2 and cos.shape[1] * 2 > head_dim:
        raise ValueError(f"rotary_cos has rotary_dim / 2 = {cos.shape[1]}: rotary_dim must be <= headdim {head_dim}")
    padded = {name: torch.nn.functional.pad(args[name], (0, padding)) if isinstance(args[name], torch.Tensor)
              else args[name] for name in ("q", "k_cache", "v_cache", "k", "v")}
    try:
        result = flash_attn_with_kvcache(**{**args, **padded,
                                            "softmax_scale": checks.softmax_scale(args["softmax_scale"], head_dim)})
    except (ValueError, TypeError) as err:  # its shapes are the padded ones: say so
        raise type(err)(f"{err} (head dim {head_dim} zero-padded to {head_dim + padding}, as flash-attn pads "
                        "it)") from None
    if args["k"] is not None:  # the new tokens (rotated if asked) went into the padded caches
        args["k_cache"].copy_(padded["k_cache"][..., :head_dim])
        args["v_cache"].copy_(padded["v_cache"][..., :head_dim])
    if isinstance(result, tuple):
        return result[0][..., :head_dim], result[1]
    return result[..., :head_dim]


def _write_new_tokens(k_cache, v_cache, k, v, seqlens, cache_rows, block_table) -> None:
    """k_cache[row(b), seqlens[b] + t] = k[b, t] (and v), in place; through the pages if paged.

    One ``index_copy_`` into a (rows x positions, heads, dim) view of each cache (``index_put_``
    with two index tensors took ~8 ms on a 16K x 4 cache, whatever the number of new tokens);
    caches whose first two dims cannot be viewed as one are written sequence by sequence."""
    batch, seqlen_new = k.shape[:2]
    pos = torch.tensor(seqlens, dtype=torch.int64)[:, None] + torch.arange(seqlen_new)[None, :]
    if block_table is None:
        rows, offsets = torch.tensor(cache_rows, dtype=torch.int64)[:, None].expand(-1, seqlen_new), pos
    else:
        rows, offsets = block_table.long().gather(1, pos // k_cache.shape[1]), pos % k_cache.shape[1]
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows_per_page = cache.shape[1]
        try:
            flat = cache.view(-1, *cache.shape[2:])
        except RuntimeError:  # strides that do not merge: one slice per new token
            for r, o, t in zip(rows.flatten().tolist(), offsets.flatten().tolist(), new.flatten(0, 1)):
                cache[r, o] = t
            continue
        flat.index_copy_(0, (rows * rows_per_page + offsets).flatten(), new.reshape(batch * seqlen_new, *new.shape[2:]))


# --- decode steps seen before ------------------------------------------------------------------
# A model calls flash_attn_with_kvcache once per layer and token with the same tensors' shapes and
# the same options; only the cache lengths change. The checks above (~25 us of Python, more than
# the kernel takes against a short cache) depend on little else, so a call whose key equals that
# of a call that passed them runs as that one did. The key holds what the plan and the kernel
# choice depend on (q's shape and dtype, the cache's batch and kv heads, the options, with exact
# types: True == 1 in a dict key, but not for the checks). The rest is the kernel's own argument
# checks, which TVM's generated code makes on every call (dtype, device, rank, a unit last
# stride, k_cache and v_cache of one shape, q and out of one): a call they refuse (a cache of
# another dtype than q, say) returns None and runs the full checks, which name the problem. What
# neither covers is checked per call: the lengths against the cache's length, and gradients.
_steps: dict[tuple, _DecodeStep] = {}
_MAX_STEPS = 256


def forget_steps() -> None:
    """Forget every checked step: the next calls run the full checks."""
    _steps.clear()
    _steps_by_options.clear()


def _step_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_size, softcap,
              rotary_interleaved, num_splits, return_lse, fp32_results) -> tuple | None:
    """What the checks of a call without new tokens, rotary, paging, cache_batch_idx and ALiBi
    depend on beyond the kernel's own argument checks; None for arguments of unusual types (the
    checks see them)."""
    if (type(q) is not torch.Tensor or type(k_cache) is not torch.Tensor or type(v_cache) is not torch.Tensor
            or not (softmax_scale is None or type(softmax_scale) is float) or type(causal) is not bool
            or type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int
            or type(window_size[1]) is not int or type(softcap) not in (float, int) or type(num_splits) is not int
            or type(rotary_interleaved) is not bool or type(return_lse) is not bool or type(fp32_results) is not bool):
        return None
    if cache_seqlens is None or type(cache_seqlens) is int:
        lengths = type(cache_seqlens)
    elif type(cache_seqlens) is torch.Tensor:
        lengths = _vector_kind(cache_seqlens)
    else:
        return None
    if cache_leftpad is not None and type(cache_leftpad) is not torch.Tensor:
        return None
    if len(k_cache.shape) != 4:
        return None
    return _key(q, k_cache, lengths, cache_leftpad, softmax_scale, causal, window_size, softcap, num_splits,
                rotary_interleaved, return_lse, fp32_results)


def _key(q, k_cache, lengths, cache_leftpad, softmax_scale, causal, window_size, softcap, num_splits,
         rotary_interleaved, return_lse, fp32_results) -> tuple:
    """The step key from arguments of the types the checks want (``lengths``: the kind of
    cache_seqlens). The caches' length is not in it: a growing cache changes it every step, and
    each call compares it with the lengths."""
    cache_shape = k_cache.shape
    starts = None if cache_leftpad is None else _vector_kind(cache_leftpad)
    return (q.shape, q.dtype, cache_shape[0], cache_shape[2], lengths, starts, softmax_scale, causal, window_size,
            softcap, num_splits, rotary_interleaved, return_lse, fp32_results,
            *_steering_values())  # (decode_kernels' memo too)


def _vector_kind(t: torch.Tensor) -> tuple:
    """What the checks of a (batch,) int tensor argument read, but its values."""
    return t.dtype, t.shape, t.is_cpu, t.layout


def repeated_decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: int,
                         softmax_scale: float | None, causal: bool, window_size: tuple[int, int], softcap: float,
                         cache_leftpad: torch.Tensor | None = None, starts: tuple | None = None,
                         fp32_and_lse: bool = False) -> torch.Tensor | tuple | None:
    """``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
    cache_leftpad=cache_leftpad, ...)`` if a call with the same key passed its checks before,
    else None: an integration's decode step (one new token per sequence against dense caches,
    each layer and token) without the checks and the keyword arguments (the scale a float or
    None, the window a tuple of two ints, softcap a float, as the checks want them).
    ``starts``: cache_leftpad's values as a tuple, where the caller holds them (the layers of a
    model share one cache_leftpad, which it need not read again). ``fp32_and_lse``: (out in
    float32, lse), as a step with sinks asks (``_with_sinks``)."""
    options = _options_key(cache_leftpad is None, softmax_scale, causal, window_size, softcap, 0, True, fp32_and_lse,
                           fp32_and_lse)
    result = _launched_step(options, q, k_cache, v_cache, cache_seqlens, cache_leftpad, starts)
    if result is not None:
        return result
    step = _steps.get(_key(q, k_cache, int, cache_leftpad, softmax_scale, causal, window_size, softcap, 0, True,
                           fp32_and_lse, fp32_and_lse))
    result = None if step is None else step(q, k_cache, v_cache, cache_seqlens, cache_leftpad, starts)
    if result is not None:
        _remember_options(options, step)
    return result


def repeated_heads_first_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: int,
                              softmax_scale: float | None, causal: bool, window_size: tuple[int, int],
                              softcap: float, fp32_and_lse: bool = False) -> torch.Tensor | tuple | None:
    """``repeated_decode_step`` (no left padding) for q, k, v as transformers' attention
    functions get them: q ``(batch, heads, 1, head_dim)``, the caches ``(batch, heads_k, n,
    head_dim)``, read in place by a C launch that transposes them in its view (three transposed
    views cost ~10 us where the model's products have just evicted the interpreter's data); out
    ``(batch, 1, heads, head_dim)``; with ``fp32_and_lse`` (out in float32, lse), as a step
    with sinks asks (``_with_sinks``). None where no step checked before has a launch for them."""
    options = _options_key(True, softmax_scale, causal, window_size, softcap, 0, True, fp32_and_lse, fp32_and_lse)
    for step in _steps_by_options.get(options, ()):
        scratch = step._scratch
        if not hasattr(scratch, "heads_first"):  # (made from the first call that the step's own launch takes)
            own = getattr(scratch, "launch", None)
            if own is None or not own.accepts(*(t.transpose(1, 2) for t in (q, k_cache, v_cache))):
                continue
            scratch.heads_first = step._new_launch(q, k_cache, v_cache, scratch.tables, heads_first=True)
        made = scratch.heads_first
        if made is not None and made.accepts(q, k_cache, v_cache):
            return step(q, k_cache, v_cache, cache_seqlens, heads_first=True)
    return None


# Steps by their options alone (int cache_seqlens, no tensor but cache_leftpad, whose values the
# caller reads): the tensors' metadata and the steering variables, which _steps' keys hold, are
# what each step's C launch checks itself (launch.c), at a fraction of the cost of building such
# a key where a model's products have just evicted the interpreter's data (~15 us a step).
_steps_by_options: dict[tuple, list[_DecodeStep]] = {}
_STEPS_PER_OPTIONS = 4


def _options_key(no_leftpad, softmax_scale, causal, window_size, softcap, num_splits, rotary_interleaved,
                 return_lse, fp32_results) -> tuple | None:
    if (not (softmax_scale is None or type(softmax_scale) is float) or type(causal) is not bool
            or type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int
            or type(window_size[1]) is not int or type(softcap) not in (float, int) or type(num_splits) is not int
            or type(rotary_interleaved) is not bool or type(return_lse) is not bool or type(fp32_results) is not bool):
        return None
    return (no_leftpad, softmax_scale, causal, window_size, softcap, num_splits, rotary_interleaved, return_lse,
            fp32_results)


def _launched_step(options, q, k_cache, v_cache, cache_seqlens: int, cache_leftpad, starts):
    """The result of the step among ``options``' whose C launch takes these tensors, or None."""
    for step in _steps_by_options.get(options, ()):
        made = getattr(step._scratch, "launch", None)  # (this thread's)
        if made is not None and made.accepts(q, k_cache, v_cache):
            return step(q, k_cache, v_cache, cache_seqlens, cache_leftpad, starts)
    return None


def _remember_options(options, step: _DecodeStep) -> None:
    """Let calls with ``options`` find ``step`` (once it has a C launch) without its full key."""
    if options is None or getattr(step._scratch, "launch", None) is None:
        return
    steps = _steps_by_options.setdefault(options, [])
    if step not in steps:
        if len(steps) >= _STEPS_PER_OPTIONS:
            del steps[0]
        steps.append(step)


class _StepTables(NamedTuple):
    lengths: tuple  # (ends, starts, threads) they are for
    seq_info: torch.Tensor  # the thread's own (its ends rewritten in place)
    units: torch.Tensor
    team: int
    units_key: tuple  # (visible tiles, starts, threads): what the units depend on


class _DecodeStep:
    """A checked decode call's plan, for calls with the same ``_step_key``."""

    def __init__(self, kernels, lse_shape, scale, window, group, num_splits, pages, mods, return_lse, batch, seqlen_q):
        # plain tuples: torch.empty(*shape) parses ~2x faster than a torch.Size (~2-3 us a call)
        self.kernels, self.lse_shape = kernels, tuple(lse_shape)
        self.out_dtype = getattr(torch, kernels.out_dtype)  # (q's, or fp32 results)
        self.device = torch.device("cpu")  # (not the default device, which a user may have set)
        self.scale, self.window, self.group, self.num_splits = scale, window, group, num_splits
        self.pages, self.mods, self.return_lse = pages, mods, return_lse
        self.batch, self.seqlen_q = batch, seqlen_q
        self.starts = (0,) * batch
        self.function, self.block_k = kernels._function, kernels.config.block_k
        self.on_torch_threads = kernels._on_torch_threads
        self.threads = threads_module.torch_threads if self.on_torch_threads else settings.num_threads
        # each thread's lse when the caller does not want it, and its tables of the last lengths
        # (the layers of a model call with the same lengths in turn)
        self._scratch = threading.local()

    def _plan(self, ends, starts, threads, heads_k, scratch) -> _StepTables:
        """The tables for these lengths, this thread's own. A growing cache changes them every token,
        but only the ends unless a sequence's keys reach a new tile: then just the ends column is
        rewritten. Inside ``generate()``, where the model's weights have just evicted everything,
        the full plan took ~50 us more of each token's first attention call (~60 us)."""
        spans = plan.visible_tiles(zip(starts, ends), self.seqlen_q, self.window, self.block_k)
        last = getattr(scratch, "tables", None)
        if last is not None and last.units_key == (spans, starts, threads):
            cells = scratch.seq_info_cells
            for b, end in enumerate(ends):
                cells[b * plan.DECODE_SEQ_COLUMNS + plan.DEC_K_END] = end
            tables = last._replace(lengths=(ends, starts, threads))
            for made in self._launches(scratch):  # (the new ends must lie inside the caches it takes)
                self._require_keys(made, tables)
            return tables
        if last is None:
            scratch.seq_info = np.empty((self.batch, plan.DECODE_SEQ_COLUMNS), np.int32)
            scratch.seq_info_cells = memoryview(scratch.seq_info).cast("B").cast("i")  # (numpy's indexing: ~10 us cold)
            seq_info = torch.from_numpy(scratch.seq_info)
        else:
            seq_info = last.seq_info
        _, units = plan.decode_units(starts, ends, seqlen_q=self.seqlen_q, window=self.window, block_k=self.block_k,
                                     heads_k=heads_k, threads=threads, num_splits=self.num_splits,
                                     head_group=self.group, seq_info=scratch.seq_info)
        tables = _StepTables((ends, starts, threads), seq_info, torch.from_numpy(units),
                             min(threads, max(1, len(units))), (spans, starts, threads))
        for made in self._launches(scratch):
            self._update_launch(made, tables)
        return tables

    @staticmethod
    def _launches(scratch) -> list:
        """This thread's C launches of the step that are made (its own layout's, transformers')."""
        return [made for made in (getattr(scratch, "launch", None), getattr(scratch, "heads_first", None))
                if made is not None]

    # the kernel's arguments after out and lse: scale, window (2), team, seq_info, units, pages, mods
    _TEAM, _SEQ_INFO, _UNITS = 8, 9, 10
    _KEYS = 1  # (the caches' key dimension: free, at least the tables' longest sequence)

    def _new_launch(self, q, k_cache, v_cache, tables: _StepTables, heads_first: bool = False):
        """This thread's C launch of the kernel for calls like these (launch.c), or None;
        ``heads_first``: for q, k, v in transformers' layout (``repeated_heads_first_step``)."""
        lse = ("out", 1) if self.return_lse else ("tensor", self._scratch.lse)
        template = (("in", 0), ("in", 1), ("in", 2), ("out", 0), lse, ("float", self.scale),
                    *(("int", w) for w in self.window), ("int", tables.team), ("tensor", tables.seq_info),
                    ("tensor", tables.units), ("tensor", self.pages), *(("tensor", m) for m in self.mods))
        every_dim = (1 << q.dim()) - 1  # (strides: the kernel's own argument checks read them)
        cache = (1 << self._KEYS, every_dim)
        outputs = (torch.empty(q.transpose(1, 2).shape if heads_first else q.shape, dtype=self.out_dtype),)
        if self.return_lse:
            outputs += (torch.empty(*self.lse_shape, dtype=torch.float32),)
        inputs = ((q, 0, every_dim, heads_first), (k_cache, *cache, heads_first), (v_cache, *cache, heads_first))
        made = launch.make(self.function, template, inputs, outputs, team=tables.team if self.on_torch_threads else 0,
                           refuse_grad=True, guards=_steering_values.guards())
        if made is not None:
            self._update_launch(made, tables)
        return made

    def _update_launch(self, made, tables: _StepTables) -> None:
        made.set(self._TEAM, ("int", tables.team))
        made.set(self._SEQ_INFO, ("tensor", tables.seq_info))
        made.set(self._UNITS, ("tensor", tables.units))
        if self.on_torch_threads:
            made.set_team(tables.team)
        self._require_keys(made, tables)

    def _require_keys(self, made, tables: _StepTables) -> None:
        """``made`` takes caches of at least the tables' longest sequence: the kernel reads up to
        each sequence's end, and its own argument checks do not compare them with the caches."""
        longest = max(tables.lengths[0], default=0)
        for cache in (1, 2):
            made.set_min_size(cache, self._KEYS, longest)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad=None, starts=None, heads_first=False):
        """The call's result, or None where the full checks must run (they raise). ``starts``:
        cache_leftpad's values, where the caller has them (a tuple). ``heads_first``: q, k, v in
        transformers' layout, for this thread's heads-first launch (``repeated_heads_first_step``)."""
        if type(cache_seqlens) is int:
            if cache_seqlens < 0:
                return None
            ends = (cache_seqlens,) * self.batch  # (the caches' length: the launch checks, or below)
        elif cache_seqlens is None:
            ends = (k_cache.shape[1],) * self.batch
        else:
            ends = cache_seqlens.tolist()
            if min(ends) < 0:
                return None
        if cache_leftpad is None:
            starts = self.starts
        else:  # (the first real key of each sequence: left padding)
            if starts is None:
                starts = tuple(cache_leftpad.tolist())
            if len(starts) != self.batch or any(not 0 <= s <= e for s, e in zip(starts, ends)):
                return None
        threads = self.threads()
        scratch = self._scratch
        tables = getattr(scratch, "tables", None)
        if tables is None or tables.lengths != (ends, starts, threads):
            tables = scratch.tables = self._plan(ends, starts, threads, k_cache.shape[1 if heads_first else 2], scratch)
        if heads_first:
            return scratch.heads_first(q, k_cache, v_cache)
        if not hasattr(scratch, "launch"):  # (this thread's first call)
            scratch.lse = torch.empty(*self.lse_shape, dtype=torch.float32, device=self.device)
            scratch.launch = self._new_launch(q, k_cache, v_cache, tables)
        if scratch.launch is not None:  # (it returns None for a call unlike the first, or grad to record)
            return scratch.launch(q, k_cache, v_cache)
        return self._python_call(q, k_cache, v_cache, ends, tables)

    def _python_call(self, q, k_cache, v_cache, ends, tables: _StepTables):
        """The launch's work in Python (where the C launcher cannot be built)."""
        if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
            return None
        shape = k_cache.shape
        if v_cache.shape != shape or max(ends) > shape[1]:
            return None
        _, seq_info, units, team, _ = tables
        out = torch.empty_like(q, dtype=self.out_dtype)  # (q's shape; the kernel writes any strides)
        lse = torch.empty(*self.lse_shape, dtype=torch.float32, device=self.device) if self.return_lse else (
            self._scratch.lse)
        # (DecodeKernels.decode without its checks: the first call of this step made them, and the
        # kernel's argument checks cover the rest: what they refuse, the full path names)
        if self.on_torch_threads:
            threads_module.limit(team)
        try:
            self.function(q, k_cache, v_cache, out, lse, self.scale, *self.window, team, seq_info, units, self.pages,
                          *self.mods)
        except Exception:  # (TVM's argument checks raise ValueError or TypeError; DLPack may raise others)
            return None
        return (out, lse) if self.return_lse else out
