"""Attention over rows that may hold several documents, told apart by ``position_ids``.

Training often packs documents into the rows of a batch; transformers tells them apart by their
``position_ids``: a document starts at the start of a row and wherever a position is not the
previous one plus 1. Eager calls find the documents (once per ``position_ids`` tensor) and run
``flash_attn_func`` on the rows or ``flash_attn_varlen_func`` on the documents. Under
``torch.compile`` that choice reads the positions' values, which breaks the graph around every
layer's attention (six graph breaks a layer, and recompiles on the cache attributes). There the
call is one op, ``tvmflash::flash_attn_documents_forward``, whose body makes the choice when the
graph runs; its shapes do not depend on it.
"""

from __future__ import annotations

import torch

from . import checks, torch_op


def documents_from_positions(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens (int32) of the documents packed in the rows, or None if every row is one sequence.

    transformers' rule (``find_packed_sequence_indices``): a document starts at the start of a
    row and wherever a position is not the previous one plus 1. Found once per tensor and
    version (the layers of a model get the same ``position_ids``)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != length or length < 2:
        return None
    if position_ids.shape[0] not in (1, batch):
        return None
    # inference tensors have no version counter to tell an in-place change: computed per call
    stamp = None if position_ids.is_inference() else (position_ids._version, batch)
    cached = getattr(position_ids, "_tvmflash_documents", None)
    if stamp is not None and cached is not None and cached[0] == stamp:
        return cached[1]
    positions = position_ids.expand(batch, -1)
    starts = torch.ones(batch, length, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    cu = None
    if bool(starts[:, 1:].any()):
        first = starts.flatten().nonzero().flatten().to(torch.int32)
        cu = torch.cat([first, first.new_tensor([batch * length])])
    if stamp is not None:
        try:
            position_ids._tvmflash_documents = (stamp, cu)
        except (AttributeError, RuntimeError):
            pass
    return cu


def rows_as_documents(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, **options) -> torch.Tensor:
    """``flash_attn_varlen_func`` on the rows of (batch, seqlen, heads, head_dim) tensors
    flattened into one token stream, cut into sequences by ``cu_q`` / ``cu_k``; the output
    in the rows' shape."""
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
        return rows_as_documents(q, k, v, cu, cu, **options)
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
