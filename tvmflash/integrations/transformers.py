"""Hugging Face transformers on tvmflash: every attention layer of a model through one name.

    from transformers import AutoModelForCausalLM
    from tvmflash.integrations.transformers import register

    name = register()                       # "tvm_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    model.set_attn_implementation(name)     # or switch a model that is already built

``register()`` puts two functions under one name: the attention function in transformers'
``AttentionInterface`` and the mask builder in its ``AttentionMaskInterface``. A model builds
its masks with the builder registered under its ``attn_implementation``, so the attention
function receives the mask in the form it expects, here flash-attn's: no mask at all, or a
``(batch, n)`` boolean key-padding mask. The name must not contain "flash": transformers sends
such names to its own flash-attention kernel loader (the ``flash_attn`` package or a Hub
kernel), which a registered function cannot go through.

What the attention function handles, with what transformers passes it:

* causal self-attention with GQA (fewer key/value heads than query heads), bidirectional
  attention where a module or call sets ``is_causal=False``;
* padding (left or right, rows that are all padding): one op over the mask,
  ``padded.attention``, in eager mode and under torch.compile alike. Rows whose real tokens are
  one run are read in place, the runs as the kernels' sequence table. A mask with holes inside
  a row (0s between 1s) gathers the real tokens into packed sequences for the varlen kernels
  and scatters the output back; on a sliding-window layer the window must count positions in
  the row, holes included, as ``eager``'s does, so there the op runs ``flex_attention`` with
  the mask and the window as its block mask instead (transformers' ``flash_attention_2``
  counts the packed positions). Padding query rows whose every key
  transformers masks (left padding) get what ``eager`` gives them, the mean of v, and eager's
  gradient for it (``uniform_rows.py``): a causal-LM loss reads the last of them, which predicts
  a row's first token. Other padding rows (after a row's tokens) get 0 where eager attends to
  the tokens before them; no real token depends on them, nor a loss with labels -100 there;
* packed sequences (several documents in one row): ``position_ids`` that restart (the same
  rule as transformers' ``eager`` masks: a document starts wherever a position is not the
  previous one plus 1) or the ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs of
  ``DataCollatorWithFlattening``, each document attending only to itself; a mask of ones with
  such position_ids keeps the documents apart, in eager mode and under torch.compile alike
  (flash_attention_2's rule: its mask builder drops a mask of ones, as ours does);
* sliding windows (Mistral, Qwen2, Gemma2's alternating layers): transformers' query at
  position p sees keys p - w < j <= p, flash-attn's ``window_size=(w - 1, 0)``;
* logit softcapping (Gemma2's ``attn_logit_softcapping``) and the module's ``scaling`` (Gemma2's
  ``query_pre_attn_scalar``) as ``softcap`` and ``softmax_scale``;
* attention sinks (gpt-oss's ``s_aux``, a learned logit per head in every row's softmax; on CPU
  transformers runs them on ``eager`` only): the padded op's sinks form for every case above
  (``sinks.py``: from the kernels' out and lse, the sinks' gradient too), a decode step on the
  decode kernel's out and lse; padding query rows get 0, as eager gives them (the sink takes
  their weight). Documents packed into rows by position_ids attend within themselves here, by
  flash_attention_2's rule; gpt-oss's ``eager`` masks do not read position_ids;
* ``generate()``: the prefill is one of the cases above; every new token then attends to the
  KV cache through :func:`decode_attention`, the one place decode is dispatched. A cache of
  left-padded prompts is read through its key-padding mask, with flash-attn's bottom-right
  alignment (the new token sees every cached key of its own sequence, or the last w of them);
  static caches (slots after the last token still empty) are cut to the tokens written.

Under ``torch.compile`` each layer's attention is one op that reads what the mask or
``position_ids`` say when the graph runs (``padded.attention``, ``documents.attention``): one
graph, also for padded batches (sliding windows included) and ``generate()`` with a static
cache (``_decode_op``).

Not supported (a clear error rather than a wrong result): attention dropout > 0 (tvmflash has
no dropout; ``model.eval()`` or ``attention_dropout=0``), 4D or BlockMask attention masks,
masks with extra patterns (``or_mask_function``/``and_mask_function``, e.g. bidirectional
image tokens), chunked attention (Llama 4) over more keys than one chunk. ``block_sequence_ids``
are not detected; models using them need another implementation.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from .. import version
from ..kvcache import flash_attn_with_kvcache, repeated_decode_step, repeated_heads_first_step
from ..torch_op import define_op, flash_attn_func, flash_attn_varlen_func, repeated_heads_first_training
from .. import documents, padded
from .. import sinks as sinks_module
from ..padded import unpad_plan
from ..tensor_memo import per_tensor

NAME = "tvm_attention"

logger = logging.getLogger(__name__)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def register(name: str = NAME) -> str:
    """Register tvmflash with transformers' attention and mask interfaces; returns ``name``,
    the value to pass as ``attn_implementation``. Idempotent."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if "flash" in name or "sdpa" in name or "flex_attention" in name or "/" in name or name in ("eager", "paged|eager"):
        raise ValueError(
            f"{name!r} cannot name tvmflash in transformers: it routes names containing 'flash' to its flash-attention "
            "kernel loader, 'sdpa' and 'flex_attention' to its own checks, 'owner/repo' to the Hub kernels")
    try:
        import transformers
    except ImportError as missing:
        raise ImportError("tvmflash.integrations.transformers needs transformers: pip install 'tvmflash[hf]'") from missing
    version.require("transformers", transformers.__version__, version.MIN_TRANSFORMERS)
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, key_padding_mask)
    return name


