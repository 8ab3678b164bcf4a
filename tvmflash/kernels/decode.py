"""Decoding against a KV cache (flash-decoding) for CPUs, in TensorIR (TVMScript).

One kernel, ``flash_decode``, computes attention of a few new queries per sequence against a
KV cache that may be paged. Decoding is memory bound (~2 FLOPs per byte of cache): every cache
row is read once, in memory order, and the keys are split over threads so that one (batch,
kv head) still uses every core.

``flash_decode(q, k_cache, v_cache, out, lse, softmax_scale, window_left, window_right,
n_threads, seq_info, units, block_table, *mod_inputs)``::

    q (B, Nq, H, D)   k_cache, v_cache (pages, page_size, Hk, D)   out (B, Nq, H, D)   lse (B, H, Nq)
    seq_info[b] = (k_start, k_end, first unit, end unit)   keys k_start <= k < k_end are visible
    units[u] = (b, first key tile, end key tile, first kv head, end kv head)   one task: a split
                                                            of a sequence's keys, a group of kv heads
    block_table[b, k // page_size] = the page holding logical key k of sequence b
    rows of a kv head hk: r = i * G + g (query i, head hk * G + g; G = H / Hk), block_rows at a time

    for slot in parallel(n_threads):                                               [slot]
      for unit u = slot, slot + n_threads, ...                                     (cyclic)
        [init_o, init_stats]  the unit's fp32 partials, every kv head: O = 0, m = -FLT_MAX, l = 0
                              (heads outside its group stay so: they weigh 0 in the merge)
        [load_q]              Q rows of every kv head as fp32 (the thread's copy)
        for key tile kt of the unit (block_k keys, inside one page):
          [scores]   for keys (score_keys at a time), kv head of the unit's group, row block:
                   S = Q . K^T, head dim in vector lanes, summed by a transposing shuffle tree in
                   registers (sum_tree); the tile is read in memory order (key, head), V of the
                   tile and K of the next tile are prefetched into L2 on the way (prefetcht1)
          for kv head hk of the group, row block:
            [load_stats] [load_scores]     the rows' running m, l and scores
            [score_mod] [mask]             softcap / ALiBi; -inf outside the window / sequence
            [row_max_lanes] [row_max] [rescale] [probs]    online softmax in log2 units, fp32
            [pv] [update_o]                O = O * alpha + P . V_tile (register tile; V from L2)
            [row_sum_lanes] [row_sum] [store_stats]        l = l * alpha + sum P, m = m_next
    for (b, kv head) in parallel:                                                  [merge]
      out, lse = the partials of b's units combined through their (m, l)   (fp32, cast once)

Every cache row is read once for all the query rows of its GQA group (the group is never
expanded), converted to fp32 on load. A unit's kv heads are a group small enough that one key
tile of them, the next tile's keys and this tile's values fit in L2 together
(``plan.decode_head_group``); within a group the tile is one contiguous stretch per key. Key tiles never straddle a page (``page_size % block_k
== 0``; a dense cache is one page per sequence), so a tile's page is one table lookup. Row
statistics, accumulators and the merge are fp32 (rule 1 and 3); the output is cast once and the
LSE computed in float64 from (m, l) as in ``kernels/cpu.py``. The units (how each sequence's visible
key tiles are split) are planned per call (``plan.decode_units``): the kernel just runs them, so
any split (flash-attn's ``num_splits``), length, window and batch is one compiled kernel.

The structure follows ``kernels/cpu.py`` (named opaque stage blocks under unit loops, task indices
in small buffers rather than let chains, the polynomial ``exp2`` with masked exponents and a
running max that starts at -FLT_MAX); ``schedules/llvm_decode.py`` schedules it by block name.
"""

from __future__ import annotations

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from ..attention_te import FLT_MAX, NEG_INF, exp2, lse_from_stats, masked_log2_exponent, normalizer, scale_log2_parts
from .. import plan
from ..config import DecodeConfig
from ..score_mods import ModContext, emitters
from ..spec import AttentionSpec
from .common import EMPTY, F32, I64, PARTIAL, ceildiv as _ceildiv, cyclic_count as _cyclic_count, i64 as _i64, io_buffer, stage

