"""Argument checks with messages that name the problem.

TVM's own argument binder would reject most bad inputs too, but with messages about symbolic
buffer constraints ("unsatisfied constraint: 64 == ..."); users get these instead. Tensors may be
any DLPack-capable object; torch tensors are read directly (cheaper).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple
    dtype: str
    device: str
    strides: tuple
    data_ptr: int = 0


def info(x) -> TensorInfo:
    torch_dtype = getattr(x, "dtype", None)
    if hasattr(x, "stride") and hasattr(x, "device") and str(torch_dtype).startswith("torch."):
        return TensorInfo(tuple(x.shape), str(torch_dtype)[len("torch."):], str(x.device), tuple(x.stride()),
                          x.data_ptr())
    try:
        t = x if isinstance(x, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(x)
    except Exception as err:  # noqa: BLE001 - any failure means "not a tensor we can read"
        raise TypeError(f"expected a DLPack tensor (torch, numpy, ...), got {type(x).__name__}") from err
    device = str(t.device)
    return TensorInfo(tuple(t.shape), str(t.dtype), "cpu" if device.startswith("cpu") else device,
                      tuple(t.strides), t.data_ptr())


def check_kernel_params(head_dim, dtype) -> None:
    if not isinstance(head_dim, int) or head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim!r} is not supported: use a multiple of 8 from 8 to {MAX_HEAD_DIM}")
    if str(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported: use one of {', '.join(SUPPORTED_DTYPES)}")


CUDA_DTYPES = ("float16", "bfloat16")
CUDA_MAX_HEAD_DIM = 128
CUDA_VECTOR_ELEMENTS = 8  # 16-byte copies of fp16/bf16


def check_cuda_params(head_dim, dtype, arch: str = "sm_90") -> None:
    """The CUDA kernels run on tensor cores: 16-bit inputs, 16 x 16 fragments along head_dim, and
    the mma.m16n8k16 / ldmatrix instructions of sm_80 and newer."""
    digits = "".join(ch for ch in str(arch) if ch.isdigit())
    if not digits or int(digits) < 80:
        raise ValueError(f"CUDA arch {arch!r} is not supported: the kernels need sm_80 or newer "
                         "(Ampere, Ada, Hopper tensor cores)")
    if str(dtype) not in CUDA_DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported on CUDA: the kernels use tensor cores, "
                        f"use float16 or bfloat16 (float32 runs on the CPU target)")
    if head_dim % 16 or head_dim > CUDA_MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported on CUDA: use a multiple of 16 up to "
                         f"{CUDA_MAX_HEAD_DIM} (64 and 128 are the tested ones)")


CUDA_MAX_GRID_Y = 65535


def check_cuda_grid(batch_heads: int) -> None:
    """The CUDA kernels put batch x heads on gridDim.y, which CUDA limits to 65535."""
    if batch_heads > CUDA_MAX_GRID_Y:
        raise ValueError(f"batch x heads = {batch_heads} is more than the CUDA kernels launch at once "
                         f"({CUDA_MAX_GRID_Y}); split the batch")


def cuda_layout_problem(t: TensorInfo) -> str | None:
    """Why the CUDA kernels cannot read ``t`` in place (16-byte vector loads need an aligned start
    and strides of 8 elements), or None. The torch op copies such inputs; the kernels reject them."""
    if t.data_ptr % 16:
        return f"must start at a 16-byte aligned address (it is offset by {t.data_ptr % 16} bytes)"
    # the stride of a size-1 dim never multiplies a nonzero index (torch gives them any value)
    if any(stride % CUDA_VECTOR_ELEMENTS for stride, size in zip(t.strides[:-1], t.shape[:-1]) if size != 1):
        return f"must have batch/seqlen/head strides that are multiples of {CUDA_VECTOR_ELEMENTS} elements, got {t.strides}"
    return None


def check_cuda_layout(**tensors) -> None:
    """Inputs the CUDA kernels read with 16-byte vector loads (tensors or their TensorInfo)."""
    for name, x in tensors.items():
        problem = cuda_layout_problem(x if isinstance(x, TensorInfo) else info(x))
        if problem:
            raise ValueError(f"{name} {problem} for the CUDA kernels; pass a .contiguous() copy")


def _device_kind(device: str) -> str:
    return device.split(":")[0]


def check_qkv(q: TensorInfo, k: TensorInfo, v: TensorInfo, names=("q", "k", "v")) -> tuple[int, int, int, int]:
    """Common checks of q, k, v. Returns (batch, seqlen_q, heads, heads_k)."""
    for name, t in zip(names, (q, k, v)):
        if len(t.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {t.shape}")
    qn, kn, vn = names
    if k.shape != v.shape:
        raise ValueError(f"{kn} and {vn} must have the same shape, got {k.shape} and {v.shape}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{qn}, {kn}, {vn} must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {q.dtype} is not supported: use one of {', '.join(SUPPORTED_DTYPES)}")
    if not q.device == k.device == v.device:
        raise ValueError(f"{qn}, {kn}, {vn} must be on the same device, got {q.device}, {k.device}, {v.device}")
    batch, seqlen_q, heads, head_dim = q.shape
    kb, seqlen_k, heads_k, kd = k.shape
    if kb != batch:
        raise ValueError(f"batch sizes differ: {qn} has {batch}, {kn} has {kb}")
    if kd != head_dim:
        raise ValueError(f"head dims differ: {qn} has {head_dim}, {kn} has {kd}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(
            f"{qn} has {heads} heads and {kn}/{vn} have {heads_k}: the query heads must be a "
            "multiple of the key/value heads (GQA/MQA)"
        )
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: use a multiple of 8 from 8 to {MAX_HEAD_DIM}")
    return batch, seqlen_q, heads, heads_k


def _check_like(name: str, t: TensorInfo, shape: tuple, dtype: str, device: str) -> None:
    if t.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {t.shape}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_kernel_fit(kernels, q: TensorInfo, tensors: dict) -> None:
    if q.dtype != kernels.dtype:
        raise TypeError(f"inputs are {q.dtype} but these kernels were compiled for {kernels.dtype}")
    if q.shape[3] != kernels.head_dim:
        raise ValueError(f"inputs have head_dim {q.shape[3]} but these kernels were compiled for {kernels.head_dim}")
    wanted = "cpu" if kernels.target_kind == "llvm" else "cuda"
    if _device_kind(q.device) != wanted:
        raise ValueError(f"these kernels run on {wanted} tensors, got tensors on {q.device}")
    for name, t in tensors.items():
        if t.strides and t.strides[-1] != 1 and t.shape[-1] != 1:
            raise ValueError(f"the last (head_dim) dimension of {name} must be contiguous, got strides {t.strides}")
        if any(n == 0 for n in t.shape):
            raise ValueError(f"{name} is empty (shape {t.shape}): every size must be at least 1")


def check_forward_args(kernels, q, k, v, out, lse) -> tuple[int, int, int, int]:
    qi, ki, vi, oi, li = (info(x) for x in (q, k, v, out, lse))
    dims = check_qkv(qi, ki, vi)
    batch, seqlen_q, heads, _ = dims
    _check_like("out", oi, qi.shape, qi.dtype, qi.device)
    _check_like("lse", li, (batch, heads, seqlen_q), "float32", qi.device)
    _check_kernel_fit(kernels, qi, {"q": qi, "k": ki, "v": vi, "out": oi, "lse": li})
    if kernels.target_kind == "cuda":
        check_cuda_layout(q=qi, k=ki, v=vi, out=oi)  # out: written with 16-byte stores
        check_cuda_grid(batch * heads)
    return dims


def check_backward_args(kernels, dout, q, k, v, out, lse, dq, dk, dv) -> tuple[int, int, int, int]:
    di, qi, ki, vi, oi, li, dqi, dki, dvi = (info(x) for x in (dout, q, k, v, out, lse, dq, dk, dv))
    dims = check_qkv(qi, ki, vi)
    batch, seqlen_q, heads, _ = dims
    for name, t in (("dout", di), ("out", oi), ("dq", dqi)):
        _check_like(name, t, qi.shape, qi.dtype, qi.device)
    for name, t in (("dk", dki), ("dv", dvi)):
        _check_like(name, t, ki.shape, ki.dtype, ki.device)
    _check_like("lse", li, (batch, heads, seqlen_q), "float32", qi.device)
    _check_kernel_fit(kernels, qi, {"dout": di, "q": qi, "k": ki, "v": vi, "out": oi, "lse": li,
                                    "dq": dqi, "dk": dki, "dv": dvi})
    if kernels.target_kind == "cuda":
        check_cuda_layout(dout=di, q=qi, k=ki, v=vi, out=oi, dq=dqi, dk=dki, dv=dvi)  # 16-byte loads and stores
        check_cuda_grid(batch * dims[3])
    return dims