# --- the mask a model builds for us ------------------------------------------------------------
def key_padding_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None, q_offset=0,
                     kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
                     cache_position: torch.Tensor | None = None, device=None, **kwargs) -> torch.Tensor | None:
    """The mask builder registered with ``register()`` (transformers' ``AttentionMaskInterface``).

    Returns None when every key the layer gets is a real token (the attention function then
    relies on causality, windows and ``position_ids``), else a ``(batch, n)`` bool mask over the
    first ``n <= kv_length`` keys (True: a real token); keys past ``n`` are empty static-cache
    slots. The queries are the last ``q_length`` of the ``n`` keys, as in flash-attn's padding
    mask that transformers builds for ``flash_attention_2``.
    """
    if kwargs.get("use_vmap"):  # create_*_mask with or_mask_function / and_mask_function
        raise NotImplementedError(
            "this model adds its own pattern to the attention mask (or_mask_function/and_mask_function, e.g. "
            "bidirectional image tokens), which tvmflash's transformers integration does not support; use "
            "attn_implementation='eager' or 'sdpa' for it")
    config = kwargs.get("config")
    chunk = getattr(config, "attention_chunk_size", None)
    if (chunk is not None and kwargs.get("local_size") == chunk and chunk != getattr(config, "sliding_window", None)
            and kv_length is not None and kv_length + kv_offset > chunk):
        # (create_chunked_causal_mask's: transformers refuses flash_attention_2 here the same way)
        raise NotImplementedError(
            f"this model's chunked attention (attention_chunk_size={chunk}, Llama 4) is not implemented by tvmflash, "
            f"and its keys ({kv_length + kv_offset}) reach past one chunk, whose pattern would be lost: use "
            f"attn_implementation='sdpa' or 'eager' for it, or sequences of at most {chunk} tokens")
    if q_length is None:  # transformers < 5: the query positions come as cache_position
        if cache_position is None:
            raise TypeError("key_padding_mask needs q_length (transformers >= 5) or cache_position")
        q_length, q_offset = cache_position.shape[0], cache_position[0]
        device = cache_position.device if device is None else device
    # (under torch.compile, reading the mask's values would break the graph: the ops read them when they run)
    unread = torch.compiler.is_compiling()
    if attention_mask is None:
        # The last query is at absolute position q_offset + q_length - 1; a static cache has
        # kv_length slots of which the ones after it are still empty.
        if unread and isinstance(q_offset, torch.Tensor):
            # (a static cache's offset is a tensor, reading it would break the graph: the slots
            # as a mask of fixed shape, whose trailing empty columns the ops cut: written_keys)
            written = torch.arange(kv_length, device=q_offset.device) < q_offset + q_length - kv_offset
            return written.expand(batch_size, kv_length)
        n = int(q_offset) + q_length - kv_offset
        if n < kv_length:
            return torch.ones(batch_size, max(n, 0), dtype=torch.bool, device=device or "cpu")
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"expected a 2D (batch, length) padding mask, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)  # a sliding layer's cache keeps the last kv_length keys
    if unread:
        return mask
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