# the call's tables (plan.decode_units)
K_START, K_END, UNIT_FIRST, UNIT_END = (plan.DEC_K_START, plan.DEC_K_END, plan.DEC_UNIT_FIRST,
                                        plan.DEC_UNIT_END)
U_SEQ, U_TILE_FIRST, U_TILE_END = plan.DEC_U_SEQ, plan.DEC_U_TILE_FIRST, plan.DEC_U_TILE_END
U_HEAD_FIRST, U_HEAD_END = plan.DEC_U_HEAD_FIRST, plan.DEC_U_HEAD_END
SEQ_INFO_COLUMNS, UNIT_COLUMNS = plan.DECODE_SEQ_COLUMNS, plan.DECODE_UNIT_COLUMNS




def score_lanes(cfg: DecodeConfig, head_dim: int) -> int:
    """Vector lanes of the score product: the config's, or fewer where they do not divide D."""
    lanes = cfg.score_lanes
    while head_dim % lanes:
        lanes //= 2
    return lanes


class DecodeKernel:
    """One build of the decode kernel: its tile sizes, mods and the Python helpers its stages
    call. Stage functions (module level, TVMScript bodies, first parameter the build) become
    its macros, fresh per build (TVM suffixes the block names of a macro's later expansions)."""

    def __init__(self, spec: AttentionSpec, cfg: DecodeConfig):
        self.spec = spec
        self.D, self.Br, self.Bc, self.KJ = D, Br, Bc, KJ = spec.head_dim, cfg.block_rows, cfg.block_k, cfg.score_keys
        self.L = L = score_lanes(cfg, D)
        self.LINE_ELEMS = 64 // (DataType(spec.dtype).bits // 8)  # elements per 64-byte cache line
        self.LINES = _ceildiv(D, self.LINE_ELEMS)
        self.VL = VL = min(cfg.lanes, Bc)  # lanes of the row max / row sum partials
        if Bc % VL:
            raise ValueError(f"block_k {Bc} must be a multiple of the lanes {VL}")
        if L < 2:
            raise ValueError(f"head_dim {D} must be even")
        self.has_mods = bool(spec.score_mods)
        self.mods = emitters(spec)
        if spec.mask_mod is not None or spec.block_sparse:
            raise ValueError("the decode kernel supports softcap and ALiBi score mods only")
        self.mod_buffers: dict = {}

    def macros(self, *stages):
        def bind(fn):
            macro = T.macro(fn)
            return lambda *args: macro(self, *args)

        return [bind(fn) for fn in stages]

    def declare_mods(self):
        for i in self.spec.mod_inputs:
            shape = tuple(tirx.Var(f"{i.name}_d{d}", I64) if n is None else n for d, n in enumerate(i.shape))
            buf = T.match_buffer(T.arg(i.name, T.handle()), shape, i.dtype)
            IRBuilder.name(i.name, buf)
            self.mod_buffers[i.name] = buf

    def exponent_constant(self, softmax_scale):
        return scale_log2_parts(tirx.const(1.0, "float64") if self.has_mods else softmax_scale)

    def sum_tree(self, SL, store):
        """The lanes of each of SL's KJ x Br accumulator vectors summed (SL[j, i, :], the score of
        key j and row i), ``store(i, vector of row i's KJ scores)``.

        A transposing tree in registers: two vectors whose lanes hold groups of w partial sums
        become one whose groups of w / 2 hold both's sums (each group's halves added), until each
        lane holds one score; a vector left alone is folded onto itself. KJ x Br accumulators of
        L lanes take ~KJ x Br x 3 shuffles and adds, against ~log2(L) x 2 per accumulator when
        each is summed alone."""
        L, w = self.L, self.L
        vectors = [(tirx.BufferLoad(SL, [j, i, tirx.Ramp(0, 1, L)]), [j * self.Br + i])
                   for j in range(self.KJ) for i in range(self.Br)]
        while w > 1:
            half = w // 2
            if len(vectors) > 1:  # pairs: both vectors' groups, halved, side by side
                merged = []
                for (x, xs), (y, ys) in zip(vectors[0::2], vectors[1::2]):
                    low = [base + g * w + h for g in range(len(xs)) for base in (0, L) for h in range(half)]
                    high = [i + half for i in low]
                    merged.append((tirx.Shuffle([x, y], low) + tirx.Shuffle([x, y], high),
                                   [o for pair in zip(xs, ys) for o in pair]))
                vectors = merged
            else:  # one vector: its groups halved in place (half as many lanes)
                (x, xs), = vectors
                low = [g * w + h for g in range(len(xs)) for h in range(half)]
                vectors = [(tirx.Shuffle([x], low) + tirx.Shuffle([x], [i + half for i in low]), xs)]
            w = half
        lanes = [v for v, _ in vectors]
        where = {o: n * L + lane for n, (_, owners) in enumerate(vectors) for lane, o in enumerate(owners)}
        for i in range(self.Br):
            at = [where[j * self.Br + i] for j in range(self.KJ)]
            store(i, tirx.Shuffle(lanes, at))

    def prefetch(self, buf, page, row, head):
        """The cache lines of one head's row, into L2: locality 2 is prefetcht1 on x86 (into L1,
        prefetcht0, was no faster than no prefetch at all on Zen 4; DEVELOPING.md)."""
        for line in range(self.LINES):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                buf[page, row, head, line * self.LINE_ELEMS]), 0, 2, 1))


