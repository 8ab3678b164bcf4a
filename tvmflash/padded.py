"""Attention over the real tokens of a padded batch, and what a padding mask says about it.

A ``(batch, n)`` key-padding mask (True: a real token) is what tokenizers and transformers'
flash-attention masks give. What it means for the kernels, found once per mask tensor
(``per_mask``; a model's layers share their mask):

* ``row_runs``: each row's real tokens as one run (left or right padding), which the kernels
  read in place as their sequence table; else the mask has holes (pad tokens inside a row);
* ``unpad_plan``: the gather indices and cu_seqlens of ``flash_attn_varlen_func`` on the real
  tokens (holes, or tensors the in-place kernels do not take);
* ``blind_rows``: the query rows whose every key the mask hides, which transformers' ``eager``
  gives the mean of v (``uniform_rows.py``).

Eager calls choose a path from these (``integrations/transformers.py``). Under ``torch.compile``
that choice reads the mask's values, which breaks the graph around every layer's attention
(27 breaks for an 8-layer Llama). There the call is one op, ``tvmflash::flash_attn_padded_forward``
(``attention``), whose body makes the choice when the graph runs; its backward op makes it again
from the saved mask. Its shapes do not depend on the mask.
"""

from __future__ import annotations

import torch

from . import checks, torch_op, uniform_rows
from .uniform_rows import UniformRows


# --- what a mask says ----------------------------------------------------------------------------
def per_mask(mask: torch.Tensor, name: str, key, build):
    """``build()``, computed once per mask tensor and ``key`` (kept on the tensor as ``name``).

    A model builds its masks once per forward and hands the same tensor to every layer of a
    kind, so the indices (and the device sync for the lengths) are found once, not per layer.
    """
    if mask.is_inference():  # no version counter to tell an in-place change: computed per call
        return build()
    stamp = (mask._version, key)
    cached = getattr(mask, name, None)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    found = build()
    try:
        setattr(mask, name, (stamp, found))
    except (AttributeError, RuntimeError):  # tensor subclasses that refuse attributes
        pass
    return found


def row_runs(mask: torch.Tensor) -> tuple | None:
    """Each row's (first, end) real key where every row's real keys are one run (left or right
    padding: what tokenizers make), else None (holes: pad tokens inside a sequence)."""
    n = mask.shape[1]
    lengths = mask.sum(dim=1)
    first = mask.to(torch.uint8).argmax(dim=1) * (lengths > 0)
    positions = torch.arange(n, device=mask.device)[None, :]
    run = (positions >= first[:, None]) & (positions < (first + lengths)[:, None])
    if not torch.equal(run, mask.bool()):
        return None
    return tuple((start, start + length) for start, length in zip(first.tolist(), lengths.tolist()))


class Unpad:
    """Where the real tokens of a padded batch are, and their sequences' boundaries."""

    __slots__ = ("key_index", "cu_k", "max_k", "query_index", "cu_q", "max_q", "_key_table")

    def __init__(self, key_mask: torch.Tensor, len_q: int):
        self.key_index, self.cu_k, self.max_k = _nonzero_and_cu(key_mask)
        # The queries are the last len_q keys (transformers' flash-attention convention).
        self.query_index, self.cu_q, self.max_q = _nonzero_and_cu(key_mask[:, -len_q:])
        self._key_table = None

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
    return per_mask(mask, "_tvmflash_unpad", len_q, lambda: Unpad(mask, len_q))


def blind_rows(mask: torch.Tensor, len_q: int, causal: bool, window: int | None) -> UniformRows | None:
    """The query rows (the last ``len_q`` of the mask's positions) for which transformers' mask
    hides every key, as ``UniformRows``, or None; found once per mask tensor and kind of layer.
    ``window``: transformers' sliding window (causal: keys p - w < j <= p; else |p - j| <= w).

    Such rows (padding queries before a row's first token: left padding) are where transformers'
    ``eager`` adds its most negative number to every score: the softmax is then uniform over all
    the layer's keys, and ``eager`` returns the mean of v. Padding queries at these positions
    predict the first real token, so a causal-LM loss sees them.
    """
    w = int(window) if window and window > 0 else None
    found = per_mask(mask, "_tvmflash_blind_rows", None, dict)
    if (len_q, causal, w) not in found:
        n = mask.shape[1]
        seen = torch.nn.functional.pad(mask.cumsum(1, dtype=torch.int32), (1, 0))  # seen[:, i]: real keys before i
        pos = torch.arange(n - len_q, n, device=mask.device)  # the queries' positions among the keys
        if causal:  # keys pos - w < j <= pos
            lo, hi = ((pos + 1 - w).clamp_min(0) if w else torch.zeros_like(pos)), pos + 1
        elif w:  # |pos - j| <= w
            lo, hi = (pos - w).clamp_min(0), (pos + w + 1).clamp_max(n)
        else:
            lo, hi = torch.zeros_like(pos), torch.full_like(pos, n)
        blind = (seen[:, hi] - seen[:, lo]) == 0
        found[(len_q, causal, w)] = UniformRows.at(*blind.nonzero(as_tuple=True), mask.shape[0])
    return found[(len_q, causal, w)]


