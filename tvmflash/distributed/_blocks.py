"""The one seam between ring attention and tvmflash's kernels.

Everything in ``tvmflash.distributed`` reaches the compiled kernels (``block_forward``,
``block_backward``), the package's argument checks (``check_inputs``) and its layout rules
(``kernel_layout``) through this file; nothing else there imports the package's internals. When
the kernels' entry point moves, only this file changes.

Contract (what the ring code relies on):

- ``block_forward(q, k, v, softmax_scale, causal)`` -> ``(out, lse)``: attention of the query
  rows ``q`` against one key/value block. ``out`` has q's shape, ``lse`` is ``(batch, heads,
  seqlen_q)`` float32 (natural log). The causal mask is aligned to the bottom-right corner; a row
  that sees no key gets out 0 and lse -inf. q, k, v, dout, out and the gradients may be strided
  views with a unit last stride; lse may be any view (copied compact here if it is not).
- ``block_backward(dout, q, k, v, out, lse, softmax_scale, causal, dq, dk, dv)``: the block's
  gradients, *written* (not added) into the float32 tensors ``dq, dk, dv`` (shapes of q, k, v).
  ``out`` and ``lse`` are the *global* (merged) output and LSE of these query rows: the kernel's
  Delta = rowsum(dO * O) and P = exp(S - lse) are then the global ones, which is what makes the
  sum of the block gradients the exact gradient.
"""

from __future__ import annotations

import torch

from ..checks import check_qkv, info
from ..torch_op import kernels_for


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


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, _ = q.shape
    # TODO(fp32-partials): allocate `out` in float32 once the kernels accept a float32 output for
    # 16-bit inputs; today a bf16/fp16 block output is rounded to its dtype before the merge.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    kernels_for(q, causal, deterministic).forward(q, k, v, out, lse, softmax_scale)
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, softmax_scale: float, causal: bool, dq: torch.Tensor, dk: torch.Tensor,
                   dv: torch.Tensor, deterministic: bool = False) -> None:
    kernels = kernels_for(q, causal, deterministic)
    lse = lse.contiguous()  # the kernels read lse compact (a copy only for the zigzag half rows)
    if q.dtype == torch.float32:
        kernels.backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)
        return
    # TODO(fp32-partials): pass the float32 dq, dk, dv straight to the kernel once it accepts
    # float32 gradients for 16-bit inputs; today each block's gradients are rounded to the input
    # dtype here and only then added to the float32 sums.
    parts = [torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *parts, softmax_scale)
    for dst, src in zip((dq, dk, dv), parts):
        dst.copy_(src)
