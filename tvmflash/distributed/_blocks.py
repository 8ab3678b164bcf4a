"""The one seam between ring attention and tvmflash's kernels.

Everything in ``tvmflash.distributed`` reaches the compiled kernels (``block_forward``,
``block_backward``), the package's argument checks (``check_inputs``, ``flash_options``,
``softmax_scale``, ``window_pair``, ``alibi_slopes``) and its layout rules (``kernel_layout``)
through this file; nothing else there imports the package's internals. When the kernels' entry point moves, only this file changes.

Contract (what the ring code relies on):

- ``block_forward(q, k, v, softmax_scale, diagonal, window, alibi=None, out=None)`` -> ``(out,
  lse)``: attention of the query rows ``q`` against one key/value block, in *float32* whatever
  the input dtype (the kernels' ``fp32_results``: a block's partial output is never rounded to
  16 bits). Query i sees key j iff ``i + diagonal - left <= j <= i + diagonal + right`` for
  ``window = (left, right)`` (flash-attn's window; -1 = no limit); with ``alibi`` (slopes
  ``(1 or batch, heads)`` fp32, from ``alibi_slopes``) the scores get ``-slope * |i + diagonal -
  j|``. For a block of a longer sequence (queries at global position q0, keys at k0) ``diagonal
  = q0 - k0`` applies the global mask and distances. ``out``: the fp32 tensor to write (a view is
  fine), else a new one; ``lse`` is a new compact ``(batch, heads, seqlen_q)`` float32 tensor
  (natural log). A row that sees no key gets out 0 and lse -inf. q, k, v may be strided views
  with a unit last stride.
- ``block_backward(dout, q, k, v, out, lse, softmax_scale, diagonal, window, dq, dk, dv,
  alibi=None)``: the block's gradients, *written* (not added) into the float32 tensors ``dq,
  dk, dv`` (shapes of q, k, v; views are fine), in float32 whatever the input dtype. ``out`` (in
  q's dtype) and ``lse`` are the *global* (merged) output and LSE of these query rows: the
  kernel's Delta = rowsum(dO * O) and P = exp(S - lse) are then the global ones, which is what
  makes the sum of the block gradients the exact gradient. lse may be any view (copied compact
  here if it is not).

CUDA tensors: the CUDA kernels build the mask in (full or causal, bottom-right aligned) and write
16-bit results only, so there a block may only be unmasked or causal with the default diagonal,
and its out/dq/dk/dv are rounded to the input dtype before they reach the fp32 sums (the ring
refuses windows and ALiBi on CUDA up front).
"""

from __future__ import annotations

import torch

from ..checks import check_qkv, flash_options, info, softmax_scale, window  # noqa: F401 - the ring's checks
from ..spec import UNLIMITED_WINDOW
from ..torch_op import kernels_for

F32 = torch.float32


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if the kernels read it in place, else a contiguous copy. CPU kernels read any
    strides but a unit last one; the CUDA kernels' 16-byte vector loads need more (aligned start,
    strides of 8 elements), which a contiguous tensor has."""
    if t.device.type == "cuda":
        return t.contiguous()
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The single-process op's checks of q, k, v (shapes, dtypes, GQA heads, head_dim)."""
    check_qkv(info(q), info(k), info(v))


def window_pair(window_size, causal: bool) -> tuple[int, int]:
    """flash-attn's (left, right) (-1: no limit), validated as the single-process op does, with
    causal folded in as right = 0."""
    left, right = window(window_size, causal)
    return tuple(-1 if x >= UNLIMITED_WINDOW else int(x) for x in (left, right))


def alibi_slopes(slopes, q: torch.Tensor) -> torch.Tensor | None:
    """flash-attn's ``alibi_slopes`` checked as the single-process op does ((heads,) or (batch,
    heads) float32 on q's device) and laid out as the kernels read them: (1 or batch, heads)."""
    if slopes is None:
        return None
    batch, heads = q.shape[0], q.shape[2]
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor of shape (heads,) or (batch, heads)")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape {(heads,)} or {(batch, heads)}, got {tuple(slopes.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, q on {q.device}")
    return slopes.detach().reshape(-1, heads).contiguous()


def _kernels(q: torch.Tensor, alibi, deterministic: bool):
    return kernels_for(q, deterministic=deterministic, alibi=alibi is not None, fp32_results=True)


def _cuda_causal(seqlen_q: int, seqlen_k: int, diagonal: int, window_lr, alibi) -> bool:
    """The CUDA kernels' mask for this block (causal or not), if they have it built in."""
    window_lr = tuple(window_lr)
    if alibi is None and (window_lr == (-1, -1) or (window_lr == (-1, 0) and diagonal == seqlen_k - seqlen_q)):
        return window_lr == (-1, 0)
    raise NotImplementedError("ring attention on CUDA tensors: the CUDA kernels support full and causal attention "
                              f"only (block with window {window_lr}, diagonal {diagonal}, ALiBi {alibi is not None})")


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, diagonal: int,
                  window_lr: tuple[int, int], alibi: torch.Tensor | None = None, deterministic: bool = False,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, _ = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=F32, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=F32, device=q.device)
    if q.device.type == "cuda":
        causal = _cuda_causal(seqlen_q, k.shape[1], diagonal, window_lr, alibi)
        rounded = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kernels_for(q, causal=causal, deterministic=deterministic).forward(q, k, v, rounded, lse, softmax_scale)
        out.copy_(rounded)
        return out, lse
    _kernels(q, alibi, deterministic).forward(q, k, v, out, lse, softmax_scale, causal=False, window_size=window_lr,
                                              diagonal=diagonal, mod_inputs=() if alibi is None else (alibi,))
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, softmax_scale: float, diagonal: int, window_lr: tuple[int, int],
                   dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, alibi: torch.Tensor | None = None,
                   deterministic: bool = False) -> None:
    lse = lse.contiguous()  # the kernels read lse compact (a copy only for the zigzag half rows)
    if q.device.type == "cuda":
        causal = _cuda_causal(q.shape[1], k.shape[1], diagonal, window_lr, alibi)
        parts = [torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v)]
        kernels_for(q, causal=causal, deterministic=deterministic).backward(dout, q, k, v, out, lse, *parts,
                                                                            softmax_scale)
        for dst, src in zip((dq, dk, dv), parts):
            dst.copy_(src)
        return
    _kernels(q, alibi, deterministic).backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal=False,
                                               window_size=window_lr, diagonal=diagonal,
                                               mod_inputs=() if alibi is None else (alibi,))
