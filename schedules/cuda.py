"""Hand-written CUDA schedules for the tensor-core kernels in ``tvmflash/kernels/cuda.py``.

The kernels already have the FlashAttention-2 shape (a thread block per (query tile, batch*head),
a warp per 16 query rows, tiles in the ``mma.m16n8k16`` register layout), so scheduling is:

* bind: batch*head and the tile index to ``blockIdx``, warps to ``threadIdx.y``, lanes to
  ``threadIdx.x``; every other per-lane loop is unrolled so its fragments live in registers;
* memory scopes: Q/K/V tiles in dynamic shared memory (rows padded by 16 bytes so the eight
  row addresses of one ``ldmatrix`` hit different banks), fragments and per-row statistics in
  ``warp`` scope (TVM lowers a ``[32, n]`` warp buffer to ``n`` registers per lane, and a read
  of another lane's element to a ``__shfl_sync``: the row max/sum exchange needs no barrier);
* tile loads: fused, vectorized 16-byte copies spread over all threads of the block;
* tensor cores: the 16 x 16 fragment loads become ``ldmatrix`` and the 16 x 16 x 16 products
  two ``mma.sync.m16n8k16`` each (fp32 accumulators), by tensorization with the intrinsics
  below. TVM 0.27 ships them for fp16 only; ours are written for fp16 and bf16 alike (same
  shape, same register layout, only the operand type differs).
"""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from tvmflash.config import CUDAKernelConfig
from tvmflash.kernels.cuda_stages import frag
from tvmflash.spec import AttentionSpec

WARP = 32
SHORT_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


# --- tensor-core intrinsics --------------------------------------------------------------
# A 16 x 16 fragment is a warp buffer [32 lanes, 8 slots] indexed by ``frag`` (the mma
# accumulator layout). For A operands and accumulators this is also the physical register
# layout; for B operands it is only a naming, used consistently by the ldmatrix that fills
# the fragment and the mma that reads it.


