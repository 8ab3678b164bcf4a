"""Hand-written CPU (LLVM) schedules for the fused kernels in ``tvmflash/kernels.py``.

Every matrix product of the kernels is a block with loops ``(row, col, reduction)``. It is
scheduled as a register-tiled micro-kernel: ``rows x cols`` fp32 accumulators held in vector
registers (``cols`` = a few vectors), the reduction loop outside the register tile, one vector
load + ``rows`` broadcasts feeding ``rows * cols / lanes`` FMAs per step. The tile buffers the
products read are small (a 64 x 64 fp32 tile is 16 KB) and stay in L1/L2.

The knobs are in ``LLVMConfig``: tile sizes (they shape the kernel's loop nest), vector width
and the register tile of each product. ``default_config`` picks them from the target's ISA:
AVX-512 has 32 vector registers of 16 floats, AVX2 16 registers of 8 floats; an FMA has a
latency of ~4 cycles and two issue ports, so at least 8 independent accumulators keep both
busy, and accumulators + operands must fit the register file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import tvm
import tvm_ffi
from tvm import s_tir

# (row, col, reduction) products of each kernel, by block name.
FORWARD_PRODUCTS = ("scores", "pv")
BACKWARD_PRODUCTS = ("scores", "dv", "dprobs", "dk", "dq")


@dataclass(frozen=True)
class RegisterTile:
    rows: int
    vectors: int  # accumulator vectors per row


@dataclass(frozen=True)
class LLVMConfig:
    """Knobs of the CPU schedules (also the search space of the autotuner)."""

    block_q: int = 64  # query rows per tile (part of the kernels' loop nests)
    block_k: int = 64  # key rows per tile
    lanes: int = 16  # fp32 lanes of one vector register
    # Register tile of each matrix product, by block name.
    forward_tiles: tuple = tuple((name, RegisterTile(4, 4)) for name in FORWARD_PRODUCTS)
    backward_tiles: tuple = tuple((name, RegisterTile(8, 2)) for name in BACKWARD_PRODUCTS)

    def tile(self, kernel: str, block: str) -> RegisterTile:
        return dict(self.forward_tiles if kernel == "forward" else self.backward_tiles)[block]

    def with_tiles(self, kernel: str, **tiles: RegisterTile) -> LLVMConfig:
        field_name = f"{kernel}_tiles"
        merged = {**dict(getattr(self, field_name)), **tiles}
        return replace(self, **{field_name: tuple(merged.items())})

    def to_json(self) -> dict:
        d = asdict(self)
        for name in ("forward_tiles", "backward_tiles"):
            d[name] = {block: [t.rows, t.vectors] for block, t in getattr(self, name)}
        return d

    @classmethod
    def from_json(cls, d: dict) -> LLVMConfig:
        d = dict(d)
        for name in ("forward_tiles", "backward_tiles"):
            d[name] = tuple((block, RegisterTile(*rv)) for block, rv in d[name].items())
        return cls(**d)


def has_avx512(target: tvm.target.Target) -> bool:
    return bool(tvm_ffi.get_global_func("target.llvm_cpu_has_feature")("avx512f", target))


def default_config(target: tvm.target.Target, head_dim: int, dtype: str, causal: bool) -> LLVMConfig:
    """Measured defaults (DEVELOPING.md): AVX-512, 32 registers of 16 floats: 16 accumulators
    (4 x 4 vectors in the forward, 8 x 2 in the backward); AVX2, 16 registers of 8 floats:
    8 accumulators (4 x 2 vectors) leave room for the operands."""
    if has_avx512(target):
        return LLVMConfig(lanes=16)
    small = RegisterTile(4, 2)
    return LLVMConfig(lanes=8, forward_tiles=tuple((n, small) for n in FORWARD_PRODUCTS),
                      backward_tiles=tuple((n, small) for n in BACKWARD_PRODUCTS))


def _fit(extent: int, preferred: int, step: int) -> int:
    """Largest multiple of ``step`` that divides ``extent`` and is <= ``preferred`` (>= step)."""
    best = step
    for cand in range(step, min(preferred, extent) + 1, step):
        if extent % cand == 0:
            best = cand
    return best


def _extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def _vector_width(extent: int, lanes: int) -> int:
    """Widest power-of-two vector <= lanes dividing the extent (head dims: multiples of 8)."""
    width = lanes
    while extent % width:
        width //= 2
    return width


def _vectorize_loop(sch: s_tir.Schedule, loop, lanes: int) -> None:
    width = _vector_width(_extent(sch, loop), lanes)
    if width == 1:
        return
    _, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)


def _vectorize_elementwise(sch: s_tir.Schedule, name: str, lanes: int) -> None:
    _vectorize_loop(sch, sch.get_loops(sch.get_sblock(name))[-1], lanes)


def _vectorize_row_reduction(sch: s_tir.Schedule, name: str, lanes: int) -> None:
    """Blocks with loops (reduction, spatial): vector along the spatial loop."""
    block = sch.get_sblock(name)
    red, col = sch.get_loops(block)[-2:]
    _vectorize_loop(sch, col, lanes)
    init = sch.decompose_reduction(block, red)
    _vectorize_loop(sch, sch.get_loops(init)[-1], lanes)


def register_tile(sch: s_tir.Schedule, name: str, tile: RegisterTile, lanes: int) -> None:
    """Schedule a (row, col, reduction) block as a register-tiled micro-kernel."""
    block = sch.get_sblock(name)
    row, col, red = sch.get_loops(block)[-3:]
    col_extent = _extent(sch, col)
    width = _vector_width(col_extent, lanes)
    cols = _fit(col_extent, tile.vectors * lanes, width)
    rows = _fit(_extent(sch, row), tile.rows, 1)
    row_o, row_i = sch.split(row, [None, rows])
    col_o, col_i = sch.split(col, [None, cols])
    sch.reorder(row_o, col_o, red, row_i, col_i)
    acc = sch.cache_write(block, 0, "local")  # the accumulators: promoted to registers by LLVM
    sch.reverse_compute_at(acc, col_o)
    for b in (block, acc):
        r, c = sch.get_loops(b)[-2:]
        sch.unroll(r)
        c_o, c_v = sch.split(c, [None, width])
        sch.unroll(c_o)
        sch.vectorize(c_v)
    sch.decompose_reduction(block, red)


def _parallel(sch: s_tir.Schedule, name: str, n_outer: int, vectorize_inner: int | None = None):
    loops = sch.get_loops(sch.get_sblock(name))
    sch.parallel(sch.fuse(*loops[:n_outer]))
    if vectorize_inner:
        _vectorize_loop(sch, loops[-1], vectorize_inner)


def schedule_forward(sch: s_tir.Schedule, cfg: LLVMConfig) -> s_tir.Schedule:
    lanes = cfg.lanes
    _parallel(sch, "pack_kv", 3, lanes)
    _parallel(sch, "q_tile", 4)
    for name in FORWARD_PRODUCTS:
        register_tile(sch, name, cfg.tile("forward", name), lanes)
    for name in ("load_q", "init_o", "init_stats", "rescale", "probs", "store_o"):
        _vectorize_elementwise(sch, name, lanes)
    for name in ("row_max", "row_sum"):
        _vectorize_row_reduction(sch, name, lanes)
    return sch


def schedule_backward(sch: s_tir.Schedule, cfg: LLVMConfig) -> s_tir.Schedule:
    lanes = cfg.lanes
    _parallel(sch, "pack_q_do", 4, lanes)
    _parallel(sch, "delta", 4)
    _parallel(sch, "lse_log2", 4)
    _parallel(sch, "zero_dq", 5, lanes)
    _parallel(sch, "kv_split", 3)
    for name in BACKWARD_PRODUCTS:
        register_tile(sch, name, cfg.tile("backward", name), lanes)
    for name in ("load_k", "load_kt", "load_vt", "init_dkv", "load_row_stats", "probs", "dscores", "store_dkv"):
        _vectorize_elementwise(sch, name, lanes)
    block = sch.get_sblock("sum_dq")
    loops = sch.get_loops(block)
    sch.parallel(sch.fuse(*loops[:4]))
    _vectorize_loop(sch, loops[-1], lanes)
    sch.decompose_reduction(block, loops[4])
    _parallel(sch, "store_dq", 4, lanes)
    return sch


def schedule_standard(sch: s_tir.Schedule) -> s_tir.Schedule:
    """Plain schedule for the unfused TE baseline: inline the masking, parallel outer loops."""
    sch.compute_inline(sch.get_sblock("scores"))
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        if len(loops) >= 2:
            sch.parallel(sch.fuse(*loops[:2]))
    return sch
