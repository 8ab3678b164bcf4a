"""Argument checks with messages that name the problem (TVM's runtime alone, no torch needed).

TVM's own argument binder rejects many bad inputs too, but with messages about symbolic buffer
constraints ("unsatisfied constraint: 64 == ..."), and it cannot see others at all (aliased
outputs, a NaN scale). Every entry point (kernel objects, torch ops, flex) checks here first.
Tensors may be any DLPack-capable object; torch tensors are read directly (cheaper).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from dataclasses import dataclass
from typing import NamedTuple

import tvm_ffi

from .config import VECTOR_BYTES
from .spec import MAX_HEAD_DIM, MAX_RECOMPUTABLE_LSE, SUPPORTED_DTYPES, UNLIMITED_WINDOW, unrecomputable_lse_message


class CapacityError(ValueError, RuntimeError):
    """A KV cache too short for the sequence lengths asked for: a ValueError, and also the
    RuntimeError that flash-attn's extension raises there (its tests and users catch that)."""


class TensorInfo(NamedTuple):  # (a named tuple: built on every call, ~4x cheaper than a dataclass)
    shape: tuple
    dtype: str
    device: str
    strides: tuple
    data_ptr: int = 0
    itemsize: int = 0

    def span(self) -> tuple[int, int]:
        """[first byte, last byte + 1) of the elements (an interval: interleaved views overlap it)."""
        if any(n == 0 for n in self.shape):
            return self.data_ptr, self.data_ptr
        low = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        high = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0)
        return self.data_ptr + low * self.itemsize, self.data_ptr + (high + 1) * self.itemsize

    def self_overlapping(self) -> bool:
        """Two indices reach the same element (an ``expand``ed tensor, stride 0)."""
        return any(s == 0 and n > 1 for n, s in zip(self.shape, self.strides))


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "int8": 1, "bool": 1}


def _address(x) -> int:
    """A torch tensor's data pointer; 0 for tensors without storage (torch.func's wrappers, fake
    tensors of torch.export), which go on to the op, whose fake kernel or transform handles them."""
    try:
        return x.data_ptr()
    except RuntimeError:
        return 0