def _ldmatrix_intrin(dtype: str, operand: str, scope: str):
    """16 x 16 shared tile -> fragment with one ``ldmatrix.x4``.

    operand "A": tile [row, k] (Q); "B": tile [k, col] (V), loaded transposed;
    "B_trans": tile [col, k] (K, whose rows are the columns of K^T), loaded as is;
    "A_trans": tile [k, row] (dS^T in the backward), loaded transposed into an A fragment.
    Each lane passes the address of one 8-element row of one of the four 8 x 8 matrices.
    """
    if operand in ("B_trans", "A_trans"):
        transpose = operand == "A_trans"
        row_of_lane = lambda tx: 8 * (tx // 16) + tx % 8  # noqa: E731
        col_of_lane = lambda tx: 8 * (tx % 16 // 8)  # noqa: E731
    else:
        transpose = operand == "B"
        row_of_lane = lambda tx: tx % 16  # noqa: E731
        col_of_lane = lambda tx: 8 * (tx // 16)  # noqa: E731

    @T.prim_func(s_tir=True)
    def desc(frag_h: T.handle, tile_h: T.handle) -> None:
        tile = T.match_buffer(tile_h, (16, 16), dtype, align=64, offset_factor=16, scope=scope)
        fr = T.match_buffer(frag_h, (WARP, 8), dtype, offset_factor=8, scope="warp")
        with T.sblock("root"):
            T.reads(tile[0:16, 0:16])
            T.writes(fr[0:WARP, 0:8])
            for r, c in T.grid(16, 16):
                with T.sblock("load"):
                    vr, vc = T.axis.remap("SS", [r, c])
                    lane, slot = T.meta_var(frag(vc, vr) if operand == "A_trans" else frag(vr, vc))
                    fr[lane, slot] = tile[vr, vc]

    @T.prim_func(s_tir=True)
    def impl(frag_h: T.handle, tile_h: T.handle) -> None:
        stride = T.int32()
        unit = T.int32()
        tile = T.match_buffer(tile_h, (16, 16), dtype, align=64, offset_factor=16, scope=scope,
                              strides=[stride, unit])
        fr = T.match_buffer(frag_h, (WARP, 8), dtype, offset_factor=8, scope="warp")
        with T.sblock("root"):
            T.reads(tile[0:16, 0:16])
            T.writes(fr[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(
                    transpose, 4, ".b16", fr.data, fr.elem_offset + 8 * tx, tile.access_ptr("r"),
                    stride * row_of_lane(tx) + col_of_lane(tx), dtype=dtype))

    return desc, impl


def _mma_intrin(dtype: str, b_transposed: bool):
    """C[16 x 16, fp32] += A[16 x 16] B[16 x 16] as two ``mma.sync.m16n8k16`` (one per 8 columns)."""
    short = SHORT_NAMES[dtype]

    def b_index(k, n):
        return frag(n, k) if b_transposed else frag(k, n)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, offset_factor=8, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, offset_factor=8, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", offset_factor=8, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for i, j, k in T.grid(16, 16, 16):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c_lane, c_slot = T.meta_var(frag(vi, vj))
                    a_lane, a_slot = T.meta_var(frag(vi, vk))
                    b_lane, b_slot = T.meta_var(b_index(vk, vj))
                    C[c_lane, c_slot] = C[c_lane, c_slot] + T.Cast("float32", A[a_lane, a_slot]) * T.Cast(
                        "float32", B[b_lane, b_slot])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, offset_factor=8, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, offset_factor=8, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", offset_factor=8, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):  # columns 8 * half ... 8 * half + 7
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", short, short, "fp32",
                        A.data, A.elem_offset + 8 * tx, B.data, B.elem_offset + 8 * tx + 4 * half,
                        C.data, C.elem_offset + 8 * tx + 4 * half, False, dtype="float32"))

    return desc, impl


def intrinsic(kind: str, dtype: str, *args) -> str:
    """Name of our tensor intrinsic, registering it on first use."""
    name = f"tvmflash_{kind}_{dtype}_" + "_".join(map(str, args))
    if name not in _REGISTERED:
        maker = {"ldmatrix": _ldmatrix_intrin, "mma": _mma_intrin}[kind]
        TensorIntrin.register(name, *maker(dtype, *args), override=True)
        _REGISTERED.add(name)
    return name


_REGISTERED: set = set()


# --- schedules ---------------------------------------------------------------------------
# Scopes of the kernels' tile buffers, by (producer block, written buffer index).
SHARED_TILES = {"load_q": 0, "load_k": 0, "load_v": 0}
FORWARD_FRAGMENTS = (("ldmatrix_q", 0), ("ldmatrix_k", 0), ("ldmatrix_v", 0), ("init_s", 0),
                     ("cast_p", 0), ("init_o", 0), ("init_stats", 0), ("init_stats", 1),
                     ("row_max", 0), ("rescale", 0), ("row_max_lane", 0), ("row_max_pair", 0), ("inverse_sum", 0))
FORWARD_LANE_STAGES = ("init_o", "init_stats", "init_s", "row_max_lane", "row_max_pair", "row_max", "rescale",
                       "probs", "cast_p", "row_sum_lane", "row_sum_pair", "row_sum", "rescale_o", "keep_max",
                       "inverse_sum", "stage_o", "store_lse")
# (product, the fragment loads it consumes as which ldmatrix operand, mma B operand transposed?)
FORWARD_PRODUCTS = (("scores", (("ldmatrix_k", "B_trans"),), True),
                    ("pv", (("ldmatrix_v", "B"),), False))


def _loop(sch, block, name: str):
    for loop in sch.get_loops(block):
        if sch.get(loop).loop_var.name == name:
            return loop
    raise KeyError(f"block {sch.get(block).name_hint} has no loop {name}")


def _own_loops(sch, block):
    """The loops of one stage: from its warp loop ``w`` inward."""
    loops = sch.get_loops(block)
    names = [sch.get(loop).loop_var.name for loop in loops]
    return loops[names.index("w"):]


def _bind_grid(sch, root: str, names=("qt", "bh")):
    block = sch.get_sblock(root)
    for name, axis in zip(names, ("blockIdx.x", "blockIdx.y")):
        sch.bind(_loop(sch, block, name), axis)


def _schedule_lane_stage(sch, name: str) -> None:
    """Element-wise / per-row stages on fragments: warp -> threadIdx.y, lane -> threadIdx.x."""
    block = sch.get_sblock(name)
    loops = _own_loops(sch, block)
    names = [sch.get(loop).loop_var.name for loop in loops]
    warp, lane = loops[0], loops[names.index("tx")]
    rest = [loop for loop in loops[1:] if loop != lane]
    sch.reorder(warp, lane, *rest)
    sch.bind(warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    for loop in rest:
        sch.unroll(loop)


def _schedule_tile_load(sch, name: str, cfg: CUDAKernelConfig, dtype_bytes: int, warps: int) -> None:
    """Global -> shared copy of one tile by the whole block, 16 bytes per thread per step."""
    block = sch.get_sblock(name)
    rows, cols = sch.get_loops(block)[-2:]
    vector = cfg.vector_bytes // dtype_bytes
    head_dim = sch.get(cols).extent.value
    sch.storage_align(block, 0, axis=0, factor=head_dim, offset=cfg.pad_bytes // dtype_bytes)
    outer, warp, lane, vec = sch.split(sch.fuse(rows, cols), [None, warps, WARP, vector])
    sch.bind(warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    sch.vectorize(vec)
    sch.unroll(outer)


def _schedule_tile_store(sch, name: str, warps: int) -> None:
    """Shared -> global copy of whole rows (loops row, 16-byte chunk, element) by the block:
    one 16-byte store per thread and step; the row test sits outside the vector."""
    block = sch.get_sblock(name)
    rows, chunks, vec = sch.get_loops(block)[-3:]
    outer, warp, lane = sch.split(sch.fuse(rows, chunks), [None, warps, WARP])
    sch.bind(warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    sch.vectorize(vec)
    sch.unroll(outer)


def _schedule_product(sch, name: str, loads, b_transposed: bool, dtype: str) -> None:
    """One warp-level product (``kernels/cuda_stages.mma``: loops warp, tiles..., 16 x 16 x 16): its
    fragment loads at its innermost tile loop, where their tile changes (A operands reused
    across that loop are loaded once per outer step), then ldmatrix + mma."""
    block = sch.get_sblock(name)
    loops = _own_loops(sch, block)
    for load, operand in loads:
        sch.compute_at(sch.get_sblock(load), loops[-4])
    loops = _own_loops(sch, block)
    sch.bind(loops[0], "threadIdx.y")
    for loop in loops[1:-3]:
        sch.unroll(loop)
    sch.tensorize(loops[-3], intrinsic("mma", dtype, b_transposed))
    for load, operand in loads:
        sch.tensorize(sch.get_loops(sch.get_sblock(load))[-2], intrinsic("ldmatrix", dtype, operand, "shared.dyn"))


def _set_scopes(sch, fragments) -> None:
    for name, index in SHARED_TILES.items():
        sch.set_scope(sch.get_sblock(name), index, "shared.dyn")
    for name, index in fragments:
        sch.set_scope(sch.get_sblock(name), index, "warp")


def schedule_forward(sch: s_tir.Schedule, cfg: CUDAKernelConfig, spec: AttentionSpec, warps: int) -> None:
    dtype = spec.dtype
    dtype_bytes = tvm.runtime.DataType(dtype).bits // 8
    _set_scopes(sch, FORWARD_FRAGMENTS)
    _bind_grid(sch, "q_tile")
    for name in ("load_q", "load_k", "load_v"):
        _schedule_tile_load(sch, name, cfg, dtype_bytes, warps)
    q_load = sch.get_sblock("ldmatrix_q")
    loops = _own_loops(sch, q_load)
    sch.bind(loops[0], "threadIdx.y")
    sch.unroll(loops[1])
    sch.tensorize(loops[2], intrinsic("ldmatrix", dtype, "A", "shared.dyn"))
    for name, loads, b_transposed in FORWARD_PRODUCTS:
        _schedule_product(sch, name, loads, b_transposed, dtype)
    for name in FORWARD_LANE_STAGES + (("score_mod",) if spec.score_mods else ()):
        _schedule_lane_stage(sch, name)
    _schedule_tile_store(sch, "store_o", warps)


BACKWARD_SHARED = (("load_q", 0), ("load_do", 0), ("load_k", 0), ("load_v", 0))
BACKWARD_FRAGMENTS = (("ldmatrix_k", 0), ("ldmatrix_qt", 0), ("init_s", 0), ("cast_p", 0), ("ldmatrix_do", 0),
                      ("ldmatrix_v", 0), ("ldmatrix_dot", 0), ("init_dp", 0), ("dscores", 0), ("ldmatrix_q", 0),
                      ("ldmatrix_ds", 0), ("ldmatrix_kb", 0), ("init_dq", 0), ("init_dkv", 0), ("init_dkv", 1))
BACKWARD_LANE_STAGES = ("init_dkv", "init_s", "probs", "cast_p", "init_dp", "dscores", "store_ds", "init_dq",
                        "add_dq", "stage_dkv")
# Fragment loads that are a stage of their own (each tile loaded once, used by a later loop).
BACKWARD_FRAGMENT_STAGES = (("ldmatrix_ds", "A_trans", "shared"),)
BACKWARD_PRODUCTS = (("scores", (("ldmatrix_k", "A"), ("ldmatrix_qt", "B_trans")), True),
                     ("dv", (("ldmatrix_do", "B"),), False),
                     ("dprobs", (("ldmatrix_v", "A"), ("ldmatrix_dot", "B_trans")), True),
                     ("dk", (("ldmatrix_q", "B"),), False),
                     ("dq", (("ldmatrix_kb", "B"),), False))


def _schedule_fragment_stage(sch, name: str, operand: str, scope: str, dtype: str) -> None:
    """Fragment loads of all tiles of a warp at once: warp -> threadIdx.y, one ldmatrix per tile."""
    loops = _own_loops(sch, sch.get_sblock(name))
    sch.bind(loops[0], "threadIdx.y")
    for loop in loops[1:-2]:
        sch.unroll(loop)
    sch.tensorize(loops[-2], intrinsic("ldmatrix", dtype, operand, scope))


def _schedule_row_load(sch, name: str, warps: int) -> None:
    """A few fp32 values per query row (LSE, Delta) -> shared memory, one per thread."""
    block = sch.get_sblock(name)
    _, warp, lane = sch.split(sch.fuse(*sch.get_loops(block)[-2:]), [None, warps, WARP])
    sch.bind(warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")


def schedule_backward(sch: s_tir.Schedule, cfg: CUDAKernelConfig, spec: AttentionSpec, warps: int) -> None:
    dtype = spec.dtype
    dtype_bytes = tvm.runtime.DataType(dtype).bits // 8
    # stages of the score mods (their values live in more slots of the score fragment)
    modded = (("score_mod",) if spec.score_mods else ()) + (
        ("captured_grads",) if spec.grad_inputs and spec.score_mods else ())
    for name, index in BACKWARD_SHARED:
        sch.set_scope(sch.get_sblock(name), index, "shared.dyn")
    sch.set_scope(sch.get_sblock("load_stats"), 0, "shared")
    # dS^T in a buffer of its own (not merged into the dynamic tile buffer): TVM's barrier
    # insertion then sees that the per-sub-tile stores cannot conflict with the tile reads in
    # the same loop (in the merged buffer it syncs twice per sub-tile).
    sch.set_scope(sch.get_sblock("store_ds"), 0, "shared")
    for name, index in BACKWARD_FRAGMENTS:
        sch.set_scope(sch.get_sblock(name), index, "warp")
    _bind_grid(sch, "kv_tile", names=("s", "bh"))
    for name in ("load_q", "load_do", "load_k", "load_v"):
        _schedule_tile_load(sch, name, cfg, dtype_bytes, warps)
    _schedule_row_load(sch, "load_stats", warps)
    # dS^T rows padded like the input tiles: the transposing ldmatrix reads 8 rows at once
    store_ds = sch.get_sblock("store_ds")
    row_length = int(sch.get(store_ds).writes[0].source.shape[1])
    sch.storage_align(store_ds, 0, axis=0, factor=row_length, offset=cfg.pad_bytes // dtype_bytes)
    # one 16-query sub-tile after the other (S^T ... dK), one dQ tile after the other
    sch.unroll(_loop(sch, sch.get_sblock("scores"), "ti"))
    sch.unroll(_loop(sch, sch.get_sblock("dq"), "td"))
    for name, loads, b_transposed in BACKWARD_PRODUCTS:
        _schedule_product(sch, name, loads, b_transposed, dtype)
    for name, operand, scope in BACKWARD_FRAGMENT_STAGES:
        _schedule_fragment_stage(sch, name, operand, scope, dtype)
    for name in BACKWARD_LANE_STAGES + modded:
        _schedule_lane_stage(sch, name)
    _schedule_tile_store(sch, "store_dkv", warps)


def _schedule_threads(sch, name: str, threads: int = 256) -> None:
    """The outer loops of a block (all but its last, the vector) over blocks of ``threads``
    threads; the last loop becomes one vector access (16 bytes)."""
    block = sch.get_sblock(name)
    *outer, vec = sch.get_loops(block)
    _, thread = sch.split(sch.fuse(*outer), [None, threads])
    sch.bind(sch.get_loops(block)[0], "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    sch.vectorize(vec)


def _schedule_row_group(sch, name: str, vector: bool) -> None:
    """A stage of the pre-pass's row groups: warp -> threadIdx.y, lane -> threadIdx.x, the
    rest unrolled (``vector``: the last loop is one 16-byte load)."""
    loops = sch.get_loops(sch.get_sblock(name))
    names = [sch.get(loop).loop_var.name for loop in loops]
    own = loops[names.index("w"):]
    sch.bind(own[0], "threadIdx.y")
    sch.bind(own[1], "threadIdx.x")
    for loop in own[2:-1] if vector else own[2:]:
        sch.unroll(loop)
    if vector:
        sch.vectorize(own[-1])


def schedule_backward_prep(sch: s_tir.Schedule) -> None:
    sch.bind(sch.get_loops(sch.get_sblock("row_group"))[0], "blockIdx.x")
    for name in ("load_do_row", "load_o_row"):
        sch.set_scope(sch.get_sblock(name), 0, "local")
        _schedule_row_group(sch, name, vector=True)
    sch.set_scope(sch.get_sblock("dot"), 0, "warp")
    sch.set_scope(sch.get_sblock("dot_pair"), 0, "warp")
    for name in ("dot", "dot_pair", "row_stats"):
        _schedule_row_group(sch, name, vector=False)
    _schedule_threads(sch, "zero_dq")


def schedule_backward_dq(sch: s_tir.Schedule) -> None:
    chunk = sch.get_sblock("dq_chunk")
    _, thread = sch.split(sch.fuse(*sch.get_loops(chunk)), [None, 256])
    sch.bind(sch.get_loops(chunk)[0], "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    sch.unroll(sch.get_loops(sch.get_sblock("dq_init"))[-1])  # registers (TVM mis-prints a float32x8 fill)
    # fp32 arithmetic 4 wide (TVM prints float32x8 constants wrongly); the 8 rounded values leave as
    # one 16-byte copy in the source, which nvcc nevertheless splits (3 x 4 bytes + 2 x 2 bytes)
    for name in ("dq_sum", "dq_scale"):
        _, four = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [None, 4])
        sch.vectorize(four)
    sch.unroll(sch.get_loops(sch.get_sblock("dq_cast"))[-1])
    sch.vectorize(sch.get_loops(sch.get_sblock("dq_store"))[-1])
