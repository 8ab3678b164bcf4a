"""Fused FlashAttention kernels for NVIDIA GPUs: warp-level loop skeletons in TensorIR.

Same math as the CPU kernels (``attention_te``: mask, exp2, LSE, dS), arranged the way
FlashAttention-2 runs on tensor cores. A thread block owns ``block_q = 16 * warps`` query rows
and walks the key tiles; each warp owns 16 rows. Every per-warp tile lives in the register
layout of the ``mma.m16n8k16`` instruction, written here as buffers ``[warp, tile, lane, slot]``
indexed through ``frag(row, col) -> (lane, slot)`` (TVM's ``shared_16x16_to_ldmatrix_32x8``):

* S = Q K^T accumulates in that layout; the softmax works on it in place (each lane knows the
  row and column of each of its 8 slots); P, cast to fp16/bf16, *is* the A operand of the
  P V product (the accumulator and A layouts coincide), so P never goes through memory;
* the products are blocks of 16 x 16 x 16 multiply-adds in exactly the form of TVM's ``mma``
  tensor intrinsics, and the fragment loads have the form of its ``ldmatrix`` intrinsics:
  ``schedules/cuda.py`` tensorizes them (and binds warps and lanes to threads);
* row max and row sum combine the 4 lanes that share a row by reading each other's partials
  (lane ^ 1, then lane ^ 2), which TVM lowers to warp shuffles: no block-wide barrier;
* tile loads clamp the row index instead of testing it: rows past the end repeat the last
  row, whose scores are masked (keys) or whose results are never stored (queries), so the
  copies stay plain 16-byte vector loads;
* masks are runtime arguments (``CUDAContext``, on ``common.KernelContext``): a window on both
  sides around a diagonal (causal is right = 0; flash-attn's bottom-right alignment by
  default), so one build serves every mask; the forward walks only the key tiles its query
  tile's window (and block mask) reaches, the backward only the query tiles that see its key
  tile. Score mods (softcap, ALiBi, a traced score_mod) rewrite the score fragment in place, a
  traced mask_mod joins the window test: the same ``score_mods`` emitters as the CPU kernels,
  with the GPU's exp2;
* sequences are plan.py's table, as on CPUs: batched tensors and packed (varlen) sequences
  alike; a forward block takes one query tile of any sequence (``q_tile_seq``), a backward
  block one key tile (or split) of one sequence, and reads its rows, lengths and diagonal.

Each kernel reads top to bottom as a sequence of named stages (``@stage``): the tile copies,
fragment loads (``ldmatrix_rows``, ``ldmatrix_tiles``), products (one ``mma``) and quad
reductions shared by all are in ``cuda_stages.py``, the forward's and backward's own below. A
stage reaches the masks and mods through the build's context ``ctx`` and the block's sequence
``seq`` (``common.SequenceInfo``).

Unscheduled, the skeleton is ordinary TIR: the tests run it on the CPU (warps and lanes as
plain loops) against float64 PyTorch, which checks the layouts and the math without a GPU.
"""

from __future__ import annotations

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T

from .. import plan
from ..attention_te import (
    NEG_INF,
    grad_scores,
    in_window,
    log2_exponent,
    lse_from_stats,
    lse_log2_parts,
)
from ..config import CUDA_ROWS_PER_WARP as ROWS_PER_WARP
from ..config import CUDA_WARPS as WARPS
from ..config import CUDAKernelConfig
from ..score_mods import NATIVE_INTRINSICS, ModContext, exponent_constant, kernel_argument
from ..spec import AttentionSpec
from .common import EMPTY, F32, FULL, PARTIAL, KernelContext, SequenceInfo, ceildiv
from .cuda_stages import (
    VEC,
    aligned_strides,
    fill,
    frag_col,
    frag_row,
    half_slot,
    ldmatrix_rows,
    ldmatrix_tiles,
    load_rows,
    mma,
    quad_partner,
    quad_reduce,
    reciprocal,
    stage,
    store_rows,
)