# --- one op over the mask (torch.compile) ----------------------------------------------------------
def attention(q, k, v, mask: torch.Tensor, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0) -> torch.Tensor:
    """Attention over the real tokens of a padded batch: (batch, len_q, heads, head_dim) q, k and
    v (batch, n_k, heads_kv, head_dim), ``mask`` (batch, n) True at real keys, len_q <= n <= n_k.
    The queries are the last len_q of the mask's n positions (transformers' flash-attention
    convention); keys after n are a static cache's empty slots, and so are the mask's trailing
    columns that no row holds a real key in, where len_q < n (a compiled decode step's mask of
    the cache's fixed length). A query sees the real keys of its row (causal: those not after
    it; a window counts positions in the row). Padding query rows get 0, except those that see
    no real key, which get ``eager``'s mean of v over all n_k keys (``blind_rows``).

    One op, whatever the mask (its values are read when the op runs): what ``torch.compile``
    traces in one graph. Rows whose real tokens are one run, queries and keys alike, are read in
    place on CPU tensors; others are gathered for the varlen kernels. A window over a mask with
    holes would count packed positions there, not positions in the row: the op refuses it when
    it runs (``integrations/transformers.py`` sends windowed layers elsewhere).
    """
    head_dim = q.shape[-1]
    flash = checks.flash_options(head_dim, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                 softcap=softcap)
    q, k, v = torch_op._padded_head_dims(q, k, v)  # (before the checks, which take the kernels' head dims)
    checks.check_qkv(*(checks.info(t, name) for name, t in zip("qkv", (q, k, v))))
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != q.shape[0]
            or not q.shape[1] <= mask.shape[1] <= k.shape[1]):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"the padding mask must be a (batch, n) tensor with batch {q.shape[0]} and {q.shape[1]} "
                         f"queries <= n <= {k.shape[1]} keys, got {shape}")
    mask = mask.to(device=q.device, dtype=torch.bool)
    q, k, v = (torch_op.kernel_layout(t) for t in (q, k, v))
    out, _ = _PaddedAttention.apply(q, k, v, mask, flash.softmax_scale, *flash.window, flash.softcap)
    return out[..., :head_dim]


def written_keys(mask: torch.Tensor, len_q: int) -> torch.Tensor:
    """``mask`` without its trailing columns that hold no real key in any row, where it is
    longer than the ``len_q`` queries (a static cache's empty slots; at least len_q columns
    stay); the same view for each call on one mask tensor (what it says is cached on it)."""
    if len_q >= mask.shape[1]:
        return mask

    def cut():
        used = mask.any(0).nonzero()
        return mask[:, :max(int(used.max()) + 1 if used.numel() else 0, len_q)]

    return per_mask(mask, "_tvmflash_written", len_q, cut)


class _Layout:
    """What the op's forward and backward bodies read from the mask (``written_keys``): the row
    runs (or None), the blind rows, the kernels' checked call on the runs (or None: the varlen
    path, ``plan``); k and v cut to the mask's keys (views), and whether the kernels add the
    blind rows' terms (no empty slots) or the torch ops over all keys (``uniform_rows``)."""

    __slots__ = ("runs", "blind", "call", "plan", "k", "v", "kernels_add_blind")

    def __init__(self, q, k, v, mask, softmax_scale: float, window_left: int, window_right: int, softcap: float):
        len_q = q.shape[1]
        mask = written_keys(mask, len_q)
        n = mask.shape[1]
        causal = window_right == 0
        window = (window_left + 1 if causal else window_left) if window_left >= 0 else None
        self.k, self.v = (k, v) if k.shape[1] == n else (k[:, :n], v[:, :n])
        self.runs = per_mask(mask, "_tvmflash_row_runs", None, lambda: row_runs(mask))
        if self.runs is None and window is not None:
            raise NotImplementedError(
                "a sliding window over a padding mask with holes (pad tokens inside a row) counts positions in the "
                "row, which the packed sequences of tvmflash's padded op would not")
        self.blind = blind_rows(mask, len_q, causal, window)
        self.call = self.plan = None
        if self.runs is not None and len_q == n:
            self.call = torch_op.row_runs_call(q, self.k, self.v, self.runs, softmax_scale=softmax_scale, causal=False,
                                               window_size=(window_left, window_right), softcap=softcap)
        if self.call is None:
            self.plan = unpad_plan(mask, len_q)
        self.kernels_add_blind = self.call is not None and k.shape[1] == n


