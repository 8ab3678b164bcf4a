"""Fused FlashAttention kernels: the loop skeletons, in TensorIR (TVMScript).

The tile-level math comes from ``attention_te`` (mask, exp2, dS, LSE); this module arranges it
into the FlashAttention loop nests and names every stage with an ``sblock`` so that the
per-target schedules in ``schedules/`` can tile, vectorize and parallelize them. Tile sizes
(``block_q`` x ``block_k``) are part of the loop structure and therefore come in here; every
other choice (register tiles, vector width, unrolling, threads) is the schedule's.

Shapes are symbolic in batch, heads and both sequence lengths, so one compiled module serves
every input size. Head dim, dtype and causality are fixed per module.

Layout conventions inside the kernels (all tile buffers fp32, rule 3):

* forward: tiles are kept transposed, query index innermost. Scores ``ST[j, i]`` and the output
  accumulator ``OT[d, i]`` are then updated with vector FMAs along i, and the row statistics
  (running max ``m``, denominator ``l``) become plain vector operations instead of horizontal
  reductions. K and V are packed once per call into zero-padded fp32 copies (O(N) memory), so
  the inner loops have no bounds checks and no dtype conversions.
* backward: for each key tile, K^T and V^T are packed once (D x block_k) and all of S, P, dP,
  dS, dV, dK, dQ for every query tile come from one recompute of S (rule 2). dK and dV
  accumulate in fp32 tile buffers across all query tiles of all heads of a GQA group. dQ is
  accumulated in fp32 partials, one per "split" of the key tiles, so that splits run in
  parallel without races (even when batch * heads is 1) and are summed once at the end.

Every stage sits in its own opaque wrapper block (``scores_tile``, ...): ``cache_write``,
``reverse_compute_at`` and ``decompose_reduction`` need the parent block of a stage to be a
"stage pipeline", which the online-softmax loop body as a whole is not. Each wrapper in turn sits
under a unit loop (``for unit in range(1)``): in TVM 0.27, once one of several blocks that sit
directly in the same ``SeqStmt`` has been scheduled, scheduling another modifies the *original*
PrimFunc in place (copy-on-write misses the shared block), which breaks MetaSchedule's trace
replay on the task's module. Loops in a ``SeqStmt`` are copied correctly; unit loops vanish when
the kernels are lowered.

Accumulators carried across loop iterations (O and l in the forward, dK, dV, dQ in the
backward) are updated in two levels: a product block sums one tile into a fresh fp32 partial,
and an ``update_*`` block adds the partial to the running accumulator. A sequential fp32 sum of
N terms has an error growing like N ulps; tile sums added up tile by tile grow like
block + N/block. The measured errors are those of PyTorch's blocked GEMMs or better. The
product blocks stay plain reduction blocks that the schedules can register-tile; the in-place
``update_*`` blocks are plain loops left to LLVM's loop vectorizer (TensorIR's ``vectorize``
refuses blocks that read and write the same buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T

from .attention_te import (
    NEG_INF,
    exp2,
    grad_scores,
    log2_exponent,
    lse_from_stats,
    lse_log2_parts,
    scale_log2_parts,
    visible,
)

F32 = "float32"


@dataclass(frozen=True)
class KernelSpec:
    """What a fused kernel computes, and the tile shape its loop nest is built around."""

    head_dim: int
    dtype: str
    causal: bool
    block_q: int
    block_k: int
    # "polynomial": attention_te.exp2, which vectorizes on CPUs; "intrinsic": T.exp2, a single
    # op (GPUs have it in hardware; FLOP analyses can only read this form).
    exp2: str = "polynomial"
    # Experiment knobs (benchmarks/rule*.py), each breaking one of the three rules; the defaults
    # are the real kernels. lse_dtype: precision of the stored LSE (rule 1: fp32 row statistics).
    # recompute: "once" or "twice" (a second pass recomputes P for dK, dQ; rule 2).
    # grad_acc_dtype: dtype of the running dQ/dK/dV sums (rule 3: fp32 accumulators).
    lse_dtype: str = "float32"
    recompute: str = "once"
    grad_acc_dtype: str = "float32"

    def exp2_fn(self):
        return exp2 if self.exp2 == "polynomial" else tirx.exp2

    @property
    def acc_storage(self) -> str:
        """dtype of the gradient accumulator buffers (bf16 ones are emulated in fp32 storage)."""
        return F32 if self.grad_acc_dtype == "bfloat16" else self.grad_acc_dtype

    def to_acc(self, x):
        """fp32 value -> the precision of the running gradient sums."""
        return round_to_precision(x, self.grad_acc_dtype, self.acc_storage)

    def from_acc(self, x):
        return x if self.acc_storage == F32 else tirx.Cast(F32, x)


def round_to_precision(x, precision: str, storage: str = F32):
    """An fp32 value rounded to ``precision``, as ``storage`` (experiment variants only).

    TVM legalizes bfloat16 scratch buffers and arithmetic to float32 on CPUs, which silently
    undoes a bf16 accumulator; bf16 rounding is therefore done on the bits (round half to even,
    keep the high 16), and the value stays in fp32 storage.
    """
    if precision == F32:
        return x
    if precision != "bfloat16":
        rounded = tirx.Cast(precision, x)
        return rounded if storage == precision else tirx.Cast(storage, rounded)
    bits = tirx.reinterpret("uint32", x)
    lsb = tirx.bitwise_and(tirx.shift_right(bits, tirx.const(16, "uint32")), tirx.const(1, "uint32"))
    bits = tirx.bitwise_and(bits + tirx.const(0x7FFF, "uint32") + lsb, tirx.const(0xFFFF0000, "uint32"))
    return tirx.reinterpret(F32, bits)


def _ceildiv(a, b):
    return (a + b - 1) // b


def _key_tiles_for_query_tile(q0, spec: KernelSpec, seqlen_q, seqlen_k):
    """Number of key tiles a query tile [q0, q0 + block_q) needs (causal: skip masked ones)."""
    n_kt = _ceildiv(seqlen_k, spec.block_k)
    if not spec.causal:
        return n_kt
    last_row = tirx.min(q0 + spec.block_q, seqlen_q) - 1
    last_key = last_row + (seqlen_k - seqlen_q)  # bottom-right aligned mask
    return tirx.max(tirx.min(_ceildiv(last_key + 1, spec.block_k), n_kt), 0)


def _first_query_tile_for_key_tile(k0, spec: KernelSpec, seqlen_q, seqlen_k):
    """First query tile that sees key k0 (causal); 0 otherwise."""
    if not spec.causal:
        return tirx.const(0, "int64")
    return tirx.max(k0 - (seqlen_k - seqlen_q), 0) // spec.block_q


def fused_forward(spec: KernelSpec) -> tirx.PrimFunc:
    """flash_fwd(q, k, v, out, lse, softmax_scale): one pass, online softmax, O(N) memory."""
    D, Br, Bc, dtype = spec.head_dim, spec.block_q, spec.block_k, spec.dtype
    causal, exp2_ = spec.causal, spec.exp2_fn()
    elem = DataType(dtype).bits // 8

    def stored_lse(x):  # rounded through a lower precision in the rule-1 experiment only
        return round_to_precision(x, spec.lse_dtype)

    @T.prim_func(s_tir=True)
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, lse_h: T.handle,
                  softmax_scale: T.float64):
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
        # Strided views (e.g. q, k, v sliced from one packed qkv tensor) are read in place; only
        # the head dim must be contiguous. align = element size: no alignment is assumed.
        Q = T.match_buffer(q_h, (B, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (B, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (B, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        O = T.match_buffer(o_h, (B, Nq, H, D), dtype, strides=(*so, 1), align=elem)
        LSE = T.match_buffer(lse_h, (B, H, Nq), F32, align=4)
        Kp = T.alloc_buffer((B, Hk, _ceildiv(Nk, Bc) * Bc, D), F32)
        Vp = T.alloc_buffer((B, Hk, _ceildiv(Nk, Bc) * Bc, D), F32)
        for b, hk, j, d in T.grid(B, Hk, _ceildiv(Nk, Bc) * Bc, D):
            with T.sblock("pack_kv"):
                vb, vhk, vj, vd = T.axis.remap("SSSS", [b, hk, j, d])
                Kp[vb, vhk, vj, vd] = T.if_then_else(vj < Nk, T.Cast(F32, K[vb, T.min(vj, Nk - 1), vhk, vd]),
                                                     T.float32(0))
                Vp[vb, vhk, vj, vd] = T.if_then_else(vj < Nk, T.Cast(F32, V[vb, T.min(vj, Nk - 1), vhk, vd]),
                                                     T.float32(0))
        # Heads as (kv head, member of its GQA group): workspace indices stay plain loop
        # variables, which TVM's buffer compaction bounds exactly (a division by H // Hk it
        # cannot simplify, and every access would carry the unsimplified bound).
        for b, hk, g, qt in T.grid(B, Hk, H // Hk, _ceildiv(Nq, Br)):
            with T.sblock("q_tile"):
                vb, vhk, vg, vqt = T.axis.remap("SSSS", [b, hk, g, qt])
                T.reads()
                T.writes()
                QT = T.sblock_alloc_buffer((D, Br), F32)  # q tile, transposed
                ST = T.sblock_alloc_buffer((Bc, Br), F32)  # scores q.k (unscaled), transposed
                PT = T.sblock_alloc_buffer((Bc, Br), F32)  # unnormalized probabilities
                OT = T.sblock_alloc_buffer((D, Br), F32)  # output accumulator
                PVT = T.sblock_alloc_buffer((D, Br), F32)  # this key tile's P V
                m = T.sblock_alloc_buffer((Br,), F32)  # running row max (log2 units)
                m_next = T.sblock_alloc_buffer((Br,), F32)
                l = T.sblock_alloc_buffer((Br,), F32)  # running denominator
                l_tile = T.sblock_alloc_buffer((Br,), F32)  # this key tile's row sums
                alpha = T.sblock_alloc_buffer((Br,), F32)  # exp2(m - m_next)
                q0: T.let[T.int64] = vqt * Br
                h: T.let[T.int64] = vhk * (H // Hk) + vg
                for d, i in T.grid(D, Br):
                    with T.sblock("load_q"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        QT[vd, vi] = T.if_then_else(
                            q0 + vi < Nq, T.Cast(F32, Q[vb, T.min(q0 + vi, Nq - 1), h, vd]), T.float32(0))
                for d, i in T.grid(D, Br):
                    with T.sblock("init_o"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        OT[vd, vi] = T.float32(0)
                for i in T.serial(Br):
                    with T.sblock("init_stats"):
                        vi = T.axis.remap("S", [i])
                        m[vi] = T.float32(NEG_INF)
                        l[vi] = T.float32(0)
                for kt in T.serial(_key_tiles_for_query_tile(q0, spec, Nq, Nk)):
                    k0: T.let[T.int64] = kt * Bc
                    for unit in range(1):
                        with T.sblock("scores_tile"):
                            for j, i, d in T.grid(Bc, Br, D):
                                with T.sblock("scores"):
                                    vj, vi, vd = T.axis.remap("SSR", [j, i, d])
                                    with T.init():
                                        ST[vj, vi] = T.float32(0)
                                    ST[vj, vi] = ST[vj, vi] + Kp[vb, vhk, k0 + vj, vd] * QT[vd, vi]
                    for unit in range(1):
                        with T.sblock("row_max_tile"):
                            for j, i in T.grid(Bc, Br):
                                with T.sblock("row_max"):
                                    vj, vi = T.axis.remap("RS", [j, i])
                                    with T.init():
                                        m_next[vi] = m[vi]
                                    m_next[vi] = T.max(m_next[vi], T.Select(
                                        visible(q0 + vi, k0 + vj, Nq, Nk, causal),
                                        ST[vj, vi] * scale_log2_parts(softmax_scale)[0], T.float32(NEG_INF)))
                    for unit in range(1):
                        with T.sblock("rescale_tile"):
                            for i in T.serial(Br):
                                with T.sblock("rescale"):
                                    vi = T.axis.remap("S", [i])
                                    # Equal maxima (also both -inf: nothing seen yet) rescale by exactly 1.
                                    alpha[vi] = T.Select(m[vi] == m_next[vi], T.float32(1), exp2_(m[vi] - m_next[vi]))
                    for unit in range(1):
                        with T.sblock("probs_tile"):
                            for j, i in T.grid(Bc, Br):
                                with T.sblock("probs"):
                                    vj, vi = T.axis.remap("SS", [j, i])
                                    PT[vj, vi] = T.Select(
                                        visible(q0 + vi, k0 + vj, Nq, Nk, causal),
                                        exp2_(log2_exponent(ST[vj, vi], scale_log2_parts(softmax_scale),
                                                           (m_next[vi], T.float32(0)))),
                                        T.float32(0))
                    for unit in range(1):
                        with T.sblock("pv_tile"):
                            for d, i, j in T.grid(D, Br, Bc):
                                with T.sblock("pv"):
                                    vd, vi, vj = T.axis.remap("SSR", [d, i, j])
                                    with T.init():
                                        PVT[vd, vi] = T.float32(0)
                                    PVT[vd, vi] = PVT[vd, vi] + Vp[vb, vhk, k0 + vj, vd] * PT[vj, vi]
                    for unit in range(1):
                        with T.sblock("update_o_tile"):
                            for d, i in T.grid(D, Br):
                                with T.sblock("update_o"):
                                    vd, vi = T.axis.remap("SS", [d, i])
                                    OT[vd, vi] = OT[vd, vi] * alpha[vi] + PVT[vd, vi]
                    for unit in range(1):
                        with T.sblock("row_sum_tile"):
                            for j, i in T.grid(Bc, Br):
                                with T.sblock("row_sum"):
                                    vj, vi = T.axis.remap("RS", [j, i])
                                    with T.init():
                                        l_tile[vi] = T.float32(0)
                                    l_tile[vi] = l_tile[vi] + PT[vj, vi]
                    for unit in range(1):
                        with T.sblock("update_stats_tile"):
                            for i in T.serial(Br):
                                with T.sblock("update_stats"):
                                    vi = T.axis.remap("S", [i])
                                    m[vi] = m_next[vi]
                                    l[vi] = l[vi] * alpha[vi] + l_tile[vi]
                for i, d in T.grid(Br, D):
                    with T.sblock("store_o"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        if q0 + vi < Nq:
                            # One cast to the storage dtype, at the end (rule 3).
                            O[vb, q0 + vi, h, vd] = T.Cast(dtype, OT[vd, vi] * T.Select(
                                l[vi] > T.float32(0), T.float32(1) / l[vi], T.float32(0)))
                for i in T.serial(Br):
                    with T.sblock("store_lse"):
                        vi = T.axis.remap("S", [i])
                        if q0 + vi < Nq:
                            LSE[vb, h, q0 + vi] = stored_lse(lse_from_stats(m[vi], l[vi]))

    return flash_fwd


def fused_backward(spec: KernelSpec) -> tirx.PrimFunc:
    """flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, n_split).

    ``n_split`` (runtime) splits the key tiles of each (batch, kv head) into interleaved groups
    that run in parallel; each split owns an fp32 dQ partial (rule 3, no races).
    """
    D, Br, Bc, dtype = spec.head_dim, spec.block_q, spec.block_k, spec.dtype
    elem = DataType(dtype).bits // 8
    acc = spec.acc_storage  # of the running dQ, dK, dV sums: float32 except in the rule-3 experiment
    to_acc, from_acc = spec.to_acc, spec.from_acc

    # Stages of one (key tile, query tile) step, as macros: the naive two-pass variant of the
    # rule-2 experiment reuses them. Non-hygienic: they use the buffers and loop variables of
    # the call site (a repeated expansion gets "_1" appended to its block names).
    @T.macro(hygienic=False)
    def recompute_probs():
        for r, i in T.grid(3, Br):
            with T.sblock("load_row_stats"):
                vr, vi = T.axis.remap("SS", [r, i])
                row_stats[vr, vi] = RowStats[vb, vhk, member, vr, q0 + vi]
        for unit in range(1):
            with T.sblock("scores_tile"):
                for i, j, d in T.grid(Br, Bc, D):
                    with T.sblock("scores"):
                        vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                        with T.init():
                            S[vi, vj] = T.float32(0)
                        S[vi, vj] = S[vi, vj] + Qp[vb, vhk, member, q0 + vi, vd] * KT[vd, vj]
        for unit in range(1):
            with T.sblock("probs_tile"):
                for i, j in T.grid(Br, Bc):
                    with T.sblock("probs"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        P[vi, vj] = T.Select(visible(q0 + vi, k0 + vj, Nq, Nk, spec.causal),
                                             spec.exp2_fn()(log2_exponent(S[vi, vj], scale_log2_parts(softmax_scale),
                                                                 (row_stats[0, vi], row_stats[1, vi]))),
                                             T.float32(0))

    @T.macro(hygienic=False)
    def accumulate_dv():
        for unit in range(1):
            with T.sblock("dv_tile"):
                for j, d, i in T.grid(Bc, D, Br):
                    with T.sblock("dv"):
                        vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                        with T.init():
                            dVtile[vj, vd] = T.float32(0)
                        dVtile[vj, vd] = dVtile[vj, vd] + P[vi, vj] * dOp[vb, vhk, member, q0 + vi, vd]
        for unit in range(1):
            with T.sblock("update_dv_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dVacc[vj, vd] = spec.to_acc(spec.from_acc(dVacc[vj, vd]) + dVtile[vj, vd])

    @T.macro(hygienic=False)
    def accumulate_dk_dq():
        for unit in range(1):
            with T.sblock("dprobs_tile"):
                for i, j, d in T.grid(Br, Bc, D):
                    with T.sblock("dprobs"):
                        vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                        with T.init():
                            dP[vi, vj] = T.float32(0)
                        dP[vi, vj] = dP[vi, vj] + dOp[vb, vhk, member, q0 + vi, vd] * VT[vd, vj]
        for unit in range(1):
            with T.sblock("dscores_tile"):
                for i, j in T.grid(Br, Bc):
                    with T.sblock("dscores"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        dS[vi, vj] = grad_scores(P[vi, vj], dP[vi, vj], row_stats[2, vi])
        for unit in range(1):
            with T.sblock("dk_tile"):
                for j, d, i in T.grid(Bc, D, Br):
                    with T.sblock("dk"):
                        vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                        with T.init():
                            dKtile[vj, vd] = T.float32(0)
                        dKtile[vj, vd] = dKtile[vj, vd] + dS[vi, vj] * Qp[vb, vhk, member, q0 + vi, vd]
        for unit in range(1):
            with T.sblock("update_dk_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dk"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dKacc[vj, vd] = spec.to_acc(spec.from_acc(dKacc[vj, vd]) + dKtile[vj, vd])
        for unit in range(1):
            with T.sblock("dq_tile"):
                for i, d, j in T.grid(Br, D, Bc):
                    with T.sblock("dq"):
                        vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                        with T.init():
                            dQtile[vi, vd] = T.float32(0)
                        dQtile[vi, vd] = dQtile[vi, vd] + dS[vi, vj] * Kt[vj, vd]
        for unit in range(1):
            with T.sblock("update_dq_tile"):
                for i, d in T.grid(Br, D):
                    with T.sblock("update_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        dQacc[vs, vb, vhk, member, q0 + vi, vd] = spec.to_acc(
                            spec.from_acc(dQacc[vs, vb, vhk, member, q0 + vi, vd]) + dQtile[vi, vd])

    @T.prim_func(s_tir=True)
    def flash_bwd(do_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle,
                  lse_h: T.handle, dq_h: T.handle, dk_h: T.handle, dv_h: T.handle,
                  softmax_scale: T.float64, n_split: T.int64):
        T.func_attr({"global_symbol": "flash_bwd", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        Nk = T.int64()
        H = T.int64()
        Hk = T.int64()
        sdo = (T.int64(), T.int64(), T.int64())
        sq = (T.int64(), T.int64(), T.int64())
        sk = (T.int64(), T.int64(), T.int64())
        sv = (T.int64(), T.int64(), T.int64())
        so = (T.int64(), T.int64(), T.int64())
        sdq = (T.int64(), T.int64(), T.int64())
        sdk = (T.int64(), T.int64(), T.int64())
        sdv = (T.int64(), T.int64(), T.int64())
        dO = T.match_buffer(do_h, (B, Nq, H, D), dtype, strides=(*sdo, 1), align=elem)
        Q = T.match_buffer(q_h, (B, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (B, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (B, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        O = T.match_buffer(o_h, (B, Nq, H, D), dtype, strides=(*so, 1), align=elem)
        LSE = T.match_buffer(lse_h, (B, H, Nq), F32, align=4)
        dQ = T.match_buffer(dq_h, (B, Nq, H, D), dtype, strides=(*sdq, 1), align=elem)
        dK = T.match_buffer(dk_h, (B, Nk, Hk, D), dtype, strides=(*sdk, 1), align=elem)
        dV = T.match_buffer(dv_h, (B, Nk, Hk, D), dtype, strides=(*sdv, 1), align=elem)
        # Packed copies are padded to whole tiles with zero rows: no bounds checks in the tile loops.
        # Heads are indexed (kv head, member of its GQA group) in the workspaces; see the forward.
        Qp = T.alloc_buffer((B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D), F32)
        dOp = T.alloc_buffer((B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D), F32)
        # Per query row: LSE * log2(e) as a float32 hi + lo pair, and Delta = rowsum(dO * O).
        RowStats = T.alloc_buffer((B, Hk, H // Hk, 3, _ceildiv(Nq, Br) * Br), F32)
        dQacc = T.alloc_buffer((n_split, B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D), acc)
        dQsum = T.alloc_buffer((B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D), F32)
        for b, hk, g, i, d in T.grid(B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D):
            with T.sblock("pack_q_do"):
                vb, vhk, vg, vi, vd = T.axis.remap("SSSSS", [b, hk, g, i, d])
                Qp[vb, vhk, vg, vi, vd] = T.if_then_else(
                    vi < Nq, T.Cast(F32, Q[vb, T.min(vi, Nq - 1), vhk * (H // Hk) + vg, vd]), T.float32(0))
                dOp[vb, vhk, vg, vi, vd] = T.if_then_else(
                    vi < Nq, T.Cast(F32, dO[vb, T.min(vi, Nq - 1), vhk * (H // Hk) + vg, vd]), T.float32(0))
        for b, hk, g, i, d in T.grid(B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D):
            with T.sblock("delta"):
                vb, vhk, vg, vi, vd = T.axis.remap("SSSSR", [b, hk, g, i, d])
                with T.init():
                    RowStats[vb, vhk, vg, 2, vi] = T.float32(0)
                RowStats[vb, vhk, vg, 2, vi] = RowStats[vb, vhk, vg, 2, vi] + dOp[vb, vhk, vg, vi, vd] * T.Cast(
                    F32, O[vb, T.min(vi, Nq - 1), vhk * (H // Hk) + vg, vd])
        for b, hk, g, i in T.grid(B, Hk, H // Hk, _ceildiv(Nq, Br) * Br):
            with T.sblock("lse_log2"):
                vb, vhk, vg, vi = T.axis.remap("SSSS", [b, hk, g, i])
                RowStats[vb, vhk, vg, 0, vi] = T.if_then_else(
                    vi < Nq, lse_log2_parts(LSE[vb, vhk * (H // Hk) + vg, T.min(vi, Nq - 1)])[0], T.float32(0))
                RowStats[vb, vhk, vg, 1, vi] = T.if_then_else(
                    vi < Nq, lse_log2_parts(LSE[vb, vhk * (H // Hk) + vg, T.min(vi, Nq - 1)])[1], T.float32(0))
        for s, b, hk, g, i, d in T.grid(n_split, B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, D):
            with T.sblock("zero_dq"):
                vs, vb, vhk, vg, vi, vd = T.axis.remap("SSSSSS", [s, b, hk, g, i, d])
                dQacc[vs, vb, vhk, vg, vi, vd] = to_acc(T.float32(0))
        for b, hk, s in T.grid(B, Hk, n_split):
            with T.sblock("kv_split"):
                vb, vhk, vs = T.axis.remap("SSS", [b, hk, s])
                T.reads()
                T.writes()
                Kt = T.sblock_alloc_buffer((Bc, D), F32)  # k tile (for dQ += dS K)
                KT = T.sblock_alloc_buffer((D, Bc), F32)  # k tile transposed (for S)
                VT = T.sblock_alloc_buffer((D, Bc), F32)  # v tile transposed (for dP)
                dKacc = T.sblock_alloc_buffer((Bc, D), acc)  # over all query tiles and GQA heads
                dKtile = T.sblock_alloc_buffer((Bc, D), F32)  # one query tile's share
                dVacc = T.sblock_alloc_buffer((Bc, D), acc)
                dVtile = T.sblock_alloc_buffer((Bc, D), F32)
                S = T.sblock_alloc_buffer((Br, Bc), F32)
                P = T.sblock_alloc_buffer((Br, Bc), F32)
                dP = T.sblock_alloc_buffer((Br, Bc), F32)
                dS = T.sblock_alloc_buffer((Br, Bc), F32)
                dQtile = T.sblock_alloc_buffer((Br, D), F32)
                row_stats = T.sblock_alloc_buffer((3, Br), F32)  # lse_hi, lse_lo, delta of the q tile
                group: T.let[T.int64] = H // Hk
                # Key tiles vs, vs + n_split, ...: interleaved, so causal splits get equal work.
                for t in T.serial(_ceildiv(_ceildiv(Nk, Bc), n_split)):
                    if vs + t * n_split < _ceildiv(Nk, Bc):
                        k0: T.let[T.int64] = (vs + t * n_split) * Bc
                        for unit in range(1):
                            with T.sblock("load_k_tile"):
                                for j, d in T.grid(Bc, D):
                                    with T.sblock("load_k"):
                                        vj, vd = T.axis.remap("SS", [j, d])
                                        Kt[vj, vd] = T.if_then_else(
                                            k0 + vj < Nk, T.Cast(F32, K[vb, T.min(k0 + vj, Nk - 1), vhk, vd]), T.float32(0))
                        for unit in range(1):
                            with T.sblock("load_kt_tile"):
                                for d, j in T.grid(D, Bc):
                                    with T.sblock("load_kt"):
                                        vd, vj = T.axis.remap("SS", [d, j])
                                        KT[vd, vj] = Kt[vj, vd]
                        for unit in range(1):
                            with T.sblock("load_vt_tile"):
                                for d, j in T.grid(D, Bc):
                                    with T.sblock("load_vt"):
                                        vd, vj = T.axis.remap("SS", [d, j])
                                        VT[vd, vj] = T.if_then_else(
                                            k0 + vj < Nk, T.Cast(F32, V[vb, T.min(k0 + vj, Nk - 1), vhk, vd]), T.float32(0))
                        for unit in range(1):
                            with T.sblock("init_dkv_tile"):
                                for j, d in T.grid(Bc, D):
                                    with T.sblock("init_dkv"):
                                        vj, vd = T.axis.remap("SS", [j, d])
                                        dKacc[vj, vd] = to_acc(T.float32(0))
                                        dVacc[vj, vd] = to_acc(T.float32(0))
                        for g in T.serial(group):
                            member: T.let[T.int64] = g
                            if spec.recompute == "once":
                                for qt in T.serial(_first_query_tile_for_key_tile(k0, spec, Nq, Nk), _ceildiv(Nq, Br)):
                                    q0: T.let[T.int64] = qt * Br
                                    recompute_probs()
                                    accumulate_dv()
                                    accumulate_dk_dq()
                            else:  # the naive structure (experiment only): a second pass recomputes P
                                for qt in T.serial(_first_query_tile_for_key_tile(k0, spec, Nq, Nk), _ceildiv(Nq, Br)):
                                    q0: T.let[T.int64] = qt * Br
                                    recompute_probs()
                                    accumulate_dv()
                                for qt in T.serial(_first_query_tile_for_key_tile(k0, spec, Nq, Nk), _ceildiv(Nq, Br)):
                                    q0: T.let[T.int64] = qt * Br
                                    recompute_probs()
                                    accumulate_dk_dq()
                        for j, d in T.grid(Bc, D):
                            with T.sblock("store_dkv"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                if k0 + vj < Nk:
                                    dK[vb, k0 + vj, vhk, vd] = T.Cast(dtype, from_acc(dKacc[vj, vd]) * T.Cast(F32, softmax_scale))
                                    dV[vb, k0 + vj, vhk, vd] = T.Cast(dtype, from_acc(dVacc[vj, vd]))
        for b, hk, g, i, s, d in T.grid(B, Hk, H // Hk, _ceildiv(Nq, Br) * Br, n_split, D):
            with T.sblock("sum_dq"):
                vb, vhk, vg, vi, vs, vd = T.axis.remap("SSSSRS", [b, hk, g, i, s, d])
                with T.init():
                    dQsum[vb, vhk, vg, vi, vd] = T.float32(0)
                dQsum[vb, vhk, vg, vi, vd] = dQsum[vb, vhk, vg, vi, vd] + from_acc(dQacc[vs, vb, vhk, vg, vi, vd])
        for b, i, hk, g, d in T.grid(B, Nq, Hk, H // Hk, D):
            with T.sblock("store_dq"):
                vb, vi, vhk, vg, vd = T.axis.remap("SSSSS", [b, i, hk, g, d])
                dQ[vb, vi, vhk * (H // Hk) + vg, vd] = T.Cast(
                    dtype, dQsum[vb, vhk, vg, vi, vd] * T.Cast(F32, softmax_scale))

    return flash_bwd


def fused_kernel(kernel: str, spec: KernelSpec) -> tirx.PrimFunc:
    """The fused "forward" or "backward" kernel."""
    return (fused_forward if kernel == "forward" else fused_backward)(spec)
