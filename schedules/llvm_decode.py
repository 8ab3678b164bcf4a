"""CPU (LLVM) schedule of the decode kernel in ``tvmflash/kernels/decode.py``, by block name.

* ``scores``: S = Q . K^T with the head dim in vector lanes: per key, ``D / lanes`` vector
  loads of the cache row (converted to fp32 on load) feed ``block_rows`` FMAs each, into
  ``keys x block_rows`` accumulator vectors held in registers; the kernel's shuffle tree then
  sums their lanes.
* ``pv``: O += P . V as the register-tiled micro-kernel of ``schedules/llvm.py`` (rows x vectors
  of the head dim in registers, the keys outside: one V row load feeds ``rows`` FMAs).
* element-wise stages vectorized along their innermost loop; the task slots and the merge run
  in TVM's thread pool.
"""

from __future__ import annotations

from tvm import s_tir

from tvmflash.config import DecodeConfig

from .llvm import _extent, _largest_divisor, _vectorize_elementwise, _vectorize_row_reduction, register_tile


class _Knobs:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg

    def split(self, sch, loop, kernel, name, max_inner):
        block, what = name.rsplit(".", 1)
        tile = self.cfg.tile(block)
        wanted = tile.rows if what == "rows" else tile.vectors
        return [None, _largest_divisor(_extent(sch, loop), min(wanted, max_inner))]


def _scores(sch: s_tir.Schedule) -> None:
    """The score register tile (loops c, key, row, lane under the key-group loop) unrolled and
    vectorized along the lanes: LLVM keeps its accumulators in registers."""
    block = sch.get_sblock("scores")
    c, j, i, lane = sch.get_loops(block)[-4:]
    for loop in (c, j, i):
        sch.unroll(loop)
    sch.vectorize(lane)
    init = sch.decompose_reduction(block, c)
    j, i, lane = sch.get_loops(init)[-3:]
    sch.unroll(j)
    sch.unroll(i)
    sch.vectorize(lane)


def schedule_decode(sch: s_tir.Schedule, cfg: DecodeConfig, head_dim: int) -> s_tir.Schedule:
    lanes = cfg.lanes
    sch.parallel(sch.get_loops(sch.get_sblock("slot"))[-1])
    merge_loops = sch.get_loops(sch.get_sblock("merge"))
    sch.parallel(sch.fuse(*merge_loops[-2:]))
    _scores(sch)
    register_tile(sch, "decode", "pv", _Knobs(cfg), lanes)
    for name in ("load_q", "init_o", "load_scores", "probs", "merge_init", "merge_store"):
        _vectorize_elementwise(sch, name, lanes)
    for name in ("row_max_lanes", "row_sum_lanes"):
        _vectorize_row_reduction(sch, name, lanes)
    return sch
