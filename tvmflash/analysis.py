"""Static analyses of the kernels: FLOPs per tile pair, allocated memory, the FLOP model.

The CPU kernels are symbolic in every size and read their sequence layout from tables
(``plan.py``), so their loop trip counts are data. Two analyses still apply statically:

* ``pair_flops``: TVM's FLOP estimator on the stages that run once per (query tile, key tile)
  pair (the body under the tile-state test), by stage: what one recompute costs, and how many
  matrix products the backward runs from it (rule 2);
* ``allocated_bytes``: after ``specialize`` binds sizes and table shapes, the bytes the lowered
  kernel allocates (workspaces and tile buffers; not its inputs and outputs).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import attention_te, plan
from .kernels import cpu as cpu_kernels
from .config import FP32_FMA, CPUKernelConfig, default_cpu_config
from .spec import AttentionSpec


def fused_kernels(head_dim: int = 64, dtype: str = "float32", block_q: int = 64, block_k: int = 64,
                  spec: AttentionSpec | None = None, products: str = FP32_FMA):
    """The unscheduled (forward, backward) PrimFuncs of a spec with the given tile sizes and
    products (config.py)."""
    spec = spec or AttentionSpec(head_dim, dtype)
    return tuple(cpu_kernels.fused_kernel(kernel, spec, _config(kernel, block_q, block_k, products))
                 for kernel in ("forward", "backward"))


def _config(kernel: str, block_q: int, block_k: int, products: str = FP32_FMA) -> CPUKernelConfig:
    cfg = default_cpu_config(kernel, avx512=True)
    return CPUKernelConfig(kernel, block_q, block_k, cfg.lanes, cfg.tiles, products)


def walk(stmt, visit) -> None:
    """Call ``visit`` on ``stmt`` and every statement below it, parents first."""
    visit(stmt)
    for field in ("seq", "body", "then_case", "else_case", "block", "init"):
        child = getattr(stmt, field, None)
        if child is None:
            continue
        for node in (child if isinstance(child, (list, tuple, tvm_ffi.Array)) else (child,)):
            if isinstance(node, (tirx.Stmt, s_tir.SBlock, s_tir.SBlockRealize)):
                walk(node, visit)


def _pair_body(func: tirx.PrimFunc) -> tirx.Stmt:
    """The then-branch of the ``state != EMPTY`` test: what runs per (query tile, key tile)."""
    found = []

    def visit(node):
        if isinstance(node, tirx.IfThenElse) and str(node.condition).startswith("state[0] != "):
            found.append(node.then_case)

    walk(func.body, visit)
    if len(found) != 1:
        raise ValueError(f"expected one per-pair body, found {len(found)}")
    return found[0]


def pair_flops(func: tirx.PrimFunc) -> dict[str, float]:
    """FLOPs of one (query tile, key tile) step, by stage (wrapper blocks named ``<stage>_tile``)."""
    stages: dict[str, float] = {}

    def visit(node):
        if isinstance(node, s_tir.SBlockRealize) and node.block.name_hint.endswith("_tile"):
            name = node.block.name_hint[: -len("_tile")]
            stages[name] = stages.get(name, 0.0) + float(s_tir.analysis.estimate_tir_flops(node))

    walk(_pair_body(func), visit)
    return stages


def count_blocks(func: tirx.PrimFunc, name: str) -> int:
    """How many blocks named ``name`` a kernel has (a stage that exists twice is done twice)."""
    count = [0]

    def visit(node):
        if isinstance(node, s_tir.SBlockRealize) and node.block.name_hint == name:
            count[0] += 1

    walk(func.body, visit)
    return count[0]


def specialize(func: tirx.PrimFunc, *, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int,
               block_q: int = 64, block_k: int = 64, n_threads: int = 1, **scalars) -> tirx.PrimFunc:
    """Bind sizes, the sequence tables' shapes and ``n_threads`` to constants (tensors compact);
    other keywords bind scalar parameters of that name (e.g. ``softmax_scale=0.125``)."""
    seqs = plan.batched(batch, seqlen_q, seqlen_k, block_q=block_q, block_k=block_k, heads_k=heads_k)
    sizes = {"Bq": batch, "Bk": batch, "Nq": seqlen_q, "Nk": seqlen_k, "H": heads, "Hk": heads_k,
             "n_seq": seqs.count, "query_tiles": seqs.query_tiles, "key_tiles": seqs.key_tiles,
             "key_super_tiles": len(seqs.k_super_seq)}
    values = {"n_threads": n_threads, "n_rounds": seqs.rounds, "super_tile": seqs.super_tile, **scalars}
    param_map = {}
    for param in func.params:
        ty = param.ty
        if isinstance(ty, tirx.buffer.BufferType):
            shape = [tirx.const(sizes[dim.name], "int64") if isinstance(dim, tvm.ir.expr.Var) else dim
                     for dim in ty.shape]
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
            param_map[param] = tirx.const(values[param.name], ty.dtype)
    return func.specialize(param_map)


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


def standard_kernels(head_dim=64, dtype="float32", causal=False):
    """The unfused TE (forward, backward) PrimFuncs: standard attention."""
    return (attention_te.standard_forward(head_dim, dtype, causal),
            attention_te.standard_backward(head_dim, dtype, causal))


def standard_allocated_bytes(func: tirx.PrimFunc, *, batch, seqlen_q, seqlen_k, heads, heads_k) -> int:
    """``allocated_bytes`` of the unfused TE kernels, whose sizes are plain parameters."""
    sizes = {"batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads": heads, "heads_k": heads_k}
    param_map = {}
    for param in func.params:
        ty = param.ty
        if isinstance(ty, tirx.buffer.BufferType):
            shape = [tirx.const(sizes[d.name], "int64") if isinstance(d, tvm.ir.expr.Var) else d for d in ty.shape]
            param_map[param] = tirx.decl_buffer(shape, ty.dtype, param.name)
    return allocated_bytes(func.specialize(param_map))


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
