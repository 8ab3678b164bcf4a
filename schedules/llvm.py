"""Hand-written CPU (LLVM) schedules for the fused kernels in ``tvmflash/kernels.py``.

Every matrix product of the kernels is a block with loops ``(row, col, reduction)``. It is
scheduled as a register-tiled micro-kernel: ``rows x cols`` fp32 accumulators held in vector
registers (``cols`` = a few vectors), the reduction loop outside the register tile, one vector
load + ``rows`` broadcasts feeding ``rows * cols / lanes`` FMAs per step. The tile buffers the
products read are small (a 64 x 64 fp32 tile is 16 KB) and stay in L1/L2.

The same code is the autotuner's search space. Every tunable choice goes through a ``Knobs``
object: ``FixedKnobs`` reads it from an ``LLVMConfig`` (the hand-written schedule), while
``tune.SampledKnobs`` draws it with ``sch.sample_perfect_tile`` for MetaSchedule. Tile sizes
(``forward_blocks``, ``backward_blocks``) shape the kernels' loop nests, so the tuner explores
them as separate kernels rather than as knobs of one schedule.

Defaults (``default_config``) follow from the ISA: AVX-512 has 32 vector registers of 16
floats, AVX2 16 registers of 8 floats; an FMA has a latency of ~4 cycles and two issue ports, so
at least 8 independent accumulators keep both busy, and accumulators + operands must fit the
register file. Measured on Emerald Rapids (DEVELOPING.md): 16 accumulators, 4 x 4 vectors in the
forward and 8 x 2 in the backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import tvm
import tvm_ffi
from tvm import s_tir

# (row, col, reduction) products of each kernel, by block name.
FORWARD_PRODUCTS = ("scores", "pv")
BACKWARD_PRODUCTS = ("scores", "dv", "dprobs", "dk", "dq")
PRODUCTS = {"forward": FORWARD_PRODUCTS, "backward": BACKWARD_PRODUCTS}
MAX_TILE_ROWS = 8
MAX_TILE_VECTORS = 4


@dataclass(frozen=True)
class RegisterTile:
    rows: int
    vectors: int  # accumulator vectors per row


@dataclass(frozen=True)
class LLVMConfig:
    """Knobs of the CPU schedules (also the search space of the autotuner)."""

    forward_blocks: tuple = (64, 64)  # (query rows, key rows) per tile: part of the loop nests
    backward_blocks: tuple = (64, 64)
    lanes: int = 16  # fp32 lanes of one vector register
    # Register tile of each matrix product, by block name.
    forward_tiles: tuple = tuple((name, RegisterTile(4, 4)) for name in FORWARD_PRODUCTS)
    backward_tiles: tuple = tuple((name, RegisterTile(8, 2)) for name in BACKWARD_PRODUCTS)

    def blocks(self, kernel: str) -> tuple:
        return tuple(self.forward_blocks if kernel == "forward" else self.backward_blocks)

    def tile(self, kernel: str, block: str) -> RegisterTile:
        return dict(self.forward_tiles if kernel == "forward" else self.backward_tiles)[block]

    def with_tiles(self, kernel: str, **tiles: RegisterTile) -> LLVMConfig:
        field_name = f"{kernel}_tiles"
        merged = {**dict(getattr(self, field_name)), **tiles}
        return replace(self, **{field_name: tuple(merged.items())})

    def to_json(self) -> dict:
        d = asdict(self)
        for kernel in PRODUCTS:
            d[f"{kernel}_blocks"] = list(self.blocks(kernel))
            d[f"{kernel}_tiles"] = {block: [t.rows, t.vectors] for block, t in getattr(self, f"{kernel}_tiles")}
        return d

    @classmethod
    def from_json(cls, d: dict) -> LLVMConfig:
        d = dict(d)
        for kernel in PRODUCTS:
            d[f"{kernel}_blocks"] = tuple(d[f"{kernel}_blocks"])
            d[f"{kernel}_tiles"] = tuple((block, RegisterTile(*rv)) for block, rv in d[f"{kernel}_tiles"].items())
        return cls(**d)


def has_avx512(target: tvm.target.Target) -> bool:
    return bool(tvm_ffi.get_global_func("target.llvm_cpu_has_feature")("avx512f", target))


def default_config(target: tvm.target.Target, head_dim: int, dtype: str, causal: bool) -> LLVMConfig:
    if has_avx512(target):
        return LLVMConfig(lanes=16)
    small = RegisterTile(4, 2)  # 8 accumulators + 2 loads + 1 broadcast of 16 AVX2 registers
    return LLVMConfig(lanes=8, forward_tiles=tuple((n, small) for n in FORWARD_PRODUCTS),
                      backward_tiles=tuple((n, small) for n in BACKWARD_PRODUCTS))


def _largest_divisor(extent: int, at_most: int) -> int:
    return max(d for d in range(1, min(at_most, extent) + 1) if extent % d == 0)


class FixedKnobs:
    """The hand-written schedule's choices, read from an LLVMConfig."""

    def __init__(self, config: LLVMConfig):
        self.config = config

    def split(self, sch: s_tir.Schedule, loop, kernel: str, name: str, max_inner: int) -> list:
        block, what = name.rsplit(".", 1)
        tile = self.config.tile(kernel, block)
        wanted = tile.rows if what == "rows" else tile.vectors
        return [None, _largest_divisor(_extent(sch, loop), min(wanted, max_inner))]


