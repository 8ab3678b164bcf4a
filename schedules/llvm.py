"""Hand-written CPU (LLVM) schedules for the fused kernels in ``tvmflash/kernels/cpu.py``.

Stages are found by their ``sblock`` names (the contract the kernels' docstrings spell out).
Every matrix product is a block with loops ``(row, col, reduction)``, scheduled as a
register-tiled micro-kernel: ``rows x cols`` fp32 accumulators held in vector registers
(``cols`` = a few vectors), the reduction loop outside the register tile, one vector load +
``rows`` broadcasts feeding ``rows * cols / lanes`` FMAs per step. The tile buffers the products
read are small (a 64 x 64 fp32 tile is 16 KB) and stay in L1/L2. Element-wise stages are
vectorized along their innermost loop; the per-thread ``slot`` loops run in TVM's thread pool.

With ``products="bf16_dot"`` the product blocks reduce over bf16 pairs (loops ``q``, ``t``) and
the register tile's innermost step, one vector of accumulators times one pair, is tensorized
into one ``vdpbf16ps`` (``llvm_bf16.py``; on aarch64, 4 lanes, one ``bfdot``); the kernel's
function then imports that module's LLVM IR helper. With ``products="amx"`` the product blocks
are already calls of AMX micro-kernels (``llvm_amx.py``), which the schedule leaves as they are
and whose IR it imports.

The same code is the autotuner's search space. Every tunable choice goes through a ``Knobs``
object: ``FixedKnobs`` reads it from a ``CPUKernelConfig`` (the hand-written schedule), while
``tune.SampledKnobs`` draws it with ``sch.sample_perfect_tile`` for MetaSchedule. Tile sizes
(``block_q``, ``block_k``) shape the kernels' loop nests, so the tuner explores them as separate
kernels rather than as knobs of one schedule.
"""

from __future__ import annotations

import tvm
from tvm import s_tir

from tvmflash import target as targets
from tvmflash.config import (AMX, BF16_DOT, FP32_FMA, MAX_TILE_ROWS, MAX_TILE_VECTORS, PRODUCTS, CPUKernelConfig,
                             default_arm_config, default_cpu_config)

from . import llvm_amx, llvm_bf16, llvm_transpose


def has_avx512(target: tvm.target.Target) -> bool:
    return targets.has_features(target, "avx512f")


def default_config(target: tvm.target.Target, kernel: str, products: str = FP32_FMA) -> CPUKernelConfig:
    """The hand-written choices for this target's ISA and the given products
    (config.default_cpu_config; which products a dtype gets: ``product_rates.default_products``)."""
    if targets.is_aarch64(target):
        return default_arm_config(kernel, products)
    return default_cpu_config(kernel, has_avx512(target), products)


def _largest_divisor(extent: int, at_most: int) -> int:
    return max(d for d in range(1, min(at_most, extent) + 1) if extent % d == 0)


class FixedKnobs:
    """The hand-written schedule's choices, read from a CPUKernelConfig."""

    def __init__(self, config: CPUKernelConfig):
        self.config = config

    def split(self, sch: s_tir.Schedule, loop, kernel: str, name: str, max_inner: int) -> list:
        block, what = name.rsplit(".", 1)
        tile = self.config.tile(block)
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


def register_tile(sch: s_tir.Schedule, kernel: str, name: str, knobs, lanes: int, block_name=None,
                  bf16_pairs: bool = False) -> None:
    """Schedule a (row, col, reduction) block as a register-tiled micro-kernel.

    Knobs: ``<name>.rows`` (rows of the register tile) and ``<name>.vectors`` (vectors per row).
    ``bf16_pairs``: the block is a bf16 dot product (row, col, pair q, t): the innermost
    (lanes, t) step is tensorized into one ``vdpbf16ps``.
    """
    block = sch.get_sblock(block_name or name)
    row, col, red, *pair = sch.get_loops(block)[-4 if bf16_pairs else -3:]
    width = _vector_width(_extent(sch, col), lanes)
    col_vectors, col_lanes = sch.split(col, [None, width])
    row_o, row_i = sch.split(row, knobs.split(sch, row, kernel, f"{name}.rows", MAX_TILE_ROWS))
    col_o, col_i = sch.split(col_vectors, knobs.split(sch, col_vectors, kernel, f"{name}.vectors",
                                                      MAX_TILE_VECTORS))
    sch.reorder(row_o, col_o, red, row_i, col_i, col_lanes, *pair)
    acc = sch.cache_write(block, 0, "local")  # the accumulators: promoted to registers by LLVM
    sch.reverse_compute_at(acc, col_o, preserve_unit_loops=True)  # same loops for every tile shape
    sch.unroll(row_i)
    sch.unroll(col_i)
    acc_row, acc_col = sch.get_loops(acc)[-2:]
    sch.unroll(acc_row)
    acc_vectors, acc_lanes = sch.split(acc_col, [None, width])
    sch.unroll(acc_vectors)
    sch.vectorize(acc_lanes)
    if not bf16_pairs:
        sch.vectorize(col_lanes)
        sch.decompose_reduction(block, red)
        return
    # The intrinsic describes the update alone: split off the zeroing first, vectorized.
    init = sch.decompose_reduction(block, red)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(col_lanes, llvm_bf16.intrinsic_name(width, _a_operand_dtype(sch, block)))


def _a_operand_dtype(sch: s_tir.Schedule, block) -> str:
    """uint16 where a bf16 dot product's broadcast operand is the bits of two bf16 elements,
    uint32 where it is a pair word (its vector operand is always pair words)."""
    dtypes = {str(region.source.dtype) for region in sch.get(block).reads}
    return "uint16" if "uint16" in dtypes else "uint32"