# --- the attention function ----------------------------------------------------------------------
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered with ``register()`` (transformers' ``AttentionInterface``).

    query ``(batch, heads, seqlen_q, head_dim)``, key and value ``(batch, heads_kv, seqlen_k,
    head_dim)`` as the model's attention module passes them; returns ``(out, None)`` with out
    ``(batch, seqlen_q, heads, head_dim)``.
    """
    if not dropout and kwargs.keys() <= _PLAIN_KWARGS and not torch.compiler.is_compiling():
        out = _repeated_call(module, query, key, value, attention_mask, scaling, sliding_window, softcap, is_causal,
                             kwargs)
        if out is not None:
            return out, None
    if dropout:
        raise ValueError(
            f"tvmflash has no attention dropout, but the model asks for dropout={dropout} (training mode with "
            "attention_dropout > 0): set config.attention_dropout = 0.0 or call model.eval()")
    if kwargs.get("output_attentions"):
        _warn_once("tvmflash does not return attention weights (output_attentions=True gives None)")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                 else type(attention_mask).__name__)
        raise ValueError(
            f"tvmflash takes a 2D key-padding mask built by its own mask function, got {shape}: build the model with "
            "attn_implementation=register() (which registers both), and pass 2D attention masks")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))

    # The kernels' layout: (batch, seqlen, heads, head_dim) views, no copy.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    dtype = _attention_dtype(q)
    if q.dtype != dtype or k.dtype != dtype or v.dtype != dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: pad v to q's head dim, crop the output
        if v_head_dim > head_dim:
            raise ValueError(f"value head dim {v_head_dim} exceeds the query's {head_dim}")
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    window, softcap = _window(sliding_window, causal, k.shape[1]), float(softcap) if softcap else 0.0

    batch, len_q = q.shape[:2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if kwargs.get("s_aux") is not None:  # (gpt-oss)
        out = _attention_with_sinks(q, k, v, attention_mask, kwargs["s_aux"], scaling, causal, window, softcap, kwargs)
        return (out if v_head_dim == head_dim else out[..., :v_head_dim]), None
    if torch.compiler.is_compiling() and _decode_op_applies(q, k, v, attention_mask, cu_q, cu_k):
        mask = None if attention_mask is None else attention_mask.to(device=q.device, dtype=torch.bool)
        out = _decode_op(q, k, v, mask, scaling, causal, *window, softcap)
        return (out if v_head_dim == head_dim else out[..., :v_head_dim]), None
    if attention_mask is None and len_q == 1 and (cu_q is None or cu_k is None) and k.shape[1] != 1:
        # generate()'s every new token (a model's layers call this in turn: no more than it needs)
        out = decode_attention(q, k, v, None, softmax_scale=scaling, causal=causal, window_size=window,
                               softcap=softcap)
        return (out if v_head_dim == head_dim else out[..., :v_head_dim]), None
    opts = {"softmax_scale": scaling, "causal": causal, "window_size": window, "softcap": softcap}
    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, opts, kwargs)
    elif cu_q is not None and cu_k is not None:
        out = _packed_attention(q, k, v, cu_q, cu_k, opts)
    elif len_q == 1:
        out = decode_attention(q, k, v, None, **opts)
    elif len_q == k.shape[1]:
        # documents packed into rows, told apart by position_ids (one op under torch.compile),
        # where transformers' own masks tell them apart: without a KV cache
        out = documents.attention(q, k, v, None if kwargs.get("use_cache") else kwargs.get("position_ids"), **opts)
    else:
        out = flash_attn_func(q, k, v, **opts)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


# what a call may carry besides the arguments _repeated_call reads (gpt-oss's s_aux: its sinks;
# output_router_logits: its experts' flag, passed along to every layer's modules)
_PLAIN_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "s_aux", "output_router_logits"})


def _repeated_call(module, query, key, value, mask, scaling, sliding_window, softcap, is_causal, kwargs: dict):
    """The output of a call like one of the layers and steps before, read in transformers' layout
    by a C launch without the checks below (they ran at the first such call): generate()'s new
    tokens without a mask (``repeated_heads_first_step``), a training forward's calls
    (``repeated_heads_first_training``, their backward too; with a padding mask or documents
    packed into rows, on the mask or position_ids the first layer's call read:
    ``padded.`` and ``documents.repeated_heads_first_training``; with gpt-oss's sinks, on the mask
    or ``_all_keys``, as ``_attention_with_sinks`` runs them); None for any other call."""
    n, len_q = key.shape[2], query.shape[2]
    if len_q != 1 and len_q != n or mask is not None and (len_q == 1 or type(mask) is not torch.Tensor
                                                          or mask.dtype != torch.bool):
        return None
    sinks = kwargs.get("s_aux")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window, softcap = _window(sliding_window, causal, n), float(softcap) if softcap else 0.0
    if len_q == 1:
        if n == 1 or torch.is_autocast_enabled("cpu"):  # (decode steps do not follow autocast)
            return None
        if sinks is None:
            return repeated_heads_first_step(query, key, value, n, scaling, causal, window, softcap)
        sinks_module.check(sinks, query.shape[1], query.device)
        if torch.is_grad_enabled() and sinks.requires_grad:
            return None  # (the padded op, differentiable: _attention_with_sinks)
        found = repeated_heads_first_step(query, key, value, n, scaling, causal, window, softcap, fp32_and_lse=True)
        return None if found is None else sinks_module.renormalized(*found, sinks, None, query.dtype)[0]
    if not query.requires_grad:
        return None  # (no gradient: flash_attn_func's own repeat)
    position_ids = None if mask is not None or kwargs.get("use_cache") else kwargs.get("position_ids")
    in_documents = documents.documents_from_positions(position_ids, query.shape[0], len_q) is not None
    dtype = _attention_dtype(query)
    if query.dtype != dtype or key.dtype != dtype or value.dtype != dtype:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if sinks is not None:
        if in_documents:
            return None
        mask = _all_keys(query.shape[0], n, query.device) if mask is None else mask
        return padded.repeated_heads_first_training(query, key, value, mask, scaling, causal, window, softcap, sinks)
    if mask is not None:
        return padded.repeated_heads_first_training(query, key, value, mask, scaling, causal, window, softcap)
    if in_documents:  # (documents packed into rows, as documents.attention reads them)
        return documents.repeated_heads_first_training(query, key, value, position_ids, scaling, causal, window,
                                                       softcap)
    return repeated_heads_first_training(query, key, value, scaling, causal, window, softcap)


def _attention_with_sinks(q, k, v, mask: torch.Tensor | None, sinks: torch.Tensor, scaling: float | None, causal: bool,
                          window: tuple[int, int], softcap: float, kwargs: dict) -> torch.Tensor:
    """Attention with gpt-oss's sinks (``sinks.py``), every case of ``attention_forward``: a decode
    step without gradients on the decode kernel (its lse renormalized; a cache read in place,
    left padding included), else ``padded.attention`` over the mask (or all keys), documents by
    position_ids or cu_seq_lens included."""
    opts = {"softmax_scale": scaling, "causal": causal, "window_size": window, "softcap": softcap}
    sinks_module.check(sinks, q.shape[2], q.device)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if q.shape[1] == 1 and not (torch.is_grad_enabled() and sinks.requires_grad):
        if torch.compiler.is_compiling():
            if _decode_op_applies(q, k, v, mask, cu_q, cu_k):
                mask = None if mask is None else mask.to(device=q.device, dtype=torch.bool)
                return _decode_sinks_op(q, k, v, mask, sinks, scaling, causal, *window, softcap)
        else:
            out = _decode_kernel_with_sinks(q, k, v, mask, sinks, opts, cut_empty_slots=False)
            if out is not None:
                return out
    position_ids = None
    if mask is None and q.shape[1] == k.shape[1] and not kwargs.get("use_cache"):
        position_ids = kwargs.get("position_ids")
        if not torch.compiler.is_compiling() and documents.documents_from_positions(position_ids, *q.shape[:2]) is None:
            position_ids = None  # (one sequence per row: the checked call on _all_keys, which later layers repeat)
        if cu_q is not None and cu_k is not None:  # (documents packed into one row: their positions)
            if q.shape[0] != 1 or not torch.equal(cu_q, cu_k):
                raise ValueError("cu_seq_lens_q/_k with attention sinks: documents packed into one row, the same "
                                 "bounds for queries and keys")
            starts = cu_q[:-1].to(torch.int64).repeat_interleave(cu_q.diff().to(torch.int64))
            position_ids = (torch.arange(q.shape[1], device=q.device) - starts.to(q.device))[None]
    if mask is None:
        mask = (torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device) if torch.compiler.is_compiling()
                else _all_keys(q.shape[0], k.shape[1], q.device))
    return padded.attention(q, k, v, mask, position_ids=position_ids, sinks=sinks, **opts)


@functools.lru_cache(maxsize=16)
def _all_keys(batch: int, n: int, device: torch.device) -> torch.Tensor:
    """A mask of ``n`` real keys per row: one tensor per shape, on which what the mask says is
    found once (``per_tensor``) for a model's layers and steps."""
    return torch.ones(batch, n, dtype=torch.bool, device=device)


def _decode_kernel_with_sinks(q, k, v, key_mask: torch.Tensor | None, sinks: torch.Tensor, opts: dict,
                              cut_empty_slots: bool) -> torch.Tensor | None:
    """A decode step with sinks on the decode kernel (``flash_attn_with_kvcache``'s sinks), where
    it reads the cache in place (one run of real keys per row: full or left-padded;
    ``cut_empty_slots`` as ``decode_attention``'s), else None. The callers have checked the sinks."""
    if not _decode_kernel_applies(q, k, v):
        return None
    keys = None if key_mask is None else _decode_keys(q, k, key_mask, cut_empty_slots)
    if keys is not None and keys.left_pad is None:  # (holes)
        return None
    n, left_pad = (k.shape[1], None) if keys is None else (keys.n, keys.left_pad)
    found = repeated_decode_step(q, k, v, n, opts["softmax_scale"], opts["causal"], opts["window_size"],
                                 opts["softcap"], left_pad, None if keys is None else keys.starts, fp32_and_lse=True)
    if found is not None:  # (a step like one checked before: the layers and tokens after the first)
        return sinks_module.renormalized(*found, sinks, None, q.dtype)[0]
    return flash_attn_with_kvcache(q, k, v, cache_seqlens=n, cache_leftpad=left_pad, sinks=sinks, **opts)


def _decode_sinks_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                          sinks: torch.Tensor, softmax_scale: float | None, causal: bool, window_left: int,
                          window_right: int, softcap: float) -> torch.Tensor:
    """``_decode_op`` with sinks (torch.compile's graphs: generate() with a compiled forward): the
    decode kernel where it reads the cache in place, else the padded op with sinks. Forward only."""
    sinks_module.check(sinks, q.shape[2], q.device)  # (a direct call of the op: _attention_with_sinks checks its own)
    opts = {"softmax_scale": softmax_scale, "causal": causal, "window_size": (window_left, window_right),
            "softcap": softcap}
    out = _decode_kernel_with_sinks(q, k, v, key_mask, sinks, opts, cut_empty_slots=True)
    if out is not None:
        return out
    if key_mask is None:  # (one mask per shape: what it says is found once, not at every step)
        key_mask = _all_keys(q.shape[0], k.shape[1], q.device)
    return padded.attention(q, k, v, key_mask, sinks=sinks, **opts)


