"""Attention over the real tokens of a padded batch, and what a padding mask says about it.

A ``(batch, n)`` key-padding mask (True: a real token) is what tokenizers and transformers'
flash-attention masks give. What it means for the kernels, found once per mask tensor
(``per_tensor``; a model's layers share their mask):

* ``mask_rows``: where each row's real tokens lie; where they are one run (left or right
  padding), the kernels read them in place as their sequence table; else the mask has holes
  (pad tokens inside a row);
* ``unpad_plan``: the gather indices and cu_seqlens of ``flash_attn_varlen_func`` on the real
  tokens (holes, or tensors the in-place kernels do not take);
* ``blind_rows``: the query rows whose every key the mask hides, which transformers' ``eager``
  gives the mean of v (``uniform_rows.py``);
* ``_window_block_mask``: a window over a mask with holes, as ``flex_attention``'s block mask;
* ``_layout``: all of it for one checked call (the forward's serves the backward).

A padded call is one op, ``tvmflash::flash_attn_padded_forward`` (``attention``), whose body
chooses the path from these when it runs; its backward op chooses again from the saved mask.
Its shapes do not depend on the mask, so ``torch.compile`` traces it in one graph whatever the
mask (a choice made while tracing would read the mask's values: 27 graph breaks for an 8-layer
Llama). Eager calls run the same bodies without torch's dispatcher (``torch_op.OpPair``); in a
training forward, the layers after the first repeat its checked call on their shared mask in
transformers' layout (``repeated_heads_first_training``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import checks, torch_op, uniform_rows
from . import sinks as sinks_module
from .documents import documents_from_positions
from .tensor_memo import per_tensor, remembered
from .flex import flex_attention_backward, flex_attention_forward
from .uniform_rows import UniformRows

if TYPE_CHECKING:
    from . import flex_trace


# --- what a mask says ----------------------------------------------------------------------------
class MaskRows:
    """Where each row's real keys lie in a ``(batch, n)`` bool mask: ``count``, ``first`` and
    ``end`` (one past the last; 0 and 0 in a row without any), tuples of ints; ``written``, the
    end of the last real key in any row; ``runs``, each row's (first, end) where every row's real
    keys are one run (left or right padding: what tokenizers make), else None (holes: pad tokens
    inside a sequence).

    Found in one scan of each row's bytes: a model meets a new mask at every forward, right after
    its matrix products have evicted the caches. There, in a compiled ``generate()``'s first
    layer of each token, this took ~50 us, where the torch ops that found the written keys and
    the left padding took ~200."""

    __slots__ = ("count", "first", "end", "written", "runs")

    def __init__(self, mask: torch.Tensor):
        if mask.dtype != torch.bool:  # (the scan reads one byte per key)
            mask = mask != 0
        flat = (mask if mask.is_cpu else mask.cpu()).numpy().tobytes()  # (row-major)
        batch, n = mask.shape
        count, first, end = [0] * batch, [0] * batch, [0] * batch
        for b in range(batch):
            row = flat[b * n:(b + 1) * n]
            count[b] = row.count(1)
            if count[b]:
                first[b], end[b] = row.find(1), row.rfind(1) + 1
        self.count, self.first, self.end = tuple(count), tuple(first), tuple(end)
        self.written = max(end, default=0)
        one_run = all(c == e - f for c, f, e in zip(count, first, end))
        self.runs = tuple(zip(first, end)) if one_run else None

    def left_pad(self, n: int) -> tuple | None:
        """Each row's first real key where every row's real keys are one run ending at key
        ``n - 1`` (left padding, or none; n in a row without any: what decode's KV-cache kernel
        reads as ``cache_leftpad`` over a cache of n keys), else None."""
        if self.runs is None or any(c and e != n for c, e in zip(self.count, self.end)):
            return None
        return tuple(n - c for c in self.count)


def mask_rows(mask: torch.Tensor) -> MaskRows:
    """``MaskRows`` of a bool mask, found once per mask tensor."""
    return per_tensor(mask, "_tvmflash_rows", None, lambda: MaskRows(mask))


class Unpad:
    """Where the real tokens of a padded batch are, and their sequences' boundaries."""

    __slots__ = ("key_index", "cu_k", "max_k", "query_index", "cu_q", "max_q", "_key_table")

    def __init__(self, key_mask: torch.Tensor, len_q: int):
        self.key_index, self.cu_k, self.max_k = _nonzero_and_cu(key_mask)
        # The queries are the last len_q keys (transformers' flash-attention convention).
        self.query_index, self.cu_q, self.max_q = _nonzero_and_cu(key_mask[:, -len_q:])
        self._key_table = None

    @classmethod
    def documents(cls, mask: torch.Tensor, cu: torch.Tensor) -> Unpad:
        """Every token of a mask of ones, in the sequences ``cu`` (int32 cu_seqlens over the rows
        flattened: documents packed into them), as queries and keys alike."""
        plan = cls.__new__(cls)
        plan.key_index = plan.query_index = mask.nonzero(as_tuple=True)
        plan.cu_k = plan.cu_q = cu
        plan.max_k = plan.max_q = int(cu.diff().max())
        plan._key_table = None
        return plan

    def key_table(self, key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """((batch, max_k) positions of each row's real keys in order, padded with later
        positions; (batch,) int32 counts): a decode step's gather of the real keys, which the
        KV-cache kernel then reads as a cache of ``counts`` tokens per row."""
        if self._key_table is None:
            order = torch.argsort((~key_mask.bool()).to(torch.uint8), dim=1, stable=True)  # real keys first
            self._key_table = (order[:, :self.max_k], (self.cu_k[1:] - self.cu_k[:-1]).to(torch.int32))
        return self._key_table


def _nonzero_and_cu(mask: torch.Tensor):
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    index = mask.nonzero(as_tuple=True)  # (batch index, position), row-major: sequences in order
    return index, cu, int(lengths.max()) if lengths.numel() else 0


def unpad_plan(mask: torch.Tensor, len_q: int) -> Unpad:
    """The gather indices and cu_seqlens for ``mask``, computed once per mask tensor."""
    return per_tensor(mask, "_tvmflash_unpad", len_q, lambda: Unpad(mask, len_q))


def blind_rows(mask: torch.Tensor, len_q: int, window_left: int, window_right: int) -> UniformRows | None:
    """The query rows (the last ``len_q`` of the mask's positions) for which transformers' mask
    hides every key, as ``UniformRows``, or None; found once per mask tensor and kind of layer.
    The query at position p sees the real keys j with -window_right <= p - j <= window_left
    (flash-attn's window, -1: unbounded; causal: window_right 0; transformers' sliding window w
    is (w - 1, 0) causal, (w, w) bidirectional).

    Such rows (padding queries before a row's first token: left padding) are where transformers'
    ``eager`` adds its most negative number to every score: the softmax is then uniform over all
    the layer's keys, and ``eager`` returns the mean of v. Padding queries at these positions
    predict the first real token, so a causal-LM loss sees them.
    """
    found = per_tensor(mask, "_tvmflash_blind_rows", None, dict)
    key = (len_q, window_left, window_right)
    if key not in found:
        n = mask.shape[1]
        seen = torch.nn.functional.pad(mask.cumsum(1, dtype=torch.int32), (1, 0))  # seen[:, i]: real keys before i
        pos = torch.arange(n - len_q, n, device=mask.device)  # the queries' positions among the keys
        lo = (pos - window_left).clamp_min(0) if window_left >= 0 else torch.zeros_like(pos)
        hi = (pos + window_right + 1).clamp_max(n) if window_right >= 0 else torch.full_like(pos, n)
        blind = (seen[:, hi] - seen[:, lo]) == 0
        found[key] = UniformRows.at(*blind.nonzero(as_tuple=True), mask.shape[0])
    return found[key]


# --- one op over the mask (torch.compile) ----------------------------------------------------------
def attention(q, k, v, mask: torch.Tensor, *, position_ids: torch.Tensor | None = None, softmax_scale=None,
              causal=False, window_size=(-1, -1), softcap=0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the real tokens of a padded batch: (batch, len_q, heads, head_dim) q, k and
    v (batch, n_k, heads_kv, head_dim), ``mask`` (batch, n) True at real keys, len_q <= n <= n_k.
    The queries are the last len_q of the mask's n positions (transformers' flash-attention
    convention); keys after n are a static cache's empty slots, and so are the mask's trailing
    columns that no row holds a real key in, where len_q < n (a compiled decode step's mask of
    the cache's fixed length). A query sees the real keys of its row (causal: those not after
    it; a window counts positions in the row). Padding query rows get 0, except those that see
    no real key, which get ``eager``'s mean of v over all n_k keys (``blind_rows``).

    ``position_ids`` (1 or batch, n), for queries and keys of the same n tokens: where the mask
    holds no padding, each document they mark (``documents.documents_from_positions``) attends
    within itself. That is transformers' ``flash_attention_2`` rule, which reads position_ids
    only when its mask builder dropped a mask of ones (as ``key_padding_mask`` does in eager
    mode); under torch.compile the mask's values are read when the op runs.

    One op, whatever the mask (its values are read when the op runs): what ``torch.compile``
    traces in one graph. Rows whose real tokens are one run, queries and keys alike, are read in
    place on CPU tensors; others are gathered for the varlen kernels, except under a window,
    which the packed sequences would count in packed positions: there ``flex_attention`` takes
    the mask and the window as its block mask, in place (its fused backward in the backward op).

    ``sinks`` (heads,): gpt-oss's attention sinks, a logit per query head in every row's softmax
    (``sinks.py``; differentiable). Padding query rows then get 0, as ``eager``'s gpt-oss gives them.
    """
    head_dim = q.shape[-1]
    # (a model's layers repeat one call: its checks, which read nothing but these, run once)
    key = None if position_ids is not None else _checks_key(q, k, v, mask, softmax_scale, causal, window_size, softcap)
    flash = _checked.get(key) if key is not None else None
    if flash is None:
        flash = checks.flash_options(head_dim, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap)
        q, k, v = torch_op._padded_head_dims(q, k, v)  # (before the checks, which take the kernels' head dims)
        checks.check_qkv(*(checks.info(t, name) for name, t in zip("qkv", (q, k, v))))
        if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != q.shape[0]
                or not q.shape[1] <= mask.shape[1] <= k.shape[1]):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"the padding mask must be a (batch, n) tensor with batch {q.shape[0]} and "
                             f"{q.shape[1]} queries <= n <= {k.shape[1]} keys, got {shape}")
        mask = mask.to(device=q.device, dtype=torch.bool)
        q, k, v = (torch_op.kernel_layout(t) for t in (q, k, v))
        if key is not None and q.shape[-1] == head_dim and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
            if len(_checked) >= torch_op._MAX_CALLS:  # (bounded as torch_op's own memo of checked calls)
                _checked.clear()
            _checked[key] = flash
    keys_seen = mask if position_ids is None else _positions_of_real_tokens(mask, position_ids, q.shape[1], k.shape[1])
    scalars = (flash.softmax_scale, *flash.window, flash.softcap)
    if sinks is not None:
        sinks_module.check(sinks, q.shape[2], q.device)
        out, _ = _sink_ops(q, k, v, sinks, keys_seen, *scalars)
    else:
        out, _ = _padded_ops(q, k, v, keys_seen, *scalars)
    if key is not None and out.requires_grad:
        _remember_repeat(mask, torch_op.options_key(softmax_scale, causal, window_size, softcap), q, k, v, scalars,
                         sinks is not None)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]  # (a view: one autograd node more)


_checked: dict[tuple, checks.FlashOptions] = {}


def _positions_of_real_tokens(mask: torch.Tensor, position_ids, len_q: int, len_k: int) -> torch.Tensor:
    """The op's ``keys_seen`` where position_ids come with the mask: the positions, -1 at padding
    (int64, batch x n): one tensor, from which the op's bodies read both (``_real_and_documents``)."""
    batch, n = mask.shape
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != n or not len_q == n == len_k):
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must be a (1 or {batch}, {n}) tensor for {len_q} queries and {len_k} keys of "
                         f"the same {n} tokens, got {shape}")
    positions = position_ids.to(device=mask.device, dtype=torch.int64).expand(batch, n)
    return positions.masked_fill(~mask, -1)


