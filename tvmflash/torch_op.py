"""PyTorch binding: ``flash_attn_func`` with autograd, as ``torch.library`` custom ops.

Two ops, ``tvmflash::flash_attn_forward`` -> (out, lse) and ``tvmflash::flash_attn_backward``
-> (dq, dk, dv), each with a fake (meta) implementation, tie the compiled TVM kernels into
PyTorch: autograd through ``register_autograd``, ``torch.compile(fullgraph=True)`` through the
fakes, and ``torch.library.opcheck`` passes. Tensors reach the kernels through DLPack without a
copy; outputs are allocated by PyTorch and written in place by the kernels.
"""

from __future__ import annotations

import math
import os

import torch

from . import compiler
from .checks import SUPPORTED_DTYPES, check_qkv, cuda_layout_problem, info


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# compile() resolves the target, the schedule config and the tuning records on every call
# (~2 ms); the op asks on every forward and backward, so it remembers the answer per request.
# The environment that steers compile() is part of the request.
_STEERING_ENV = ("TVMFLASH_CACHE_DIR", "TVMFLASH_TUNE_LOGS", "TVMFLASH_PREBUILT")
_kernels_by_request: dict[tuple, compiler.FlashKernels] = {}


def kernels_for(q: torch.Tensor, causal: bool, deterministic: bool = False) -> compiler.FlashKernels:
    """The compiled kernels for q's device, head dim, dtype and mask (cached).

    CUDA kernels run on torch's current stream: tvm-ffi reads it from the tensors it is given.
    """
    if q.device.type == "cpu":
        target = {"kind": "llvm"}
    elif q.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(q.device)
        target = {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    else:
        raise ValueError(f"tvmflash runs on cpu and cuda tensors, got {q.device}")
    request = (*target.values(), q.shape[-1], _dtype_name(q), causal, deterministic,
               *(os.environ.get(name) for name in _STEERING_ENV))
    found = _kernels_by_request.get(request)
    if found is None:
        found = _kernels_by_request[request] = compiler.compile(
            target, head_dim=q.shape[-1], dtype=_dtype_name(q), causal=causal, deterministic=deterministic)
    return found


def _lse_like(q: torch.Tensor) -> torch.Tensor:
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def _empty_problem(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.numel() == 0 or k.shape[1] == 0


@torch.library.custom_op("tvmflash::flash_attn_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             causal: bool, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if _empty_problem(q, k):  # no keys: out = 0, lse = -inf (no kernel call)
        return torch.zeros_like(q), _lse_like(q).fill_(float("-inf"))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = _lse_like(q)
    kernels_for(q, causal, deterministic).forward(q, k, v, out, lse, softmax_scale)
    return out, lse


@_forward.register_fake
def _(q, k, v, softmax_scale, causal, deterministic=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format), _lse_like(q)


@torch.library.custom_op("tvmflash::flash_attn_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fresh = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    if _empty_problem(q, k):
        return tuple(t.zero_() for t in fresh)
    dq, dk, dv = fresh
    kernels_for(q, causal, deterministic).backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)
    return dq, dk, dv


@_backward.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(_kernel_layout(dout), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                           ctx.deterministic)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself if the kernels can read it in place, else a contiguous copy.

    CPU kernels read any batch/seq/head strides; only head_dim must be unit-stride. CUDA kernels
    copy tiles with 16-byte vector loads: 16-byte aligned data and strides of 8 elements too.
    """
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return t.contiguous()
    if t.device.type == "cuda":
        return _cuda_readable(t)
    return t


def _cuda_readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the CUDA kernels can read it in place, else a copy in a fresh allocation.

    Not ``contiguous()``: it returns ``t`` itself whenever torch calls it contiguous, which a
    tensor with a storage offset that is not 16-byte aligned still is.
    """
    if cuda_layout_problem(info(t)) is None:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    deterministic: bool = False, *, return_lse: bool = False):
    """Exact attention ``softmax(q k^T * scale [+ causal mask]) v``, FlashAttention style.

    Same calling convention as flash-attn's ``flash_attn_func``: q ``(batch, seqlen_q, heads,
    head_dim)``, k and v ``(batch, seqlen_k, heads_k, head_dim)`` with ``heads % heads_k == 0``
    (GQA/MQA), float32/float16/bfloat16, head_dim a multiple of 8 up to 256. The causal mask is
    aligned to the bottom-right corner. ``softmax_scale`` defaults to ``1/sqrt(head_dim)``.
    Returns ``out`` (like q), or ``(out, lse)`` with ``lse`` of shape ``(batch, heads,
    seqlen_q)`` in float32 (natural log; not differentiable) when ``return_lse=True``.
    Dropout is not supported (``dropout_p`` must be 0). CUDA tensors (float16/bfloat16, head_dim
    a multiple of 16 up to 128) run the tensor-core kernels on the current stream;
    ``deterministic=True`` makes their backward reproducible bit for bit (no atomic adds). The
    CPU kernels are always deterministic.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_qkv(info(q), info(k), info(v))
    if q.dtype not in tuple(getattr(torch, d) for d in SUPPORTED_DTYPES):
        raise TypeError(f"dtype {q.dtype} is not supported")
    if dropout_p:
        raise ValueError(f"dropout is not supported by tvmflash (dropout_p={dropout_p}); use 0.0")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale}")
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out, lse = _forward(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))
    return (out, lse) if return_lse else out