def _decode_sinks_op_fake(q, k, v, key_mask, sinks, softmax_scale, causal, window_left, window_right, softcap):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


_decode_sinks_op = define_op("transformers_decode_sinks", _decode_sinks_op_impl, _decode_sinks_op_fake)


def _decode_op_applies(q, k, v, mask: torch.Tensor | None, cu_q, cu_k) -> bool:
    """Whether a call under torch.compile is a decode step that ``_decode_op`` takes: one query
    per row, no gradient to record (the op has none), the mask (if any) within the keys."""
    if q.shape[1] != 1 or (cu_q is not None and cu_k is not None) or (mask is None and k.shape[1] == 1):
        return False
    if mask is not None and mask.shape[1] > k.shape[1]:
        return False  # (padded.attention names it)
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def _decode_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                    softmax_scale: float | None, causal: bool, window_left: int, window_right: int,
                    softcap: float) -> torch.Tensor:
    """``decode_attention`` as one op (torch.compile's graphs: generate() with a compiled
    forward), which reads the mask (left padding, holes) when it runs: a static cache's mask of
    the cache's fixed length, whose trailing columns without a real key it cuts. Forward only."""
    return decode_attention(q, k, v, key_mask, softmax_scale=softmax_scale, causal=causal,
                            window_size=(window_left, window_right), softcap=softcap, cut_empty_slots=True)


