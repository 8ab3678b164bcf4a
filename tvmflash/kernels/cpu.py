"""Fused FlashAttention kernels for CPUs, in TensorIR (TVMScript).

The tile-level math comes from ``attention_te`` (exp2, window mask, dS, LSE) and the score and
mask mods from ``score_mods``; this module arranges it into the FlashAttention loop nests. Each
stage is a named ``sblock`` (in brackets below): that is the contract with
``schedules/llvm.py``, which tiles, vectorizes and parallelizes stages by name. Tile sizes
(``block_q`` x ``block_k``) shape the loops and come from the kernel's config; head dim, dtypes
and mods from its spec (``spec.py``). Everything else is a runtime argument: sizes, strides,
the sequences (a table from ``plan.py``: batched, or packed varlen), the window (causal =
right window 0), the thread count.

Forward ``flash_fwd(q, k, v, out, lse, softmax_scale, window_left, window_right, n_threads,
seq_table, q_tile_seq, k_tile_seq, *mod_inputs, [tile_state, kv_range])``::

    (one parallel region: [pack_kv] in parallel, a barrier, the slots)
    [pack_kv]   Kp, Vp = K, V as product operands, each sequence zero-padded to whole key tiles
    for slot in parallel(n_threads):                                          [slot]
      for task (query tile, query head h) of the slot (common.slot_task)    (tiles from the last)
        [load_q] QT = query tile, transposed         [init_o, init_stats] OT = 0, m = -inf, l = 0
                 (fp32, whole tiles: [load_q_blocks], 16 x 16 blocks transposed in registers)
        for each key tile the window (and block mask) leaves non-empty:
          [scores]       ST = K_tile . QT                     raw dot products
          [score_mod]    ST = score_mods(ST * scale, ...)     if the spec has any
          [mask]         ST = -inf where masked               only on partly masked tiles
          [row_max]      m_tile = max(m, max_j ST)            of raw scores
          [settle_max]   m_next = m if (m_tile - m) c <= 8 else m_tile   log2 units: c = scale * log2(e),
          [rescale]      alpha = 2^((m - m_next) c)             or log2(e) after score mods
          [probs]        PT = 2^(ST * c - m_next)             0 where ST = -inf
          [pack_p]       PTw = PT rounded to bf16             bf16 products only
          [pv]           PVT = V_tile^T . PTw
          [update_o]     OT = OT * alpha + PVT      (AMX: [rescale_o] OT *= alpha, [pv] OT += V_tile^T . PTw)
          [row_sum]      l_tile = sum_j PT
          [update_stats] m = m_next, l = l * alpha + l_tile
        [store_o]   out = OT / l (cast once)     [store_lse]  lse = (m + log2 l) ln 2 (float64, once)
                    (fp32, whole tiles: [inverse_l] 1 / l, [store_o_blocks] transposed as load_q's)

Backward ``flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, window_left,
window_right, n_threads, n_rounds, super_tile, seq_table, q_tile_seq, k_tile_seq, k_super_seq,
*mod_inputs, *mod_input_grads, [tile_state])``::

    (one parallel region from the packs to the stores: a barrier after the packs and after each round)
    [pack_q_do]   Qp, dOp (, Qw, dOw) = Q, dO as product operands, zero-padded to whole query tiles
    [delta, lse_log2]  per query row: Delta = rowsum(dO * O); LSE * log2(e) as fp32 hi + lo
    [zero_dq, zero_dkv, zero_mod_grads]   fp32 accumulators = 0
    for round r in range(n_rounds):                         no two tasks of a round share rows
      for slot in parallel(n_threads):                                        [round_slot]
        for task (kv head, key super tile J) of the slot's kv heads (common.slot_task):
          I = (J + r) mod M  (M: super tiles of the sequence; a super tile = super_tile tiles)
          for key tile j of J:
            (K_j, K_j^T, V_j^T packed as product operands once per key tile: [pack_k, pack_kt, pack_vt];
             fp32: K^T and whole tiles' V^T as 16 x 16 blocks transposed in registers)
            [init_dkv] the task's dK_j, dV_j sums = 0; [update_dkv] after the loop below adds
            them into dKacc_j, dVacc_j, only if some tile (i, j) of the round was not empty
            for query head h of the kv head's GQA group, query tile i of I, tile (i, j) not empty:
              [load_row_stats]
              [scores]      S = Q_i . K_j^T         P is recomputed once (rule 2) and
              [score_mod]   X = score_mods(S * scale)      everything comes from it
              [mask]        X = -inf where masked
              [probs]       P = 2^(X * c - LSE)
              [pack_p]      Pw = P rounded to bf16                        bf16 products only
              [dv] [update_dv]   dVacc_j += Pw^T . dO_i      (AMX: [dv] dVacc_j^T += dO_i^T . Pw)
              [dprobs]      dP = dO_i . V_j^T
              [dscores]     dS = P (dP - Delta)   [dscores_mod]  dS *= d score_mods / d S
              [mod_grads]   captured-tensor gradients += upstream terms (into the slot's partial)
              [pack_ds]     dSw, dSb = dS rounded to bf16 (pairs of rows, rows)   bf16 products only
              [dk] [update_dk]   dKacc_j += dSw^T . Q_i      (AMX: [dk] dKacc_j^T += Q_i^T . dSw)
              [dq] [update_dq]   dQacc_i += dSb . K_j
    [store_dq]  dq = dQacc * scale    [store_dkv]  dk = dKacc * scale, dv = dVacc    (cast once)
    [sum_mod_grads]   captured-tensor gradients = the slots' partials, summed in slot order

Rounds (``plan.py``): in round r key super tile J meets query super tile (J + r) mod M, so every
query row and key row is updated by one task per round, in an order fixed by the problem: no
races, results bitwise independent of the thread count, and scratch memory of a few fp32 copies
of q and k at any thread count.

Products (``config.products``) are an operand-format object (``Fp32Fma``, ``Bf16Dot``,
``AmxTiles``): the dtypes of its operands (``rows``: the reduction along a row; ``words``: pairs
of rows), how a product block reduces (``product``), its three operand packs, whether P and dS
are packed, and (AMX) whether the products take transposed forms and add into the running sums.
With fp32 FMAs (``fp32_fma``) the operands are fp32 copies and
the packs only convert and pad; with bf16 dot products (``bf16_dot``, bf16 inputs on CPUs with
AVX512-BF16) they stay bf16: bits of rows (uint16) where a product reads pairs along a row,
pair words (uint32, ``pair_words.py``) where it reads pairs of rows, and every product block
reduces over pairs ``(q, t)``, the form of the ``vdpbf16ps`` intrinsic it is tensorized into
(``schedules/llvm_bf16.py``). With AMX tiles (``amx``) each product block calls micro-kernels
that keep whole blocks of C in tile registers (``schedules/llvm_amx.py``, ``AmxTiles``). P and
dS are rounded to bf16 (round to nearest even) only as product inputs, as FlashAttention does on
GPUs; their fp32 values feed the row sums and dS.

All accumulators and row statistics are fp32 (rule 3). The forward keeps tiles transposed (query index innermost),
so the row statistics are plain vector operations. Products sum one tile into a fresh partial
and ``update_*`` stages add it to the running accumulator: error ~ block + N / block ulps
instead of N. In-place stages (``update_*``, ``score_mod``, ``dscores_mod``) are plain loops that
LLVM vectorizes (TensorIR's ``vectorize`` refuses blocks that read and write one buffer); ``mask``,
which LLVM left scalar, has its inner loop marked vectorized in the kernel. Each stage sits in an
opaque wrapper block under a unit loop (``stage``): TVM 0.27 needs a "stage pipeline" parent for
``cache_write``/``decompose_reduction`` and copies loops, not blocks, on write (DEVELOPING.md).
The stages are module-level functions written in TVMScript whose first parameter is the kernel
build (``Kernel``: tile sizes, format, context); each build expands them as fresh ``T.macro``s.
The sequence table, windows, tile ranges and states, block masks and score mods come from the
kernel context (``kernels/common.py``).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.sym.analyzer import Analyzer
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .. import plan
from ..attention_te import (
    FLT_MAX,
    LOG2E,
    NEG_INF,
    exp2,
    grad_scores,
    lse_from_raw_max,
    lse_log2_parts,
    masked_log2_exponent,
    normalizer,
    shifted_log2_exponent,
)
from ..config import AMX, AMX_TILE, BF16_DOT, CPUKernelConfig
from ..pair_words import bf16_bits, bits_value, half, pair_word, rounded_bits, rounded_pair_word
from ..schedules.llvm_amx import HELPER_ATTR
from ..schedules.llvm_amx import helper_name as amx_helper_name
from ..schedules import llvm_transpose
from ..score_mods import exponent_constant
from ..spec import MAX_RECOMPUTABLE_LSE, AttentionSpec, unrecomputable_lse_message
from .common import (EMPTY, F32, I64, PARTIAL, CPUContext, TileRows, ceildiv, i64, io_buffer, slot_task,
                     slot_task_count, stage)

BF16 = "bfloat16"
LAZY_MAX_LOG2 = 8.0  # the forward's running max lags the true one by at most this (log2 units)
U16, U32 = "uint16", "uint32"  # bf16 bits and pair words (pair_words.py)


# --- building blocks ---------------------------------------------------------------------------
def _loops(*axes):
    """``T.grid`` over ``(name, extent)`` axes, its loop variables named."""
    frame = T.grid(*(extent for _, extent in axes))
    return frame, [name for name, _ in axes]


def _to_f32(x):
    return T.Cast(F32, x)


class Kernel:
    """One kernel build: tile sizes, the operand format of its products, its context. Stage
    functions (module level, TVMScript bodies, first parameter the build) become its macros:
    fresh ones per build, since TVM suffixes the block names of a macro's later expansions."""

    def __init__(self, spec: AttentionSpec, cfg: CPUKernelConfig, backward: bool):
        self.spec, self.D, self.Br, self.Bc = spec, spec.head_dim, cfg.block_q, cfg.block_k
        self.fmt = operand_format(spec, cfg)
        self.ctx = CPUContext(spec, cfg.block_q, cfg.block_k, backward)
        self.has_mods = bool(spec.score_mods)
        # a key tile's dK, dV sums: (key, head dim), transposed where the format needs (AMX)
        self.kv_tile = (self.D, self.Bc) if self.fmt.transposed else (self.Bc, self.D)
        # 16 x 16 blocks transposed in registers (schedules/llvm_transpose.py), fp32 inputs and
        # products: the forward's query load and output store (fp32 output), the backward's K^T
        # and V^T packs
        edge = llvm_transpose.EDGE
        self.block_transposes = (self.fmt is Fp32Fma and spec.dtype == F32 and self.D % edge == 0
                                 and (self.Bc % edge == 0 if backward else
                                      self.Br % edge == 0 and spec.out_dtype == F32))

    def declare_helpers(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        """The kernel, with a function attribute for the LLVM IR helpers it calls (the schedule
        imports them)."""
        return func.with_attr(llvm_transpose.HELPER_ATTR, 1) if self.block_transposes else func

    def whole_tile(self, rows: TileRows, extent: int):
        """Where the block transposes apply: False (statically) without them, else whether the
        tile of ``extent`` rows lies whole inside its sequence (a partial one takes the element
        loops, which zero or skip its padding rows)."""
        return rows.inside(extent - 1) if self.block_transposes else False

    def macros(self, *stages):
        def bind(fn):
            macro = T.macro(fn)
            return lambda *args: macro(self, *args)

        return [bind(fn) for fn in stages]


# --- the operand packs of each format (TVMScript, expanded as macros of a Kernel) -----------------
def _pack_rows(block, tile: TileRows, head, first, extent, width, convert, zero, *pairs):
    """One block over tile rows i < extent and d < width: for each ``(dst, src)`` of ``pairs``,
    ``dst[head, first + i, d] = convert(src's element at tile row i)``, ``zero`` past the
    sequence's end (a tile's padding). The row copy every format's packs start from (called from
    their macros; built with the IR builder, as the products are)."""
    frame, names = _loops(("i", extent), ("d", width))
    with frame as loops:
        for name, loop in zip(names, loops):
            IRBuilder.name(name, loop)
        with T.sblock(block):
            vi, vd = T.axis.remap("SS", loops)
            for dst, src in pairs:
                T.buffer_store(dst, tile.load(src, vi, head, vd, convert, zero), [head, first + vi, vd])


def fp32_pack_kv(k, Kp, Vp, K, V, kv: TileRows, hk, t):
    _pack_rows("pack_kv", kv, hk, t * k.Bc, k.Bc, k.D, _to_f32, T.float32(0), (Kp, K), (Vp, V))


def bf16_pack_kv(k, Kp, Vp, K, V, kv: TileRows, hk, t):
    _pack_rows("pack_k", kv, hk, t * k.Bc, k.Bc, k.D, bf16_bits, T.uint16(0), (Kp, K))  # K's bits, zero-padded
    for p, d in T.grid(k.Bc // 2, k.D):
        with T.sblock("pack_v"):  # V as pair words of rows 2p, 2p + 1
            vp, vd = T.axis.remap("SS", [p, d])
            Vp[hk, t * (k.Bc // 2) + vp, vd] = pair_word(kv.load(V, 2 * vp, hk, vd, bf16_bits, T.uint16(0)),
                                                         kv.load(V, 2 * vp, hk, vd, bf16_bits, T.uint16(0), plus=1))


def fp32_pack_q_do(k, Qp, dOp, Qw, dOw, Q, dO, q: TileRows, h, t):
    _pack_rows("pack_q_do", q, h, t * k.Br, k.Br, k.D, _to_f32, T.float32(0), (Qp, Q), (dOp, dO))


def bf16_pack_q_do(k, Qp, dOp, Qw, dOw, Q, dO, q: TileRows, h, t):
    _pack_rows("pack_q_do", q, h, t * k.Br, k.Br, k.D, bf16_bits, T.uint16(0), (Qp, Q), (dOp, dO))  # their bits
    for p, d in T.grid(k.Br // 2, k.D):
        with T.sblock("pack_q_do_pairs"):  # pair words of rows 2p, 2p + 1
            vp, vd = T.axis.remap("SS", [p, d])
            Qw[h, t * (k.Br // 2) + vp, vd] = pair_word(Qp[h, t * k.Br + 2 * vp, vd], Qp[h, t * k.Br + 2 * vp + 1, vd])
            dOw[h, t * (k.Br // 2) + vp, vd] = pair_word(dOp[h, t * k.Br + 2 * vp, vd],
                                                         dOp[h, t * k.Br + 2 * vp + 1, vd])


def fp32_pack_k_v(k, Kp, KTp, VTp, K, V, kv: TileRows, hk, t):
    _pack_rows("pack_k", kv, hk, t * k.Bc, k.Bc, k.D, _to_f32, T.float32(0), (Kp, K))
    with stage("pack_kt_tile"):  # (ifs between scheduled blocks: each in an opaque parent, DEVELOPING.md)
        if k.block_transposes:  # K^T from the zero-padded rows just packed: whole blocks always
            for j0, d0 in T.grid(k.Bc // 16, k.D // 16):
                with T.sblock("pack_kt_blocks"):
                    vj0, vd0 = T.axis.remap("SS", [j0, d0])
                    T.reads(Kp[hk, t * k.Bc + vj0 * 16:t * k.Bc + vj0 * 16 + 16, vd0 * 16:vd0 * 16 + 16])
                    T.writes(KTp[hk, t, vd0 * 16:vd0 * 16 + 16, vj0 * 16:vj0 * 16 + 16])
                    T.evaluate(T.call_extern("void", llvm_transpose.LOAD, T.address_of(KTp[hk, t, vd0 * 16, vj0 * 16]),
                                             T.int64(k.Bc), T.address_of(Kp[hk, t * k.Bc + vj0 * 16, vd0 * 16]),
                                             T.int64(k.D)))
        else:
            for d, j in T.grid(k.D, k.Bc):
                with T.sblock("pack_kt"):
                    vd, vj = T.axis.remap("SS", [d, j])
                    KTp[hk, t, vd, vj] = Kp[hk, t * k.Bc + vj, vd]
    with stage("pack_vt_tile"):
        if k.whole_tile(kv, k.Bc):  # V^T from V's rows in place
            for j0, d0 in T.grid(k.Bc // 16, k.D // 16):
                with T.sblock("pack_vt_blocks"):
                    vj0, vd0 = T.axis.remap("SS", [j0, d0])
                    T.reads()
                    T.writes(VTp[hk, t, vd0 * 16:vd0 * 16 + 16, vj0 * 16:vj0 * 16 + 16])
                    T.evaluate(T.call_extern("void", llvm_transpose.LOAD, T.address_of(VTp[hk, t, vd0 * 16, vj0 * 16]),
                                             T.int64(k.Bc), T.address_of(V[kv.batch, kv.row(vj0 * 16), hk, vd0 * 16]),
                                             V.strides[1]))
        else:
            for d, j in T.grid(k.D, k.Bc):
                with T.sblock("pack_vt"):
                    vd, vj = T.axis.remap("SS", [d, j])
                    VTp[hk, t, vd, vj] = kv.load(V, vj, hk, vd, _to_f32, T.float32(0))


def bf16_pack_k_v(k, Kp, KTp, VTp, K, V, kv: TileRows, hk, t):
    for p, d in T.grid(k.Bc // 2, k.D):
        with T.sblock("pack_k"):  # pair words of rows 2p, 2p + 1
            vp, vd = T.axis.remap("SS", [p, d])
            Kp[hk, t * (k.Bc // 2) + vp, vd] = pair_word(kv.load(K, 2 * vp, hk, vd, bf16_bits, T.uint16(0)),
                                                         kv.load(K, 2 * vp, hk, vd, bf16_bits, T.uint16(0), plus=1))
    for p, j in T.grid(k.D // 2, k.Bc):
        with T.sblock("pack_kt"):  # pair words of elements 2p, 2p + 1 of each key row
            vp, vj = T.axis.remap("SS", [p, j])
            KTp[hk, t, vp, vj] = Bf16Dot.along_row(kv, K, vj, hk, vp)
    for p, j in T.grid(k.D // 2, k.Bc):
        with T.sblock("pack_vt"):
            vp, vj = T.axis.remap("SS", [p, j])
            VTp[hk, t, vp, vj] = Bf16Dot.along_row(kv, V, vj, hk, vp)


def amx_pack_kv(k, Kp, Vp, K, V, kv: TileRows, hk, t):
    _pack_rows("pack_k", kv, hk, t * k.Bc, k.Bc, k.D, bf16_bits, T.uint16(0), (Kp, K))  # K's bits, zero-padded
    for j, d in T.grid(k.Bc, k.D):
        # V^T's bits: rows of the key tile's values of one head dim (read along V's rows: a
        # gather along its keys was scalar loads with the row arithmetic redone per element)
        with T.sblock("pack_v"):
            vj, vd = T.axis.remap("SS", [j, d])
            Vp[hk, t * k.D + vd, vj] = kv.load(V, vj, hk, vd, bf16_bits, T.uint16(0))


def amx_pack_q_do(k, Qp, dOp, QTr, dOTr, Q, dO, q: TileRows, h, t):
    _pack_rows("pack_q_do", q, h, t * k.Br, k.Br, k.D, bf16_bits, T.uint16(0), (Qp, Q), (dOp, dO))  # their bits
    for d, i in T.grid(k.D, k.Br):
        with T.sblock("pack_q_do_t"):  # Q^T, dO^T as rows (the A operands of dK^T, dV^T)
            vd, vi = T.axis.remap("SS", [d, i])
            QTr[h, t * k.D + vd, vi] = Qp[h, t * k.Br + vi, vd]
            dOTr[h, t * k.D + vd, vi] = dOp[h, t * k.Br + vi, vd]


# --- operand formats -----------------------------------------------------------------------------
class Fp32Fma:
    """Products as fp32 FMAs: the operands are fp32 copies of the inputs, the packs only convert
    and zero-pad; P and dS are read as they are."""

    pair = 1  # reduction elements per operand word
    rows = words = F32  # operand dtypes: rows (reduction along a row), words (pairs of rows)
    packed = False  # whether P and dS are packed (rounded) as product inputs
    transposed = False  # AMX: V, Q, dO also as transposed rows, dK and dV tiles transposed
    accumulates = False  # AMX: products add into the running O, dK, dV sums (no fresh partials)
    pack_kv, pack_q_do, pack_k_v = (staticmethod(f) for f in (fp32_pack_kv, fp32_pack_q_do, fp32_pack_k_v))

    @staticmethod
    def words_of(rows):
        """The word offset of a row offset in a pairs-of-rows operand."""
        return rows

    @staticmethod
    def along_row(tile: TileRows, buf, i, head, w):
        """Operand word w of row i of a tile, read along the row (head dim): transposed loads."""
        return tile.load(buf, i, head, w, _to_f32, T.float32(0))

    @staticmethod
    def product(block, C, x, y, red, a, b):
        """``C[x, y] = sum over red of a * b`` (a reduction block named ``block``): x, y, red are
        (loop name, extent); a and b are (kind, load(vx, vy, word)) operands: "row" operands hold
        the reduction along a row, "word" operands in pairs of rows (the same for fp32). Formats
        that ``accumulate`` also take ``accumulate=True``: ``C[x, y] += ...``."""
        frame, names = _loops(x, y, red)
        with frame as loops:
            for name, loop in zip(names, loops):
                IRBuilder.name(name, loop)
            with T.sblock(block):
                vx, vy, vk = T.axis.remap("SSR", loops)
                for name, var in zip(names, (vx, vy, vk)):
                    IRBuilder.name(f"v{name}", var)
                with T.init():
                    T.buffer_store(C, T.float32(0), [vx, vy])
                T.buffer_store(C, C[vx, vy] + a[1](vx, vy, vk) * b[1](vx, vy, vk), [vx, vy])


class Bf16Dot:
    """Products as bf16 dot products (``vdpbf16ps``, AVX512-BF16): the operands stay bf16 (bits
    of rows as uint16 where a product reads along a row, pair words of rows as uint32 where it
    reads pairs of rows), each product reduces over pairs ``(q, t)``, the intrinsic's form
    (``schedules/llvm_bf16.py`` tensorizes it). P and dS are rounded to bf16 as product inputs."""

    pair = 2
    rows, words = U16, U32
    packed = True
    transposed = False
    accumulates = False
    pack_kv, pack_q_do, pack_k_v = (staticmethod(f) for f in (bf16_pack_kv, bf16_pack_q_do, bf16_pack_k_v))

    @staticmethod
    def words_of(rows):
        return rows // 2

    @staticmethod
    def along_row(tile: TileRows, buf, i, head, w):
        return T.if_then_else(tile.inside(i), pair_word(bf16_bits(buf[tile.batch, tile.row(i), head, 2 * w]),
                                                        bf16_bits(buf[tile.batch, tile.row(i), head, 2 * w + 1])),
                              T.uint32(0))

    @staticmethod
    def product(block, C, x, y, red, a, b):
        frame, names = _loops(x, y, ("q", red[1] // 2), ("t", 2))
        with frame as loops:
            for name, loop in zip(names, loops):
                IRBuilder.name(name, loop)
            with T.sblock(block):
                vx, vy, vq, vt = T.axis.remap("SSRR", loops)
                for name, var in zip(names, (vx, vy, vq, vt)):
                    IRBuilder.name(f"v{name}", var)

                def value(operand):
                    kind, load = operand
                    return bits_value(load(vx, vy, 2 * vq + vt)) if kind == "row" else half(load(vx, vy, vq), vt)

                with T.init():
                    T.buffer_store(C, T.float32(0), [vx, vy])
                T.buffer_store(C, C[vx, vy] + value(a) * value(b), [vx, vy])


class AmxTiles(Bf16Dot):
    """Products on AMX tiles (``tdpbf16ps``): bf16 operands as for ``Bf16Dot``, but every
    product's first operand must be rows (its A tile: 16 rows, the reduction along each) and its
    second pair words (its B tile), the layouts of the instruction. The products whose first
    operand would be pairs of rows take transposed forms: O^T += V^T P^T with V^T as rows per key
    tile (``amx_pack_kv``), dV^T += dO^T P and dK^T += Q^T dS with Q^T, dO^T as rows per query
    tile (``amx_pack_q_do``) and dK, dV tiles accumulated transposed. Each product block is a
    grid of calls, one per block of up to 2 x 2 accumulator tiles of C, to an LLVM IR helper
    that keeps them in tile registers over the whole reduction (``schedules/llvm_amx.py``).

    Blocks: LLVM configures each of the 8 tile registers with one shape for a whole function.
    Whole 32-element reduction chunks use one shape (16 rows x 64 bytes) for A, B and C tiles: a
    2 x 2 block (4 C, 2 A, 2 B) fills all 8. A reduction of 16 mod 32 (a head dim of 48 or 80,
    16-row tiles) ends on a half chunk, whose A and B tiles have shapes of their own; such kernels
    use blocks of 2 tiles (5 full-shape registers, 3 of the half shapes), else LLVM runs out."""

    transposed = accumulates = True
    pack_kv, pack_q_do = staticmethod(amx_pack_kv), staticmethod(amx_pack_q_do)

    def __init__(self, accumulators: int):
        self.accumulators = accumulators  # accumulator tiles per block: 4, or 2 with half chunks

    def product(self, block, C, x, y, red, a, b, accumulate: bool = False):
        if a[0] != "row" or b[0] != "word":
            raise ValueError(f"{block}: AMX products take rows times pair words, got {a[0]} times {b[0]}")
        (_, rows), (_, cols), (_, red_extent) = x, y, red
        mt = 2 if rows % (2 * AMX_TILE) == 0 else 1
        nt = 2 if cols % (2 * AMX_TILE) == 0 and mt * 2 <= self.accumulators else 1
        helper = amx_helper_name(mt, nt, red_extent, accumulate)
        with T.grid(rows // (AMX_TILE * mt), cols // (AMX_TILE * nt)) as (xo, yo):
            with T.sblock(block):
                vxo, vyo = T.axis.remap("SS", [xo, yo])
                x0, y0 = vxo * (AMX_TILE * mt), vyo * (AMX_TILE * nt)
                if accumulate:
                    T.reads(C[x0:x0 + AMX_TILE * mt, y0:y0 + AMX_TILE * nt])
                else:
                    T.reads()
                T.writes(C[x0:x0 + AMX_TILE * mt, y0:y0 + AMX_TILE * nt])
                T.sblock_attr({HELPER_ATTR: helper})  # the schedule imports its IR
                a_at, b_at = a[1](x0, y0, 0), b[1](x0, y0, 0)
                T.evaluate(T.call_extern("void", helper, T.address_of(C[x0, y0]), _row_bytes(C[x0, y0], C[x0 + 1, y0]),
                                         T.address_of(a_at), _row_bytes(a_at, a[1](x0 + 1, y0, 0)),
                                         T.address_of(b_at), _row_bytes(b_at, b[1](x0, y0, 1))))


_BYTES = {U16: 2, U32: 4, F32: 4}


def _row_bytes(load, next_row):
    """The distance in bytes between two elements of a buffer (loads of it), as an int64."""
    def offset(ld):
        flat, stride = tirx.const(0, "int64"), tirx.const(1, "int64")
        for index, extent in reversed(list(zip(ld.indices, ld.source.shape))):
            flat, stride = flat + i64(index) * stride, stride * i64(extent)
        return flat

    elements = Analyzer().simplify(offset(next_row) - offset(load))
    return elements * tirx.const(_BYTES[str(load.source.dtype)], "int64")


def operand_format(spec: AttentionSpec, cfg: CPUKernelConfig):
    """The operand format of a kernel's products (``config.products``)."""
    if cfg.products not in (BF16_DOT, AMX):
        return Fp32Fma
    if spec.dtype != BF16 or spec.head_dim % (AMX_TILE if cfg.products == AMX else 8):
        raise ValueError(f"{cfg.products} products need bfloat16 inputs and a head dim that is a multiple of "
                         f"{AMX_TILE if cfg.products == AMX else 8}, got {spec.dtype} (head dim {spec.head_dim})")
    if cfg.products == BF16_DOT:
        return Bf16Dot
    half_chunks = any(extent % (2 * AMX_TILE) for extent in (spec.head_dim, cfg.block_q, cfg.block_k))
    return AmxTiles(accumulators=2 if half_chunks else 4)


def _exponent_scale(spec: AttentionSpec, softmax_scale):
    """c of 2^((x - max) * c) as float64: x is the raw dot product without score mods (the scale
    folds into c), the modded natural-log score with them."""
    return (tirx.const(1.0, "float64") if spec.score_mods else tirx.Cast("float64", softmax_scale)) * tirx.const(
        LOG2E, "float64")




# --- forward stages (tiles transposed: query index innermost) ------------------------------------
def fwd_load_q(k, QT, Q, q: TileRows, h):
    with stage("load_q_tile"):
        if k.whole_tile(q, k.Br):  # 16 x 16 blocks transposed in registers
            for i0, d0 in T.grid(k.Br // 16, k.D // 16):
                with T.sblock("load_q_blocks"):
                    vi0, vd0 = T.axis.remap("SS", [i0, d0])
                    T.reads()
                    T.writes(QT[vd0 * 16:vd0 * 16 + 16, vi0 * 16:vi0 * 16 + 16])
                    T.evaluate(T.call_extern("void", llvm_transpose.LOAD, T.address_of(QT[vd0 * 16, vi0 * 16]),
                                             T.int64(k.Br), T.address_of(Q[q.batch, q.row(vi0 * 16), h, vd0 * 16]),
                                             Q.strides[1]))
        else:
            for i, d in T.grid(k.Br, k.D // k.fmt.pair):
                with T.sblock("load_q"):  # fp32, or pair words of elements 2d, 2d + 1 of each query row
                    vi, vd = T.axis.remap("SS", [i, d])
                    QT[vd, vi] = k.fmt.along_row(q, Q, vi, h, vd)


def fwd_init(k, OT, m, l):
    with stage("init_o_tile"):
        for d, i in T.grid(k.D, k.Br):
            with T.sblock("init_o"):
                vd, vi = T.axis.remap("SS", [d, i])
                OT[vd, vi] = T.float32(0)
    with stage("init_stats_tile"):
        for i in T.serial(k.Br):
            with T.sblock("init_stats"):
                vi = T.axis.remap("S", [i])
                # not -inf: 2^(-inf - m) must be 0 for masked scores before a row sees any key
                m[vi] = T.float32(-FLT_MAX)
                l[vi] = T.float32(0)


def fwd_scores(k, ST, Kp, QT, hk, krow):
    with stage("scores_tile"):
        k.fmt.product("scores", ST, ("j", k.Bc), ("i", k.Br), ("d", k.D), ("row", lambda j, i, w: Kp[hk, krow + j, w]),
                      ("word", lambda j, i, w: QT[w, i]))


def fwd_score_mod(k, ST, scale, seq, h, q0, k0):
    with stage("score_mod_tile"):
        for j, i in T.grid(k.Bc, k.Br):
            with T.sblock("score_mod"):
                vj, vi = T.axis.remap("SS", [j, i])
                ST[vj, vi] = k.ctx.score(seq, ST[vj, vi] * scale, h, q0 + vi, k0 + vj)


def fwd_mask(k, ST, seq, h, q0, k0):
    with stage("mask_tile"):
        for j in T.serial(k.Bc):
            visible = T.meta_var(k.ctx.window_interval(seq, q0, k0, j, "q"))  # the queries key j is visible to
            first: T.let[T.int32] = visible[0]
            last: T.let[T.int32] = visible[1]
            # vectorized here, not in the schedule: TensorIR's vectorize refuses a block that
            # reads and writes one buffer, and LLVM left this loop scalar
            for i in T.vectorized(k.Br):
                with T.sblock("mask"):
                    vj, vi = T.axis.remap("SS", [j, i])
                    ST[vj, vi] = T.Select(k.ctx.sees_in_interval(seq, h, q0 + vi, k0 + vj, vi, (first, last)),
                                          ST[vj, vi], T.float32(NEG_INF))


def fwd_online_softmax(k, ST, PT, m, m_tile, m_next, alpha, c_hi, c_lo):
    with stage("row_max_tile"):
        for j, i in T.grid(k.Bc, k.Br):
            with T.sblock("row_max"):
                vj, vi = T.axis.remap("RS", [j, i])
                with T.init():
                    m_tile[vi] = m[vi]
                m_tile[vi] = T.max(m_tile[vi], ST[vj, vi])  # of raw scores (c > 0)
    with stage("settle_max_tile"):
        for i in T.serial(k.Br):
            with T.sblock("settle_max"):
                vi = T.axis.remap("S", [i])
                # The max moves only when it grows by more than LAZY_MAX_LOG2 (P then stays <= 2^8,
                # exact enough in fp32 and bf16): O and l are rescaled on few key tiles, not on every
                # tile where some row's max grew a little (most of them, for 64 rows).
                m_next[vi] = T.Select((m_tile[vi] - m[vi]) * c_hi <= T.float32(LAZY_MAX_LOG2), m[vi], m_tile[vi])
    with stage("rescale_tile"):
        for i in T.serial(k.Br):
            with T.sblock("rescale"):
                vi = T.axis.remap("S", [i])
                # Equal maxima (also both -inf: nothing seen yet) rescale by exactly 1.
                alpha[vi] = T.Select(m[vi] == m_next[vi], T.float32(1),
                                     exp2(shifted_log2_exponent(m[vi], m_next[vi], (c_hi, c_lo))))
    with stage("probs_tile"):
        for j, i in T.grid(k.Bc, k.Br):
            with T.sblock("probs"):
                vj, vi = T.axis.remap("SS", [j, i])
                PT[vj, vi] = exp2(shifted_log2_exponent(ST[vj, vi], m_next[vi], (c_hi, c_lo)))


def fwd_pack_p(k, PTw, PT):
    with stage("pack_p_tile"):
        for q, i in T.grid(k.Bc // 2, k.Br):
            with T.sblock("pack_p"):  # P rounded to bf16 as a product input only (rule 3)
                vq, vi = T.axis.remap("SS", [q, i])
                PTw[vq, vi] = rounded_pair_word(PT[2 * vq, vi], PT[2 * vq + 1, vi])


def fwd_pv(k, PVT, Vp, PTw, hk, krow):
    with stage("pv_tile"):
        if k.fmt.transposed:  # V^T as rows of this key tile; added into O^T (PVT is OT)
            k.fmt.product("pv", PVT, ("d", k.D), ("i", k.Br), ("j", k.Bc),
                          ("row", lambda d, i, w: Vp[hk, krow // k.Bc * k.D + d, w]),
                          ("word", lambda d, i, w: PTw[w, i]), accumulate=True)
        else:
            k.fmt.product("pv", PVT, ("d", k.D), ("i", k.Br), ("j", k.Bc),
                          ("word", lambda d, i, w: Vp[hk, k.fmt.words_of(krow) + w, d]),
                          ("word", lambda d, i, w: PTw[w, i]))


def fwd_update_o(k, OT, PVT, alpha):
    with stage("update_o_tile"):
        for d in T.serial(k.D):
            # vectorized here (an in-place block, as in mask): with 16-row tiles LLVM unrolled
            # the row loop and vectorized the head dim loop instead, as gathers and scatters
            for i in T.vectorized(k.Br):
                with T.sblock("update_o"):
                    vd, vi = T.axis.remap("SS", [d, i])
                    OT[vd, vi] = OT[vd, vi] * alpha[vi] + PVT[vd, vi]


def fwd_rescale_o(k, OT, alpha, state):
    """O^T *= alpha where some row's max moved (once the maxima settle, most key tiles move none)."""
    with stage("rescale_o_tile"):
        state[3] = T.int64(0)
        for i in T.serial(k.Br):
            state[3] = T.max(state[3], T.Cast(I64, alpha[i] != T.float32(1)))
        if state[3] != 0:
            for d in T.serial(k.D):
                for i in T.vectorized(k.Br):  # (in place, as update_o)
                    with T.sblock("rescale_o"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        OT[vd, vi] = OT[vd, vi] * alpha[vi]


def fwd_accumulate(k, PT, m, m_next, l, l_tile, alpha):
    with stage("row_sum_tile"):
        for j, i in T.grid(k.Bc, k.Br):
            with T.sblock("row_sum"):
                vj, vi = T.axis.remap("RS", [j, i])
                with T.init():
                    l_tile[vi] = T.float32(0)
                l_tile[vi] = l_tile[vi] + PT[vj, vi]
    with stage("update_stats_tile"):
        for i in T.serial(k.Br):
            with T.sblock("update_stats"):
                vi = T.axis.remap("S", [i])
                m[vi] = m_next[vi]
                l[vi] = l[vi] * alpha[vi] + l_tile[vi]


def fwd_store(k, O, LSE, OT, m, l, l_inverse, scale_log2, q: TileRows, h):
    with stage("store_o_tile"):  # (an opaque parent: TVM 0.27 edits an if outside one in place, DEVELOPING.md)
        if k.whole_tile(q, k.Br):  # 16 x 16 blocks transposed in registers, each column times its row's 1 / l
            for i in T.serial(k.Br):
                with T.sblock("inverse_l"):
                    vi = T.axis.remap("S", [i])
                    l_inverse[vi] = normalizer(l[vi])
            for i0, d0 in T.grid(k.Br // 16, k.D // 16):
                with T.sblock("store_o_blocks"):
                    vi0, vd0 = T.axis.remap("SS", [i0, d0])
                    T.reads(OT[vd0 * 16:vd0 * 16 + 16, vi0 * 16:vi0 * 16 + 16], l_inverse[vi0 * 16:vi0 * 16 + 16])
                    T.writes()
                    T.evaluate(T.call_extern("void", llvm_transpose.STORE_SCALED,
                                             T.address_of(O[q.batch, q.row(vi0 * 16), h, vd0 * 16]), O.strides[1],
                                             T.address_of(OT[vd0 * 16, vi0 * 16]), T.int64(k.Br),
                                             T.address_of(l_inverse[vi0 * 16])))
        else:
            for i, d in T.grid(k.Br, k.D):
                with T.sblock("store_o"):
                    vi, vd = T.axis.remap("SS", [i, d])
                    if q.inside(vi):
                        O[q.batch, q.start + q.first + vi, h, vd] = T.Cast(k.spec.out_dtype,
                                                                         OT[vd, vi] * normalizer(l[vi]))
    for i in T.serial(k.Br):
        with T.sblock("store_lse"):
            vi = T.axis.remap("S", [i])
            if q.inside(vi):
                LSE[q.batch, h, q.start + q.first + vi] = lse_from_raw_max(m[vi], scale_log2, l[vi])


def fused_forward(spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    k = Kernel(spec, cfg, backward=False)
    D, Br, Bc, fmt, ctx = k.D, k.Br, k.Bc, k.fmt, k.ctx
    dtype, out_dtype, has_mods = spec.dtype, spec.out_dtype, k.has_mods
    (pack_kv, load_q, init_tile, scores, score_mod, mask, online_softmax, pack_p, pv, update_o, rescale_o, accumulate,
     store) = k.macros(fmt.pack_kv, fwd_load_q, fwd_init, fwd_scores, fwd_score_mod, fwd_mask, fwd_online_softmax,
                       fwd_pack_p, fwd_pv, fwd_update_o, fwd_rescale_o, fwd_accumulate, fwd_store)

    @T.prim_func(s_tir=True)
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, lse_h: T.handle,
                  softmax_scale: T.float64, window_left: T.int64, window_right: T.int64, n_threads: T.int64):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        Bq = T.int64()
        Nq = T.int64()
        Bk = T.int64()
        Nk = T.int64()
        H = T.int64()
        Hk = T.int64()
        Q = io_buffer(q_h, (Bq, Nq, H, D), dtype, "sq")
        K = io_buffer(k_h, (Bk, Nk, Hk, D), dtype, "sk")
        V = io_buffer(v_h, (Bk, Nk, Hk, D), dtype, "sv")
        O = io_buffer(o_h, (Bq, Nq, H, D), out_dtype, "so")
        LSE = T.match_buffer(lse_h, (Bq, H, Nq), F32, align=4)
        ctx.declare(window_left, window_right)
        # K (rows) and V (pairs of rows with bf16 products, V^T rows per key tile on AMX),
        # zero-padded to whole key tiles
        Kp = T.alloc_buffer((Hk, ctx.key_tiles_total() * Bc, D), fmt.rows)
        Vp = T.alloc_buffer((Hk, ctx.key_tiles_total() * D, Bc), fmt.rows) if fmt.transposed else T.alloc_buffer(
            (Hk, ctx.key_tiles_total() * (Bc // fmt.pair), D), fmt.words)
        # one parallel region (the schedule makes this loop its launch point): the packs, a
        # barrier, then the query tiles
        for _region in T.serial(1):
            for hk, t in T.grid(Hk, ctx.key_tiles_total()):
                with T.sblock("pack_kv_tile"):
                    vhk, vt = T.axis.remap("SS", [hk, t])
                    T.reads()
                    T.writes()
                    pack_kv(Kp, Vp, K, V, ctx.bind_tile_rows("k", vt), vhk, vt)
            for slot in T.serial(n_threads):
                with T.sblock("slot"):
                    vslot = T.axis.remap("S", [slot])
                    T.reads()
                    T.writes()
                    QT = T.sblock_alloc_buffer((D // fmt.pair, Br), fmt.words)  # query tile, transposed
                    ST = T.sblock_alloc_buffer((Bc, Br), F32)  # scores, transposed
                    PT = T.sblock_alloc_buffer((Bc, Br), F32)  # unnormalized probabilities
                    PTw = T.sblock_alloc_buffer((Bc // 2, Br), U32) if fmt.packed else PT  # P as the input of PV
                    OT = T.sblock_alloc_buffer((D, Br), F32)  # output accumulator
                    PVT = OT if fmt.accumulates else T.sblock_alloc_buffer((D, Br), F32)  # this key tile's P V
                    m = T.sblock_alloc_buffer((Br,), F32)  # running row max (log2 units)
                    m_next = T.sblock_alloc_buffer((Br,), F32)
                    m_tile = T.sblock_alloc_buffer((Br,), F32)  # the max including this key tile's scores
                    l = T.sblock_alloc_buffer((Br,), F32)  # running denominator
                    l_tile = T.sblock_alloc_buffer((Br,), F32)
                    alpha = T.sblock_alloc_buffer((Br,), F32)  # 2^(m - m_next)
                    l_inverse = T.sblock_alloc_buffer((Br,), F32)  # 1 / l at the store (block transposes)
                    # The task's indices, the key-tile range and the tile's state go through small
                    # buffers, not let bindings: TVM's simplifier carries let values into every region
                    # analysis below, and compiling took minutes (DEVELOPING.md).
                    state = T.sblock_alloc_buffer((4,), I64)  # tile state, first and end key tile, any max moved
                    at = T.sblock_alloc_buffer((3,), I64)  # query head, query tile, sequence
                    # Task order: query tiles last to first (a sequence's last tiles see the most keys
                    # when causal), the heads of one tile next to each other; a block of heads per
                    # slot, or dealt out cyclically (common.slot_task).
                    for e in T.serial(slot_task_count(vslot, H, ctx.query_tiles_total(), n_threads)):
                        task = T.meta_var(slot_task(vslot, e, H, ctx.query_tiles_total(), n_threads, heads_outer=False))
                        at[0] = task[0]
                        at[1] = ctx.query_tiles_total() - 1 - task[1]  # the query tile (task[1] from the last)
                        at[2] = ctx.q_tile_sequence(at[1])
                        h: T.let[T.int64] = at[0]
                        hk: T.let[T.int64] = h // (H // Hk)
                        b: T.let[T.int64] = at[2]
                        seq = T.meta_var(ctx.sequence(b))
                        q0: T.let[T.int64] = (at[1] - seq.column(plan.Q_TILE0)) * Br
                        q_len: T.let[T.int64] = seq.q_len
                        q = T.meta_var(TileRows(seq.column(plan.Q_BATCH), seq.column(plan.Q_START), q0, q_len))
                        load_q(QT, Q, q, h)
                        init_tile(OT, m, l)
                        state[1] = ctx.key_tiles(seq, h, q0)[0]
                        state[2] = ctx.key_tiles(seq, h, q0)[1]
                        for kt in T.serial(state[1], state[2]):
                            k0: T.let[T.int64] = kt * Bc
                            krow: T.let[T.int64] = (seq.column(plan.K_TILE0) + kt) * Bc
                            state[0] = ctx.tile_state(seq, h, q0, k0)
                            if state[0] != EMPTY:
                                scores(ST, Kp, QT, hk, krow)
                                if has_mods:
                                    score_mod(ST, T.Cast(F32, softmax_scale), seq, h, q0, k0)
                                if state[0] == PARTIAL:
                                    mask(ST, seq, h, q0, k0)
                                online_softmax(ST, PT, m, m_tile, m_next, alpha,
                                               exponent_constant(spec, softmax_scale)[0],
                                               exponent_constant(spec, softmax_scale)[1])
                                if fmt.packed:
                                    pack_p(PTw, PT)
                                if fmt.accumulates:  # O^T *= alpha, then O^T += V^T P^T in the products
                                    rescale_o(OT, alpha, state)
                                    pv(OT, Vp, PTw, hk, krow)
                                else:  # PVT = V^T P^T, O^T = O^T * alpha + PVT
                                    pv(PVT, Vp, PTw, hk, krow)
                                    update_o(OT, PVT, alpha)
                                accumulate(PT, m, m_next, l, l_tile, alpha)
                        store(O, LSE, OT, m, l, l_inverse, _exponent_scale(spec, softmax_scale), q, h)

    return k.declare_helpers(flash_fwd)


# --- backward stages (tiles by query rows) ---------------------------------------------------------
def bwd_row_stats(k, RowStats, dQacc, dO, O, LSE, q: TileRows, h, t):
    """Per query row: Delta = rowsum(dO * O), LSE * log2(e) as fp32 hi + lo; dQ's sums = 0."""
    for i, d in T.grid(k.Br, k.D):
        with T.sblock("delta"):
            vi, vd = T.axis.remap("SR", [i, d])
            with T.init():
                RowStats[h, 2, t * k.Br + vi] = T.float32(0)
            RowStats[h, 2, t * k.Br + vi] = RowStats[h, 2, t * k.Br + vi] + T.if_then_else(
                q.inside(vi), T.Cast(F32, dO[q.batch, q.row(vi), h, vd]) * T.Cast(F32, O[q.batch, q.row(vi), h, vd]),
                T.float32(0))
    for i in T.serial(k.Br):
        with T.sblock("lse_log2"):
            vi = T.axis.remap("S", [i])
            # rows that see no key (LSE -inf) get +inf: 2^(score - LSE) = 0 for all scores
            RowStats[h, 0, t * k.Br + vi] = T.if_then_else(q.inside(vi), T.Select(
                LSE[q.batch, h, q.row(vi)] == T.float32(NEG_INF), T.float32(-NEG_INF),
                lse_log2_parts(LSE[q.batch, h, q.row(vi)])[0]), T.float32(0))
            RowStats[h, 1, t * k.Br + vi] = T.if_then_else(q.inside(vi), T.Select(
                LSE[q.batch, h, q.row(vi)] == T.float32(NEG_INF), T.float32(0),
                lse_log2_parts(LSE[q.batch, h, q.row(vi)])[1]), T.float32(0))
    for i, d in T.grid(k.Br, k.D):
        with T.sblock("zero_dq"):
            vi, vd = T.axis.remap("SS", [i, d])
            dQacc[h, t * k.Br + vi, vd] = T.float32(0)


def bwd_zero_dkv(k, dKacc, dVacc, hk, t):
    for r, c in T.grid(*k.kv_tile):  # the key tile's block of the sums (transposed formats: (D, Bc))
        with T.sblock("zero_dkv"):
            vr, vc = T.axis.remap("SS", [r, c])
            dKacc[hk, t * k.kv_tile[0] + vr, vc] = T.float32(0)
            dVacc[hk, t * k.kv_tile[0] + vr, vc] = T.float32(0)


def bwd_refuse_unrecomputable_lse(k, LSE):
    """ValueError, before the kernel writes anything, if a finite |LSE| reaches
    ``MAX_RECOMPUTABLE_LSE``: P recomputed from that fp32 value would be off by its rounding
    (spec.py). One pass over the LSE (O(N) against the backward's O(N^2)), here rather than in
    Python around the call: no torch or numpy reduction, whose code a model never runs warm."""
    largest = T.decl_buffer((1,), F32)
    for b, h, i in T.grid(*LSE.shape):
        with T.sblock("largest_lse"):
            vb, vh, vi = T.axis.remap("RRR", [b, h, i])
            with T.init():
                largest[0] = T.float32(0)
            # (-inf: a query that sees no key; NaN: NaN inputs, whose gradients are NaN anyway)
            largest[0] = T.max(largest[0], T.if_then_else(
                T.abs(LSE[vb, vh, vi]) < T.float32(-NEG_INF), T.abs(LSE[vb, vh, vi]), T.float32(0)))
    assert largest[0] < T.float32(MAX_RECOMPUTABLE_LSE), (
        "ValueError", [unrecomputable_lse_message(f"{MAX_RECOMPUTABLE_LSE:.0f} or more in magnitude")])


def bwd_zero_mod_grads(k, partials, n_threads):
    for s, x in T.grid(n_threads, partials.shape[1]):
        with T.sblock("zero_mod_grads"):
            vs, vx = T.axis.remap("SS", [s, x])
            partials[vs, vx] = T.float32(0)


def bwd_recompute_probs(k, P, S, X, row_stats, RowStats, Qp, KTp, softmax_scale, seq, h, hk, q0, k0, qrow, gk, state):
    """S = Q_i K_j^T, X = mods(S * scale), masked, P = 2^(X c - LSE)."""
    with stage("load_row_stats_tile"):
        for r, i in T.grid(3, k.Br):
            with T.sblock("load_row_stats"):
                vr, vi = T.axis.remap("SS", [r, i])
                row_stats[vr, vi] = RowStats[h, vr, qrow + vi]
    with stage("scores_tile"):
        k.fmt.product("scores", S, ("i", k.Br), ("j", k.Bc), ("d", k.D), ("row", lambda i, j, w: Qp[h, qrow + i, w]),
                      ("word", lambda i, j, w: KTp[hk, gk, w, j]))
    if k.has_mods:
        with stage("score_mod_tile"):
            for i, j in T.grid(k.Br, k.Bc):
                with T.sblock("score_mod"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    X[vi, vj] = k.ctx.score(seq, S[vi, vj] * T.Cast(F32, softmax_scale), h, q0 + vi, k0 + vj)
    if state == PARTIAL:
        with stage("mask_tile"):
            for i in T.serial(k.Br):
                visible = T.meta_var(k.ctx.window_interval(seq, q0, k0, i, "k"))  # the keys query i sees
                first: T.let[T.int32] = visible[0]
                last: T.let[T.int32] = visible[1]
                for j in T.vectorized(k.Bc):  # (in place: TensorIR's vectorize refuses, see fwd_mask)
                    with T.sblock("mask"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        X[vi, vj] = T.Select(k.ctx.sees_in_interval(seq, h, q0 + vi, k0 + vj, vj, (first, last)),
                                             X[vi, vj], T.float32(NEG_INF))
    with stage("probs_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("probs"):
                vi, vj = T.axis.remap("SS", [i, j])
                P[vi, vj] = exp2(masked_log2_exponent(X[vi, vj], exponent_constant(k.spec, softmax_scale),
                                                      (row_stats[0, vi], row_stats[1, vi])), nonpositive=True)


def bwd_pack_p(k, Pw, P):
    with stage("pack_p_tile"):
        for q, j in T.grid(k.Br // 2, k.Bc):
            with T.sblock("pack_p"):  # P rounded to bf16 as a product input only (rule 3)
                vq, vj = T.axis.remap("SS", [q, j])
                Pw[vq, vj] = rounded_pair_word(P[2 * vq, vj], P[2 * vq + 1, vj])


def bwd_key_grad(k, name, tile, run, weights, rows, h, qrow):
    """A key tile's sums of ``weights^T rows_i`` (block ``name``): dV_j += P^T dO_i, dK_j += dS^T
    Q_i, with P, dS as pair words. Transposed formats: run_j^T += rows_i^T weights, rows^T as rows
    of the query tile, added into the task's sums directly (``tile`` is then ``run``)."""
    with stage(name + "_tile"):
        if k.fmt.transposed:
            k.fmt.product(name, run, ("d", k.D), ("j", k.Bc), ("i", k.Br),
                          ("row", lambda d, j, w: rows[h, qrow // k.Br * k.D + d, w]),
                          ("word", lambda d, j, w: weights[w, j]), accumulate=True)
        else:
            k.fmt.product(name, tile, ("j", k.Bc), ("d", k.D), ("i", k.Br), ("word", lambda j, d, w: weights[w, j]),
                          ("word", lambda j, d, w: rows[h, k.fmt.words_of(qrow) + w, d]))
    if not k.fmt.accumulates:
        with stage("update_" + name + "_tile"):
            for j, d in T.grid(k.Bc, k.D):
                with T.sblock("update_" + name):
                    vj, vd = T.axis.remap("SS", [j, d])
                    run[vj, vd] = run[vj, vd] + tile[vj, vd]


def bwd_grad_scores(k, dS, dP, P, S, VTp, dOp, row_stats, partials, softmax_scale, slot, seq, h, hk, q0, k0, qrow,
                    gk):
    """dP = dO_i V_j^T, dS = P (dP - Delta), the captured tensors' gradients, dS *= d mods / d S."""
    with stage("dprobs_tile"):
        k.fmt.product("dprobs", dP, ("i", k.Br), ("j", k.Bc), ("d", k.D), ("row", lambda i, j, w: dOp[h, qrow + i, w]),
                      ("word", lambda i, j, w: VTp[hk, gk, w, j]))
    with stage("dscores_tile"):
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("dscores"):
                vi, vj = T.axis.remap("SS", [i, j])
                dS[vi, vj] = grad_scores(P[vi, vj], dP[vi, vj], row_stats[2, vi])
    if k.ctx.has_captured_grads:
        for i, j in T.grid(k.Br, k.Bc):  # scatter-adds: a plain serial loop
            with T.sblock("mod_grads"):
                vi, vj = T.axis.remap("SS", [i, j])
                if P[vi, vj] != T.float32(0):
                    k.ctx.scatter_captured_grads(partials, slot, seq, S[vi, vj] * T.Cast(F32, softmax_scale), h,
                                                 q0 + vi, k0 + vj, dS[vi, vj])
    if k.has_mods:
        with stage("dscores_mod_tile"):
            for i, j in T.grid(k.Br, k.Bc):
                with T.sblock("dscores_mod"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    # masked and underflowed entries have dS = 0: keep it 0 even where the mods'
                    # derivative is not finite there
                    dS[vi, vj] = T.Select(dS[vi, vj] == T.float32(0), T.float32(0), dS[vi, vj] * k.ctx.score_grad(
                        seq, S[vi, vj] * T.Cast(F32, softmax_scale), h, q0 + vi, k0 + vj))


def bwd_pack_ds(k, dSw, dSb, dS):
    with stage("pack_ds_tile"):  # dS rounded to bf16 as a product input only (rule 3)
        for q, j in T.grid(k.Br // 2, k.Bc):
            with T.sblock("pack_ds_pairs"):  # for dK: pairs of rows
                vq, vj = T.axis.remap("SS", [q, j])
                dSw[vq, vj] = rounded_pair_word(dS[2 * vq, vj], dS[2 * vq + 1, vj])
        for i, j in T.grid(k.Br, k.Bc):
            with T.sblock("pack_ds"):  # for dQ: rows
                vi, vj = T.axis.remap("SS", [i, j])
                dSb[vi, vj] = rounded_bits(dS[vi, vj])


def bwd_accumulate_dq(k, dQtile, dQacc, dSb, Kp, h, hk, qrow, krow):
    """dQ_i += dS K_j."""
    with stage("dq_tile"):
        k.fmt.product("dq", dQtile, ("i", k.Br), ("d", k.D), ("j", k.Bc), ("row", lambda i, d, w: dSb[i, w]),
                      ("word", lambda i, d, w: Kp[hk, k.fmt.words_of(krow) + w, d]))
    with stage("update_dq_tile"):
        for i, d in T.grid(k.Br, k.D):
            with T.sblock("update_dq"):
                vi, vd = T.axis.remap("SS", [i, d])
                dQacc[h, qrow + vi, vd] = dQacc[h, qrow + vi, vd] + dQtile[vi, vd]


def bwd_init_dkv(k, dKrun, dVrun):
    with stage("init_dkv_tile"):
        for r, c in T.grid(*k.kv_tile):
            with T.sblock("init_dkv"):
                vr, vc = T.axis.remap("SS", [r, c])
                dKrun[vr, vc] = T.float32(0)
                dVrun[vr, vc] = T.float32(0)


def bwd_update_dkv(k, dKacc, dVacc, dKrun, dVrun, hk, gk):
    """The key tile's block of the sums += the task's (both in the task's layout, ``kv_tile``:
    transposed formats keep the sums transposed too, and store_dkv turns them back once)."""
    with stage("update_dkv_tile"):
        for r, c in T.grid(*k.kv_tile):
            with T.sblock("update_dk_acc"):
                vr, vc = T.axis.remap("SS", [r, c])
                dKacc[hk, gk * k.kv_tile[0] + vr, vc] = dKacc[hk, gk * k.kv_tile[0] + vr, vc] + dKrun[vr, vc]
        for r, c in T.grid(*k.kv_tile):
            with T.sblock("update_dv_acc"):
                vr, vc = T.axis.remap("SS", [r, c])
                dVacc[hk, gk * k.kv_tile[0] + vr, vc] = dVacc[hk, gk * k.kv_tile[0] + vr, vc] + dVrun[vr, vc]


def bwd_store_dq(k, dQ, dQacc, softmax_scale, q: TileRows, h, t):
    for i, d in T.grid(k.Br, k.D):
        with T.sblock("store_dq"):
            vi, vd = T.axis.remap("SS", [i, d])
            if q.inside(vi):
                dQ[q.batch, q.start + q.first + vi, h, vd] = T.Cast(
                    k.spec.out_dtype, dQacc[h, t * k.Br + vi, vd] * T.Cast(F32, softmax_scale))


def bwd_store_dkv(k, dK, dV, dKacc, dVacc, softmax_scale, kv: TileRows, hk, t):
    for j, d in T.grid(k.Bc, k.D):
        with T.sblock("store_dkv"):
            vj, vd = T.axis.remap("SS", [j, d])
            if kv.inside(vj):
                dK[kv.batch, kv.start + kv.first + vj, hk, vd] = T.Cast(k.spec.out_dtype, (
                    dKacc[hk, t * k.D + vd, vj] if k.fmt.transposed else dKacc[hk, t * k.Bc + vj, vd])
                    * T.Cast(F32, softmax_scale))
                dV[kv.batch, kv.start + kv.first + vj, hk, vd] = T.Cast(k.spec.out_dtype, (
                    dVacc[hk, t * k.D + vd, vj] if k.fmt.transposed else dVacc[hk, t * k.Bc + vj, vd]))


def fused_backward(spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    k = Kernel(spec, cfg, backward=True)
    D, Br, Bc, fmt, ctx = k.D, k.Br, k.Bc, k.fmt, k.ctx
    dtype, out_dtype, has_grads = spec.dtype, spec.out_dtype, ctx.has_captured_grads
    grad_elements = _grad_elements(spec)
    # (dV's and dK's sums: one stage function, two macros: TVM renames the blocks of a macro's
    # second expansion, and the schedule finds blocks by name)
    (refuse_unrecomputable_lse, pack_q_do, pack_k_v, prepare_rows, zero_dkv, zero_mod_grads, recompute_probs, pack_p,
     grad_v, grad_scores_, pack_ds, grad_k, accumulate_dq, init_dkv, update_dkv, store_dq, store_dkv) = k.macros(
        bwd_refuse_unrecomputable_lse, fmt.pack_q_do, fmt.pack_k_v, bwd_row_stats, bwd_zero_dkv, bwd_zero_mod_grads,
        bwd_recompute_probs, bwd_pack_p, bwd_key_grad, bwd_grad_scores, bwd_pack_ds, bwd_key_grad, bwd_accumulate_dq,
        bwd_init_dkv, bwd_update_dkv, bwd_store_dq, bwd_store_dkv)

    @T.prim_func(s_tir=True)
    def flash_bwd(do_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, lse_h: T.handle,
                  dq_h: T.handle, dk_h: T.handle, dv_h: T.handle, softmax_scale: T.float64, window_left: T.int64,
                  window_right: T.int64, n_threads: T.int64, n_rounds: T.int64, super_tile: T.int64):
        T.func_attr({"global_symbol": "flash_bwd", "tirx.noalias": True})
        Bq = T.int64()
        Nq = T.int64()
        Bk = T.int64()
        Nk = T.int64()
        H = T.int64()
        Hk = T.int64()
        dO = io_buffer(do_h, (Bq, Nq, H, D), dtype, "sdo")
        Q = io_buffer(q_h, (Bq, Nq, H, D), dtype, "sq")
        K = io_buffer(k_h, (Bk, Nk, Hk, D), dtype, "sk")
        V = io_buffer(v_h, (Bk, Nk, Hk, D), dtype, "sv")
        O = io_buffer(o_h, (Bq, Nq, H, D), dtype, "so")
        LSE = T.match_buffer(lse_h, (Bq, H, Nq), F32, align=4)
        dQ = io_buffer(dq_h, (Bq, Nq, H, D), out_dtype, "sdq")
        dK = io_buffer(dk_h, (Bk, Nk, Hk, D), out_dtype, "sdk")
        dV = io_buffer(dv_h, (Bk, Nk, Hk, D), out_dtype, "sdv")
        ctx.declare(window_left, window_right, ("q_tile_seq", "k_tile_seq", "k_super_seq"))
        # Padded global rows: every sequence starts on a whole tile (plan.py). The operand layouts
        # the products read: fp32, or bf16 bits (U16) and pair words (U32) with bf16 products.
        Qp = T.decl_buffer((H, ctx.query_tiles_total() * Br, D), fmt.rows)
        dOp = T.decl_buffer((H, ctx.query_tiles_total() * Br, D), fmt.rows)
        # (transposed formats: Q^T and dO^T as rows per query tile)
        Qw = (T.decl_buffer((H, ctx.query_tiles_total() * D, Br), U16) if fmt.transposed else
              T.decl_buffer((H, ctx.query_tiles_total() * (Br // 2), D), U32) if fmt.packed else Qp)
        dOw = (T.decl_buffer((H, ctx.query_tiles_total() * D, Br), U16) if fmt.transposed else
               T.decl_buffer((H, ctx.query_tiles_total() * (Br // 2), D), U32) if fmt.packed else dOp)
        # Per query row: LSE * log2(e) as fp32 hi + lo, and Delta = rowsum(dO * O).
        RowStats = T.decl_buffer((H, 3, ctx.query_tiles_total() * Br), F32)
        dQacc = T.decl_buffer((H, ctx.query_tiles_total() * Br, D), F32)
        # K (pairs of rows with bf16 products), K^T, V^T per key tile
        Kp = T.decl_buffer((Hk, ctx.key_tiles_total() * (Bc // fmt.pair), D), fmt.words)
        KTp = T.decl_buffer((Hk, ctx.key_tiles_total(), D // fmt.pair, Bc), fmt.words)
        VTp = T.decl_buffer((Hk, ctx.key_tiles_total(), D // fmt.pair, Bc), fmt.words)
        # (transposed formats: a (D, Bc) block per key tile)
        dKacc = T.decl_buffer((Hk, ctx.key_tiles_total() * k.kv_tile[0], k.kv_tile[1]), F32)
        dVacc = T.decl_buffer((Hk, ctx.key_tiles_total() * k.kv_tile[0], k.kv_tile[1]), F32)
        # each thread's partial gradients of captured tensors (summed in slot order at the end)
        partials = T.decl_buffer((n_threads, grad_elements), F32)
        refuse_unrecomputable_lse(LSE)
        if has_grads:
            zero_mod_grads(partials, n_threads)
        # one parallel region (the schedule makes this loop its launch point): the packs, a
        # barrier, each round and a barrier after it, the stores
        for _region in T.serial(1):
            for h, t in T.grid(H, ctx.query_tiles_total()):
                with T.sblock("prepare_q_tile"):
                    vh, vt = T.axis.remap("SS", [h, t])
                    T.reads()
                    T.writes()
                    q = T.meta_var(ctx.bind_tile_rows("q", vt))
                    pack_q_do(Qp, dOp, Qw, dOw, Q, dO, q, vh, vt)
                    prepare_rows(RowStats, dQacc, dO, O, LSE, q, vh, vt)
            for hk, t in T.grid(Hk, ctx.key_tiles_total()):
                with T.sblock("prepare_k_tile"):
                    vhk, vt = T.axis.remap("SS", [hk, t])
                    T.reads()
                    T.writes()
                    pack_k_v(Kp, KTp, VTp, K, V, ctx.bind_tile_rows("k", vt), vhk, vt)
                    zero_dkv(dKacc, dVacc, vhk, vt)
            for rnd in T.serial(n_rounds):  # rounds run in order
                vrnd: T.let[T.int64] = rnd
                for slot in T.serial(n_threads):
                    with T.sblock("round_slot"):
                        vslot = T.axis.remap("S", [slot])
                        T.reads()
                        T.writes()
                        S = T.sblock_alloc_buffer((Br, Bc), F32)  # raw dot products
                        X = T.sblock_alloc_buffer((Br, Bc), F32) if k.has_mods else S  # modded scores
                        P = T.sblock_alloc_buffer((Br, Bc), F32)
                        dP = T.sblock_alloc_buffer((Br, Bc), F32)
                        dS = T.sblock_alloc_buffer((Br, Bc), F32)
                        # P and dS as product inputs: pairs of rows (dV, dK) and rows (dQ) in bf16
                        Pw = T.sblock_alloc_buffer((Br // 2, Bc), U32) if fmt.packed else P
                        dSw = T.sblock_alloc_buffer((Br // 2, Bc), U32) if fmt.packed else dS
                        dSb = T.sblock_alloc_buffer((Br, Bc), U16) if fmt.packed else dS
                        dKrun = T.sblock_alloc_buffer(k.kv_tile, F32)  # this task's share
                        dVrun = T.sblock_alloc_buffer(k.kv_tile, F32)
                        # one query tile's share (formats that accumulate add into the task's directly)
                        dKtile = dKrun if fmt.accumulates else T.sblock_alloc_buffer((Bc, D), F32)
                        dVtile = dVrun if fmt.accumulates else T.sblock_alloc_buffer((Bc, D), F32)
                        dQtile = T.sblock_alloc_buffer((Br, D), F32)
                        row_stats = T.sblock_alloc_buffer((3, Br), F32)  # lse hi, lse lo, Delta
                        # The task's indices and the tile's state go through a small buffer, not let
                        # bindings: TVM's simplifier carries let values into every region analysis
                        # below, and compiling took minutes (DEVELOPING.md).
                        state = T.sblock_alloc_buffer((2,), I64)  # tile state; whether the key tile got work
                        at = T.sblock_alloc_buffer((4,), I64)  # kv head, sequence, J, I
                        # a block of kv heads per slot, or dealt out cyclically (common.slot_task)
                        for e in T.serial(slot_task_count(vslot, Hk, ctx.key_super_tiles_total(), n_threads)):
                            task = T.meta_var(slot_task(vslot, e, Hk, ctx.key_super_tiles_total(), n_threads,
                                                        heads_outer=True))
                            at[0] = task[0]
                            # super tiles rotate by kv head: under causal masks the busy tasks of a round
                            # are the low J, which would otherwise land on the same slots for every head
                            at[1] = i64(ctx.k_super_seq[(task[1] + at[0]) % ctx.key_super_tiles_total()])
                            at[2] = (task[1] + at[0]) % ctx.key_super_tiles_total() - ctx.column(
                                at[1], plan.K_SUPER0)
                            hk: T.let[T.int64] = at[0]
                            b: T.let[T.int64] = at[1]
                            J: T.let[T.int64] = at[2]
                            seq = T.meta_var(ctx.sequence(b))
                            q_supers: T.let[T.int64] = ceildiv(seq.q_tiles, super_tile)
                            supers: T.let[T.int64] = T.max(q_supers, ceildiv(seq.k_tiles, super_tile))
                            at[3] = (J + vrnd) % supers
                            I: T.let[T.int64] = at[3]
                            if vrnd < supers and I < q_supers:
                                for jj in T.serial(super_tile):  # key tile j of J
                                    kt: T.let[T.int64] = J * super_tile + jj
                                    if kt < seq.k_tiles:
                                        k0: T.let[T.int64] = kt * Bc
                                        gk: T.let[T.int64] = seq.column(plan.K_TILE0) + kt
                                        krow: T.let[T.int64] = gk * Bc
                                        init_dkv(dKrun, dVrun)
                                        # added into dKacc/dVacc only if the round has work for this key
                                        # tile (most rounds have none under windows and causal masks)
                                        state[1] = T.int64(0)
                                        for g in T.serial(H // Hk):  # query head h of the GQA group
                                            h: T.let[T.int64] = hk * (H // Hk) + g
                                            for ii in T.serial(super_tile):  # query tile i of I
                                                qt: T.let[T.int64] = I * super_tile + ii
                                                q0: T.let[T.int64] = qt * Br
                                                qrow: T.let[T.int64] = (seq.column(plan.Q_TILE0) + qt) * Br
                                                state[0] = T.if_then_else(
                                                    qt < seq.q_tiles, ctx.tile_state(seq, h, q0, k0), T.int64(EMPTY))
                                                if state[0] != EMPTY:
                                                    state[1] = T.int64(1)
                                                    recompute_probs(P, S, X, row_stats, RowStats, Qp, KTp,
                                                                    softmax_scale, seq, h, hk, q0, k0, qrow, gk,
                                                                    state[0])
                                                    if fmt.packed:
                                                        pack_p(Pw, P)
                                                    grad_v("dv", dVtile, dVrun, Pw, dOw, h, qrow)
                                                    grad_scores_(dS, dP, P, S, VTp, dOp, row_stats, partials,
                                                                 softmax_scale, vslot, seq, h, hk, q0, k0, qrow, gk)
                                                    if fmt.packed:
                                                        pack_ds(dSw, dSb, dS)
                                                    grad_k("dk", dKtile, dKrun, dSw, Qw, h, qrow)
                                                    accumulate_dq(dQtile, dQacc, dSb, Kp, h, hk, qrow, krow)
                                        if state[1] == 1:
                                            update_dkv(dKacc, dVacc, dKrun, dVrun, hk, gk)
            for h, t in T.grid(H, ctx.query_tiles_total()):
                with T.sblock("store_dq_tile"):
                    vh, vt = T.axis.remap("SS", [h, t])
                    T.reads()
                    T.writes()
                    store_dq(dQ, dQacc, softmax_scale, ctx.bind_tile_rows("q", vt), vh, vt)
            for hk, t in T.grid(Hk, ctx.key_tiles_total()):
                with T.sblock("store_dkv_tile"):
                    vhk, vt = T.axis.remap("SS", [hk, t])
                    T.reads()
                    T.writes()
                    store_dkv(dK, dV, dKacc, dVacc, softmax_scale, ctx.bind_tile_rows("k", vt), vhk, vt)
        if has_grads:
            sum_mod_grads(ctx, partials, n_threads)

    return k.declare_helpers(flash_bwd)


def _grad_elements(spec: AttentionSpec) -> int:
    """Elements of every captured tensor's gradient together (at least 1: a buffer's size)."""
    return max(sum(math.prod(i.shape) for i in spec.grad_inputs), 1)


def sum_mod_grads(ctx: CPUContext, partials, n_threads) -> None:
    """Each captured tensor's gradient: the slots' partials summed in slot order (emitted with
    the IR builder: one loop nest per tensor)."""
    offsets = ctx.grad_offsets()
    for name, grad in ctx.grad_buffers.items():
        with T.grid(grad.shape[0], n_threads) as (x, s):
            with T.sblock(f"sum_{name}_grad"):
                vx, vs = T.axis.remap("SR", [x, s])
                with T.init():
                    T.buffer_store(grad, T.float32(0), [vx])
                T.buffer_store(grad, grad[vx] + partials[vs, vx + offsets[name]], [vx])


def fused_kernel(kernel: str, spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    """The fused "forward" or "backward" kernel."""
    return (fused_forward if kernel == "forward" else fused_backward)(spec, cfg)