class CUDAContext(KernelContext):
    """The CUDA kernels' context (``common.KernelContext``; one per build).

    Sequences are plan.py's table (batched, or packed varlen); ``sequence(b)`` is the sequence a
    thread block works on. Mods see indices clamped into the sequence, so a mod never reads past
    its tensors on the padding rows and keys of a tile (those are masked). The forward declares
    the query-tile map, the backward none (a block per key tile of a sequence).

    Block masks (``spec.block_sparse``, ``flex.tile_maps`` at these tiles): the forward walks
    only the key tiles of its query tile's ``kv_range``, the backward only the query tiles of its
    key tile's ``q_range``; every tile's state masks all of it (empty), none of it (full: the
    mask_mod is not evaluated) or applies the mask_mod, element by element in ``sees``.
    Captured tensors' gradients: ``atomicAdd`` on the GPU, plain adds in the CPU test build
    (``on_cpu``)."""

    def __init__(self, spec: AttentionSpec, cfg: CUDAKernelConfig, backward: bool = False, on_cpu: bool = False):
        super().__init__(spec, cfg.block_q, cfg.block_k, backward, NATIVE_INTRINSICS)
        self.on_cpu = on_cpu

    @property
    def has_captured_grads(self) -> bool:
        return super().has_captured_grads and self.has_score_mods

    def declare(self, window_left, window_right) -> None:
        """Called inside the kernel body, after its own parameters: the sequence table, the
        forward's query-tile map, the mods' inputs (and gradients), the block mask."""
        super().declare(window_left, window_right, () if self.backward else ("q_tile_seq",))

    def _declare_tile_ranges(self, dims) -> None:
        if self.backward:
            self.q_range = kernel_argument("q_range", (*dims[:2], dims[3], 2), "int32")
        else:
            self.kv_range = kernel_argument("kv_range", (*dims[:3], 2), "int32")

    def mod_context(self, seq: SequenceInfo, h, q, k) -> ModContext:
        return ModContext(seq.b, h, tirx.min(q, seq.q_len - 1), tirx.min(k, seq.k_len - 1), seq.diagonal,
                          self.mod_buffers)

    def sees(self, seq: SequenceInfo, h, q, k):
        """Whether query q attends to key k (k may be padding past the last key)."""
        keep = in_window(q, k, seq.k_len, seq.diagonal, self.left, self.right)
        mask_mod = None if self.spec.mask_mod is None else self.mods.mask(self.mod_context(seq, h, q, k))
        if self.spec.block_sparse:
            state = self.tile_states[self._mask_at(seq.b, h, q // self.block_q, k // self.block_k)]
            if mask_mod is None:
                by_state = state != tirx.const(EMPTY, "int8")
            else:
                by_state = tirx.Or(state == tirx.const(FULL, "int8"),
                                   tirx.all(state == tirx.const(PARTIAL, "int8"), mask_mod))
            return tirx.all(keep, by_state)
        return keep if mask_mod is None else tirx.all(keep, mask_mod)

    def kept(self, sees, x):
        """Whether a score enters the softmax: seen, and not -inf (which a score_mod may return)."""
        return tirx.all(sees, x > tirx.const(NEG_INF, F32)) if self.has_score_mods else sees

    def scatter_captured_grads(self, seq: SequenceInfo, s, h, q, k, upstream) -> None:
        """grad[index] += upstream * d mods / d captured for each captured tensor requiring grad:
        ``atomicAdd`` on the GPU (any order: not deterministic), plain adds in the CPU test build."""
        for name, flat, value in self.captured_grads(seq, s, h, q, k, upstream):
            buf = self.grad_buffers[name]
            if self.on_cpu:
                T.buffer_store(buf, buf[flat] + value, [flat])
            else:
                T.evaluate(T.call_extern(F32, "atomicAdd", T.address_of(buf[flat]), value))

    def chain_rule(self, ds, grad):
        """dL/ds = dL/dx * dx/ds, x = mods(s). Masked and underflowed entries have dL/dx = 0: keep
        it 0 even where the mods' derivative is not finite there."""
        if not self.has_score_mods:
            return ds
        return tirx.Select(ds == tirx.const(0, F32), tirx.const(0, F32), ds * grad)

    def exponent_scale(self, softmax_scale):
        return exponent_constant(self.spec, softmax_scale)


# --- forward stages: FlashAttention-2's online softmax on the score fragments S[warp, key tile] --
# Query q0 + 16 w + frag_row, key k0 + 16 t + frag_col; per lane the statistics of its two rows.


def exp2(x):
    return tirx.exp2(x)  # ex2.approx in hardware


@stage
def init_row_stats(m, l):
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock("init_stats"):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            m[vw, vtx, vhf] = T.float32(NEG_INF)
            l[vw, vtx, vhf] = T.float32(0)


@stage
def mod_scores(S, ctx, seq, scale, h, q0, k0):
    """S := mods(S * scale), in place (natural-log units)."""
    for w, tx, tj, s in T.grid(WARPS, 32, S.shape[1], 8):
        with T.sblock("score_mod"):
            vw, vtj, vtx, vs = T.axis.remap("SSSS", [w, tj, tx, s])
            S[vw, vtj, vtx, vs] = ctx.score(seq, S[vw, vtj, vtx, vs] * T.Cast(F32, scale), h,
                                            q0 + vw * 16 + frag_row(vtx, vs), k0 + vtj * 16 + frag_col(vtx, vs))


@stage
def row_max(m_new, m, S, partial, pair, ctx, seq, scale, h, q0, k0):
    """m_new := max(m, the row maxima of the scores each row sees), in exp2 units."""
    for w, tx, hf, tj, qq in T.grid(WARPS, 32, 2, S.shape[1], 4):
        with T.sblock("row_max_lane"):
            vw, vtx, vhf, vtj, vq = T.axis.remap("SSSRR", [w, tx, hf, tj, qq])
            with T.init():
                partial[vw, vtx, vhf] = T.float32(NEG_INF)
            partial[vw, vtx, vhf] = T.max(partial[vw, vtx, vhf], T.Select(
                ctx.sees(seq, h, q0 + vw * 16 + frag_row(vtx, half_slot(vhf, vq)),
                         k0 + vtj * 16 + frag_col(vtx, half_slot(vhf, vq))),
                S[vw, vtj, vtx, half_slot(vhf, vq)] * ctx.exponent_scale(scale)[0], T.float32(NEG_INF)))
    quad_reduce("row_max", "max", m_new, m, partial, pair)


@stage
def rescale_factor(alpha, m, m_new):
    """alpha := 2^(m - m_new), what the running sums shrink by (1 while the maximum stays -inf)."""
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock("rescale"):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            alpha[vw, vtx, vhf] = T.Select(m[vw, vtx, vhf] == m_new[vw, vtx, vhf], T.float32(1),
                                           exp2(m[vw, vtx, vhf] - m_new[vw, vtx, vhf]))


@stage
def probs(S, P, m_new, ctx, seq, scale, h, q0, k0):
    """S := 2^(S c - m_new) in place, 0 where masked (also where a score_mod returned -inf, and
    in rows that see nothing); P := S in the operand dtype: the accumulator layout is the A
    operand layout of P V, so P never goes through memory."""
    for w, tx, tj, s in T.grid(WARPS, 32, S.shape[1], 8):
        with T.sblock("probs"):
            vw, vtj, vtx, vs = T.axis.remap("SSSS", [w, tj, tx, s])
            S[vw, vtj, vtx, vs] = T.Select(
                ctx.kept(ctx.sees(seq, h, q0 + vw * 16 + frag_row(vtx, vs),
                                  k0 + vtj * 16 + frag_col(vtx, vs)), S[vw, vtj, vtx, vs]),
                exp2(log2_exponent(S[vw, vtj, vtx, vs], ctx.exponent_scale(scale),
                                   (m_new[vw, vtx, vs % 4 // 2], T.float32(0)))),
                T.float32(0))
    for w, tx, tj, s in T.grid(WARPS, 32, S.shape[1], 8):
        with T.sblock("cast_p"):
            vw, vtj, vtx, vs = T.axis.remap("SSSS", [w, tj, tx, s])
            P[vw, vtj, vtx, vs] = T.Cast(str(P.dtype), S[vw, vtj, vtx, vs])


@stage
def row_sum(l, alpha, S, partial, pair):
    """l := l alpha + the row sums of S (= P)."""
    for w, tx, hf, tj, qq in T.grid(WARPS, 32, 2, S.shape[1], 4):
        with T.sblock("row_sum_lane"):
            vw, vtx, vhf, vtj, vq = T.axis.remap("SSSRR", [w, tx, hf, tj, qq])
            with T.init():
                partial[vw, vtx, vhf] = T.float32(0)
            partial[vw, vtx, vhf] = partial[vw, vtx, vhf] + S[vw, vtj, vtx, half_slot(vhf, vq)]
    quad_reduce("row_sum", "sum", l, l, partial, pair, alpha)


@stage
def scale_rows(name, O, alpha):
    """O := O alpha, row by row."""
    for w, tx, td, s in T.grid(WARPS, 32, O.shape[1], 8):
        with T.sblock(name):
            vw, vtd, vtx, vs = T.axis.remap("SSSS", [w, td, tx, s])
            O[vw, vtd, vtx, vs] = O[vw, vtd, vtx, vs] * alpha[vw, vtx, vs % 4 // 2]


@stage
def copy_stats(name, dst, src):
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock(name):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            dst[vw, vtx, vhf] = src[vw, vtx, vhf]


@stage
def stage_output(tile, O, l, inv_l, on_cpu):
    """O / l by rows into ``tile`` (the Q tile, free since its fragments were loaded): 1 / l once
    per row, correctly rounded (``reciprocal``), 0 in rows that see no key."""
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock("inverse_sum"):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            inv_l[vw, vtx, vhf] = T.Select(l[vw, vtx, vhf] > T.float32(0), reciprocal(l[vw, vtx, vhf], on_cpu),
                                           T.float32(0))
    for w, tx, td, s in T.grid(WARPS, 32, O.shape[1], 8):
        with T.sblock("stage_o"):
            vw, vtd, vtx, vs = T.axis.remap("SSSS", [w, td, tx, s])
            tile[vw * 16 + frag_row(vtx, vs), vtd * 16 + frag_col(vtx, vs)] = T.Cast(
                str(tile.dtype), O[vw, vtd, vtx, vs] * inv_l[vw, vtx, vs % 4 // 2])


@stage
def store_lse(LSE, m, l, batch, h, start, q0, length):
    """LSE of each row (``attention_te.lse_from_stats``) by the lane that holds it first: lane
    4 r holds rows r and r + 8."""
    for w, tx, hf in T.grid(WARPS, 32, 2):
        with T.sblock("store_lse"):
            vw, vtx, vhf = T.axis.remap("SSS", [w, tx, hf])
            if vtx % 4 == 0 and q0 + vw * 16 + vtx // 4 + 8 * vhf < length:
                LSE[batch, h, start + q0 + vw * 16 + vtx // 4 + 8 * vhf] = lse_from_stats(m[vw, vtx, vhf],
                                                                                          l[vw, vtx, vhf])


def cuda_forward(spec: AttentionSpec, cfg: CUDAKernelConfig, on_cpu: bool = False) -> tirx.PrimFunc:
    """flash_fwd(q, k, v, out, lse, softmax_scale, window_left, window_right, seq_table,
    q_tile_seq, *mod_inputs, [tile_state, kv_range]) for tensor cores (fp16/bf16 inputs). The
    sequences (batched, or packed varlen) are plan.py's table: a thread block per query tile of
    any sequence and query head.

    ``on_cpu``: the unscheduled kernel for the CPU tests (no CUDA-only intrinsics)."""
    D, Bc, dtype = spec.head_dim, cfg.block_k, spec.dtype
    ctx = CUDAContext(spec, cfg, on_cpu=on_cpu)
    has_mods = ctx.has_score_mods
    Br = WARPS * ROWS_PER_WARP
    if cfg.block_q != Br or D % 16 or Bc % 16:
        raise ValueError(f"CUDA kernels need block_q = {Br} and multiples of 16 (got {spec}, {cfg})")
    TD, TC = D // 16, Bc // 16  # 16-wide tiles along the head dim and along the keys
    elem = DataType(dtype).bits // 8

    @T.prim_func(s_tir=True)
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, lse_h: T.handle,
                  softmax_scale: T.float64, window_left: T.int64, window_right: T.int64):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        Nk = T.int64()
        H = T.int64()
        Hk = T.int64()
        sq = (T.int64(), T.int64(), T.int64())
        sk = (T.int64(), T.int64(), T.int64())
        sv = (T.int64(), T.int64(), T.int64())
        so = (T.int64(), T.int64(), T.int64())
        Q = T.match_buffer(q_h, (B, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (B, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (B, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        O = T.match_buffer(o_h, (B, Nq, H, D), dtype, strides=(*so, 1), align=elem)
        LSE = T.match_buffer(lse_h, (B, H, Nq), F32, align=4)
        ctx.declare(window_left, window_right)
        # The same inputs with strides written as multiples of VEC (the Python side checks that
        # they are): the tile copies become 16-byte vector loads only if TVM's codegen can see
        # the alignment in the index expression (otherwise it emits element-wise int64 index
        # vectors, which CUDA codegen rejects).
        Qa = T.decl_buffer((B, Nq, H, D), dtype, data=Q.data, strides=aligned_strides(sq))
        Ka = T.decl_buffer((B, Nk, Hk, D), dtype, data=K.data, strides=aligned_strides(sk))
        Va = T.decl_buffer((B, Nk, Hk, D), dtype, data=V.data, strides=aligned_strides(sv))
        Oa = T.decl_buffer((B, Nq, H, D), dtype, data=O.data, strides=aligned_strides(so))
        for bh, qt in T.grid(H, ctx.query_tiles_total()):  # query tiles of all sequences, heads
            with T.sblock("q_tile"):
                vbh, vqt = T.axis.remap("SS", [bh, qt])
                T.reads()
                T.writes()
                Qs = T.sblock_alloc_buffer((Br, D), dtype)  # shared memory tiles
                Ks = T.sblock_alloc_buffer((Bc, D), dtype)
                Vs = T.sblock_alloc_buffer((Bc, D), dtype)
                Red = T.sblock_alloc_buffer((WARPS, 32, 2), F32)  # per lane: partial max / sum of its 2 rows
                Pair = T.sblock_alloc_buffer((WARPS, 32, 2), F32)  # ... combined with the lane next to it
                Qw = T.sblock_alloc_buffer((WARPS, TD, 32, 8), dtype)  # register fragments
                Kw = T.sblock_alloc_buffer((WARPS, TC, TD, 32, 8), dtype)
                Vw = T.sblock_alloc_buffer((WARPS, TC, TD, 32, 8), dtype)
                Sw = T.sblock_alloc_buffer((WARPS, TC, 32, 8), F32)
                Pw = T.sblock_alloc_buffer((WARPS, TC, 32, 8), dtype)
                Ow = T.sblock_alloc_buffer((WARPS, TD, 32, 8), F32)
                m = T.sblock_alloc_buffer((WARPS, 32, 2), F32)  # per lane: its two rows
                m_new = T.sblock_alloc_buffer((WARPS, 32, 2), F32)
                l = T.sblock_alloc_buffer((WARPS, 32, 2), F32)
                alpha = T.sblock_alloc_buffer((WARPS, 32, 2), F32)
                inv_l = T.sblock_alloc_buffer((WARPS, 32, 2), F32)
                # b: the sequence (plan.py's table); its rows start at row qs of batch tb of q (and of
                # out, lse), at ks of batch tb of k and v (queries and keys share the batch index).
                # truncdiv: operands are non-negative, and C division needs no sign fix-ups
                b: T.let[T.int64] = T.Cast("int64", ctx.q_tile_seq[vqt])
                tb: T.let[T.int64] = ctx.column(b, plan.Q_BATCH)
                qs: T.let[T.int64] = ctx.column(b, plan.Q_START)
                ks: T.let[T.int64] = ctx.column(b, plan.K_START)
                seq = T.meta_var(ctx.sequence(b))
                h: T.let[T.int64] = vbh
                hk: T.let[T.int64] = T.truncdiv(h, T.truncdiv(H, Hk))
                q0: T.let[T.int64] = (vqt - ctx.column(b, plan.Q_TILE0)) * Br
                load_rows("load_q", Qs, Qa, tb, qs, q0, seq.q_len, h)
                ldmatrix_rows("ldmatrix_q", Qw, Qs)  # A operand of Q K^T: the warp's 16 query rows
                fill("init_o", T.float32(0), Ow)
                init_row_stats(m, l)  # m = -inf, l = 0
                for kt in T.serial(*ctx.key_tiles(seq, h, q0)):  # the key tiles the query tile sees
                    k0: T.let[T.int64] = kt * Bc
                    load_rows("load_k", Ks, Ka, tb, ks, k0, seq.k_len, hk)
                    load_rows("load_v", Vs, Va, tb, ks, k0, seq.k_len, hk)
                    ldmatrix_tiles("ldmatrix_k", Kw, Ks)  # B operand of Q K^T: K rows as columns
                    fill("init_s", T.float32(0), Sw)
                    mma("scores", Sw, "w n", Qw, "w k", Kw, "w n k", TC, TD, b_rows=True)  # S = Q K^T
                    if has_mods:
                        mod_scores(Sw, ctx, seq, softmax_scale, h, q0, k0)  # S = mods(S * scale)
                    row_max(m_new, m, Sw, Red, Pair, ctx, seq, softmax_scale, h, q0, k0)
                    rescale_factor(alpha, m, m_new)  # alpha = 2^(m - m_new)
                    probs(Sw, Pw, m_new, ctx, seq, softmax_scale, h, q0, k0)  # P = 2^(S c - m_new), masked
                    row_sum(l, alpha, Sw, Red, Pair)  # l = l alpha + rowsum(P)
                    scale_rows("rescale_o", Ow, alpha)  # O = O alpha
                    ldmatrix_tiles("ldmatrix_v", Vw, Vs)  # B operand of P V
                    mma("pv", Ow, "w n", Pw, "w k", Vw, "w k n", TD, TC)  # O += P V
                    copy_stats("keep_max", m, m_new)
                stage_output(Qs, Ow, l, inv_l, on_cpu)  # O / l by rows into the Q tile
                store_rows("store_o", Oa, Qs, tb, qs, q0, seq.q_len, h)
                store_lse(LSE, m, l, tb, h, qs, q0, seq.q_len)

    return flash_fwd


# --- backward -----------------------------------------------------------------------------
# Three kernels, as FlashAttention-2:
#   flash_bwd_prep: per query row the LSE in log2 units (a float32 hi + lo pair) and
#       Delta = rowsum(dO * O), padded to whole query tiles; zeroes the fp32 dQ accumulator;
#   flash_bwd: a thread block per (key tile or split, batch * kv head); each warp owns 16 key
#       rows. For every query tile (and every query head of the GQA group) it recomputes the
#       tile of S^T = K Q^T once and from it accumulates dV, dK (registers) and dQ (fp32, global);
#   flash_bwd_dq: dQ = scale * (sum of the dQ partials), cast to the storage dtype once.
# Transposed scores (keys as rows) put the key rows, whose dK and dV a warp owns, in the rows
# of every mma, so P^T and dS^T in the accumulator layout are directly the A operands of
# dV += P^T dO and dK += dS^T Q. dQ += dS K needs dS by query rows: dS^T goes through shared
# memory once and comes back transposed by ldmatrix.


PREP_ROWS = WARPS * 16  # query rows per block of the pre-pass: 2 threads per row


@stage
def load_half_rows(name, dst, src, group, padded_rows):
    """Lanes 2 r and 2 r + 1 of each warp: every other 16-byte chunk of row r of the group's 16 x
    warps rows (over B x H x padded_rows; past a sequence: its last row)."""
    for w, lane, c, e in T.grid(WARPS, 32, int(src.shape[3]) // (2 * VEC), VEC):
        with T.sblock(name):
            vw, vl, vc, ve = T.axis.remap("SSSS", [w, lane, c, e])
            row = T.meta_var(group * PREP_ROWS + vw * 16 + vl // 2)
            bh = T.meta_var(T.truncdiv(row, padded_rows))
            dst[vw, vl, vc * VEC + ve] = src[T.truncdiv(bh, src.shape[2]), T.min(
                T.truncmod(row, padded_rows), src.shape[1] - 1), T.truncmod(bh, src.shape[2]),
                (vc * 2 + vl % 2) * VEC + ve]


def cuda_backward_prep(head_dim: int, dtype: str) -> tirx.PrimFunc:
    """flash_bwd_prep(dout, out, lse, stats, dq_acc): stats = (lse2_hi, lse2_lo, delta), dq_acc = 0.

    Delta = rowsum(dO * O) with two threads per row (lanes 2 r and 2 r + 1), each reading every
    other 16-byte chunk of the row (a warp reads 16 rows x 32 contiguous bytes per step: whole
    32-byte sectors), summing in registers and combining with one shuffle (lane ^ 1). The
    rows are padded to whole query tiles (stats rows = NqP, a multiple of 64 = PREP_ROWS).
    """
    D = head_dim
    elem = DataType(dtype).bits // 8
    CH = D // (2 * VEC)  # 16-byte chunks per thread

    @T.prim_func(s_tir=True)
    def flash_bwd_prep(do_h: T.handle, o_h: T.handle, lse_h: T.handle, stats_h: T.handle, acc_h: T.handle):
        T.func_attr({"global_symbol": "flash_bwd_prep", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        H = T.int64()
        NqP = T.int64()
        P = T.int64()
        sdo = (T.int64(), T.int64(), T.int64())
        so = (T.int64(), T.int64(), T.int64())
        dO = T.match_buffer(do_h, (B, Nq, H, D), dtype, strides=(*sdo, 1), align=elem)
        O = T.match_buffer(o_h, (B, Nq, H, D), dtype, strides=(*so, 1), align=elem)
        LSE = T.match_buffer(lse_h, (B, H, Nq), F32)
        Stats = T.match_buffer(stats_h, (B, H, 3, NqP), F32)
        dQacc = T.match_buffer(acc_h, (P, B, Nq, H, D), F32)
        dOa = T.decl_buffer((B, Nq, H, D), dtype, data=dO.data, strides=aligned_strides(sdo))
        Oa = T.decl_buffer((B, Nq, H, D), dtype, data=O.data, strides=aligned_strides(so))
        for g in T.serial(T.truncdiv(B * H * NqP, PREP_ROWS)):
            with T.sblock("row_group"):
                vg = T.axis.remap("S", [g])
                T.reads()
                T.writes()
                dOl = T.sblock_alloc_buffer((WARPS, 32, CH * VEC), dtype)  # per lane: its chunks
                Ol = T.sblock_alloc_buffer((WARPS, 32, CH * VEC), dtype)
                part = T.sblock_alloc_buffer((WARPS, 32, 1), F32)  # per lane: its half of the dot product
                pair = T.sblock_alloc_buffer((WARPS, 32, 1), F32)
                load_half_rows("load_do_row", dOl, dOa, vg, NqP)
                load_half_rows("load_o_row", Ol, Oa, vg, NqP)
                for w, lane, c, e in T.grid(WARPS, 32, CH, VEC):
                    with T.sblock("dot"):
                        vw, vl, vc, ve = T.axis.remap("SSRR", [w, lane, c, e])
                        with T.init():
                            part[vw, vl, 0] = T.float32(0)
                        part[vw, vl, 0] = part[vw, vl, 0] + T.Cast(F32, dOl[vw, vl, vc * VEC + ve]) * T.Cast(
                            F32, Ol[vw, vl, vc * VEC + ve])
                for w, lane in T.grid(WARPS, 32):
                    with T.sblock("dot_pair"):
                        vw, vl = T.axis.remap("SS", [w, lane])
                        pair[vw, vl, 0] = part[vw, vl, 0] + part[vw, quad_partner(vl, 1), 0]
                for w, lane in T.grid(WARPS, 32):
                    with T.sblock("row_stats"):  # even lanes write their row's three statistics
                        vw, vl = T.axis.remap("SS", [w, lane])
                        row = T.meta_var(vg * PREP_ROWS + vw * 16 + vl // 2)
                        b = T.meta_var(T.truncdiv(T.truncdiv(row, NqP), H))
                        h = T.meta_var(T.truncmod(T.truncdiv(row, NqP), H))
                        i = T.meta_var(T.truncmod(row, NqP))
                        lse = T.meta_var(LSE[b, h, T.min(i, Nq - 1)])
                        if vl % 2 == 0:
                            Stats[b, h, 0, i] = T.if_then_else(i < Nq, lse_log2_parts(lse)[0], T.float32(0))
                            # A row that sees no key has LSE = -inf: its lo part would be (-inf) - (-inf) = NaN
                            Stats[b, h, 1, i] = T.if_then_else(tirx.all(i < Nq, lse > T.float32(NEG_INF)),
                                                               lse_log2_parts(lse)[1], T.float32(0))
                            Stats[b, h, 2, i] = T.if_then_else(i < Nq, pair[vw, vl, 0], T.float32(0))
        for p, b, i, h, c, e in T.grid(P, B, Nq, H, D // 4, 4):
            with T.sblock("zero_dq"):  # 16-byte stores
                vp, vb, vi, vh, vc, ve = T.axis.remap("SSSSSS", [p, b, i, h, c, e])
                dQacc[vp, vb, vi, vh, vc * 4 + ve] = T.float32(0)

    return flash_bwd_prep


def cuda_backward_dq(head_dim: int, dtype: str) -> tirx.PrimFunc:
    """flash_bwd_dq(dq_acc, dq, softmax_scale): dQ = scale * sum over the partials.

    One thread per 8 consecutive elements: 16-byte fp32 loads of each partial, one 16-byte store."""
    D = head_dim
    elem = DataType(dtype).bits // 8

    @T.prim_func(s_tir=True)
    def flash_bwd_dq(acc_h: T.handle, dq_h: T.handle, softmax_scale: T.float64):
        T.func_attr({"global_symbol": "flash_bwd_dq", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        H = T.int64()
        P = T.int64()
        sdq = (T.int64(), T.int64(), T.int64())
        dQacc = T.match_buffer(acc_h, (P, B, Nq, H, D), F32)
        dQ = T.match_buffer(dq_h, (B, Nq, H, D), dtype, strides=(*sdq, 1), align=elem)
        dQa = T.decl_buffer((B, Nq, H, D), dtype, data=dQ.data, strides=aligned_strides(sdq))
        for b, i, h, c in T.grid(B, Nq, H, D // VEC):
            with T.sblock("dq_chunk"):
                vb, vi, vh, vc = T.axis.remap("SSSS", [b, i, h, c])
                T.reads(dQacc[0:P, vb, vi, vh, vc * VEC:vc * VEC + VEC])
                T.writes(dQa[vb, vi, vh, vc * VEC:vc * VEC + VEC])
                total = T.sblock_alloc_buffer((VEC,), F32, scope="local")
                rounded = T.sblock_alloc_buffer((VEC,), dtype, scope="local")
                for e in range(VEC):
                    with T.sblock("dq_init"):
                        ve = T.axis.remap("S", [e])
                        total[ve] = T.float32(0)
                for p, e in T.grid(P, VEC):  # P > 1 only in deterministic mode: fixed summation order
                    with T.sblock("dq_sum"):
                        vp, ve = T.axis.remap("RS", [p, e])
                        total[ve] = total[ve] + dQacc[vp, vb, vi, vh, vc * VEC + ve]
                for e in range(VEC):
                    with T.sblock("dq_scale"):
                        ve = T.axis.remap("S", [e])
                        total[ve] = total[ve] * T.Cast(F32, softmax_scale)
                for e in range(VEC):
                    with T.sblock("dq_cast"):
                        ve = T.axis.remap("S", [e])
                        rounded[ve] = T.Cast(dtype, total[ve])
                for e in range(VEC):
                    with T.sblock("dq_store"):  # one 16-byte store
                        ve = T.axis.remap("S", [e])
                        dQa[vb, vi, vh, vc * VEC + ve] = rounded[ve]

    return flash_bwd_dq


# --- backward stages: one 16-query sub-tile of S^T[warp] (keys as rows, queries as columns) -----
# Key k0 + 16 w + frag_row, query q0 + 16 ti + frag_col; Sx holds S^T, X^T = mods(S^T) (-> P^T)
# and d mods / d S^T in its slots (S_, X_, G_), Ls the sub-tile's lse2 hi, lo and Delta by query.


@stage
def load_row_stats(Ls, Stats, batch, h, start, q0):
    """The query tile's lse2 hi, lo and Delta (rows past the sequence: 0 in the padding, or the
    next sequence's, which the mask zeroes)."""
    for r, i in T.grid(3, Ls.shape[1]):
        with T.sblock("load_stats"):
            vr, vi = T.axis.remap("SS", [r, i])
            Ls[vr, vi] = Stats[batch, h, vr, start + q0 + vi]


@stage
def mod_scores_t(Sx, slots, ctx, seq, scale, h, q0, k0, sub):
    """X^T := mods(S^T * scale) and the derivative d mods / d S^T (for dS)."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("score_mod"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vti = T.axis.spatial(sub[1], sub[0])
            scaled = T.meta_var(Sx[vw, slots[0], vtx, vs8] * T.Cast(F32, scale))
            q_idx = T.meta_var(q0 + vti * 16 + frag_col(vtx, vs8))
            kv_idx = T.meta_var(k0 + vw * 16 + frag_row(vtx, vs8))
            Sx[vw, slots[1], vtx, vs8] = ctx.score(seq, scaled, h, q_idx, kv_idx)
            Sx[vw, slots[2], vtx, vs8] = ctx.score_grad(seq, scaled, h, q_idx, kv_idx)


@stage
def probs_t(Sx, X_, Ph, Ls, ctx, seq, scale, h, q0, k0, sub):
    """P^T := 2^(X^T c - lse2) in place over X^T, masked (and where the query is past the
    sequence); Ph := P^T in the operand dtype, the A operand of dV += P^T dO."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("probs"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vti = T.axis.spatial(sub[1], sub[0])
            col: T.let[T.int32] = vti * 16 + frag_col(vtx, vs8)
            Sx[vw, X_, vtx, vs8] = T.Select(
                ctx.kept(tirx.all(q0 + col < seq.q_len, ctx.sees(
                    seq, h, q0 + col, k0 + vw * 16 + frag_row(vtx, vs8))), Sx[vw, X_, vtx, vs8]),
                exp2(log2_exponent(Sx[vw, X_, vtx, vs8], ctx.exponent_scale(scale), (Ls[0, col], Ls[1, col]))),
                T.float32(0))
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("cast_p"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            Ph[vw, vtx, vs8] = T.Cast(str(Ph.dtype), Sx[vw, X_, vtx, vs8])


@stage
def dscores_t(dSh, Sx, slots, dPt, Ls, ctx, sub):
    """dS^T := P^T (dP^T - Delta) (times d mods / d S^T), cast once for the mma."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("dscores"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vti = T.axis.spatial(sub[1], sub[0])
            dSh[vw, vtx, vs8] = T.Cast(str(dSh.dtype), ctx.chain_rule(
                grad_scores(Sx[vw, slots[1], vtx, vs8], dPt[vw, vtx, vs8], Ls[2, vti * 16 + frag_col(vtx, vs8)]),
                Sx[vw, slots[2], vtx, vs8]))


@stage
def captured_grads_t(Sx, slots, dPt, Ls, ctx, seq, scale, h, q0, k0, sub):
    """Scatter-adds dL/dX^T times d mods / d captured into the captured tensors' gradients."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("captured_grads"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vti = T.axis.spatial(sub[1], sub[0])
            # a warp-buffer read cannot be an `if` condition (ThreadSync's access visitor rejects
            # it): bind it first
            seen: T.let[T.bool] = Sx[vw, slots[1], vtx, vs8] != T.float32(0)
            if seen:
                ctx.scatter_captured_grads(
                    seq, Sx[vw, slots[0], vtx, vs8] * T.Cast(F32, scale), h, q0 + vti * 16 + frag_col(vtx, vs8),
                    k0 + vw * 16 + frag_row(vtx, vs8),
                    grad_scores(Sx[vw, slots[1], vtx, vs8], dPt[vw, vtx, vs8], Ls[2, vti * 16 + frag_col(vtx, vs8)]))


@stage
def store_ds_t(dSs, dSh, sub):
    """dS^T by rows into shared memory, for dQ (which needs it by query rows)."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("store_ds"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vti = T.axis.spatial(sub[1], sub[0])
            dSs[vw * 16 + frag_row(vtx, vs8), vti * 16 + frag_col(vtx, vs8)] = dSh[vw, vtx, vs8]


@stage
def add_dq(dQacc, dQw, part, batch, start, h, q0, length, dq_tile, on_cpu):
    """The warp's 16 x 16 dQ tile into the fp32 accumulator: ``atomicAdd`` (``red.global.add``),
    plain adds in the CPU test build."""
    for w, tx, s8 in T.grid(WARPS, 32, 8):
        with T.sblock("add_dq"):
            vw, vtx, vs8 = T.axis.remap("SSS", [w, tx, s8])
            vtd = T.axis.spatial(dq_tile[1], dq_tile[0])
            row = T.meta_var(q0 + vw * 16 + frag_row(vtx, vs8))
            colq = T.meta_var(vtd * 16 + frag_col(vtx, vs8))
            T.reads(dQw[vw, vtx, vs8], dQacc[part, batch, start + row, h, colq])
            T.writes(dQacc[part, batch, start + row, h, colq])
            if row < length:
                if not on_cpu:
                    T.evaluate(T.call_extern("float32", "atomicAdd", T.address_of(
                        dQacc[part, batch, start + row, h, colq]), dQw[vw, vtx, vs8]))
                else:
                    dQacc[part, batch, start + row, h, colq] = dQacc[part, batch, start + row, h, colq] + dQw[
                        vw, vtx, vs8]


@stage
def stage_dkv(Ks, Vs, dKw, dVw, scale):
    """dK * scale and dV by rows into the K and V tiles (done with)."""
    for w, tx, td, s8 in T.grid(WARPS, 32, dKw.shape[1], 8):
        with T.sblock("stage_dkv"):
            vw, vtd, vtx, vs8 = T.axis.remap("SSSS", [w, td, tx, s8])
            Ks[vw * 16 + frag_row(vtx, vs8), vtd * 16 + frag_col(vtx, vs8)] = T.Cast(
                str(Ks.dtype), dKw[vw, vtd, vtx, vs8] * T.Cast(F32, scale))
            Vs[vw * 16 + frag_row(vtx, vs8), vtd * 16 + frag_col(vtx, vs8)] = T.Cast(
                str(Vs.dtype), dVw[vw, vtd, vtx, vs8])


def cuda_backward(spec: AttentionSpec, cfg: CUDAKernelConfig, atomic_dq: bool = True,
                  on_cpu: bool = False) -> tirx.PrimFunc:
    """flash_bwd(dout, q, k, v, stats, dq_acc, dk, dv, softmax_scale, n_split, window_left,
    window_right, seq_table, *mod_inputs, *mod_input_grads, [tile_state, q_range]): a thread
    block per (key tile or split, sequence x kv head).

    ``atomic_dq``: blocks add their dQ tiles into one fp32 accumulator (``n_split`` = number
    of key tiles, one per block). Otherwise (deterministic mode) block ``s`` walks key tiles
    s, s + n_split, ... and owns partial ``s`` of ``dq_acc``; ``flash_bwd_dq`` sums the
    partials in a fixed order. The adds are ``atomicAdd`` (``red.global.add``) in both modes:
    in a partial of its own every element is added to by one thread only, so the adds apply
    in program order and the result is reproducible, and unlike a load + add + store they
    keep no loaded values or addresses live (the deterministic D = 128 backward spilled
    216 bytes with the load + add + store). ``on_cpu``: plain adds instead (the unscheduled
    kernel run on the CPU by the tests, one thread, the same arithmetic).
    """
    D, Bc, dtype = spec.head_dim, cfg.block_k, spec.dtype
    ctx = CUDAContext(spec, cfg, backward=True, on_cpu=on_cpu)
    has_mods = ctx.has_score_mods
    # slots of the score fragment Sx: raw scores S^T, modded scores X^T (-> P^T), d mods / d S^T
    SLOTS = S_, X_, G_ = (0, 1, 2 if ctx.has_captured_grads else 0) if has_mods else (0, 0, 0)
    Br = WARPS * ROWS_PER_WARP
    if cfg.block_q != Br or Bc != Br or D % 16:
        raise ValueError(f"the CUDA backward needs 64 x 64 tiles and a multiple of 16 as head dim (got {spec}, {cfg})")
    TD, TI, TC = D // 16, Br // 16, Bc // 16
    elem = DataType(dtype).bits // 8

    @T.prim_func(s_tir=True)
    def flash_bwd(do_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, stats_h: T.handle,
                  acc_h: T.handle, dk_h: T.handle, dv_h: T.handle, softmax_scale: T.float64, n_split: T.int64,
                  window_left: T.int64, window_right: T.int64):
        T.func_attr({"global_symbol": "flash_bwd", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        Nk = T.int64()
        H = T.int64()
        Hk = T.int64()
        NqP = T.int64()
        P = T.int64()
        sdo = (T.int64(), T.int64(), T.int64())
        sq = (T.int64(), T.int64(), T.int64())
        sk = (T.int64(), T.int64(), T.int64())
        sv = (T.int64(), T.int64(), T.int64())
        sdk = (T.int64(), T.int64(), T.int64())
        sdv = (T.int64(), T.int64(), T.int64())
        dO = T.match_buffer(do_h, (B, Nq, H, D), dtype, strides=(*sdo, 1), align=elem)
        Q = T.match_buffer(q_h, (B, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (B, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (B, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        Stats = T.match_buffer(stats_h, (B, H, 3, NqP), F32)
        dQacc = T.match_buffer(acc_h, (P, B, Nq, H, D), F32)
        dK = T.match_buffer(dk_h, (B, Nk, Hk, D), dtype, strides=(*sdk, 1), align=elem)
        dV = T.match_buffer(dv_h, (B, Nk, Hk, D), dtype, strides=(*sdv, 1), align=elem)
        ctx.declare(window_left, window_right)
        dOa = T.decl_buffer((B, Nq, H, D), dtype, data=dO.data, strides=aligned_strides(sdo))
        Qa = T.decl_buffer((B, Nq, H, D), dtype, data=Q.data, strides=aligned_strides(sq))
        Ka = T.decl_buffer((B, Nk, Hk, D), dtype, data=K.data, strides=aligned_strides(sk))
        Va = T.decl_buffer((B, Nk, Hk, D), dtype, data=V.data, strides=aligned_strides(sv))
        dKa = T.decl_buffer((B, Nk, Hk, D), dtype, data=dK.data, strides=aligned_strides(sdk))
        dVa = T.decl_buffer((B, Nk, Hk, D), dtype, data=dV.data, strides=aligned_strides(sdv))
        for s, bh in T.grid(n_split, ctx.sequences() * Hk):
            with T.sblock("kv_tile"):
                vs, vbh = T.axis.remap("SS", [s, bh])
                T.reads()
                T.writes()
                Qs = T.sblock_alloc_buffer((Br, D), dtype)  # shared memory tiles
                dOs = T.sblock_alloc_buffer((Br, D), dtype)
                Ks = T.sblock_alloc_buffer((Bc, D), dtype)
                Vs = T.sblock_alloc_buffer((Bc, D), dtype)
                Ls = T.sblock_alloc_buffer((3, Br), F32)  # lse2 hi, lo and Delta of the query tile
                dSs = T.sblock_alloc_buffer((Bc, Br), dtype)  # dS^T, for dQ
                # register fragments; suffix: a = A operand, b = B (k x n), bt = B given as n x k
                Ka_f = T.sblock_alloc_buffer((WARPS, TD, 32, 8), dtype)
                Qbt = T.sblock_alloc_buffer((WARPS, TI, TD, 32, 8), dtype)
                # S^T, then P^T (fp32), of one sub-tile; with score mods also X^T = mods(S^T), which
                # becomes P^T, and d mods / d S^T (in place over S^T unless captured tensors need
                # S^T for their gradients). One buffer: StorageRewrite would alias separate
                # fragments whose lifetimes it sees apart, which LowerWarpMemory then rejects.
                Sx = T.sblock_alloc_buffer((WARPS, len(set(SLOTS)), 32, 8), F32)
                Ph = T.sblock_alloc_buffer((WARPS, 32, 8), dtype)
                dOb = T.sblock_alloc_buffer((WARPS, TI, TD, 32, 8), dtype)
                Va_f = T.sblock_alloc_buffer((WARPS, TD, 32, 8), dtype)
                dObt = T.sblock_alloc_buffer((WARPS, TI, TD, 32, 8), dtype)
                dPt = T.sblock_alloc_buffer((WARPS, 32, 8), F32)  # one 16 x 16 tile of dP^T
                dSh = T.sblock_alloc_buffer((WARPS, 32, 8), dtype)
                Qb = T.sblock_alloc_buffer((WARPS, TI, TD, 32, 8), dtype)
                dSa = T.sblock_alloc_buffer((WARPS, TC, 32, 8), dtype)
                Kb = T.sblock_alloc_buffer((WARPS, TC, TD, 32, 8), dtype)
                dQw = T.sblock_alloc_buffer((WARPS, 32, 8), F32)  # one 16 x 16 tile of this query tile's dQ
                dKw = T.sblock_alloc_buffer((WARPS, TD, 32, 8), F32)  # over all query tiles and heads
                dVw = T.sblock_alloc_buffer((WARPS, TD, 32, 8), F32)
                # b: the sequence (plan.py's table); its rows start at row qs of batch tb of q (dout,
                # stats, dq), at ks of batch tb of k and v (dk, dv)
                b: T.let[T.int64] = T.truncdiv(vbh, Hk)
                tb: T.let[T.int64] = ctx.column(b, plan.Q_BATCH)
                qs: T.let[T.int64] = ctx.column(b, plan.Q_START)
                ks: T.let[T.int64] = ctx.column(b, plan.K_START)
                seq = T.meta_var(ctx.sequence(b))
                hk: T.let[T.int64] = T.truncmod(vbh, Hk)
                group: T.let[T.int64] = T.truncdiv(H, Hk)
                part: T.let[T.int64] = T.int64(0) if atomic_dq else vs
                # Key tiles vs, vs + n_split, ... of the sequence: a trip count, not a condition, keeps
                # this block-uniform for TVM's barrier insertion (which refuses barriers under an `if`).
                for t in T.serial(ceildiv(ceildiv(seq.k_len, Bc) - vs, n_split)):
                    if True:
                        k0: T.let[T.int64] = (vs + t * n_split) * Bc
                        load_rows("load_k", Ks, Ka, tb, ks, k0, seq.k_len, hk)
                        load_rows("load_v", Vs, Va, tb, ks, k0, seq.k_len, hk)
                        fill("init_dkv", T.float32(0), dKw, dVw)
                        for g in T.serial(group):  # the query heads of the GQA group
                            h: T.let[T.int64] = hk * group + g
                            for qt in T.serial(*ctx.query_tiles(seq, h, k0)):  # the query tiles that see the keys
                                q0: T.let[T.int64] = qt * Br
                                load_rows("load_q", Qs, Qa, tb, qs, q0, seq.q_len, h)
                                load_rows("load_do", dOs, dOa, tb, qs, q0, seq.q_len, h)
                                load_row_stats(Ls, Stats, tb, h, qs, q0)
                                ldmatrix_rows("ldmatrix_k", Ka_f, Ks)  # A operands: the warp's 16 keys
                                ldmatrix_tiles("ldmatrix_qt", Qbt, Qs)
                                ldmatrix_tiles("ldmatrix_do", dOb, dOs)
                                ldmatrix_rows("ldmatrix_v", Va_f, Vs)
                                ldmatrix_tiles("ldmatrix_dot", dObt, dOs)
                                ldmatrix_tiles("ldmatrix_q", Qb, Qs)
                                # One 16-query sub-tile (ti) at a time, from S^T to dK: besides dK and dV
                                # only 16 x 16 tiles stay live (S^T/P^T, dP^T: 8 fp32 registers each
                                # instead of 32), what lets the D = 128 backward fit in 255 registers. The
                                # price: the warp's K and V fragments (A operands) are loaded per sub-tile.
                                for ti in T.serial(TI):
                                    sub = T.meta_var((ti, TI))
                                    fill("init_s", T.float32(0), Sx, slot=S_)
                                    mma("scores", Sx, ("w", S_), Ka_f, "w k", Qbt, "w n k", sub, TD,
                                        b_rows=True)  # S^T = K Q^T
                                    if has_mods:
                                        mod_scores_t(Sx, SLOTS, ctx, seq, softmax_scale, h, q0, k0, sub)
                                    probs_t(Sx, X_, Ph, Ls, ctx, seq, softmax_scale, h, q0, k0, sub)  # P^T
                                    mma("dv", dVw, "w n", Ph, "w", dOb, "w k n", TD, sub)  # dV += P^T dO
                                    fill("init_dp", T.float32(0), dPt)
                                    mma("dprobs", dPt, "w", Va_f, "w k", dObt, "w n k", sub, TD,
                                        b_rows=True)  # dP^T = V dO^T
                                    dscores_t(dSh, Sx, SLOTS, dPt, Ls, ctx, sub)  # dS^T = P^T (dP^T - Delta)
                                    if ctx.has_captured_grads:
                                        captured_grads_t(Sx, SLOTS, dPt, Ls, ctx, seq, softmax_scale, h, q0, k0, sub)
                                    mma("dk", dKw, "w n", dSh, "w", Qb, "w k n", TD, sub)  # dK += dS^T Q
                                    store_ds_t(dSs, dSh, sub)
                                ldmatrix_rows("ldmatrix_ds", dSa, dSs, transposed=True)  # dS by query rows
                                ldmatrix_tiles("ldmatrix_kb", Kb, Ks)
                                # dQ one 16-column tile at a time, added to the accumulator as soon as
                                # it is complete: 8 fp32 registers live instead of D / 2 (what kept the
                                # D = 128 backward from fitting in 255 registers).
                                for td in T.serial(TD):
                                    fill("init_dq", T.float32(0), dQw)
                                    mma("dq", dQw, "w", dSa, "w k", Kb, "w k n", (td, TD), TC)  # dQ = dS K
                                    add_dq(dQacc, dQw, part, tb, qs, h, q0, seq.q_len, (td, TD), on_cpu)
                        stage_dkv(Ks, Vs, dKw, dVw, softmax_scale)  # dK, dV by rows into the K, V tiles
                        store_rows("store_dkv", dKa, Ks, tb, ks, k0, seq.k_len, hk, dVa, Vs)

    return flash_bwd