def _decode_op_fake(q, k, v, key_mask, softmax_scale, causal, window_left, window_right, softcap):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


_decode_op = define_op("transformers_decode", _decode_op_impl, _decode_op_fake)


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the attention runs in: a CPU autocast region's for CPU tensors, as SDPA's (it is
    on autocast's lower-precision list; under autocast a Llama hands it RoPE'd fp32 q and k, the
    projections' bf16 v), the decode steps' too, which do not follow autocast themselves; else
    q's (k and v follow it). float64 stays, as autocast leaves it."""
    if q.is_cpu and q.dtype != torch.float64 and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return q.dtype


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, *,
                     softmax_scale: float | None, causal: bool, window_size: tuple[int, int], softcap: float,
                     cut_empty_slots: bool = False) -> torch.Tensor:
    """One new token per sequence against the KV cache: the single place decode is dispatched.

    q ``(batch, 1, heads, head_dim)``, k and v ``(batch, n_cache, heads_kv, head_dim)`` (any
    strides with unit head_dim stride); ``key_mask`` ``(batch, n)`` bool, n <= n_cache, or None
    when every cached key is a real token; ``cut_empty_slots``: the mask's trailing columns
    without a real key in any row are a static cache's empty slots (a compiled step's mask of
    the cache's length), not padding. The query sees all real keys of its sequence (or the last
    ``window_size[0] + 1`` of them): flash-attn's bottom-right alignment.

    CPU caches without gradients, full or left-padded (each row's real keys one run ending at
    key n - 1, as ``generate()`` builds them): ``flash_attn_with_kvcache``'s decode kernel reads
    the cache in place (``cache_seqlens = n``, ``cache_leftpad``: the first real key), each
    cached row once per GQA group, keys split over the threads. A mask with holes (pad tokens
    inside a prompt: ``generate()`` masks every ``pad_token_id`` of the input) gives the same
    kernel each row's real keys, gathered (a copy of the cache's real rows per layer and step:
    ~0.1 ms at a thousand keys, where one query on the varlen kernel's 64-row tiles took ~3 ms);
    a window then keeps the keys within it by position in the row (eager's), not by count.
    Otherwise (gradients, CUDA tensors): ``flash_attn_func``, or ``flash_attn_varlen_func`` on the
    gathered real keys.
    """
    if key_mask is not None:
        keys = _decode_keys(q, k, key_mask, cut_empty_slots)
        n, left_pad = keys.n, keys.left_pad
    else:
        n, keys, left_pad = k.shape[1], None, None
    if ((key_mask is None or left_pad is not None)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        out = repeated_decode_step(q, k, v, n, softmax_scale, causal, window_size, softcap, left_pad,
                                   None if keys is None else keys.starts)
        if out is not None:  # (a step like one checked before: the layers and tokens after the first)
            return out
    if key_mask is not None and n < key_mask.shape[1]:  # (cut_empty_slots: the written keys)
        key_mask = key_mask[:, :n]
    opts = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    on_kernel = _decode_kernel_applies(q, k, v)
    if on_kernel and (key_mask is None or left_pad is not None):
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=n, cache_leftpad=left_pad, **opts)
    if key_mask is None:
        return flash_attn_func(q, k, v, **opts)
    if window_size[0] >= 0:  # holes and a window: the window counts positions in the row (as eager), not real keys
        key_mask = key_mask & (torch.arange(n, device=key_mask.device) >= n - 1 - window_size[0])
        opts["window_size"] = (-1, window_size[1])
    plan = unpad_plan(key_mask, 1)
    if on_kernel and plan.max_k > 0:  # holes (pad tokens inside a prompt): each row's real keys gathered to its front
        table, lengths = plan.key_table(key_mask)
        if q.shape[0] == 1:  # index_select: ~2.5x faster than advanced indexing here
            k, v = k.index_select(1, table[0]), v.index_select(1, table[0])
        else:
            rows = torch.arange(q.shape[0], device=q.device)[:, None]
            k, v = k[rows, table], v[rows, table]
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, **opts)
    k, v = k[:, :n], v[:, :n]
    batch = q.shape[0]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q[:, 0], k[plan.key_index], v[plan.key_index], cu_q, plan.cu_k, 1, plan.max_k,
                                 **opts)
    return out.unsqueeze(1)


