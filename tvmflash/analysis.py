"""Static analyses of the kernels: FLOPs and allocated memory at concrete sizes.

The kernels are symbolic in batch, heads and sequence lengths; ``specialize`` binds those sizes
(TVM's ``PrimFunc.specialize``), after which ``estimate_tir_flops`` counts every floating-point
operation of every loop and ``allocated_bytes`` sums what the lowered kernel allocates (tile
buffers and workspaces; not its inputs and outputs).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from . import attention_te, kernels

# Size names used by the fused kernels (kernels.py) and by the TE definitions (attention_te.py).
_ALIASES = {
    "batch": ("B", "batch"),
    "seqlen_q": ("Nq", "seqlen_q"),
    "seqlen_k": ("Nk", "seqlen_k"),
    "heads": ("H", "heads"),
    "heads_k": ("Hk", "heads_k"),
    "n_split": ("n_split",),
}


def specialize(func: tirx.PrimFunc, **sizes) -> tirx.PrimFunc:
    """Bind batch, seqlen_q, seqlen_k, heads, heads_k (and n_split) to constants; tensors compact.

    Other keywords bind scalar parameters of that name (e.g. ``softmax_scale=0.125``).
    """
    values = {alias: sizes[name] for name, aliases in _ALIASES.items() if name in sizes for alias in aliases}
    scalars = {name: v for name, v in sizes.items() if name not in _ALIASES}
    param_map = {}
    for param in func.params:
        ty = param.ty
        if isinstance(ty, tirx.buffer.BufferType):
            shape = [_bind(dim, values) for dim in ty.shape]
            strides = None
            if len(ty.strides):
                compact, acc = [], 1
                for dim in reversed(shape):
                    compact.append(acc)
                    acc *= int(dim)
                strides = [tirx.const(c, "int64") if isinstance(s, tvm.ir.expr.Var) else s
                           for s, c in zip(ty.strides, reversed(compact))]
            param_map[param] = tirx.decl_buffer(
                shape, ty.dtype, param.name, strides=strides, elem_offset=ty.elem_offset,
                data_alignment=ty.data_alignment, offset_factor=ty.offset_factor)
        elif param.name in values:
            param_map[param] = tirx.const(values[param.name], "int64")
        elif param.name in scalars:
            param_map[param] = tirx.const(scalars[param.name], ty.dtype)
    return func.specialize(param_map)


def _bind(dim, values):
    if isinstance(dim, tvm.ir.expr.Var):
        return tirx.const(values[dim.name], "int64")
    return dim


# FlashAttention's FLOP model, the one every benchmark reports against: the forward's two matrix
# products (4 * B * H * Nq * Nk * D), halved when causal; the backward does 2.5x that (five
# products; the recompute of S is counted in the 0.5).
BACKWARD_FLOPS_RATIO = 2.5
PASS_FLOPS_RATIO = {"forward": 1.0, "backward": BACKWARD_FLOPS_RATIO, "forward+backward": 1.0 + BACKWARD_FLOPS_RATIO}


def model_flops(kernel: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                causal: bool) -> float:
    """Model FLOPs of "forward", "backward" or "forward+backward"."""
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return PASS_FLOPS_RATIO[kernel] * (forward / 2 if causal else forward)


def flops(func: tirx.PrimFunc) -> float:
    return float(s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": func})))


def allocated_bytes(func: tirx.PrimFunc) -> int:
    """Bytes the kernel allocates itself (all scopes), after TVM's buffer compaction."""
    lower = tvm.transform.Sequential([
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerMatchBuffer(),
        s_tir.transform.LowerOpaqueBlock(),
        tirx.transform.FlattenBuffer(),
    ])
    lowered = lower(tvm.IRModule({"main": func}))
    per_scope = s_tir.analysis.calculate_allocated_bytes(lowered)["main"]
    return int(sum(int(v) for v in per_scope.values()))


def fused_kernels(head_dim=64, dtype="float32", causal=False, block_q=64, block_k=64):
    """The fused (forward, backward) PrimFuncs with T.exp2, the form the FLOP counter reads."""
    spec = kernels.KernelSpec(head_dim, dtype, causal, block_q, block_k, exp2="intrinsic")
    return kernels.fused_forward(spec), kernels.fused_backward(spec)


def standard_kernels(head_dim=64, dtype="float32", causal=False):
    """The unfused TE (forward, backward) PrimFuncs: standard attention."""
    return (attention_te.standard_forward(head_dim, dtype, causal),
            attention_te.standard_backward(head_dim, dtype, causal))