def _extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def _vector_width(extent: int, lanes: int) -> int:
    """Widest power-of-two vector <= lanes dividing the extent (head dims: multiples of 8)."""
    width = lanes
    while extent % width:
        width //= 2
    return width


def _vectorize_loop(sch: s_tir.Schedule, loop, lanes: int) -> None:
    _, inner = sch.split(loop, [None, _vector_width(_extent(sch, loop), lanes)])
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


def _instances(sch: s_tir.Schedule, name: str) -> list[str]:
    """``name`` and its repeats: a macro stage expanded twice gets ``_1`` appended (kernels.py)."""
    found = [name]
    try:
        sch.get_sblock(f"{name}_1")
        found.append(f"{name}_1")
    except s_tir.schedule.ScheduleError:  # no such block: the usual case
        pass
    return found


def register_tile(sch: s_tir.Schedule, kernel: str, name: str, knobs, lanes: int, block_name=None) -> None:
    """Schedule a (row, col, reduction) block as a register-tiled micro-kernel.

    Knobs: ``<name>.rows`` (rows of the register tile) and ``<name>.vectors`` (vectors per row).
    """
    block = sch.get_sblock(block_name or name)
    row, col, red = sch.get_loops(block)[-3:]
    width = _vector_width(_extent(sch, col), lanes)
    col_vectors, col_lanes = sch.split(col, [None, width])
    row_o, row_i = sch.split(row, knobs.split(sch, row, kernel, f"{name}.rows", MAX_TILE_ROWS))
    col_o, col_i = sch.split(col_vectors, knobs.split(sch, col_vectors, kernel, f"{name}.vectors",
                                                      MAX_TILE_VECTORS))
    sch.reorder(row_o, col_o, red, row_i, col_i, col_lanes)
    acc = sch.cache_write(block, 0, "local")  # the accumulators: promoted to registers by LLVM
    sch.reverse_compute_at(acc, col_o, preserve_unit_loops=True)  # same loops for every tile shape
    sch.unroll(row_i)
    sch.unroll(col_i)
    sch.vectorize(col_lanes)
    acc_row, acc_col = sch.get_loops(acc)[-2:]
    sch.unroll(acc_row)
    acc_vectors, acc_lanes = sch.split(acc_col, [None, width])
    sch.unroll(acc_vectors)
    sch.vectorize(acc_lanes)
    sch.decompose_reduction(block, red)


def _parallel(sch: s_tir.Schedule, name: str, n_outer: int, vectorize_inner: int | None = None):
    loops = sch.get_loops(sch.get_sblock(name))
    sch.parallel(sch.fuse(*loops[:n_outer]))
    if vectorize_inner:
        _vectorize_loop(sch, loops[-1], vectorize_inner)


def schedule_forward(sch: s_tir.Schedule, cfg: LLVMConfig, knobs=None) -> s_tir.Schedule:
    knobs = knobs or FixedKnobs(cfg)
    lanes = cfg.lanes
    _parallel(sch, "pack_kv", 3, lanes)
    _parallel(sch, "q_tile", 4)
    for name in FORWARD_PRODUCTS:
        register_tile(sch, "forward", name, knobs, lanes)
    for name in ("load_q", "init_o", "init_stats", "rescale", "probs", "store_o"):
        _vectorize_elementwise(sch, name, lanes)
    for name in ("row_max", "row_sum"):
        _vectorize_row_reduction(sch, name, lanes)
    return sch


def schedule_backward(sch: s_tir.Schedule, cfg: LLVMConfig, knobs=None) -> s_tir.Schedule:
    knobs = knobs or FixedKnobs(cfg)
    lanes = cfg.lanes
    _parallel(sch, "pack_q_do", 4, lanes)
    _parallel(sch, "delta", 4)
    _parallel(sch, "lse_log2", 4)
    _parallel(sch, "zero_dq", 5, lanes)
    _parallel(sch, "kv_split", 3)
    for name in BACKWARD_PRODUCTS:
        for block in _instances(sch, name):
            register_tile(sch, "backward", name, knobs, lanes, block)
    for name in ("load_k", "load_kt", "load_vt", "init_dkv", "load_row_stats", "probs", "dscores", "store_dkv"):
        for block in _instances(sch, name):
            _vectorize_elementwise(sch, block, lanes)
    block = sch.get_sblock("sum_dq")
    loops = sch.get_loops(block)
    sch.parallel(sch.fuse(*loops[:4]))
    _vectorize_loop(sch, loops[-1], lanes)
    sch.decompose_reduction(block, loops[4])
    _parallel(sch, "store_dq", 4, lanes)
    return sch


SCHEDULES = {"forward": schedule_forward, "backward": schedule_backward}


def schedule_standard(sch: s_tir.Schedule) -> s_tir.Schedule:
    """Plain schedule for the unfused TE baseline: inline the masking, parallel outer loops."""
    sch.compute_inline(sch.get_sblock("scores"))
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        if len(loops) >= 2:
            sch.parallel(sch.fuse(*loops[:2]))
    return sch