def _decode_keys(q, k, key_mask: torch.Tensor, cut_empty_slots: bool) -> _DecodeKeys:
    """What a decode step reads from its padding mask (kept on the mask), or a clear error where
    the mask does not fit the step."""
    if key_mask.dim() != 2 or key_mask.shape[0] != q.shape[0] or not 1 <= key_mask.shape[1] <= k.shape[1]:
        n = key_mask.shape[-1] if key_mask.dim() else 0
        raise ValueError(f"the padding mask covers {n} keys (shape {tuple(key_mask.shape)}), the layer got "
                         f"{k.shape[1]} keys of {q.shape[0]} sequences (a decode step needs a (batch, n) mask with "
                         f"1 <= n <= {k.shape[1]})")
    return per_tensor(key_mask, "_tvmflash_decode_keys", cut_empty_slots,
                      lambda: _DecodeKeys.of(key_mask, cut_empty_slots))


class _DecodeKeys(NamedTuple):
    """What a decode step reads from its padding mask, found once per mask tensor (a model's
    layers share it) from one scan of the mask's rows (``padded.MaskRows``)."""

    n: int  # the keys the step covers: the mask's, or its written ones (cut_empty_slots)
    starts: tuple | None  # each row's first real key where every row's are one run ending at key n - 1
    left_pad: torch.Tensor | None  # starts as the kernel's (batch,) int32 cache_leftpad

    @classmethod
    def of(cls, mask: torch.Tensor, cut_empty_slots: bool) -> _DecodeKeys:
        rows = padded.MaskRows(mask)
        n = max(rows.written, 1) if cut_empty_slots else mask.shape[1]
        starts = rows.left_pad(n)
        left_pad = None if starts is None else torch.tensor(starts, dtype=torch.int32, device=mask.device)
        return cls(n, starts, left_pad)


