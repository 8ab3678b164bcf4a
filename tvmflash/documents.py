"""Attention over rows that may hold several documents, told apart by ``position_ids``.

Training often packs documents into the rows of a batch; transformers tells them apart by their
``position_ids``: a document starts at the start of a row and wherever a position is not the
previous one plus 1. Eager calls find the documents (once per ``position_ids`` tensor) and run
``flash_attn_func`` on the rows, or read each document in place as a run of its row
(``torch_op.row_runs_call``; ``flash_attn_varlen_func`` on packed copies where those kernels do
not apply); a training forward's later layers repeat its first layer's call in transformers'
layout (``repeated_heads_first_training``). Under
``torch.compile`` that choice reads the positions' values, which breaks the graph around every
layer's attention (six graph breaks a layer, and recompiles on the cache attributes). There the
call is one op, ``tvmflash::flash_attn_documents_forward``, whose body makes the choice when the
graph runs; its shapes do not depend on it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd import forward_ad

from . import checks, launch, torch_op
from .tensor_memo import per_tensor, remembered


def documents_from_positions(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens (int32) of the documents packed in the rows, or None if every row is one sequence.

    transformers' rule (``find_packed_sequence_indices``): a document starts at the start of a
    row and wherever a position is not the previous one plus 1. Found once per tensor and
    version (the layers of a model get the same ``position_ids``)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != length or length < 2:
        return None
    if position_ids.shape[0] not in (1, batch):
        return None
    return per_tensor(position_ids, "_tvmflash_documents", batch, lambda: _documents(position_ids, batch, length))


def _documents(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    positions = position_ids.expand(batch, -1)
    starts = torch.ones(batch, length, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    first = starts.flatten().nonzero().flatten().to(torch.int32)
    return torch.cat([first, first.new_tensor([batch * length])])


def rows_as_documents(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, holder: torch.Tensor | None = None,
                      **options) -> torch.Tensor:
    """Attention within the sequences ``cu_q`` / ``cu_k`` cut from the rows of (batch, seqlen,
    heads, head_dim) tensors flattened into one token stream; the output in the rows' shape.
    Queries and keys of the same documents, none across rows: each read in place as a run of its
    row (``_in_rows``; what it finds kept on ``holder``, default ``cu_q``), else
    ``flash_attn_varlen_func`` on the packed rows."""
    if q.shape[1] == k.shape[1] and (cu_q is cu_k or cu_q.shape == cu_k.shape and torch.equal(cu_q, cu_k)):
        out = _in_rows(q, k, v, cu_q if holder is None else holder, cu_q, {**_DEFAULT_OPTIONS, **options})
        if out is not None:
            return out
    batch, len_q, heads, head_dim = q.shape
    len_k = k.shape[1]
    max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    out = torch_op.flash_attn_varlen_func(q.reshape(batch * len_q, heads, head_dim),
                                          k.reshape(batch * len_k, *k.shape[2:]),
                                          v.reshape(batch * len_k, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **options)
    return out.view(batch, len_q, heads, out.shape[-1])


def attention(q, k, v, position_ids: torch.Tensor | None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0) -> torch.Tensor:
    """``flash_attn_func`` on (batch, seqlen, heads, head_dim) q, k, v of the same tokens, each
    document of a row (``documents_from_positions``) attending within itself."""
    options = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    if not torch.compiler.is_compiling():
        cu = documents_from_positions(position_ids, q.shape[0], q.shape[1])
        if cu is None:
            return torch_op.flash_attn_func(q, k, v, **options)
        return rows_as_documents(q, k, v, cu, cu, position_ids, **options)
    if position_ids is None:
        return torch_op.flash_attn_func(q, k, v, **options)
    # torch.compile: the checks read shapes only; the op finds the documents when it runs
    head_dim = q.shape[-1]
    flash = checks.flash_options(head_dim, **options)
    q, k, v = torch_op._padded_head_dims(q, k, v)  # (before the checks, which take the kernels' head dims)
    checks.check_qkv(*(checks.info(t, name) for name, t in zip("qkv", (q, k, v))))
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"documents by position_ids need queries and keys of the same tokens, got {q.shape[1]} "
                         f"queries and {k.shape[1]} keys")
    q, k, v = (torch_op.kernel_layout(t) for t in (q, k, v))
    out, _, _ = _DocumentsAttention.apply(q, k, v, position_ids, flash.softmax_scale, *flash.window, flash.softcap)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]  # (a view: one autograd node more)


# --- documents read in place, as runs of their rows -------------------------------------------------
class _InRows(NamedTuple):
    """Documents read in place as runs of their rows: the checked call (``torch_op.row_runs_call``),
    and the documents' op table and the op's scalars for the backward op (its fallback)."""

    call: torch_op._ForwardCall
    table: torch.Tensor
    scalars: tuple

    def backward_op(self, dout, q, k, v, out, lse, table):
        """The documents' backward op (``torch_op.launched_training``'s fallback)."""
        return _documents_backward(dout, q, k, v, out, lse, table, *self.scalars)


def _in_rows(q, k, v, holder: torch.Tensor, cu: torch.Tensor, options: dict) -> torch.Tensor | None:
    """The documents' attention with q, k, v read in place, each document a run of its row
    (``torch_op.row_runs_call``: no packed copies, and after a model's first layer no checks),
    or None where that does not apply: documents across rows or cu_seqlens out of order, other
    tensors (CUDA, a head dim the kernels pad), an autocast region of another dtype, a mode,
    transform or forward-mode AD (the varlen path then names or handles them). The runs and the
    call are kept on ``holder`` (the position_ids or cu_seqlens the layers share), the call for
    the next layers' calls in transformers' layout (``repeated_heads_first_training``)."""
    if (not q.is_cpu or forward_ad._current_level >= 0 or k.shape[1] != q.shape[1] or torch.is_autocast_enabled("cpu")
            and any(t.dtype != torch.get_autocast_dtype("cpu") for t in (q, k, v))):
        return None
    state = launch.eager_state(torch_op._NO_MODES, q, k, v)
    if state == 2:
        return None
    batch, length = q.shape[:2]
    runs = per_tensor(holder, "_tvmflash_document_runs", batch, lambda: _runs(cu, batch, length))
    call = None if runs is None else torch_op.row_runs_call(q, k, v, runs, **options)
    if call is None:
        return None
    if state == 0:  # (no gradient to record)
        return call(q, k, v)
    kept = per_tensor(holder, "_tvmflash_in_rows", (batch, torch_op.calls_generation), dict)
    key = torch_op.options_key(**options)
    in_rows = kept.get(key)
    if in_rows is None or in_rows.call is not call:
        in_rows = kept[key] = _InRows(call, _documents_table(cu, batch * length, cu.device),
                                      (call.scale, *call.window, call.softcap))
    return torch_op.launched_training(call, None, in_rows.backward_op, (in_rows.table,), q, k, v)


_DEFAULT_OPTIONS = {"softmax_scale": None, "causal": False, "window_size": (-1, -1), "softcap": 0.0}


def _runs(cu: torch.Tensor, batch: int, length: int) -> tuple | None:
    """The documents of cu_seqlens over ``batch`` rows of ``length`` tokens as (row, start, end)
    runs, or None where they are not runs of rows (one across rows, or bounds out of order)."""
    bounds = cu.tolist()
    if (not bounds or bounds[0] != 0 or bounds[-1] != batch * length or any(b < a for a, b in zip(bounds, bounds[1:]))
            or not set(range(0, batch * length, length)) <= set(bounds)):
        return None
    return tuple((a // length, a % length, a % length + b - a) for a, b in zip(bounds, bounds[1:]) if b > a)


def repeated_heads_first_training(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                                  softmax_scale: float | None, causal: bool, window_size: tuple[int, int],
                                  softcap: float) -> torch.Tensor | None:
    """``attention``'s out for a training call whose ``position_ids`` a call with these options
    read in place before (the model's first layer), q, k, v in transformers' ``(batch, heads, n,
    head_dim)`` layout, read by the call's C launches (``torch_op.launched_training``); None
    where no such call's launch takes them, or under a mode, transform or forward-mode AD."""
    found = remembered(position_ids, "_tvmflash_in_rows", (q.shape[0], torch_op.calls_generation))
    in_rows = None if found is None else found.get(torch_op.options_key(softmax_scale, causal, window_size, softcap))
    if in_rows is None or not torch_op.repeat_records(q, k, v):
        return None
    return torch_op.launched_training(in_rows.call, None, in_rows.backward_op, (in_rows.table,), q, k, v,
                                      heads_first=True)


def _packed(*tensors):
    """(batch, seqlen, ...) tensors as packed (batch * seqlen, ...) ones."""
    return tuple(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in tensors)


def _documents_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                       softmax_scale: float, window_left: int, window_right: int, softcap: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward op's body on the rows, or on the documents packed: out like q, lse (batch,
    heads, seqlen) either way, and the documents found (``_documents_table``) for the backward
    (inductor's graphs recompute position_ids there rather than save them: a new tensor, whose
    documents would be found again)."""
    batch, length, heads, _ = q.shape
    options = (None, softmax_scale, window_left, window_right, softcap, False, False, None)
    cu = documents_from_positions(position_ids, batch, length)
    table = _documents_table(cu, batch * length, position_ids.device)
    if cu is None:
        return *torch_op._forward_impl(q, k, v, None, None, *options), table
    out, lse = torch_op._forward_impl(*_packed(q, k, v), cu, cu, *options)
    return out.view(q.shape), lse.view(heads, batch, length).transpose(0, 1).contiguous(), table


def _documents_table(cu: torch.Tensor | None, tokens: int, device: torch.device) -> torch.Tensor:
    """The documents as a tensor of a fixed shape (tokens + 2,) on ``device`` (the backward's
    cu_seqlens are a view of it, on the device the forward's were): their count, then their
    cu_seqlens, then zeros."""
    table = torch.zeros(tokens + 2, dtype=torch.int32, device=device)
    if cu is not None:
        table[0] = cu.numel() - 1
        table[1:cu.numel() + 1] = cu
    return table


def _cu_seqlens(table: torch.Tensor) -> torch.Tensor | None:
    count = int(table[0])
    return None if count == 0 else table[1:count + 2]


def _documents_forward_fake(q, k, v, position_ids, softmax_scale, window_left, window_right, softcap):
    batch, length, heads, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q.new_empty((batch, heads, length), dtype=torch.float32),
            torch.empty(batch * length + 2, dtype=torch.int32, device=position_ids.device))


_documents_forward = torch_op.define_op("flash_attn_documents_forward", _documents_forward_impl,
                                        _documents_forward_fake)


def _documents_backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, documents: torch.Tensor, softmax_scale: float, window_left: int,
                        window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``_documents_forward``: the backward op's body on the rows or the documents
    (``documents``: the forward's table)."""
    batch, length, heads, _ = q.shape
    options = (None, softmax_scale, window_left, window_right, softcap, False, False, None)
    cu = _cu_seqlens(documents)
    if cu is None:
        return torch_op._backward_impl(dout, q, k, v, out, lse, None, None, *options)
    packed_lse = lse.transpose(0, 1).reshape(heads, batch * length)
    grads = torch_op._backward_impl(*_packed(dout, q, k, v, out), packed_lse, cu, cu, *options)
    return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v)))


def _documents_backward_fake(dout, q, k, v, out, lse, documents, softmax_scale, window_left, window_right, softcap):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


_documents_backward = torch_op.define_op("flash_attn_documents_backward", _documents_backward_impl,
                                         _documents_backward_fake)


# (the documents' forward op, differentiated by their backward op from the documents it found)
_DocumentsAttention = torch_op.differentiable_pair(_documents_forward, _documents_backward, "_DocumentsAttention")