def info(x, name: str = "tensor") -> TensorInfo:
    torch = sys.modules.get("torch")
    if torch is not None and type(x) is torch.Tensor:  # the common case, read directly (a few us a call)
        if x.layout is not torch.strided:
            raise TypeError(f"{name} is a {x.layout} tensor: tvmflash reads dense (strided) tensors, "
                            f"pass {name}.to_dense()")
        # (no memo of the names: torch.compile guards on a dict that tracing fills, and recompiles)
        return TensorInfo(tuple(x.shape), str(x.dtype)[len("torch."):], "cpu" if x.is_cpu else str(x.device), x.stride(), _address(x),
                          x.element_size())
    torch_dtype = getattr(x, "dtype", None)
    if hasattr(x, "stride") and hasattr(x, "device") and str(torch_dtype).startswith("torch."):
        if getattr(x, "is_sparse", False) or str(getattr(x, "layout", "")) != "torch.strided":
            raise TypeError(f"{name} is a {x.layout} tensor: tvmflash reads dense (strided) tensors, "
                            f"pass {name}.to_dense()")
        dtype = str(torch_dtype)[len("torch."):]
        return TensorInfo(tuple(x.shape), dtype, str(x.device), tuple(x.stride()), _address(x),
                          x.element_size())
    flags = getattr(x, "flags", None)  # numpy
    if flags is not None and not flags.writeable:
        raise ValueError(f"{name} is a read-only array, which DLPack cannot share; pass a writable one "
                         f"(e.g. numpy.array({name}))")
    try:
        t = x if isinstance(x, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(x)
    except Exception as err:  # noqa: BLE001 - any failure means "not a tensor we can read"
        raise TypeError(f"{name} must be a DLPack tensor (torch, numpy, ...), got {type(x).__name__}") from err
    device = str(t.device)
    dtype = str(t.dtype)
    return TensorInfo(tuple(t.shape), dtype, "cpu" if device.startswith("cpu") else device, tuple(t.strides),
                      t.data_ptr(), _ITEMSIZE.get(dtype, 1))


def integer(name: str, value) -> int:
    """An integer argument as an int: Python and numpy integers are fine, floats and bools are not."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def head_dim_value(head_dim) -> int:
    return integer("head_dim", head_dim)


def count(name: str, value, minimum: int = 0) -> int:
    """An integer argument of at least ``minimum``."""
    value = integer(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def sequence_lengths(seqlen) -> int | tuple[int, int] | None:
    """``compile``'s ``seqlen``: None, a length, or (queries, keys)."""
    if seqlen is None:
        return None
    if isinstance(seqlen, tuple):
        if len(seqlen) != 2:
            raise ValueError(f"seqlen must be an int or a (queries, keys) pair, got {seqlen!r}")
        return count("seqlen", seqlen[0], 1), count("seqlen", seqlen[1], 1)
    return count("seqlen", seqlen, 1)


def check_kernel_params(head_dim, dtype) -> None:
    head_dim = head_dim_value(head_dim)
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: use a multiple of 8 from 8 to {MAX_HEAD_DIM}")
    if str(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported: use one of {', '.join(SUPPORTED_DTYPES)}")


def head_dim_padding(head_dims) -> int:
    """Zero columns that flash-attn's rule adds to a head dim that is no multiple of 8 (the
    kernels' unit) when every tensor has the same one, below MAX_HEAD_DIM; else 0 (nothing to
    pad, or the checks will name the problem)."""
    dims = set(head_dims)
    if len(dims) != 1 or not 0 < (d := dims.pop()) < MAX_HEAD_DIM:
        return 0
    return -d % 8


def require_bool(name: str, value) -> bool:
    """``causal="False"`` would be truthy: flags must be real booleans."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_ too
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def _is_bool(value) -> bool:
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def real_number(name: str, value) -> float:
    """A real scalar as a float: Python and numpy numbers, 0-d numpy arrays and torch tensors of a
    real dtype (``np.float32(30.)``, ``torch.tensor(0.125)``); not bools, strings or complex."""
    if type(value) is float or type(value) is int:  # (also what torch.compile(dynamic=True) makes of floats)
        return float(value)
    if not _is_bool(value) and "complex" not in str(getattr(value, "dtype", "")):
        if isinstance(value, numbers.Real):
            return float(value)
        if getattr(value, "shape", None) == ():  # 0-d array or tensor
            try:
                return float(value)
            except (TypeError, ValueError, RuntimeError, NotImplementedError):  # e.g. a meta tensor
                pass
    raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")


def softmax_scale(value, head_dim: int) -> float:
    """The one check of ``softmax_scale`` for every entry point: None -> 1/sqrt(head_dim); any
    finite number > 0 works (the kernels' exponents keep the scale as an fp32 hi + lo pair)."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    value = real_number("softmax_scale", value)
    if not 0 < value < float("inf"):  # (comparisons: torch.compile traces them on its SymFloats; NaN fails too)
        raise ValueError(f"softmax_scale must be a finite number > 0, got {value}")
    return value


def softcap(value) -> float:
    """flash-attn's ``softcap``: scores become ``softcap * tanh(s / softcap)``; 0 is off."""
    value = real_number("softcap", value)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {value!r}")
    return value


def _window_entry(value) -> int:
    if type(value) is int:
        return value
    if type(value).__name__ == "SymInt":  # (torch.compile made it dynamic: specialized, one graph per window)
        return int(value)
    if _is_bool(value):  # operator.index(True) is 1
        raise TypeError
    return operator.index(value)


def window_pair(window_size, causal: bool) -> tuple[int, int]:
    """flash-attn's (left, right) as the user gave it, -1 = no limit, causal folded in as right = 0."""
    try:
        left, right = window_size
        left, right = _window_entry(left), _window_entry(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of integers (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: no limit), got {window_size!r}")
    return left, 0 if causal else right


def window(window_size, causal: bool) -> tuple[int, int]:
    """``window_pair`` as the kernels take it: no limit (-1) and larger ones as UNLIMITED_WINDOW."""
    return tuple(UNLIMITED_WINDOW if w < 0 else min(w, UNLIMITED_WINDOW) for w in window_pair(window_size, causal))


def dropout(dropout_p) -> None:
    if dropout_p is not None and (isinstance(dropout_p, (str, bytes)) or dropout_p != 0):
        raise ValueError(f"dropout is not supported by tvmflash (dropout_p={dropout_p!r}); use 0.0")


@dataclass(frozen=True)
class FlashOptions:
    """flash-attn's keyword options, checked, as the kernels take them."""
    softmax_scale: float | None  # None: no head dim to default from (the shape checks refuse it)
    causal: bool
    window: tuple[int, int]  # (left, right), -1: no limit, causal folded in as right = 0
    softcap: float
    deterministic: bool


_softmax_scale, _softcap = softmax_scale, softcap  # (flash_options' parameters have their names)


def flash_options(head_dim: int, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, deterministic=False, **flags) -> FlashOptions:
    """flash-attn's options, checked the one way for every entry point (``flash_attn_*``,
    ``flash_attn_with_kvcache``, ring attention): flags are real booleans (``causal="False"``
    is truthy), scale and softcap real numbers, windows integer pairs, no dropout. ``flags``:
    the entry point's other booleans (``return_attn_probs=...``), checked the same way."""
    dropout(dropout_p)
    causal = require_bool("causal", causal)
    deterministic = require_bool("deterministic", deterministic)
    for name, value in flags.items():
        require_bool(name, value)
    return FlashOptions(_softmax_scale(softmax_scale, head_dim) if head_dim else None, causal,
                        window_pair(window_size, causal), _softcap(softcap), deterministic)


CUDA_DTYPES = ("float16", "bfloat16")
CUDA_MAX_HEAD_DIM = 128
CUDA_VECTOR_ELEMENTS = VECTOR_BYTES // 2  # 16-byte copies of fp16/bf16


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


def check_cuda_spec(spec, deterministic: bool) -> None:
    """What the CUDA kernels compute of an ``AttentionSpec`` so far: windows, softcap, ALiBi,
    traced score/mask mods, block masks and gradients of captured tensors (atomic adds), fused;
    not fp32 results, nor captured tensors' gradients in a bitwise reproducible order."""
    missing = [what for what, asked in (
        (f"deterministic gradients of captured tensors ({', '.join(i.name for i in spec.grad_inputs)})",
         deterministic and spec.grad_inputs),
        ("float32 results of 16-bit inputs", spec.out_dtype != spec.dtype)) if asked]
    if missing:
        raise NotImplementedError(f"the CUDA kernels do not support {' or '.join(missing)} yet (the CPU kernels do)")


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
    """Tensors the CUDA kernels access with 16-byte vector loads and stores."""
    for name, x in tensors.items():
        problem = cuda_layout_problem(x if isinstance(x, TensorInfo) else info(x, name))
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


def _check_like(name: str, t: TensorInfo, shape: tuple, dtype, device: str) -> None:
    if t.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {t.shape}")
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_compact(name: str, t: TensorInfo) -> None:
    expected, size = [], 1
    for n in reversed(t.shape):
        expected.append(size)
        size *= n
    if any(s != e for s, e, n in zip(t.strides, reversed(expected), t.shape) if n != 1):
        raise ValueError(f"{name} must be contiguous (compact row-major), got strides {t.strides} for shape {t.shape}")


def check_no_overlap(outputs: dict, inputs: dict) -> None:
    """Outputs are written while inputs are read, with no aliasing assumed: an output may not
    overlap an input, another output, or itself."""
    for name, t in outputs.items():
        if t.self_overlapping():
            raise ValueError(f"{name} has overlapping elements (a stride of 0, e.g. from expand): "
                             "outputs must be writable tensors of their own")
        first, end = t.span()
        for other, u in (*inputs.items(), *outputs.items()):
            if other == name:
                continue
            o_first, o_end = u.span()
            if first < o_end and o_first < end:
                raise ValueError(f"{name} overlaps {other} in memory: outputs must not alias inputs or "
                                 "each other (in-place attention is not supported)")


def _check_kernel_fit(kernels, q: TensorInfo, tensors: dict) -> None:
    if q.dtype != kernels.dtype:
        raise TypeError(f"inputs are {q.dtype} but these kernels were compiled for {kernels.dtype}")
    if q.shape[3] != kernels.head_dim:
        raise ValueError(f"inputs have head_dim {q.shape[3]} but these kernels were compiled for {kernels.head_dim}")
    wanted = "cpu" if kernels.target_kind == "llvm" else "cuda"
    if _device_kind(q.device) != wanted:
        raise ValueError(f"these kernels run on {wanted} tensors, got tensors on {q.device}")
    for name, t in tensors.items():
        if any(n == 0 for n in t.shape):
            raise ValueError(f"{name} is empty (shape {t.shape}): every size must be at least 1")
        if t.strides and t.strides[-1] != 1 and t.shape[-1] != 1:
            what = "(sequence)" if len(t.shape) == 3 else "(head_dim)"  # (lse: (batch, heads, seqlen))
            raise ValueError(f"the last {what} dimension of {name} must be contiguous, got strides {t.strides}")


def check_inputs(kernels, q, k, v) -> tuple[int, int, int, int]:
    """q, k, v of a call whose outputs the caller allocated itself. Returns check_qkv's dims."""
    qi, ki, vi = info(q, "q"), info(k, "k"), info(v, "v")
    dims = check_qkv(qi, ki, vi)
    _check_kernel_fit(kernels, qi, {"q": qi, "k": ki, "v": vi})
    if kernels.target_kind == "cuda":
        check_cuda_layout(q=qi, k=ki, v=vi)
    return dims


def check_forward_args(kernels, q, k, v, out, lse) -> tuple[int, int, int, int]:
    qi, ki, vi, oi, li = (info(x, n) for x, n in zip((q, k, v, out, lse), ("q", "k", "v", "out", "lse")))
    dims = check_qkv(qi, ki, vi)
    _check_kernel_fit(kernels, qi, {"q": qi, "k": ki, "v": vi, "out": oi, "lse": li})
    batch, seqlen_q, heads, _ = dims
    _check_like("out", oi, qi.shape, kernels.out_dtype, qi.device)
    _check_like("lse", li, (batch, heads, seqlen_q), "float32", qi.device)
    _check_compact("lse", li)
    check_no_overlap({"out": oi, "lse": li}, {"q": qi, "k": ki, "v": vi})
    if kernels.target_kind == "cuda":
        check_cuda_layout(q=qi, k=ki, v=vi, out=oi)  # out: written with 16-byte stores
        check_cuda_grid(heads)
    return dims


def check_backward_args(kernels, dout, q, k, v, out, lse, dq, dk, dv) -> tuple[int, int, int, int]:
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    di, qi, ki, vi, oi, li, dqi, dki, dvi = (info(x, n) for x, n in zip((dout, q, k, v, out, lse, dq, dk, dv), names))
    dims = _check_backward_inputs(kernels, di, qi, ki, vi, oi, li, {"dq": dqi, "dk": dki, "dv": dvi})
    _check_like("dq", dqi, qi.shape, kernels.out_dtype, qi.device)
    for name, t in (("dk", dki), ("dv", dvi)):
        _check_like(name, t, ki.shape, kernels.out_dtype, ki.device)
    check_no_overlap({"dq": dqi, "dk": dki, "dv": dvi},
                     {"dout": di, "q": qi, "k": ki, "v": vi, "out": oi, "lse": li})
    if kernels.target_kind == "cuda":
        check_cuda_layout(dq=dqi, dk=dki, dv=dvi)  # 16-byte stores
    return dims


def check_backward_inputs(kernels, dout, q, k, v, out, lse) -> tuple[int, int, int, int]:
    """The backward's inputs, for a caller that allocates dq, dk and dv itself (the torch op):
    fresh tensors of q's and k's shapes, which overlap nothing. Returns check_qkv's dims."""
    names = ("dout", "q", "k", "v", "out", "lse")
    return _check_backward_inputs(kernels, *(info(x, n) for x, n in zip((dout, q, k, v, out, lse), names)), {})


def _check_backward_inputs(kernels, di, qi, ki, vi, oi, li, outputs: dict) -> tuple[int, int, int, int]:
    dims = check_qkv(qi, ki, vi)
    _check_kernel_fit(kernels, qi, {"dout": di, "q": qi, "k": ki, "v": vi, "out": oi, "lse": li, **outputs})
    batch, seqlen_q, heads, _ = dims
    for name, t in (("dout", di), ("out", oi)):
        _check_like(name, t, qi.shape, qi.dtype, qi.device)
    _check_like("lse", li, (batch, heads, seqlen_q), "float32", qi.device)
    _check_compact("lse", li)
    if kernels.target_kind == "cuda":
        check_cuda_layout(dout=di, q=qi, k=ki, v=vi, out=oi)  # 16-byte loads
        # its grid (sequences x kv heads) is checked where the sequences are known (runtime.py)
    return dims


def check_devices(device: str, tensors: dict, reference: str = "q") -> None:
    """Every tensor argument lives on the device of ``reference`` (a kernel handed a pointer of
    another device reads garbage or faults; torch sends an op with a ``meta`` argument to its
    shape-only implementation, which returns uninitialised memory)."""
    for name, t in tensors.items():
        if t is None:
            continue
        found = t.device if isinstance(t, TensorInfo) else info(t, name).device
        if found != device:
            raise ValueError(f"{name} is on {found}, {reference} on {device}: every tensor argument must be on "
                             f"{reference}'s device")


def check_cu_seqlens(name: str, cu, total_rows: int, batch: int | None = None, device: str | None = None) -> list[int]:
    """Cumulative sequence lengths: int32, 1-D, on ``device`` (q's), starting at 0,
    non-decreasing, ending at the number of rows. Returns them as Python ints."""
    import numpy as np

    t = info(cu, name)
    if t.dtype != "int32" or len(t.shape) != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor, got {t.dtype} with shape {t.shape}")
    if device is not None:
        check_devices(device, {name: t})
    if t.device != "cpu" and not t.device.startswith("cuda"):
        raise ValueError(f"{name} must be on the CPU or a GPU, got {t.device}")
    values = [int(x) for x in np.asarray(cu.cpu() if hasattr(cu, "cpu") else cu).tolist()]
    if len(values) < 2:
        raise ValueError(f"{name} must hold at least 2 entries (batch + 1), got {len(values)}")
    if batch is not None and len(values) != batch + 1:
        raise ValueError(f"{name} has {len(values)} entries, cu_seqlens_q has {batch + 1}: they must match")
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must start at 0 and never decrease, got {values[:8]}{'...' if len(values) > 8 else ''}")
    if values[-1] != total_rows:
        raise ValueError(f"{name} ends at {values[-1]} but the packed tensor has {total_rows} rows")
    return values


def check_lse_recomputable(lse) -> None:
    """Raise if a CUDA forward's LSE is too large for an accurate backward (``softmax_scale`` x
    q . k in the tens of thousands or more; the forward itself is exact at any scale). The CPU
    backward kernels check their LSE themselves, before they write anything (``kernels/cpu.py``):
    no torch or numpy reduction runs around them."""
    if hasattr(lse, "detach"):  # torch, on its device
        magnitudes = lse.detach().abs().nan_to_num(nan=0.0, posinf=0.0)
        largest = float(magnitudes.max()) if magnitudes.numel() else 0.0
    else:  # a compile-API tensor: TVM's, numpy's or another DLPack one, on the GPU (this module stays torch-free)
        import numpy as np

        values = (lse if isinstance(lse, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(lse)).numpy()  # (a host copy)
        finite = np.abs(values[np.isfinite(values)])
        largest = float(finite.max()) if finite.size else 0.0
    if largest >= MAX_RECOMPUTABLE_LSE:
        raise ValueError(unrecomputable_lse_message(f"{largest:.3g}"))
