"""Query rows whose softmax is uniform over all keys: what transformers' ``eager`` computes for a
row whose every key its mask hides (left padding: the padding queries before a row's first real
token). eager adds the dtype's most negative number to every score of such a row, which absorbs
the scores: the output is the mean of v over all the layer's keys, and the backward still runs
softmax's Jacobian at that uniform P, as for attention with scores ``s - s.detach()``:
``dS_rj = (dO_r . v_j - dO_r . mean(v)) / n`` (times softcap's derivative ``1 - tanh^2``).

The rows are kept as a span of query positions with a 0/1 weight per (batch row, position):
views of q and dO, no gather, one set of batched products for the whole batch: dq and dk from
head_dim x head_dim products (through the scores themselves where those take fewer FLOPs, and
for softcap, whose derivative weighs each score). Rows the kernels read in place (the row-runs
path of ``torch_op``) take the same formulas as CPU kernels, one launch each
(``kernels/uniform_rows.py``); this torch formulation serves softcap and the other paths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class UniformRows(NamedTuple):
    """Query positions ``first .. end - 1`` of each batch row, ``weight`` (batch, end - first,
    1, 1) float32: 1 where the row's softmax is uniform, 0 where it is not (rows the kernels own)."""

    first: int
    end: int
    weight: torch.Tensor

    @classmethod
    def at(cls, batch_index: torch.Tensor, query_index: torch.Tensor, batch: int) -> UniformRows | None:
        """The span around the rows (batch_index[i], query_index[i]), or None for no rows."""
        if batch_index.numel() == 0:
            return None
        first, end = int(query_index.min()), int(query_index.max()) + 1
        weight = torch.zeros(batch, end - first, 1, 1, dtype=torch.float32, device=batch_index.device)
        weight[batch_index, query_index - first] = 1.0
        return cls(first, end, weight)


def add_means(out_span: torch.Tensor, v: torch.Tensor, rows: UniformRows) -> None:
    """``out_span`` (the output's rows first .. end - 1) += at the uniform rows the mean of v
    over all keys (per query head: GQA's v head of its group). Those rows must hold 0 (the
    kernels leave rows outside their runs at 0)."""
    mean = v.mean(dim=1, dtype=torch.float32)  # (batch, heads_kv, head_dim)
    # (fp32 products, rounded once; GQA's groups as a view: two ops in all, their cost is per op)
    _grouped(out_span, v.shape[2]).addcmul_(rows.weight[..., None], mean[:, None, :, None])


def _grouped(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(batch, rows, heads, d) as a view (batch, rows, heads_kv, groups, d)."""
    return t.unflatten(2, (heads_kv, t.shape[2] // heads_kv))


def add_gradients(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, dout_span: torch.Tensor, rows: UniformRows, scale: float,
                  softcap: float = 0.0) -> None:
    """dq, dk, dv += the uniform rows' gradients, summed in float32 and rounded once into each.
    q, dq (batch, seqlen_q, heads, head_dim), dout_span the rows first .. end - 1 of dO; k, v,
    dk, dv (batch, n, heads_kv, head_dim); any strides.

    With the keys' values centred, u_j = v_j - mean(v): dS_rj = dO_r . u_j / n, so (each head
    of a GQA group a row of its kv head) dq_r = scale/n dO_r U^T K and dk_j = scale/n A u_j
    with A = sum_r q_r dO_r^T: products of head_dim x head_dim matrices, no scores (or through
    the scores where they take fewer FLOPs: short rows). At a few tens of tokens each op costs
    5-15 us whatever its size (Xeon): the layout changes are folded into the copies the products
    need, the scale into the adds (15 ops instead of 22: the layer's attention 5 % faster)."""
    batch, n, heads_kv, head_dim = k.shape
    rows_n, groups = rows.end - rows.first, q.shape[2] // heads_kv
    fp32 = torch.float32

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:  # (batch, rows, heads, d) -> (batch, heads_kv, rows x groups, d)
        return _fp32_copy(_grouped(t, heads_kv).transpose(1, 2)).view(batch, heads_kv, rows_n * groups, head_dim)

    # dO of the uniform rows, 0 elsewhere: the other rows then add nothing to any sum below
    do = per_kv_head(dout_span * rows.weight)
    qs = per_kv_head(q[:, rows.first:rows.end])
    kf = _fp32_copy(k.transpose(1, 2))  # (batch, heads_kv, n, d)
    u = torch.sub(v.transpose(1, 2), v.mean(dim=1, dtype=fp32)[:, :, None],
                  out=torch.empty(kf.shape, dtype=fp32))
    dv.add_(do.sum(2)[:, None], alpha=1 / n)  # P_rj = 1/n: dv_j += sum_r dO_r / n
    span_rows, alpha = do.shape[2], scale / n
    if softcap or 3 * span_rows * n < 2 * head_dim * (span_rows + n):  # (fewer FLOPs through the scores)
        dq_rows, dk_sum = _through_scores(qs, kf, u, do, scale, softcap)
    else:
        dq_rows = do @ (u.mT @ kf)
        dk_sum = u @ (qs.mT @ do).mT
    _grouped(dq[:, rows.first:rows.end], heads_kv).add_(
        dq_rows.view(batch, heads_kv, rows_n, groups, head_dim).transpose(1, 2), alpha=alpha)
    dk.add_(dk_sum.transpose(1, 2), alpha=alpha)


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of t: one op (layout and dtype change at once)."""
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


def _through_scores(qs, kf, u, do, scale: float, softcap: float):
    """dq, dk / (scale / n) through dS_rj = dO_r . u_j itself (a few rows and keys, or softcap,
    whose derivative 1 - tanh^2 of each score weighs dS_rj): dense, in chunks of rows (at most
    ~4M scores (batch, heads_kv, rows, n) at a time); dk summed over the chunks in float32."""
    batch, heads_kv, span_rows, _ = qs.shape
    n = kf.shape[2]
    chunk = max(1, (1 << 22) // max(1, batch * heads_kv * n))
    dq, dk = [], None
    for start in range(0, span_rows, chunk):
        part = slice(start, start + chunk)
        ds = do[:, :, part] @ u.mT
        if softcap:
            tanh = torch.tanh((qs[:, :, part] @ kf.mT).mul_(scale / softcap))
            ds.mul_(1 - tanh * tanh)
        dq.append(ds @ kf)
        dk = ds.mT @ qs[:, :, part] if dk is None else dk.add_(ds.mT @ qs[:, :, part])
    return dq[0] if len(dq) == 1 else torch.cat(dq, dim=2), dk
