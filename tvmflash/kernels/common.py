"""What every fused kernel shares: the kernel context, tile states, the strided-IO header.

The context (``KernelContext``) is one object per kernel build, in one vocabulary for the CPU
and CUDA kernels (flash-attn's ``SeqlenInfo`` / ``BlockInfo`` / ``mask.py`` in one):

* ``declare``: inside the kernel body, after its own parameters, it adds the arguments whose
  number depends on the spec: the sequence table and tile maps of ``plan.py``, the mods' inputs
  (and their gradients), the block mask; and it takes the window (``window_left/right``, causal
  is right = 0), a runtime argument of every kernel;
* ``sequence(b)``: one sequence's lengths, diagonal and rows (``SequenceInfo``), the sequence
  let-block of a work item; ``rows``: a tile's rows of it (``TileRows``: clamped, zero-padded
  loads);
* tile ranges and states: ``key_tiles`` (the key tiles a query tile's window and block mask
  reach), ``query_tiles`` (the converse), ``tile_state`` (``EMPTY`` / ``PARTIAL`` / ``FULL``);
* element masks and score mods: ``sees``, ``score``, ``score_grad``, and the captured tensors'
  gradients (``captured_grads``; how they are summed is the target's: ``scatter_captured_grads``).

Query q's diagonal is key ``q + diagonal`` (the table's column: ``k_len - q_len`` for flash-attn's
bottom-right alignment), and q sees key k iff ``diagonal - left <= k - q <= diagonal + right``
(``attention_te.in_window``). The targets differ in small ways, kept in subclasses:
``CPUContext`` (mods see indices as they are: the tile's padding is masked before they matter;
captured gradients go to per-thread partials) and ``CUDAContext`` in ``cuda.py``.
"""

from __future__ import annotations

import contextlib
import math

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .. import plan
from ..attention_te import in_window, visible_keys, visible_queries
from ..score_mods import FAST_INTRINSICS, ModContext, declare_inputs, emitters, kernel_argument
from ..spec import AttentionSpec

F32, I64 = "float32", "int64"
EMPTY, PARTIAL, FULL = plan.EMPTY, plan.PARTIAL, plan.FULL
ceildiv = plan.ceildiv


def i64(x):
    return tirx.Cast(I64, x)


def cyclic_count(slot, tasks, n_threads):
    """Tasks slot, slot + n_threads, ... below ``tasks`` (a thread's share, cyclic: balanced)."""
    return tirx.max(ceildiv(tasks - slot, n_threads), 0)


# A kernel's tasks are (head, unit) pairs: a unit is a query tile (forward) or a key super tile
# (backward). Where the slots divide the heads evenly, each slot takes a contiguous block of heads
# with all their units: the same work per slot, and the heads the kernel's packs and stores give
# each thread (contiguous chunks of the (head, tile) loops). Every line of the packs, of q, k, v
# and out rows and of the accumulators is then one thread's. Dealt out cyclically, neighbouring
# heads went to different threads: their lines are neighbours, and the prefetchers and packs moved
# them between cores each call (2 threads no faster than 1 on 32 heads of 16 tokens; DEVELOPING.md).
# Else (the heads do not divide evenly: fewer heads than threads, say) the tasks go out cyclically,
# as many units of each length to every slot as can be.
def slot_task_count(slot, heads, units, n_threads):
    """How many of the ``heads x units`` tasks ``slot`` takes (``slot_task``)."""
    return tirx.if_then_else(heads % n_threads == 0, heads // n_threads * units,
                             cyclic_count(slot, heads * units, n_threads))


