"""The shared stages of the CUDA kernels (``kernels/cuda.py``): the mma register layout
(``frag``), and the tile copies, fragment loads, warp-level products and quad reductions every
kernel is a sequence of. Each stage emits one or a few blocks over the warps' fragments, named by
its caller: the schedules (``schedules/cuda.py``) find every block by that name.
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..config import CUDA_WARPS as WARPS
from ..config import VECTOR_BYTES
from .common import F32

VEC = VECTOR_BYTES // 2  # fp16/bf16 elements per 16-byte copy


def aligned_strides(strides):
    return (*(T.truncdiv(s, VEC) * VEC for s in strides), 1)


def frag(row, col):
    """(lane, slot) of element (row, col) of a 16 x 16 tile in the mma register layout."""
    return 4 * (row % 8) + (col % 8) // 2, 4 * (col // 8) + (row // 8) * 2 + col % 2


def frag_row(lane, slot):
    return 8 * (slot % 4 // 2) + lane // 4


def frag_col(lane, slot):
    return 8 * (slot // 4) + (lane % 4) * 2 + slot % 2


def quad_partner(lane, bit: int):
    """``lane ^ bit`` (bit 1 or 2): the lanes ``4 r ... 4 r + 3`` hold the 16 columns of rows r
    and r + 8, so two exchanges (bit 1, then bit 2) combine a row (FlashAttention-2's quad
    allreduce). Written with + and %, which TVM's index analysis bounds (it does not bound xor)."""
    return lane + bit - 2 * bit * (lane // bit % 2)


def half_slot(half, q):
    """The q-th (of 4) slot holding row ``lane // 4 + 8 * half`` of a tile."""
    return (q // 2) * 4 + half * 2 + q % 2


def reciprocal(x, on_cpu: bool):
    """1 / x correctly rounded, also under ``nvcc --use_fast_math`` (TVM's flag at load time),
    which turns a plain ``1 / x`` into the approximate ``rcp.approx``: ``__frcp_rn`` is
    ``rcp.rn`` whatever the flags. ``on_cpu``: the same IEEE division for the CPU test build."""
    return T.float32(1) / x if on_cpu else T.call_pure_extern(F32, "__frcp_rn", x)


# --- named stages ---------------------------------------------------------------------------
# The kernels (kernels/cuda.py) are sequences of these stages and of their own.


def stage(func):
    """A ``T.macro`` whose blocks keep the names its caller passes: TVMScript suffixes the blocks
    of every later expansion of one macro (``pv_1``, ``dv_2``, ...), and the schedules find the
    stages by block name, so every call expands a macro of its own."""

    @functools.wraps(func)
    def expand(*args, **kwargs):
        return T.macro(func)(*args, **kwargs)

    return expand


@stage
def load_rows(name, tile, src, batch, start, row0, length, head):
    """Rows ``row0 ...`` of a sequence (its rows start at ``start`` of ``batch`` in ``src``) into a
    shared tile. The row is clamped, not tested: the copies stay plain 16-byte loads, and rows past
    the sequence are masked (keys) or never stored (queries)."""
    for r, c in T.grid(T.int64(int(tile.shape[0])), T.int64(int(tile.shape[1]))):  # int64: the copy stays a ramp
        with T.sblock(name):
            vr, vc = T.axis.remap("SS", [r, c])
            tile[vr, vc] = src[batch, start + T.min(row0 + vr, length - 1), head, vc]


@stage
def store_rows(name, dst, tile, batch, start, row0, length, head, dst2=None, tile2=None):
    """The tile's rows (those before ``length``) to rows ``row0 ...`` of the sequence in ``dst``,
    whole rows, 16 bytes per thread and step (FlashAttention-2's epilogue); ``tile2`` to ``dst2``
    in the same loop. The row test sits outside the 16-byte vector."""
    for r, c, e in T.grid(T.int64(int(tile.shape[0])), T.int64(int(tile.shape[1]) // VEC), T.int64(VEC)):
        with T.sblock(name):
            vr, vc, ve = T.axis.remap("SSS", [r, c, e])
            if row0 + vr < length:
                dst[batch, start + row0 + vr, head, vc * VEC + ve] = tile[vr, vc * VEC + ve]
                if dst2 is not None:
                    dst2[batch, start + row0 + vr, head, vc * VEC + ve] = tile2[vr, vc * VEC + ve]


@stage
def ldmatrix_rows(name, frags, tile, transposed=False):
    """The warp's own 16 rows of ``tile`` (an A operand: query rows, key rows) as fragments, one
    per 16 columns; ``transposed``: the warp's 16 columns, as rows (dS by query rows)."""
    for w, t, r, c in T.grid(WARPS, frags.shape[1], 16, 16):
        with T.sblock(name):
            vw, vt, vr, vc = T.axis.remap("SSSS", [w, t, r, c])
            if transposed:
                lane, slot = T.meta_var(frag(vc, vr))
                frags[vw, vt, lane, slot] = tile[vt * 16 + vr, vw * 16 + vc]
            else:
                lane, slot = T.meta_var(frag(vr, vc))
                frags[vw, vt, lane, slot] = tile[vw * 16 + vr, vt * 16 + vc]


@stage
def ldmatrix_tiles(name, frags, tile):
    """Every 16 x 16 tile of ``tile`` into every warp's fragments (B operands)."""
    for w, tr, tc, r, c in T.grid(WARPS, frags.shape[1], frags.shape[2], 16, 16):
        with T.sblock(name):
            vw, vtr, vtc, vr, vc = T.axis.remap("SSSSS", [w, tr, tc, r, c])
            lane, slot = T.meta_var(frag(vr, vc))
            frags[vw, vtr, vtc, lane, slot] = tile[vtr * 16 + vr, vtc * 16 + vc]


def _operand(lead, w, n, k, lane_slot):
    """The index of a product operand's element: its leading indices, named "w" (the warp), "n"
    (the output tile), "k" (the reduction tile) in a string ("w n k") or a tuple that may also
    hold constants (a slot of the backward's score buffer), then (lane, slot)."""
    loops = {"w": w, "n": n, "k": k}
    lead = lead.split() if isinstance(lead, str) else lead
    return tuple(loops[i] if isinstance(i, str) else i for i in lead) + tuple(lane_slot)


@T.macro
def _multiply_add(C, c, A, a, B, b, w, n, k, i, j, kk, b_rows):
    """C[i, j] += A[i, kk] B[kk, j] in tiles n, k of warp w (B[j, kk] if ``b_rows``), in fp32."""
    ci = T.meta_var(_operand(c, w, n, k, frag(i, j)))
    ai = T.meta_var(_operand(a, w, n, k, frag(i, kk)))
    bi = T.meta_var(_operand(b, w, n, k, frag(j, kk) if b_rows else frag(kk, j)))
    C[ci] = C[ci] + T.Cast(F32, A[ai]) * T.Cast(F32, B[bi])


@stage
def mma(name, C, c, A, a, B, b, n, k, b_rows=False):
    """C[c] += A[a] B[b]: every warp, 16 x 16 x 16 steps in exactly the form of TVM's mma tensor
    intrinsics (two ``mma.m16n8k16`` each once tensorized). ``c``, ``a``, ``b``: each operand's
    leading indices (``_operand``: "w n k"); ``n`` output tiles by ``k`` reduction tiles, each a
    loop of the stage (an int) or the tile of an enclosing loop (``(var, extent)``, bound by the
    block).
    ``b_rows``: B given as rows of its transpose (K in Q K^T). The fragment loads it consumes are
    scheduled into its innermost tile loop."""
    if isinstance(n, tuple):  # one output tile, the enclosing loop's
        for w, tk, i, j, kk in T.grid(WARPS, k, 16, 16, 16):
            with T.sblock(name):
                vw, vk, vi, vj, vkk = T.axis.remap("SRSSR", [w, tk, i, j, kk])
                vn = T.axis.spatial(n[1], n[0])
                _multiply_add(C, c, A, a, B, b, vw, vn, vk, vi, vj, vkk, b_rows)
    elif isinstance(k, tuple):  # one reduction tile, the enclosing loop's
        for w, tn, i, j, kk in T.grid(WARPS, n, 16, 16, 16):
            with T.sblock(name):
                vw, vn, vi, vj, vkk = T.axis.remap("SSSSR", [w, tn, i, j, kk])
                vk = T.axis.reduce(k[1], k[0])
                _multiply_add(C, c, A, a, B, b, vw, vn, vk, vi, vj, vkk, b_rows)
    else:
        for w, tn, tk, i, j, kk in T.grid(WARPS, n, k, 16, 16, 16):
            with T.sblock(name):
                vw, vn, vk, vi, vj, vkk = T.axis.remap("SSRSSR", [w, tn, tk, i, j, kk])
                _multiply_add(C, c, A, a, B, b, vw, vn, vk, vi, vj, vkk, b_rows)


@stage
def fill(name, value, frags, frags2=None, slot=None):
    """Every element of the warps' fragments := value (and of ``frags2``, of the same shape);
    ``frags`` is [warp, tile, lane, element] or one tile [warp, lane, element]; ``slot``: only
    that slot of the backward's score buffer."""
    if slot is not None:
        for w, tx, s in T.grid(WARPS, 32, 8):
            with T.sblock(name):
                vw, vtx, vs = T.axis.remap("SSS", [w, tx, s])
                frags[vw, slot, vtx, vs] = value
    elif _tiled(frags):
        for w, tx, t, s in T.grid(WARPS, 32, frags.shape[1], 8):
            with T.sblock(name):
                vw, vt, vtx, vs = T.axis.remap("SSSS", [w, t, tx, s])
                frags[vw, vt, vtx, vs] = value
                if frags2 is not None:
                    frags2[vw, vt, vtx, vs] = value
    else:
        for w, tx, s in T.grid(WARPS, 32, 8):
            with T.sblock(name):
                vw, vtx, vs = T.axis.remap("SSS", [w, tx, s])
                frags[vw, vtx, vs] = value


def _tiled(frags) -> bool:
    return len(frags.shape) == 4


@stage
def quad_reduce(name, op, out, prev, partial, pair, alpha=None):
    """Per row, the ``op`` ("max" or "sum") of the lanes' ``partial``s, folded into ``prev``:
    out := max(prev, row max), or prev * alpha + row sum. Lanes ``4 r ... 4 r + 3`` hold rows r
    and r + 8: exchanging with lane ^ 1, then lane ^ 2 combines a row (FlashAttention-2's quad
    allreduce; TVM lowers the reads of another lane's registers to ``__shfl_sync``: no barrier)."""
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock(name + "_pair"):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            if op == "max":
                pair[vw, vtx, vhf] = T.max(partial[vw, vtx, vhf], partial[vw, quad_partner(vtx, 1), vhf])
            else:
                pair[vw, vtx, vhf] = partial[vw, vtx, vhf] + partial[vw, quad_partner(vtx, 1), vhf]
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock(name):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            if op == "max":
                out[vw, vtx, vhf] = T.max(prev[vw, vtx, vhf], T.max(
                    pair[vw, vtx, vhf], pair[vw, quad_partner(vtx, 2), vhf]))
            else:
                out[vw, vtx, vhf] = prev[vw, vtx, vhf] * alpha[vw, vtx, vhf] + (
                    pair[vw, vtx, vhf] + pair[vw, quad_partner(vtx, 2), vhf])