def _packed_lse(lse: torch.Tensor, plan: Unpad) -> torch.Tensor:
    """(batch, heads, n) row statistics at the real queries, as the varlen kernels' (heads, tokens)."""
    return lse.transpose(1, 2)[plan.query_index].T.contiguous()


def _padded_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softmax_scale: float,
                         window_left: int, window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's body: out like q, lse (batch, heads, n), 0 at padding rows (but the
    blind rows' out: the mean of v)."""
    layout = _Layout(q, k, v, mask, softmax_scale, window_left, window_right, softcap)
    blind = layout.blind
    if layout.call is not None:
        out, lse = torch_op.row_runs_forward(layout.call, blind if layout.kernels_add_blind else None, q, layout.k,
                                             layout.v)
    else:
        plan, (batch, len_q, heads, _) = layout.plan, q.shape
        keys = layout.k[plan.key_index], layout.v[plan.key_index]
        out_real, lse_real = torch_op._forward_impl(q[plan.query_index], *keys, plan.cu_q, plan.cu_k, None,
                                                    softmax_scale, window_left, window_right, softcap, False, False,
                                                    None)
        out = q.new_zeros(q.shape).index_put_(plan.query_index, out_real)
        lse = lse_real.new_zeros(batch, len_q, heads).index_put_(plan.query_index, lse_real.T).transpose(1, 2)
        lse = lse.contiguous()
    if blind is not None and not layout.kernels_add_blind:  # (their rows of out hold 0)
        uniform_rows.add_means(out[:, blind.first:blind.end], v, blind)
    return out, lse


def _padded_forward_fake(q, k, v, mask, softmax_scale, window_left, window_right, softcap):
    batch, n, heads, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((batch, heads, n), dtype=torch.float32)


_padded_forward = torch_op.define_op("flash_attn_padded_forward", _padded_forward_impl, _padded_forward_fake)


def _padded_backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, mask: torch.Tensor, softmax_scale: float, window_left: int,
                          window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``_padded_forward`` (the same choice of path, made again from the mask)."""
    layout = _Layout(q, k, v, mask, softmax_scale, window_left, window_right, softcap)
    blind, n = layout.blind, layout.k.shape[1]
    if layout.call is not None:
        dq, dk, dv = torch_op.row_runs_backward(layout.call, blind if layout.kernels_add_blind else None, dout, q,
                                                layout.k, layout.v, out, lse)
    else:
        plan, queries, keys = layout.plan, layout.plan.query_index, layout.plan.key_index
        grads = torch_op._backward_impl(dout[queries], q[queries], layout.k[keys], layout.v[keys], out[queries],
                                        _packed_lse(lse, plan), plan.cu_q, plan.cu_k, None, softmax_scale, window_left,
                                        window_right, softcap, False, False, None)
        dq, dk, dv = (t.new_zeros(t.shape).index_put_(index, g)
                      for t, index, g in zip((q, layout.k, layout.v), (queries, keys, keys), grads))
    if k.shape[1] > n:  # (the empty slots: no gradient but the blind rows')
        dk, dv = (torch.nn.functional.pad(g, (0, 0, 0, 0, 0, k.shape[1] - n)) for g in (dk, dv))
    if blind is not None and not layout.kernels_add_blind:  # (their rows of dq hold 0; fp32 sums, one rounding)
        uniform_rows.add_gradients(dq, dk, dv, q, k, v, dout[:, blind.first:blind.end], blind, softmax_scale, softcap)
    return dq, dk, dv


def _padded_backward_fake(dout, q, k, v, out, lse, mask, softmax_scale, window_left, window_right, softcap):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


_padded_backward = torch_op.define_op("flash_attn_padded_backward", _padded_backward_impl, _padded_backward_fake)


# (the padded batch's forward op, differentiated by its backward op from the saved mask)
_PaddedAttention = torch_op.differentiable_pair(_padded_forward, _padded_backward, "_PaddedAttention")