# --- stages (TVMScript; expanded as macros of a DecodeKernel) -----------------------------------------
def dec_load_q(k, QF: T.Buffer, Q: T.Buffer, slot: T.int64, b: T.int64, G: T.int64, R: T.int64):
    with stage("load_q_tile"):
        for h, r, d in T.grid(QF.shape[1], QF.shape[2], k.D):
            with T.sblock("load_q"):
                vh, vr, vd = T.axis.remap("SSS", [h, r, d])
                QF[slot, vh, vr, vd] = T.if_then_else(
                    vr < R, T.Cast(F32, Q[b, T.min(vr, R - 1) // G, vh * G + T.min(vr, R - 1) % G, vd]),
                    T.float32(0))

def dec_scores(k, SA: T.Buffer, QF: T.Buffer, K: T.Buffer, V: T.Buffer, slot: T.int64, page: T.int64, prow: T.int64,
           last: T.int64, next_tile: T.int64, next_page: T.int64, next_prow: T.int64, next_last: T.int64,
           hk_first: T.int64, hk_end: T.int64):
    """S = Q . K^T for every kv head and row block of the tile, keys outermost: the tile's
    rows are read in memory order (key, head). KJ keys x Br rows at a time, the head dim in
    vector lanes, summed by ``sum_tree``. V of the tile and K of the next tile are prefetched
    into L2 on the way, for the P . V passes that follow."""
    with stage("scores_tile"):
        T.reads(QF[slot, 0:QF.shape[1], 0:QF.shape[2], 0:k.D], K[page, prow:prow + k.Bc, 0:QF.shape[1], 0:k.D])
        T.writes(SA[slot, 0:QF.shape[1], 0:QF.shape[2], 0:k.Bc])
        SL = T.sblock_alloc_buffer((k.KJ, k.Br, k.L), F32, scope="local")  # KJ keys x Br rows, per lane
        for jo in T.serial(k.Bc // k.KJ):
            j0: T.let[T.int64] = T.Cast(I64, jo) * k.KJ
            for hh in T.serial(hk_end - hk_first):
                hk: T.let[T.int64] = hk_first + hh
                for j in T.serial(k.KJ):
                    k.prefetch(V, page, prow + T.min(j0 + j, last), hk)
                    if next_tile != 0:
                        k.prefetch(K, next_page, next_prow + T.min(j0 + j, next_last), hk)
                for rb in T.serial(QF.shape[2] // k.Br):
                    r0: T.let[T.int64] = T.Cast(I64, rb) * k.Br
                    for c, j, i, l in T.grid(k.D // k.L, k.KJ, k.Br, k.L):
                        with T.sblock("scores"):
                            vc, vj, vi, vl = T.axis.remap("RSSS", [c, j, i, l])
                            with T.init():
                                SL[vj, vi, vl] = T.float32(0)
                            SL[vj, vi, vl] = SL[vj, vi, vl] + QF[slot, hk, r0 + vi, vc * k.L + vl] * T.Cast(
                                F32, K[page, prow + T.min(j0 + vj, last), hk, vc * k.L + vl])
                    k.sum_tree(SL, lambda i, scores: T.buffer_store(
                        SA, scores, [slot, hk, r0 + i, tirx.Ramp(j0, 1, k.KJ) if k.KJ > 1 else j0]))

def dec_load_scores(k, ST: T.Buffer, SA: T.Buffer, slot: T.int64, hk: T.int64, r0: T.int64):
    with stage("load_scores_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("load_scores"):
                vi, vj = T.axis.remap("SS", [i, j])
                ST[vi, vj] = SA[slot, hk, r0 + vi, vj]

def dec_score_mod(k, ST: T.Buffer, scale: T.float32, b: T.int64, hk: T.int64, r0: T.int64, k0: T.int64,
              diag: T.int64, G: T.int64):
    with stage("score_mod_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("score_mod"):
                vi, vj = T.axis.remap("SS", [i, j])
                ST[vi, vj] = k.mods.score(ST[vi, vj] * scale, ModContext(
                    b, hk * G + (r0 + vi) % G, (r0 + vi) // G, k0 + vj, diag, k.mod_buffers))

def dec_mask(k, ST: T.Buffer, r0: T.int64, k0: T.int64, k_start: T.int64, k_end: T.int64, diag: T.int64,
         window_left: T.int64, window_right: T.int64, G: T.int64):
    with stage("mask_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("mask"):
                vi, vj = T.axis.remap("SS", [i, j])
                ST[vi, vj] = T.Select(
                    tirx.all(k0 + vj >= k_start, k0 + vj < k_end,
                          k0 + vj <= (r0 + vi) // G + diag + window_right,
                          k0 + vj >= (r0 + vi) // G + diag - window_left),
                    ST[vi, vj], T.float32(NEG_INF))

def dec_online_softmax(k, ST: T.Buffer, PT: T.Buffer, m: T.Buffer, m_next: T.Buffer, alpha: T.Buffer,
                   c_hi: T.float32, c_lo: T.float32):
    with stage("row_max_tile"):
        # the raw scores' max per vector lane, then over the lanes, scaled once: the
        # exponents below subtract it (2^(s c - max) <= 1; c > 0 keeps the order)
        RM = T.sblock_alloc_buffer((k.Br, k.VL), F32)
        for i, jo, l in T.grid(k.Br, k.Bc // k.VL, k.VL):
            with T.sblock("row_max_lanes"):
                vi, vjo, vl = T.axis.remap("SRS", [i, jo, l])
                with T.init():
                    RM[vi, vl] = T.float32(NEG_INF)
                RM[vi, vl] = T.max(RM[vi, vl], ST[vi, vjo * k.VL + vl])
        for i, l in T.grid(k.Br, k.VL):
            with T.sblock("row_max"):
                vi, vl = T.axis.remap("SR", [i, l])
                with T.init():
                    m_next[vi] = m[vi]
                m_next[vi] = T.max(m_next[vi],
                                   RM[vi, vl] * c_hi + T.max(RM[vi, vl], T.float32(-FLT_MAX)) * c_lo)
    with stage("rescale_tile"):
        for i in T.serial(k.Br):
            with T.sblock("rescale"):
                vi = T.axis.remap("S", [i])
                alpha[vi] = T.Select(m[vi] == m_next[vi], T.float32(1), exp2(m[vi] - m_next[vi]))
    with stage("probs_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("probs"):
                vi, vj = T.axis.remap("SS", [i, j])
                PT[vi, vj] = exp2(masked_log2_exponent(ST[vi, vj], (c_hi, c_lo), (m_next[vi], T.float32(0))), nonpositive=True)

def dec_accumulate(k, OP: T.Buffer, SP: T.Buffer, PV: T.Buffer, PT: T.Buffer, V: T.Buffer, m_next: T.Buffer,
               l: T.Buffer, l_tile: T.Buffer, alpha: T.Buffer, u: T.int64, hk: T.int64, r0: T.int64,
               page: T.int64, prow: T.int64, v_first: T.int64, v_last: T.int64):
    with stage("pv_tile"):
        for i, d, j in T.grid(k.Br, k.D, k.Bc):
            with T.sblock("pv"):
                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                with T.init():
                    PV[vi, vd] = T.float32(0)
                PV[vi, vd] = PV[vi, vd] + PT[vi, vj] * T.Cast(
                    F32, V[page, prow + T.max(T.min(vj, v_last), v_first), hk, vd])
    with stage("update_o_tile"):
        for i, d in T.grid(k.Br, k.D):
            with T.sblock("update_o"):
                vi, vd = T.axis.remap("SS", [i, d])
                OP[u, hk, r0 + vi, vd] = OP[u, hk, r0 + vi, vd] * alpha[vi] + PV[vi, vd]
    with stage("row_sum_tile"):
        RS = T.sblock_alloc_buffer((k.Br, k.VL), F32)
        for i, jo, l in T.grid(k.Br, k.Bc // k.VL, k.VL):
            with T.sblock("row_sum_lanes"):
                vi, vjo, vl = T.axis.remap("SRS", [i, jo, l])
                with T.init():
                    RS[vi, vl] = T.float32(0)
                RS[vi, vl] = RS[vi, vl] + PT[vi, vjo * k.VL + vl]
        for i, l in T.grid(k.Br, k.VL):
            with T.sblock("row_sum"):
                vi, vl = T.axis.remap("SR", [i, l])
                with T.init():
                    l_tile[vi] = T.float32(0)
                l_tile[vi] = l_tile[vi] + RS[vi, vl]
    with stage("store_stats_tile"):
        for i in T.serial(k.Br):
            with T.sblock("store_stats"):
                vi = T.axis.remap("S", [i])
                SP[u, hk, 0, r0 + vi] = m_next[vi]
                SP[u, hk, 1, r0 + vi] = l[vi] * alpha[vi] + l_tile[vi]


def decode_kernel(spec: AttentionSpec, cfg: DecodeConfig) -> tirx.PrimFunc:
    """The ``flash_decode`` kernel of a spec (head dim, dtypes, softcap / ALiBi) and config."""
    k = DecodeKernel(spec, cfg)
    D, Br, Bc = k.D, k.Br, k.Bc
    dtype, out_dtype, has_mods = spec.dtype, spec.out_dtype, k.has_mods
    declare_mods, exponent_constant, prefetch = k.declare_mods, k.exponent_constant, k.prefetch
    load_q, scores, load_scores, score_mod, mask, online_softmax, accumulate = k.macros(
        dec_load_q, dec_scores, dec_load_scores, dec_score_mod, dec_mask, dec_online_softmax, dec_accumulate)

    @T.prim_func(s_tir=True)
    def flash_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, lse_h: T.handle,
                     softmax_scale: T.float64, window_left: T.int64, window_right: T.int64, n_threads: T.int64,
                     seq_info_h: T.handle, units_h: T.handle, block_table_h: T.handle):
        T.func_attr({"global_symbol": "flash_decode", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        H = T.int64()
        Hk = T.int64()
        NP = T.int64()
        P = T.int64()
        U = T.int64()
        MB = T.int64()
        Q = io_buffer(q_h, (B, Nq, H, D), dtype, "sq")
        K = io_buffer(k_h, (NP, P, Hk, D), dtype, "sk")
        V = io_buffer(v_h, (NP, P, Hk, D), dtype, "sv")
        O = io_buffer(o_h, (B, Nq, H, D), out_dtype, "so")
        LSE = T.match_buffer(lse_h, (B, H, Nq), F32, align=4)
        SeqInfo = T.match_buffer(seq_info_h, (B, SEQ_INFO_COLUMNS), "int32")
        Units = T.match_buffer(units_h, (U, UNIT_COLUMNS), "int32")
        Table = T.match_buffer(block_table_h, (B, MB), "int32")
        declare_mods()
        G: T.let[T.int64] = H // Hk
        R: T.let[T.int64] = G * Nq  # query rows per (sequence, kv head): query-major, r = i * G + g
        RB: T.let[T.int64] = _ceildiv(R, Br)
        # each task's fp32 partial: unnormalized O, and (m, l) per row
        OP = T.alloc_buffer((U, Hk, RB * Br, D), F32)
        SP = T.alloc_buffer((U, Hk, 2, RB * Br), F32)
        # each thread's query rows (fp32) and one tile's scores, for every kv head
        QF = T.alloc_buffer((n_threads, Hk, RB * Br, D), F32)
        SA = T.alloc_buffer((n_threads, Hk, RB * Br, Bc), F32)
        for slot in T.serial(n_threads):
            with T.sblock("slot"):
                vslot = T.axis.remap("S", [slot])
                T.reads()
                T.writes()
                ST = T.sblock_alloc_buffer((Br, Bc), F32)
                PT = T.sblock_alloc_buffer((Br, Bc), F32)
                PV = T.sblock_alloc_buffer((Br, D), F32)
                m = T.sblock_alloc_buffer((Br,), F32)
                m_next = T.sblock_alloc_buffer((Br,), F32)
                l = T.sblock_alloc_buffer((Br,), F32)
                l_tile = T.sblock_alloc_buffer((Br,), F32)
                alpha = T.sblock_alloc_buffer((Br,), F32)
                # unit, -, sequence, page, row in page, tile state, next tile?, its page and row
                # (small buffers, not let chains: kernels/cpu.py)
                at = T.sblock_alloc_buffer((9,), I64)
                for e in T.serial(_cyclic_count(vslot, U, n_threads)):
                    at[0] = vslot + e * n_threads
                    at[2] = _i64(Units[at[0], U_SEQ])
                    u: T.let[T.int64] = at[0]
                    b: T.let[T.int64] = at[2]
                    k_start: T.let[T.int64] = _i64(SeqInfo[b, K_START])
                    k_end: T.let[T.int64] = _i64(SeqInfo[b, K_END])
                    diag: T.let[T.int64] = k_end - Nq
                    with stage("init_task_tile"):
                        for h, r, d in T.grid(Hk, RB * Br, D):
                            with T.sblock("init_o"):
                                vh, vr, vd = T.axis.remap("SSS", [h, r, d])
                                OP[u, vh, vr, vd] = T.float32(0)
                        for h, r in T.grid(Hk, RB * Br):
                            with T.sblock("init_stats"):
                                vh, vr = T.axis.remap("SS", [h, r])
                                SP[u, vh, 0, vr] = T.float32(-FLT_MAX)
                                SP[u, vh, 1, vr] = T.float32(0)
                    # the unit's first tile into L2 (the following ones are prefetched a tile ahead)
                    at[3] = _i64(Units[u, U_TILE_FIRST]) * Bc
                    for jj, hh in T.grid(Bc, _i64(Units[u, U_HEAD_END]) - _i64(Units[u, U_HEAD_FIRST])):
                        prefetch(K, _i64(Table[b, at[3] // P]), at[3] % P + T.min(jj, T.max(k_end - 1 - at[3], 0)),
                                 _i64(Units[u, U_HEAD_FIRST]) + hh)
                    load_q(QF, Q, vslot, b, G, R)
                    for kt in T.serial(_i64(Units[u, U_TILE_FIRST]), _i64(Units[u, U_TILE_END])):
                        at[3] = _i64(Table[b, kt * Bc // P])
                        at[4] = kt * Bc % P
                        # the next tile of this unit (its K is prefetched during this one's scores)
                        at[6] = _i64(kt + 1 < _i64(Units[u, U_TILE_END]))
                        at[7] = _i64(Table[b, T.min((kt + 1) * Bc // P, MB - 1)])
                        at[8] = (kt + 1) * Bc % P
                        k0: T.let[T.int64] = kt * Bc
                        page: T.let[T.int64] = at[3]
                        prow: T.let[T.int64] = at[4]
                        last: T.let[T.int64] = k_end - 1 - k0  # clamp: rows past the sequence are masked
                        scores(SA, QF, K, V, vslot, page, prow, last, at[6], at[7], at[8], T.max(last - Bc, 0),
                               _i64(Units[u, U_HEAD_FIRST]), _i64(Units[u, U_HEAD_END]))
                        for hh in T.serial(_i64(Units[u, U_HEAD_END]) - _i64(Units[u, U_HEAD_FIRST])):
                            hk: T.let[T.int64] = _i64(Units[u, U_HEAD_FIRST]) + hh
                            for rb in T.serial(RB):
                                r0: T.let[T.int64] = rb * Br
                                # queries i_lo .. i_hi of this row block (rows are query-major)
                                at[5] = _i64(tirx.all(
                                    k0 < k_end, k0 + Bc > k_start,
                                    k0 <= T.min((r0 + Br - 1) // G, Nq - 1) + diag + window_right,
                                    k0 + Bc - 1 >= r0 // G + diag - window_left)) * (PARTIAL + _i64(tirx.all(
                                        k0 >= k_start, k0 + Bc <= k_end,
                                        k0 + Bc - 1 <= r0 // G + diag + window_right,
                                        k0 >= T.min((r0 + Br - 1) // G, Nq - 1) + diag - window_left)))
                                if at[5] != EMPTY:
                                    # the V rows this row block sees, [v_first, v_last] of the tile: the
                                    # others (P = 0) are never read, so that a NaN in cache_leftpad, past
                                    # cache_seqlens or outside every row's window cannot give 0 x NaN
                                    v_first: T.let[T.int64] = T.max(k_start, r0 // G + diag - window_left) - k0
                                    v_last: T.let[T.int64] = T.min(
                                        k_end - 1, T.min((r0 + Br - 1) // G, Nq - 1) + diag + window_right) - k0
                                    with stage("load_stats_tile"):
                                        for i in T.serial(Br):
                                            with T.sblock("load_stats"):
                                                vi = T.axis.remap("S", [i])
                                                m[vi] = SP[u, hk, 0, r0 + vi]
                                                l[vi] = SP[u, hk, 1, r0 + vi]
                                    load_scores(ST, SA, vslot, hk, r0)
                                    if has_mods:
                                        score_mod(ST, T.Cast(F32, softmax_scale), b, hk, r0, k0, diag, G)
                                    if at[5] == PARTIAL:
                                        mask(ST, r0, k0, k_start, k_end, diag, window_left, window_right, G)
                                    online_softmax(ST, PT, m, m_next, alpha, exponent_constant(softmax_scale)[0],
                                                   exponent_constant(softmax_scale)[1])
                                    accumulate(OP, SP, PV, PT, V, m_next, l, l_tile, alpha, u, hk, r0, page, prow,
                                               v_first, v_last)
        for b, hk in T.grid(B, Hk):
            with T.sblock("merge"):
                vb, vhk = T.axis.remap("SS", [b, hk])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((D,), F32)
                st = T.sblock_alloc_buffer((3,), F32)  # max, denominator, weight of a partial
                for rr in T.serial(R):
                    r: T.let[T.int64] = rr
                    st[0] = T.float32(-FLT_MAX)
                    st[1] = T.float32(0)
                    for d in T.serial(D):
                        with T.sblock("merge_init"):
                            vd = T.axis.remap("S", [d])
                            acc[vd] = T.float32(0)
                    for uu in T.serial(_i64(SeqInfo[vb, UNIT_FIRST]), _i64(SeqInfo[vb, UNIT_END])):
                        st[0] = T.max(st[0], SP[uu, vhk, 0, r])
                    for uu in T.serial(_i64(SeqInfo[vb, UNIT_FIRST]), _i64(SeqInfo[vb, UNIT_END])):
                        pu: T.let[T.int64] = uu
                        st[2] = exp2(SP[pu, vhk, 0, r] - st[0])
                        st[1] = st[1] + SP[pu, vhk, 1, r] * st[2]
                        for d in T.serial(D):
                            with T.sblock("merge_acc"):
                                vd = T.axis.remap("S", [d])
                                acc[vd] = acc[vd] + OP[pu, vhk, r, vd] * st[2]
                    for d in T.serial(D):
                        with T.sblock("merge_store"):
                            vd = T.axis.remap("S", [d])
                            O[vb, r // G, vhk * G + r % G, vd] = T.Cast(out_dtype, acc[vd] * normalizer(st[1]))
                    LSE[vb, vhk * G + r % G, r // G] = lse_from_stats(st[0], st[1])

    return flash_decode