def _parallel_tiles(sch: s_tir.Schedule, name: str) -> None:
    """A per-tile stage's (heads, tiles) loops, under the kernel's unit region loop, fused and
    parallel."""
    sch.parallel(sch.fuse(*sch.get_loops(sch.get_sblock(name))[1:3]))


def _parallel_slots(sch: s_tir.Schedule, kernel: str, name: str, products: str = FP32_FMA, lanes: int = 16) -> None:
    """The per-thread slot loop in TVM's thread pool: last, after everything inside it is scheduled.

    Marking a loop parallel copies the loop but keeps its body: the block below is then shared
    with the module the schedule started from, and TVM 0.27's schedule state, which checks only
    the loops' and blocks' reference counts, edits later primitives inside it in place, changing
    that module too. MetaSchedule replays every candidate's trace on one task module, so there
    that corrupted the search space. The bf16 products' LLVM helper is imported there too.
    """
    slots = sch.get_loops(sch.get_sblock(name))[-1]
    if products == BF16_DOT:
        llvm_bf16.import_helpers(sch, slots, lanes)
    elif products == AMX:
        llvm_amx.import_helpers(sch, slots, PRODUCTS[kernel])
    elif _calls_transposes(sch):  # (fp32 products only: one pragma_import_llvm per loop)
        llvm_transpose.import_helpers(sch, slots)
    sch.parallel(slots)


def _calls_transposes(sch: s_tir.Schedule) -> bool:
    """Whether the kernel calls the block transposes (its function attribute says so: read off
    the IR, not with a schedule primitive, which MetaSchedule's traces would record)."""
    return any(func.attrs is not None and llvm_transpose.HELPER_ATTR in func.attrs
               for func in sch.mod.functions.values())


# Element-wise stages that differ between the product kinds: the operand packs (kernels/cpu.py).
PACKS = {
    ("forward", FP32_FMA): ("pack_kv",),
    ("forward", BF16_DOT): ("pack_k", "pack_v", "pack_p"),
    ("forward", AMX): ("pack_k", "pack_v", "pack_p"),
    ("backward", FP32_FMA): ("pack_q_do", "pack_k", "pack_kt", "pack_vt"),
    ("backward", BF16_DOT): ("pack_q_do", "pack_q_do_pairs", "pack_k", "pack_kt", "pack_vt", "pack_p", "pack_ds",
                             "pack_ds_pairs"),
    ("backward", AMX): ("pack_q_do", "pack_q_do_t", "pack_k", "pack_kt", "pack_vt", "pack_p", "pack_ds",
                        "pack_ds_pairs"),
}


def schedule_forward(sch: s_tir.Schedule, cfg: CPUKernelConfig, knobs=None) -> s_tir.Schedule:
    knobs = knobs or FixedKnobs(cfg)
    lanes, products = cfg.lanes, cfg.products
    _parallel_tiles(sch, "pack_kv_tile")
    for name in PRODUCTS["forward"] if products != AMX else ():
        register_tile(sch, "forward", name, knobs, lanes, bf16_pairs=products == BF16_DOT)
    for name in (*PACKS["forward", products], "load_q", "init_o", "init_stats", "settle_max", "rescale", "probs",
                 "store_o", *(("inverse_l",) if _calls_transposes(sch) else ())):
        _vectorize_elementwise(sch, name, lanes)
    for name in ("row_max", "row_sum"):
        _vectorize_row_reduction(sch, name, lanes)
    _parallel_slots(sch, "forward", "slot", products, lanes)
    _one_region(sch, "pack_kv_tile")
    return sch


def _one_region(sch: s_tir.Schedule, packs: str) -> None:
    """The kernel's parallel loops as one region: its outer unit loop (kernels/cpu.py) becomes
    the launch point, and the loop of the stage ``packs`` (the last of the packs) ends with a
    barrier. Each region costs a wake-up and a join of the team (1.6-2.3 us on a 2-vCPU VM:
    DEVELOPING.md, "Threads"); the kernel's stages between barriers are all parallel loops (a
    serial statement in the region would run once per thread)."""
    region, stage = sch.get_loops(sch.get_sblock(packs))[:2]
    sch.annotate(region, "pragma_parallel_launch_point", 1)
    sch.annotate(stage, "pragma_parallel_barrier_when_finish", 1)


def schedule_backward(sch: s_tir.Schedule, cfg: CPUKernelConfig, knobs=None) -> s_tir.Schedule:
    knobs = knobs or FixedKnobs(cfg)
    lanes, products = cfg.lanes, cfg.products
    for tile_block in ("prepare_q_tile", "prepare_k_tile", "store_dq_tile", "store_dkv_tile"):
        _parallel_tiles(sch, tile_block)
    packs = [name for name in PACKS["backward", products] if name != "pack_kt" or not _calls_transposes(sch)]
    for name in (*packs, "zero_dq", "zero_dkv", "store_dq", "store_dkv"):  # (K^T: block transposes, if called)
        _vectorize_elementwise(sch, name, lanes)
    for name in PRODUCTS["backward"] if products != AMX else ():
        register_tile(sch, "backward", name, knobs, lanes, bf16_pairs=products == BF16_DOT)
    for name in ("init_dkv", "load_row_stats", "probs", "dscores"):
        _vectorize_elementwise(sch, name, lanes)
    _parallel_slots(sch, "backward", "round_slot", products, lanes)
    _one_region(sch, "prepare_k_tile")  # (after both packs: prepare_q_tile's loop precedes it)
    sch.annotate(sch.get_loops(sch.get_sblock("round_slot"))[-1], "pragma_parallel_barrier_when_finish", 1)
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