def _real_and_documents(keys_seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op's ``keys_seen`` as (the bool mask, the cu_seqlens of the documents where the mask
    holds no padding and position_ids mark several, else None): a mask is itself; positions with
    -1 at padding (``_positions_of_real_tokens``) are read once per tensor."""
    if keys_seen.dtype == torch.bool:
        return keys_seen, None

    def read():
        mask = keys_seen >= 0
        rows = mask_rows(mask)
        if any(count != mask.shape[1] for count in rows.count):
            return mask, None
        return mask, documents_from_positions(keys_seen, *mask.shape)

    return per_tensor(keys_seen, "_tvmflash_real_and_documents", None, read)


def _checks_key(q, k, v, mask, softmax_scale, causal, window_size, softcap) -> tuple | None:
    """What ``attention``'s checks read, for plain CPU tensors and a bool CPU mask in eager mode
    (no head dim to pad, rows read in place: memoized only then), else None."""
    if torch.compiler.is_compiling() or type(mask) is not torch.Tensor or mask.dtype != torch.bool or not mask.is_cpu:
        return None
    key = torch_op._call_key(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, False, False)
    return None if key is None or not q.is_cpu else key + (mask.shape,)


def written_keys(mask: torch.Tensor, len_q: int) -> torch.Tensor:
    """``mask`` without its trailing columns that hold no real key in any row, where it is
    longer than the ``len_q`` queries (a static cache's empty slots; at least len_q columns
    stay); the same view for each call on one mask tensor (what it says is cached on it)."""
    if len_q >= mask.shape[1]:
        return mask

    def cut():
        rows = mask_rows(mask)
        n = max(rows.written, len_q)
        if n == mask.shape[1]:
            return mask
        view = mask[:, :n]
        per_tensor(view, "_tvmflash_rows", None, lambda: rows)  # (the same rows: the cut columns hold none)
        return view

    return per_tensor(mask, "_tvmflash_written", len_q, cut)


def _layout(q, k, v, keys_seen, softmax_scale: float, window_left: int, window_right: int, softcap: float
            ) -> _Layout:
    """The ``_Layout`` of a call, found once per ``keys_seen`` tensor and checked call (tensors'
    shapes, strides and dtypes, options): a model's layers share their mask, and the forward's
    layout serves its backward (~50 us each where the model's products evicted the caches)."""
    key = torch_op._call_key(q, k, v, 0.0, softmax_scale, False, (window_left, window_right), softcap, False, False)
    if key is None:
        return _Layout(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap)
    found = per_tensor(keys_seen, "_tvmflash_layouts", torch_op.calls_generation, dict)
    layout = found.get(key)
    if layout is None:
        layout = found[key] = _Layout(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap)
    return layout


# --- the layers' repeated training calls ------------------------------------------------------------
# A model's layers call attention with one mask per forward; after the first layer's checked call,
# the others repeat it (``repeated_heads_first_training``).
class _Repeat(NamedTuple):
    """A checked training call's row runs and blind rows on its mask (kept on the mask, no
    reference to it), and the op's scalars (its backward's, where the repeat's cannot run)."""

    call: torch_op._ForwardCall
    blind: UniformRows | None
    scalars: tuple

    def backward_op(self, dout, q, k, v, out, lse, mask):
        """The padded backward op (``torch_op.launched_training``'s fallback)."""
        return _padded_ops.backward(dout, q, k, v, out, lse, mask, *self.scalars)


class _SinksRepeat(NamedTuple):
    """``_Repeat`` of a call with sinks: the checked calls of its forward (float32 out where q is
    16-bit: ``_Layout.forward_call``) and backward; whether some query rows are padding (the
    mask then says which are real); the op's scalars."""

    calls: tuple[torch_op._ForwardCall, torch_op._ForwardCall]
    padding: bool
    scalars: tuple

    def backward_op(self, dout, q, k, v, out, lse, sinks, mask):
        """The padded backward op with sinks (``sinks.repeated_training``'s fallback)."""
        return _sink_ops.backward(dout, q, k, v, out, lse, sinks, mask, *self.scalars)


def _remember_repeat(mask: torch.Tensor, options: tuple, q, k, v, scalars: tuple, sinks: bool) -> None:
    """Keep on ``mask`` what a call with these ``options`` (as the caller gave them; with
    ``sinks`` or without) repeats, where the op's forward read the mask's rows in place and its
    kernels add the blind rows' terms."""
    generation = torch_op.calls_generation
    layout = (remembered(mask, "_tvmflash_layouts", generation) or {}).get(
        torch_op._call_key(q, k, v, 0.0, scalars[0], False, scalars[1:3], scalars[3], False, False))
    if layout is None or not layout.kernels_add_blind:
        return
    repeats = per_tensor(mask, "_tvmflash_repeats", generation, dict)
    if sinks:  # (the blind rows are padding rows there, whose out' is 0: the kernels add nothing to them)
        calls = (layout.forward_call(q, k, v, scalars, fp32_results=True), layout.call)
        repeats[options, "sinks"] = _SinksRepeat(calls, _real_queries(mask, q.shape[1]) is not None, scalars)
    else:
        repeats[options] = _Repeat(layout.call, layout.blind, scalars)


def repeated_heads_first_training(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                                  softmax_scale: float | None, causal: bool, window_size: tuple[int, int],
                                  softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """``attention``'s out for a training call on a ``mask`` that a call with these options (and
    ``sinks`` or none) ran on before (the model's first layer), q, k, v in transformers' ``(batch,
    heads, n, head_dim)`` layout, read in place by the checked call's C launches
    (``torch_op.repeated_heads_first_training`` for calls without a mask); None where no such
    call's launch takes them, for a call that records no gradient, or under a mode, transform or
    forward-mode AD."""
    options = torch_op.options_key(softmax_scale, causal, window_size, softcap)
    repeats = remembered(mask, "_tvmflash_repeats", torch_op.calls_generation) or {}
    repeat = repeats.get(options) if sinks is None else repeats.get((options, "sinks"))
    if repeat is None or not torch_op.repeat_records(q, k, v):
        return None
    if sinks is None:
        return torch_op.launched_training(repeat.call, repeat.blind, repeat.backward_op, (mask,), q, k, v,
                                          heads_first=True)
    sinks_module.check(sinks, q.shape[1], q.device)
    if type(sinks) not in (torch.Tensor, torch.nn.Parameter):  # (a subclass: the op, which modes see)
        return None
    launches = repeat.calls[0].heads_first_launches(q, k, v, backward=repeat.calls[1])
    if launches is None or not launches[0].accepts(q, k, v):
        return None
    # (the mask is the real query rows: training calls have as many queries as keys)
    return sinks_module.repeated_training(repeat.calls, launches, mask if repeat.padding else None,
                                          repeat.backward_op, (mask,), q, k, v, sinks)


class _Layout:
    """What the op's forward and backward bodies read from the mask (``written_keys``) or the
    documents (``_real_and_documents``): the row runs (or None), the blind rows, the kernels'
    checked call on the runs (or None: the varlen path, ``plan``); the mask's n keys, and
    whether the kernels add the blind rows' terms (no empty slots) or the torch ops over all keys
    (``uniform_rows``). It holds no reference to the mask (it is kept on the mask: ``_layout``)."""

    __slots__ = ("n", "runs", "blind", "call", "window_over_holes", "plan", "kernels_add_blind", "_fp32_call")

    def __init__(self, q, k, v, keys_seen, softmax_scale: float, window_left: int, window_right: int,
                 softcap: float):
        len_q = q.shape[1]
        mask, documents = _real_and_documents(keys_seen)
        mask = written_keys(mask, len_q)
        self.n = n = mask.shape[1]
        runs = mask_rows(mask).runs if documents is None else None
        self.runs = None if runs is None else tuple((b, first, end) for b, (first, end) in enumerate(runs))
        self.blind = blind_rows(mask, len_q, window_left, window_right)
        # (a window over holes counts positions in the row, which packed sequences would not: flex, in place;
        # one within documents counts positions in the document, as the varlen kernels do)
        self.window_over_holes = (self.runs is None and documents is None
                                  and (window_left, window_right) not in ((-1, -1), (-1, 0)))
        self.call = self.plan = self._fp32_call = None
        if self.runs is not None and len_q == n:
            self.call = torch_op.row_runs_call(q, *self.keys(k, v), self.runs, softmax_scale=softmax_scale,
                                               causal=False, window_size=(window_left, window_right), softcap=softcap)
        if documents is not None:
            self.plan = per_tensor(keys_seen, "_tvmflash_documents_plan", None, lambda: Unpad.documents(mask, documents))
        elif self.call is None and not self.window_over_holes:
            self.plan = unpad_plan(mask, len_q)
        self.kernels_add_blind = self.call is not None and k.shape[1] == n

    def keys(self, k, v) -> tuple:
        """k and v cut to the mask's keys (views)."""
        n = self.n
        return (k, v) if k.shape[1] == n else (k[:, :n], v[:, :n])

    def forward_call(self, q, k, v, scalars: tuple, fp32_results: bool) -> torch_op._ForwardCall:
        """``call``, or with ``fp32_results`` its twin whose out is float32 (made at its first use)."""
        if not fp32_results or q.dtype == torch.float32:
            return self.call
        if self._fp32_call is None:
            softmax_scale, window_left, window_right, softcap = scalars
            self._fp32_call = torch_op.row_runs_call(q, *self.keys(k, v), self.runs, softmax_scale=softmax_scale,
                                                     causal=False, window_size=(window_left, window_right),
                                                     softcap=softcap, fp32_results=True)
        return self._fp32_call


def _written_mask(keys_seen: torch.Tensor, len_q: int) -> torch.Tensor:
    """The bool mask of ``keys_seen`` without its trailing columns that hold no real key
    (``written_keys``), as ``_Layout`` reads it."""
    return written_keys(_real_and_documents(keys_seen)[0], len_q)


def _flex_inputs(q, k, v, mask, softmax_scale: float, window_left: int, window_right: int, softcap: float) -> tuple:
    """(q, k, v: cut to the written ``mask``'s keys) as flex_attention's (batch, heads, n,
    head_dim) views, and its other arguments: the mask and the window as a block mask (one per
    mask tensor), softcap as a score_mod."""
    len_q = q.shape[1]
    blocks = per_tensor(mask, "_tvmflash_window_blocks", (len_q, window_left, window_right),
                      lambda: _window_block_mask(mask, len_q, window_left, window_right))
    views = tuple(t.transpose(1, 2) for t in (q, k, v))
    return views, {"score_mod": _softcap_mod(softcap, q.device.type) if softcap else None, "block_mask": blocks,
                   "scale": softmax_scale, "enable_gqa": q.shape[2] != k.shape[2]}


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float, device: str) -> flex_trace.TracedScoreMod:
    """softcap as flex_attention's score_mod, traced once per value (a constant of its kernels)."""
    def softcapped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    from . import flex_trace  # (TVM's IR: imported where a mod is traced)

    return flex_trace.trace_score_mod(softcapped, device=device)


def _window_block_mask(mask: torch.Tensor, len_q: int, left: int, right: int, block: int = 128):
    """flex_attention's block mask for a window (flash-attn's (left, right), -1: unbounded) over a
    padding mask, counted in positions of the row (eager's), holes included: the query at
    position p (the last ``len_q`` of the mask's n) sees the real keys j with -right <= p - j <=
    left. Built from block bounds: a (query block, key block) is empty where no pair is inside
    the window or no key is real, full where every pair is and every key is real (complete
    blocks only), else partial (the mask_mod decides per score). O(batch x blocks^2): torch's
    ``create_block_mask`` evaluates the mask_mod on every (query, key) pair, with int64
    temporaries of that size (GBs at tens of thousands of tokens)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = mask.shape[1]
    offset = n - len_q  # (the queries' positions among the keys)
    unbounded = 2 * n + 1  # (-1: no bound)
    far_left, far_right = (left if left >= 0 else unbounded), (right if right >= 0 else unbounded)
    # Read from tensors, which the kernels take as inputs: Python numbers would be constants of the
    # traced mask_mod (a kernel compiled per offset and window), and a captured tensor's shape is
    # part of the kernels' key: the mask goes flat into a buffer of a power-of-two size, a kernel
    # per size class rather than per (batch, n).
    bounds = torch.tensor([offset, far_left, -far_right, n], dtype=torch.int32, device=mask.device)
    flat = mask.new_zeros(max(1024, 1 << (mask.numel() - 1).bit_length()))
    flat[:mask.numel()] = mask.reshape(-1)

    def window_over_mask(b, h, q_idx, kv_idx):
        distance = q_idx + bounds[0] - kv_idx
        return flat[b * bounds[3] + kv_idx] & (distance <= bounds[1]) & (distance >= bounds[2])

    # traced here, once per mask: it reads nothing but the tensors it holds (flex_attention
    # would ask dynamo on each call whether what it reads has changed, also inside compiled graphs)
    from . import flex_trace

    mask_mod = flex_trace.trace_mask_mod(window_over_mask, device=mask.device.type)

    device = mask.device
    seen = torch.nn.functional.pad(mask.cumsum(1, dtype=torch.int32), (1, 0))  # seen[:, i]: real keys before i
    k_first = torch.arange(0, n, block, device=device)
    k_last = (k_first + block).clamp_max(n) - 1
    real = seen[:, k_last + 1] - seen[:, k_first]  # (batch, key blocks)
    q_starts = torch.arange(0, len_q, block, device=device)
    p_first, p_last = q_starts + offset, (q_starts + block).clamp_max(len_q) - 1 + offset  # positions
    p_first, p_last = p_first[:, None], p_last[:, None]
    some = (p_last - k_first >= -far_right) & (p_first - k_last <= far_left)  # (some distance p - j in the window)
    every = (p_first - k_last >= -far_right) & (p_last - k_first <= far_left)
    whole = (p_last - p_first + 1 == block) & (k_last - k_first + 1 == block)  # (as torch's: the last blocks partial)
    full = every & whole & (real == block)[:, None, :]  # (batch, query blocks, key blocks)
    partial = some & (real > 0)[:, None, :] & ~full

    def listed(blocks: torch.Tensor):  # (counts, indices of the marked key blocks first), with a heads dim
        order = torch.argsort((~blocks).to(torch.uint8), dim=-1, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    # (no query-side blocks: tvmflash's flex reads the key side only)
    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(len_q, n), compute_q_blocks=False)


def _packed_lse(lse: torch.Tensor, plan: Unpad) -> torch.Tensor:
    """(batch, heads, n) row statistics at the real queries, as the varlen kernels' (heads, tokens)."""
    return lse.transpose(1, 2)[plan.query_index].T.contiguous()


def _padded_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_seen: torch.Tensor,
                         softmax_scale: float, window_left: int, window_right: int, softcap: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's body: out like q, lse (batch, heads, n), 0 at padding rows (but the
    blind rows' out: the mean of v). ``keys_seen``: the bool mask, or the positions with -1 at
    padding (``_positions_of_real_tokens``)."""
    return _padded_forward(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap, fp32_results=False)


def _padded_forward_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_seen: torch.Tensor,
                         softmax_scale: float, window_left: int, window_right: int, softcap: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_padded_forward_impl`` with out in float32 (for a caller that scales it, then rounds it
    once: ``sinks.py``)."""
    return _padded_forward(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap, fp32_results=True)


def _padded_forward(q, k, v, keys_seen, softmax_scale: float, window_left: int, window_right: int, softcap: float, *,
                    fp32_results: bool) -> tuple[torch.Tensor, torch.Tensor]:
    layout = _layout(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap)
    blind, (k_cut, v_cut) = layout.blind, layout.keys(k, v)
    if layout.call is not None:
        call = layout.forward_call(q, k, v, (softmax_scale, window_left, window_right, softcap), fp32_results)
        out, lse = torch_op.row_runs_forward(call, blind if layout.kernels_add_blind else None, q, k_cut, v_cut)
    elif layout.window_over_holes:
        mask = _written_mask(keys_seen, q.shape[1])
        with torch_op.eager_dispatch():  # (the mask_mod's trace, once per mask: make_fx, in a compiled graph too)
            views, options = _flex_inputs(q, k_cut, v_cut, mask, softmax_scale, window_left, window_right, softcap)
            out, lse = flex_attention_forward(*views, fp32_results=fp32_results, **options)
        out = out.transpose(1, 2).contiguous()
        out.masked_fill_(~mask[:, -q.shape[1]:, None, None], 0)  # (padding rows: 0, as on the other paths)
    else:
        plan, (batch, len_q, heads, _) = layout.plan, q.shape
        keys = k_cut[plan.key_index], v_cut[plan.key_index]
        out_real, lse_real = torch_op._forward_impl(q[plan.query_index], *keys, plan.cu_q, plan.cu_k, None,
                                                    softmax_scale, window_left, window_right, softcap, False,
                                                    fp32_results, None)
        out = out_real.new_zeros(q.shape).index_put_(plan.query_index, out_real)
        lse = lse_real.new_zeros(batch, len_q, heads).index_put_(plan.query_index, lse_real.T).transpose(1, 2)
        lse = lse.contiguous()
    if blind is not None and not layout.kernels_add_blind:  # (their rows of out hold 0)
        uniform_rows.add_means(out[:, blind.first:blind.end], v, blind)
    return out, lse


def _padded_forward_fake(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap):
    batch, n, heads, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((batch, heads, n), dtype=torch.float32)


def _padded_backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, keys_seen: torch.Tensor, softmax_scale: float, window_left: int,
                          window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``_padded_forward_impl`` (the same choice of path, made again from
    ``keys_seen``)."""
    layout = _layout(q, k, v, keys_seen, softmax_scale, window_left, window_right, softcap)
    blind, n, (k_cut, v_cut) = layout.blind, layout.n, layout.keys(k, v)
    if layout.call is not None:
        dq, dk, dv = torch_op.row_runs_backward(layout.call, blind if layout.kernels_add_blind else None, dout, q,
                                                k_cut, v_cut, out, lse)
    elif layout.window_over_holes:
        mask = _written_mask(keys_seen, q.shape[1])
        real_dout = dout.masked_fill(~mask[:, -q.shape[1]:, None, None], 0)  # (out is 0 there)
        with torch_op.eager_dispatch():
            views, options = _flex_inputs(q, k_cut, v_cut, mask, softmax_scale, window_left, window_right, softcap)
            grads = flex_attention_backward(real_dout.transpose(1, 2), *views, out.transpose(1, 2), lse, **options)
        dq, dk, dv = (g.transpose(1, 2).contiguous() for g in grads)
    else:
        plan, queries, keys = layout.plan, layout.plan.query_index, layout.plan.key_index
        grads = torch_op._backward_impl(dout[queries], q[queries], k_cut[keys], v_cut[keys], out[queries],
                                        _packed_lse(lse, plan), plan.cu_q, plan.cu_k, None, softmax_scale, window_left,
                                        window_right, softcap, False, False, None)
        dq, dk, dv = (t.new_zeros(t.shape).index_put_(index, g)
                      for t, index, g in zip((q, k_cut, v_cut), (queries, keys, keys), grads))
    if k.shape[1] > n:  # (the empty slots: no gradient but the blind rows')
        dk, dv = (torch.nn.functional.pad(g, (0, 0, 0, 0, 0, k.shape[1] - n)) for g in (dk, dv))
    if blind is not None and not layout.kernels_add_blind:  # (their rows of dq hold 0; fp32 sums, one rounding)
        uniform_rows.add_gradients(dq, dk, dv, q, k, v, dout[:, blind.first:blind.end], blind, softmax_scale, softcap)
    return dq, dk, dv


def _padded_backward_fake(dout, q, k, v, out, lse, keys_seen, softmax_scale, window_left, window_right, softcap):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


# the padded batch's forward op, differentiated by its backward op from the saved mask (or positions)
_padded_ops = torch_op.OpPair("flash_attn_padded", _padded_forward_impl, _padded_forward_fake, _padded_backward_impl,
                              _padded_backward_fake)


def _real_queries(keys_seen: torch.Tensor, len_q: int) -> torch.Tensor | None:
    """(batch, len_q) bool: the query rows that are real tokens (the last len_q of the written
    mask's), or None where all are (what the mask says is kept on it: ``mask_rows``)."""
    mask = _written_mask(keys_seen, len_q)
    if all(count == mask.shape[1] for count in mask_rows(mask).count):
        return None
    return mask[:, -len_q:]


# the same with attention sinks (sinks.py): over the padded op's bodies
_sink_ops = sinks_module.SinkOps("flash_attn_padded_sinks", _padded_forward_fp32, _padded_backward_impl,
                                 _real_queries)