def slot_task(slot, e, heads, units, n_threads, *, heads_outer: bool):
    """(head, unit) of ``slot``'s ``e``-th task. A block of heads goes unit by unit, the heads of
    one unit next to each other. Cyclic dealing runs over the tasks in the kernel's order:
    ``heads_outer`` (each head's units together) or not (each unit's heads together)."""
    per_slot = tirx.max(heads // n_threads, 1)
    task = slot + e * n_threads
    cyclic = (task // units, task % units) if heads_outer else (task % heads, task // heads)
    block = heads % n_threads == 0
    return (tirx.if_then_else(block, slot * per_slot + e % per_slot, cyclic[0]),
            tirx.if_then_else(block, e // per_slot, cyclic[1]))


def let(name: str, value, dtype: str = I64):
    """``name: T.let[dtype] = value`` emitted from Python: a let binding in the kernel being parsed."""
    var = tirx.Var(name, dtype)
    T.Bind(value, var=var)
    return var


@contextlib.contextmanager
def stage(name: str):
    """The opaque wrapper block of one stage, under a unit loop (kernels/cpu.py's docstring):
    ``for unit in range(1): with T.sblock(name): ...``."""
    with T.serial(0, 1) as unit:
        IRBuilder.name("unit", unit)
        with T.sblock(name):
            yield


def io_buffer(handle, shape, dtype: str, strides: str):
    """The strided-IO header of a tensor argument: any strides (q, k, v sliced from a packed
    qkv are read in place) but a contiguous last dim; align = element size (none assumed).
    ``strides``: the name of the stride variables (``sq`` -> ``sq_0``, ...)."""
    stride_vars = []
    for i in range(len(shape) - 1):
        var = T.int64()
        IRBuilder.name(f"{strides}_{i}", var)
        stride_vars.append(var)
    return T.match_buffer(handle, shape, dtype, strides=(*stride_vars, 1), align=DataType(dtype).bits // 8)


class TileRows:
    """Rows ``first, first + 1, ...`` of one sequence on one side (queries or keys): where the
    sequence sits in its tensor (``batch``, ``start``) and its ``length``. Loads clamp the row
    into the sequence and zero what lies past its end (a tile's padding)."""

    def __init__(self, batch, start, first, length):
        self.batch, self.start, self.first, self.length = batch, start, first, length

    def _at(self, i, plus):
        return self.first + i if plus is None else self.first + i + plus

    def inside(self, i, plus=None):
        """Whether tile row i (+ plus) is a row of the sequence."""
        return self._at(i, plus) < self.length

    def row(self, i, plus=None):
        """The tensor row of tile row i (+ plus), clamped to the sequence's last."""
        return self.start + T.min(self._at(i, plus), self.length - 1)

    def load(self, buf, i, head, d, convert, zero, plus=None):
        """``convert(buf[row i (+ plus), head, d])``, or ``zero`` past the sequence's end."""
        return T.if_then_else(self.inside(i, plus), convert(buf[self.batch, self.row(i, plus), head, d]), zero)


class SequenceInfo:
    """One sequence of the table (``plan.py``) as index expressions: ``b``, its lengths,
    diagonal and tile counts (cute's ``SeqlenInfo``)."""

    def __init__(self, ctx: KernelContext, b):
        self.ctx, self.b = ctx, b
        self.q_len, self.k_len = ctx.column(b, plan.Q_LEN), ctx.column(b, plan.K_LEN)
        self.diagonal = ctx.column(b, plan.DIAGONAL)

    def column(self, column: int):
        return self.ctx.column(self.b, column)

    @property
    def q_tiles(self):
        return ceildiv(self.q_len, self.ctx.block_q)

    @property
    def k_tiles(self):
        return ceildiv(self.k_len, self.ctx.block_k)


def tiles_holding(lo, hi, block: int, length, narrowed=None):
    """Tiles [first, end) of ``block`` rows (of ``length``) holding a row in [lo, hi], within
    ``narrowed`` (a block mask's [first, end)) if given; first == end when none does."""
    first = tirx.max(tirx.floordiv(lo, block), 0)
    end = tirx.min(tirx.floordiv(hi, block) + 1, ceildiv(length, block))
    if narrowed is not None:
        first, end = tirx.max(first, narrowed[0]), tirx.min(end, narrowed[1])
    return first, tirx.max(end, first)


class KernelContext:
    """The arguments beyond the tensors and scalars that every kernel has, as index
    expressions: sequences, the window, tile ranges and states, block mask, score/mask mods and
    the captured tensors' gradients (module docstring). One per kernel build."""

    def __init__(self, spec: AttentionSpec, block_q: int, block_k: int, backward: bool,
                 intrinsics=FAST_INTRINSICS):
        self.spec, self.backward = spec, backward
        self.block_q, self.block_k = block_q, block_k
        self.mods = emitters(spec, intrinsics)
        self.mod_buffers: dict = {}
        self.grad_buffers: dict = {}

    @property
    def has_score_mods(self) -> bool:
        return bool(self.spec.score_mods)

    @property
    def has_captured_grads(self) -> bool:
        return self.backward and bool(self.spec.grad_inputs)

    # --- arguments -------------------------------------------------------------------------------
    def declare(self, window_left, window_right, tile_maps=("q_tile_seq", "k_tile_seq")) -> None:
        """Called inside the kernel body, after its own parameters: the sequence table, the tile
        maps named (``plan.py``), the mods' inputs (and gradients), the block mask."""
        self.window = self.left, self.right = window_left, window_right
        n_seq = tirx.Var("n_seq", I64)
        self.table = kernel_argument("seq_table", (n_seq, plan.TABLE_COLUMNS), "int32")
        sizes = {"q_tile_seq": "query_tiles", "k_tile_seq": "key_tiles", "k_super_seq": "key_super_tiles"}
        for name in tile_maps:
            setattr(self, name, kernel_argument(name, (tirx.Var(sizes[name], I64),), "int32"))
        self.mod_buffers, self.grad_buffers = declare_inputs(self.spec, grads=self.backward)
        if self.spec.block_sparse:
            dims = tuple(tirx.Var(n, I64) for n in ("mask_batch", "mask_heads", "mask_q_tiles", "mask_k_tiles"))
            self.tile_states = kernel_argument("tile_state", dims, "int8")
            self._declare_tile_ranges(dims)

    def _declare_tile_ranges(self, dims) -> None:
        """The block mask's tile ranges the kernel walks: the forward's key tiles per query tile."""
        if not self.backward:
            self.kv_range = kernel_argument("kv_range", (*dims[:3], 2), "int32")

    # --- sequences -------------------------------------------------------------------------------
    def column(self, seq, column: int):
        """A column of the sequence table (plan.py) as int64."""
        return i64(self.table[seq, column])

    def sequences(self):
        return self.table.shape[0]

    def query_tiles_total(self):
        """Query tiles of all sequences (the length of ``q_tile_seq``)."""
        return self.q_tile_seq.shape[0]

    def key_tiles_total(self):
        return self.k_tile_seq.shape[0]

    def key_super_tiles_total(self):
        return self.k_super_seq.shape[0]

    def q_tile_sequence(self, tile):
        """The sequence of a query tile of ``q_tile_seq`` (int64)."""
        return i64(self.q_tile_seq[tile])

    def k_tile_sequence(self, tile):
        return i64(self.k_tile_seq[tile])

    def sequence(self, b) -> SequenceInfo:
        return SequenceInfo(self, b)

    def bind_tile_rows(self, side: str, tile) -> TileRows:
        """The sequence let-block of a tile of ``q_tile_seq`` (side "q") or ``k_tile_seq`` ("k"):
        ``b``, the tile's first row in its sequence, the sequence's length, batch and start,
        bound once (``T.let``s named ``b, q0, q_len, q_batch, q_start``; ``k...`` for keys)."""
        tile_map, block = (self.q_tile_seq, self.block_q) if side == "q" else (self.k_tile_seq, self.block_k)
        tile0, length, batch, start = ((plan.Q_TILE0, plan.Q_LEN, plan.Q_BATCH, plan.Q_START) if side == "q"
                                       else (plan.K_TILE0, plan.K_LEN, plan.K_BATCH, plan.K_START))
        b = let("b", i64(tile_map[tile]))
        first = let(f"{side}0", (tile - self.column(b, tile0)) * block)
        length = let(f"{side}_len", self.column(b, length))
        batch = let(f"{side}_batch", self.column(b, batch))
        rows = TileRows(batch, let(f"{side}_start", self.column(b, start)), first, length)
        rows.b = b
        return rows

    # --- tiles -----------------------------------------------------------------------------------
    def _mask_at(self, b, h, *rest):
        dims = self.tile_states.shape
        return (tirx.min(b, dims[0] - 1), tirx.min(h, dims[1] - 1), *rest)

    def _block_range(self, ranges, b, h, tile):
        return tuple(i64(ranges[self._mask_at(b, h, tile, i)]) for i in (0, 1))

    def key_tiles(self, seq: SequenceInfo, h, q0):
        """Key tiles [first, end) holding a key some row of the query tile at q0 sees."""
        last_row = tirx.min(q0 + self.block_q, seq.q_len) - 1
        narrowed = self._block_range(self.kv_range, seq.b, h, q0 // self.block_q) if self.spec.block_sparse else None
        return tiles_holding(q0 + seq.diagonal - self.left, last_row + seq.diagonal + self.right, self.block_k,
                             seq.k_len, narrowed)

    def query_tiles(self, seq: SequenceInfo, h, k0):
        """Query tiles [first, end) holding a query (of head h) that sees some key of the key tile at k0."""
        last_key = tirx.min(k0 + self.block_k, seq.k_len) - 1
        narrowed = self._block_range(self.q_range, seq.b, h, k0 // self.block_k) if self.spec.block_sparse else None
        return tiles_holding(k0 - seq.diagonal - self.right, last_key - seq.diagonal + self.left, self.block_q,
                             seq.q_len, narrowed)

    def tile_state(self, seq: SequenceInfo, h, q0, k0):
        """EMPTY, PARTIAL or FULL for the tile at query rows q0..., keys k0... of the sequence."""
        q_len, k_len, off = seq.q_len, seq.k_len, seq.diagonal
        Bq, Bk = self.block_q, self.block_k
        q_last = tirx.min(q0 + Bq, q_len) - 1
        k_last = tirx.min(k0 + Bk, k_len) - 1
        # Integer arithmetic rather than Select: TVM's simplifier treats every Select condition as
        # a constraint to analyse, which made compiling these kernels take minutes.
        seen = i64(tirx.all(q_last + off + self.right >= k0, q0 + off - self.left <= k_last))
        # Full needs whole tiles: a ragged tile's padding rows and keys are masked too.
        full = i64(tirx.all(q0 + Bq <= q_len, k0 + Bk <= k_len, k0 + Bk - 1 <= q0 + off + self.right,
                            k0 >= q0 + Bq - 1 + off - self.left))
        state = seen * (PARTIAL + full)  # EMPTY 0, PARTIAL 1, FULL 2
        if not self.spec.block_sparse:
            return state
        stored = i64(self.tile_states[self._mask_at(seq.b, h, q0 // Bq, k0 // Bk)])
        # As empty as either mask makes it; full only if both leave it full.
        return tirx.min(state, stored)

    # --- elements: masks and score mods -----------------------------------------------------------
    def mod_context(self, seq: SequenceInfo, h, q, k) -> ModContext:
        return ModContext(seq.b, h, q, k, seq.diagonal, self.mod_buffers)

    def sees(self, seq: SequenceInfo, h, q, k):
        """Whether query q attends to key k on a partly masked tile: window, sequence ends, mask_mod."""
        keep = tirx.all(q < seq.q_len, in_window(q, k, seq.k_len, seq.diagonal, *self.window))
        if self.spec.mask_mod is None:
            return keep
        return tirx.all(keep, self.mods.mask(self.mod_context(seq, h, q, k)))

    def window_interval(self, seq: SequenceInfo, q0, k0, outer, inner: str):
        """The window and the sequence ends on a partly masked tile, as an interval: the tile
        offsets on side ``inner`` ("q": queries, "k": keys) visible to offset ``outer`` on the
        other side, ``(first, last)`` as int32 clamped to [-1, tile edge] (a window shows each
        query an interval of keys, and each key an interval of queries). Bound outside the inner
        loop, the interval leaves that loop two int32 compares a lane, vectorized; with ``sees``
        there, LLVM kept int64 compares of table loads (which it could not hoist past the tile's
        stores) and made them a branch per score."""
        if inner == "q":
            first, last = visible_queries(k0 + outer, seq.q_len, seq.k_len, seq.diagonal, *self.window)
            origin, extent = q0, self.block_q
        else:
            first, last = visible_keys(q0 + outer, seq.k_len, seq.diagonal, *self.window)
            last = tirx.Select(q0 + outer < seq.q_len, last, first - 1)  # a row past the sequence sees nothing
            origin, extent = k0, self.block_k

        def clamped(offset):  # [-1, extent] holds every case; an empty interval stays empty
            return tirx.Cast("int32", tirx.max(tirx.min(offset, extent), -1))

        return clamped(first - origin), clamped(last - origin)

    def sees_in_interval(self, seq: SequenceInfo, h, q, k, offset, interval):
        """``sees(seq, h, q, k)`` where ``interval`` is ``window_interval``'s of this tile
        position and ``offset`` the inner loop's offset in the tile."""
        keep = tirx.all(tirx.Cast("int32", offset) >= interval[0], tirx.Cast("int32", offset) <= interval[1])
        if self.spec.mask_mod is None:
            return keep
        return tirx.all(keep, self.mods.mask(self.mod_context(seq, h, q, k)))

    def score(self, seq: SequenceInfo, s, h, q, k):
        """The modded score of the scaled dot product s (natural-log units)."""
        return self.mods.score(s, self.mod_context(seq, h, q, k))

    def score_grad(self, seq: SequenceInfo, s, h, q, k):
        """d mods(s) / d s."""
        return self.mods.score_grad(s, self.mod_context(seq, h, q, k))

    def captured_grads(self, seq: SequenceInfo, s, h, q, k, upstream):
        """(name, flat index, upstream * d mods / d captured) per captured tensor requiring grad."""
        return self.mods.flat_captured_grads(s, self.mod_context(seq, h, q, k), upstream)


class CPUContext(KernelContext):
    """The CPU kernels' context: each thread sums its captured-tensor gradients into its own
    row of a partials buffer (summed in thread order at the end: deterministic)."""

    def grad_offsets(self) -> dict[str, int]:
        """Where each captured tensor's gradient starts in a slot's row of the partials buffer."""
        offsets, at = {}, 0
        for i in self.spec.grad_inputs:
            offsets[i.name], at = at, at + math.prod(i.shape)
        return offsets

    def scatter_captured_grads(self, partials, slot, seq: SequenceInfo, s, h, q, k, upstream) -> None:
        """Emit partials[slot, offset + index] += value for each captured tensor requiring grad."""
        offsets = self.grad_offsets()
        for name, flat, value in self.captured_grads(seq, s, h, q, k, upstream):
            at = flat + offsets[name]
            T.buffer_store(partials, partials[slot, at] + value, [slot, at])