def _decode_kernel_applies(q, k, v) -> bool:
    """Whether ``flash_attn_with_kvcache`` can serve this decode step (it is forward-only, CPU)."""
    tensors = (q, k, v)
    if any(t.device.type != "cpu" or t.dtype != q.dtype or t.stride(-1) != 1 for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# --- padding, packing, windows -----------------------------------------------------------------------
def _window(sliding_window: int | None, causal: bool, len_k: int) -> tuple[int, int]:
    """transformers' sliding window as flash-attn's (left, right).

    Causal: the query at position p sees p - w < j <= p (``sliding_window_overlay``: itself and
    w - 1 keys before it): (w - 1, 0); dropped when no sequence is longer than w. Bidirectional:
    |p - j| <= w (``sliding_window_bidirectional_overlay``): (w, w).
    """
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    w = int(sliding_window)
    if causal:
        return (-1, -1) if len_k <= w else (w - 1, 0)
    return (w, w)


def _padded_attention(q, k, v, mask: torch.Tensor, opts: dict, kwargs: dict | None = None) -> torch.Tensor:
    """Attention over the real tokens of a padded batch: ``padded.attention``, one op over the
    mask in eager mode and under torch.compile alike (rows of one run read in place, holes
    gathered, a window over holes on flex, the rows that see no key given eager's mean of v);
    an eager decode step: ``decode_attention``.

    Under torch.compile the mask may be all ones (``key_padding_mask`` cannot read it there),
    where eager mode gets no mask and finds documents by position_ids: the op is given them too
    (from the attention function's ``kwargs``), and applies that rule when it runs."""
    mask = mask.to(device=q.device, dtype=torch.bool)  # (both check its shape against q and k)
    compiling = torch.compiler.is_compiling()
    if q.shape[1] == 1 and not compiling:
        return decode_attention(q, k, v, mask, **opts)
    kwargs = kwargs or {}
    position_ids = kwargs.get("position_ids")
    if (not compiling or kwargs.get("use_cache") or not isinstance(position_ids, torch.Tensor)
            or position_ids.dim() != 2 or position_ids.shape[0] not in (1, q.shape[0])
            or not position_ids.shape[1] == q.shape[1] == k.shape[1] == mask.shape[-1]):
        position_ids = None  # (where eager mode finds no documents either: documents_from_positions)
    return padded.attention(q, k, v, mask, position_ids=position_ids, **opts)


def _packed_attention(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, opts: dict) -> torch.Tensor:
    """Documents packed into the rows of a batch: all rows flattened into one token stream."""
    batch, len_q = q.shape[:2]
    len_k = k.shape[1]
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    if int(cu_q[-1]) != batch * len_q or int(cu_k[-1]) != batch * len_k:
        raise ValueError(f"cu_seq_lens end at {int(cu_q[-1])} (q) and {int(cu_k[-1])} (k), but the batch holds "
                         f"{batch} x {len_q} queries and {batch} x {len_k} keys")
    return documents.rows_as_documents(q, k, v, cu_q, cu_k, **opts)
