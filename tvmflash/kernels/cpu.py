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

    [pack_kv]   Kp, Vp = K, V as product operands, each sequence zero-padded to whole key tiles
    for slot in parallel(n_threads):                                          [slot]
      for task (query head h, query tile) = slot, slot + n_threads, ...       (cyclic: balanced)
        [load_q] QT = query tile, transposed         [init_o, init_stats] OT = 0, m = -inf, l = 0
        for each key tile the window (and block mask) leaves non-empty:
          [scores]       ST = K_tile . QT                     raw dot products
          [score_mod]    ST = score_mods(ST * scale, ...)     if the spec has any
          [mask]         ST = -inf where masked               only on partly masked tiles
          [row_max]      m_next = max(m, max_j ST * c)        log2 units: c = scale * log2(e),
          [rescale]      alpha = 2^(m - m_next)                 or log2(e) after score mods
          [probs]        PT = 2^(ST * c - m_next)             0 where ST = -inf
          [pack_p]       PTw = PT rounded to bf16             bf16 products only
          [pv]           PVT = V_tile^T . PTw
          [update_o]     OT = OT * alpha + PVT
          [row_sum]      l_tile = sum_j PT
          [update_stats] m = m_next, l = l * alpha + l_tile
        [store_o]   out = OT / l (cast once)     [store_lse]  lse = (m + log2 l) ln 2 (float64, once)

Backward ``flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, window_left,
window_right, n_threads, n_rounds, super_tile, seq_table, q_tile_seq, k_tile_seq, k_super_seq,
*mod_inputs, *mod_input_grads, [tile_state])``::

    [pack_q_do]   Qp, dOp (, Qw, dOw) = Q, dO as product operands, zero-padded to whole query tiles
    [delta, lse_log2]  per query row: Delta = rowsum(dO * O); LSE * log2(e) as fp32 hi + lo
    [zero_dq, zero_dkv, zero_mod_grads]   fp32 accumulators = 0
    for round r in range(n_rounds):                         no two tasks of a round share rows
      for slot in parallel(n_threads):                                        [round_slot]
        for task (kv head, key super tile J) = slot, slot + n_threads, ...:
          I = (J + r) mod M  (M: super tiles of the sequence; a super tile = super_tile tiles)
          for key tile j of J:
            (K_j, K_j^T, V_j^T packed as product operands once per key tile: [pack_k, pack_kt, pack_vt])
            [init_dkv] the task's dK_j, dV_j sums = 0; [update_dkv] after the loop below adds
            them into dKacc_j, dVacc_j, only if some tile (i, j) of the round was not empty
            for query head h of the kv head's GQA group, query tile i of I, tile (i, j) not empty:
              [load_row_stats]
              [scores]      S = Q_i . K_j^T         P is recomputed once (rule 2) and
              [score_mod]   X = score_mods(S * scale)      everything comes from it
              [mask]        X = -inf where masked
              [probs]       P = 2^(X * c - LSE)
              [pack_p]      Pw = P rounded to bf16                        bf16 products only
              [dv] [update_dv]   dVacc_j += Pw^T . dO_i
              [dprobs]      dP = dO_i . V_j^T
              [dscores]     dS = P (dP - Delta)   [dscores_mod]  dS *= d score_mods / d S
              [mod_grads]   captured-tensor gradients += upstream terms (into the slot's partial)
              [pack_ds]     dSw, dSb = dS rounded to bf16 (pairs of rows, rows)   bf16 products only
              [dk] [update_dk]   dKacc_j += dSw^T . Q_i
              [dq] [update_dq]   dQacc_i += dSb . K_j
    [store_dq]  dq = dQacc * scale    [store_dkv]  dk = dKacc * scale, dv = dVacc    (cast once)
    [sum_mod_grads]   captured-tensor gradients = the slots' partials, summed in slot order

Rounds (``plan.py``): in round r key super tile J meets query super tile (J + r) mod M, so every
query row and key row is updated by one task per round, in an order fixed by the problem: no
races, results bitwise independent of the thread count, and scratch memory of a few fp32 copies
of q and k at any thread count.

Products (``config.products``): with fp32 FMAs (``fp32_fma``) the operands are fp32 copies and
the packs only convert and pad; with bf16 dot products (``bf16_dot``, bf16 inputs on CPUs with
AVX512-BF16) they stay bf16: bits of rows (uint16) where a product reads pairs along a row,
pair words (uint32, ``pair_words.py``) where it reads pairs of rows, and every product block
reduces over pairs ``(q, t)``, the form of the ``vdpbf16ps`` intrinsic it is tensorized into
(``schedules/llvm_bf16.py``). P and dS are rounded to bf16 (round to nearest even) only as
product inputs, as FlashAttention does on GPUs; their fp32 values feed the row sums and dS.

All accumulators and row statistics are fp32 (rule 3). The forward keeps tiles transposed (query index innermost),
so the row statistics are plain vector operations. Products sum one tile into a fresh partial
and ``update_*`` stages add it to the running accumulator: error ~ block + N / block ulps
instead of N. In-place stages (``update_*``, ``mask``, ``score_mod``, ``dscores_mod``) are plain
loops that LLVM vectorizes (TensorIR's ``vectorize`` refuses blocks that read and write one
buffer). Each stage sits in an opaque wrapper block under a unit loop: TVM 0.27 needs a "stage
pipeline" parent for ``cache_write``/``decompose_reduction`` and copies loops, not blocks, on
write (DEVELOPING.md).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T

from .. import plan
from ..attention_te import (
    FLT_MAX,
    LOG2E,
    NEG_INF,
    exp2,
    grad_scores,
    in_window,
    masked_log2_exponent,
    lse_from_raw_max,
    lse_log2_parts,
    normalizer,
    shifted_log2_exponent,
)
from ..config import BF16_DOT, CPUKernelConfig
from ..pair_words import bf16_bits, bits_value, half, pair_word, rounded_bits, rounded_pair_word
from ..score_mods import ModContext, declare_inputs, emitters, exponent_constant, kernel_argument
from ..spec import AttentionSpec

F32 = "float32"
BF16 = "bfloat16"
U16, U32 = "uint16", "uint32"  # bf16 bits and pair words (pair_words.py)
I64 = "int64"
# Tile states: block masks store them per tile (int8); the window mask is computed.
EMPTY, PARTIAL, FULL = 0, 1, 2


def _i64(x):
    return tirx.Cast(I64, x)


def _ceildiv(a, b):
    return (a + b - 1) // b


class KernelArgs:
    """The arguments beyond the tensors and scalars that every kernel has: the sequence table
    (and tile maps) of ``plan.py``, the mod inputs of the spec, their gradients and the block
    mask. ``declare`` adds them to the prim_func being parsed (their number depends on the
    spec); the helpers below turn them into index expressions."""

    def __init__(self, spec: AttentionSpec, cfg: CPUKernelConfig, backward: bool):
        self.spec, self.backward = spec, backward
        self.block_q, self.block_k = cfg.block_q, cfg.block_k
        self.mod_buffers: dict = {}
        self.grad_buffers: dict = {}

    _buffer = staticmethod(kernel_argument)

    def declare(self, heads) -> None:
        """Called once inside the kernel body, after its own parameters."""
        n_seq, tq, tk = (tirx.Var(n, I64) for n in ("n_seq", "query_tiles", "key_tiles"))
        self.table = self._buffer("seq_table", (n_seq, plan.TABLE_COLUMNS), "int32")
        self.q_tile_seq = self._buffer("q_tile_seq", (tq,), "int32")
        self.k_tile_seq = self._buffer("k_tile_seq", (tk,), "int32")
        if self.backward:
            self.k_super_seq = self._buffer("k_super_seq", (tirx.Var("key_super_tiles", I64),), "int32")
        self.mod_buffers, self.grad_buffers = declare_inputs(self.spec, grads=self.backward)
        if self.spec.block_sparse:
            dims = tuple(tirx.Var(n, I64) for n in ("mask_batch", "mask_heads", "mask_q_tiles", "mask_k_tiles"))
            self.tile_states = self._buffer("tile_state", dims, "int8")
            if not self.backward:
                self.kv_range = self._buffer("kv_range", (*dims[:3], 2), "int32")
        self.heads = heads

    # --- sequences -------------------------------------------------------------------------
    def col(self, b, column: int):
        return _i64(self.table[b, column])

    def query_tiles(self):
        return self.q_tile_seq.shape[0]

    def key_tiles(self):
        return self.k_tile_seq.shape[0]

    def key_super_tiles(self):
        return self.k_super_seq.shape[0]

    def q_seq(self, tile):
        return _i64(self.q_tile_seq[tile])

    def k_seq(self, tile):
        return _i64(self.k_tile_seq[tile])

    def q_len(self, b):
        return self.col(b, plan.Q_LEN)

    def k_len(self, b):
        return self.col(b, plan.K_LEN)

    def q_tiles(self, b):
        return _ceildiv(self.q_len(b), self.block_q)

    def k_tiles(self, b):
        return _ceildiv(self.k_len(b), self.block_k)

    # --- masks ---------------------------------------------------------------------------------
    def tile_state(self, b, h, q0, k0, window):
        """EMPTY, PARTIAL or FULL for the tile at query rows q0..., keys k0... of sequence b."""
        q_len, k_len = self.q_len(b), self.k_len(b)
        left, right = window
        off = self.col(b, plan.DIAGONAL)
        q_last = tirx.min(q0 + self.block_q, q_len) - 1
        k_last = tirx.min(k0 + self.block_k, k_len) - 1
        # Integer arithmetic rather than Select: TVM's simplifier treats every Select condition as
        # a constraint to analyse, which made compiling these kernels take minutes.
        seen = _i64(tirx.all(q_last + off + right >= k0, q0 + off - left <= k_last))
        # Full needs whole tiles: a ragged tile's padding rows and keys are masked too.
        full = _i64(tirx.all(q0 + self.block_q <= q_len, k0 + self.block_k <= k_len,
                             k0 + self.block_k - 1 <= q0 + off + right, k0 >= q0 + self.block_q - 1 + off - left))
        state = seen * (PARTIAL + full)  # EMPTY 0, PARTIAL 1, FULL 2
        if not self.spec.block_sparse:
            return state
        stored = _i64(self.tile_states[self._mask_at(b, h, q0 // self.block_q, k0 // self.block_k)])
        # As empty as either mask makes it; full only if both leave it full.
        return tirx.min(state, stored)

    def _mask_at(self, b, h, *rest):
        dims = self.tile_states.shape
        return (tirx.min(b, dims[0] - 1), tirx.min(h, dims[1] - 1), *rest)

    def key_tile_range(self, b, h, q0, window):
        """Key tiles [first, end) that hold a key some row of the query tile at q0 sees."""
        q_len = self.q_len(b)
        left, right = window
        off = self.col(b, plan.DIAGONAL)
        first = tirx.max((q0 + off - left) // self.block_k, 0)
        end = tirx.min((tirx.min(q0 + self.block_q, q_len) - 1 + off + right) // self.block_k + 1, self.k_tiles(b))
        if self.spec.block_sparse:
            qt = q0 // self.block_q
            first = tirx.max(first, _i64(self.kv_range[self._mask_at(b, h, qt, 0)]))
            end = tirx.min(end, _i64(self.kv_range[self._mask_at(b, h, qt, 1)]))
        return first, tirx.max(end, first)

    def visible(self, b, h, q, k, window):
        """Element mask of a partly masked tile: window, sequence ends, mask_mod."""
        keep = tirx.all(q < self.q_len(b), in_window(q, k, self.k_len(b), self.col(b, plan.DIAGONAL), *window))
        if self.spec.mask_mod is None:
            return keep
        return tirx.all(keep, self.mods.mask(self.context(b, h, q, k)))

    # --- score mods ----------------------------------------------------------------------------
    @property
    def mods(self):
        return emitters(self.spec)

    def context(self, b, h, q, k) -> ModContext:
        return ModContext(b, h, q, k, self.col(b, plan.DIAGONAL), self.mod_buffers)

    def modded(self, s, b, h, q, k):
        return self.mods.score(s, self.context(b, h, q, k))

    def modded_grad(self, s, b, h, q, k):
        return self.mods.score_grad(s, self.context(b, h, q, k))

    def grad_offsets(self) -> dict[str, int]:
        """Where each captured tensor's gradient starts in a slot's row of the partials buffer."""
        offsets, at = {}, 0
        for i in self.spec.grad_inputs:
            offsets[i.name], at = at, at + math.prod(i.shape)
        return offsets

    def scatter_mod_grads(self, partials, slot, s, b, h, q, k, upstream) -> None:
        """Emit partials[slot, offset + index] += value for each captured tensor requiring grad."""
        offsets = self.grad_offsets()
        for name, flat, value in self.mods.flat_captured_grads(s, self.context(b, h, q, k), upstream):
            at = flat + offsets[name]
            T.buffer_store(partials, partials[slot, at] + value, [slot, at])


def _exponent_scale(spec: AttentionSpec, softmax_scale):
    """c of 2^((x - max) * c) as float64: x is the raw dot product without score mods (the scale
    folds into c), the modded natural-log score with them."""
    return (tirx.const(1.0, "float64") if spec.score_mods else tirx.Cast("float64", softmax_scale)) * tirx.const(
        LOG2E, "float64")


def _bf16_products(spec: AttentionSpec, cfg: CPUKernelConfig) -> bool:
    """Whether the kernel's products are bf16 dot products (config.products)."""
    if cfg.products != BF16_DOT:
        return False
    if spec.dtype != BF16 or spec.head_dim % 8:
        raise ValueError(f"bf16_dot products need bfloat16 inputs, got {spec.dtype} (head dim {spec.head_dim})")
    return True


def _cyclic_count(slot, tasks, n_threads):
    """Tasks slot, slot + n_threads, ... below ``tasks``."""
    return tirx.max(_ceildiv(tasks - slot, n_threads), 0)


def fused_forward(spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    D, Br, Bc, dtype, out_dtype = spec.head_dim, cfg.block_q, cfg.block_k, spec.dtype, spec.out_dtype
    elem, out_elem = DataType(dtype).bits // 8, DataType(out_dtype).bits // 8
    has_mods = bool(spec.score_mods)
    bf16 = _bf16_products(spec, cfg)
    pair = 2 if bf16 else 1  # reduction elements per operand word
    args = KernelArgs(spec, cfg, backward=False)

    # --- the operands of the products, and the products: fp32 FMAs -----------------------------
    @T.macro
    def pack_kv_fp32(Kp: T.Buffer, Vp: T.Buffer, K: T.Buffer, V: T.Buffer, k_batch: T.int64, k_start: T.int64,
                     k0: T.int64, k_len: T.int64, hk: T.int64, t: T.int64):
        for j, d in T.grid(Bc, D):
            with T.sblock("pack_kv"):
                vj, vd = T.axis.remap("SS", [j, d])
                Kp[hk, t * Bc + vj, vd] = T.if_then_else(
                    k0 + vj < k_len, T.Cast(F32, K[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, vd]),
                    T.float32(0))
                Vp[hk, t * Bc + vj, vd] = T.if_then_else(
                    k0 + vj < k_len, T.Cast(F32, V[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, vd]),
                    T.float32(0))

    @T.macro
    def load_q_fp32(QT: T.Buffer, Q: T.Buffer, q_batch: T.int64, q_start: T.int64, q0: T.int64, q_len: T.int64,
                    h: T.int64):
        for unit in range(1):
            with T.sblock("load_q_tile"):
                for d, i in T.grid(D, Br):
                    with T.sblock("load_q"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        QT[vd, vi] = T.if_then_else(
                            q0 + vi < q_len, T.Cast(F32, Q[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, vd]),
                            T.float32(0))

    @T.macro
    def scores_fp32(ST: T.Buffer, Kp: T.Buffer, QT: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("scores_tile"):
                for j, i, d in T.grid(Bc, Br, D):
                    with T.sblock("scores"):
                        vj, vi, vd = T.axis.remap("SSR", [j, i, d])
                        with T.init():
                            ST[vj, vi] = T.float32(0)
                        ST[vj, vi] = ST[vj, vi] + Kp[hk, krow + vj, vd] * QT[vd, vi]

    @T.macro
    def pv_fp32(PVT: T.Buffer, Vp: T.Buffer, PT: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("pv_tile"):
                for d, i, j in T.grid(D, Br, Bc):
                    with T.sblock("pv"):
                        vd, vi, vj = T.axis.remap("SSR", [d, i, j])
                        with T.init():
                            PVT[vd, vi] = T.float32(0)
                        PVT[vd, vi] = PVT[vd, vi] + Vp[hk, krow + vj, vd] * PT[vj, vi]

    # --- ... and bf16 dot products: reductions in pairs (q, t), B operands as pair words ------
    @T.macro
    def pack_kv_bf16(Kp: T.Buffer, Vp: T.Buffer, K: T.Buffer, V: T.Buffer, k_batch: T.int64, k_start: T.int64,
                     k0: T.int64, k_len: T.int64, hk: T.int64, t: T.int64):
        for j, d in T.grid(Bc, D):
            with T.sblock("pack_k"):  # K's bits, zero-padded
                vj, vd = T.axis.remap("SS", [j, d])
                Kp[hk, t * Bc + vj, vd] = T.if_then_else(
                    k0 + vj < k_len, bf16_bits(K[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, vd]), T.uint16(0))
        for p, d in T.grid(Bc // 2, D):
            with T.sblock("pack_v"):  # V as pair words of rows 2p, 2p + 1
                vp, vd = T.axis.remap("SS", [p, d])
                Vp[hk, t * (Bc // 2) + vp, vd] = pair_word(
                    T.if_then_else(k0 + 2 * vp < k_len,
                                   bf16_bits(V[k_batch, k_start + T.min(k0 + 2 * vp, k_len - 1), hk, vd]), T.uint16(0)),
                    T.if_then_else(k0 + 2 * vp + 1 < k_len,
                                   bf16_bits(V[k_batch, k_start + T.min(k0 + 2 * vp + 1, k_len - 1), hk, vd]),
                                   T.uint16(0)))

    @T.macro
    def load_q_bf16(QT: T.Buffer, Q: T.Buffer, q_batch: T.int64, q_start: T.int64, q0: T.int64, q_len: T.int64,
                    h: T.int64):
        for unit in range(1):
            with T.sblock("load_q_tile"):
                for p, i in T.grid(D // 2, Br):
                    with T.sblock("load_q"):  # pair words of elements 2p, 2p + 1 of each query row
                        vp, vi = T.axis.remap("SS", [p, i])
                        QT[vp, vi] = T.if_then_else(q0 + vi < q_len, pair_word(
                            bf16_bits(Q[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, 2 * vp]),
                            bf16_bits(Q[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, 2 * vp + 1])), T.uint32(0))

    @T.macro
    def scores_bf16(ST: T.Buffer, Kp: T.Buffer, QT: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("scores_tile"):
                for j, i, q, t in T.grid(Bc, Br, D // 2, 2):
                    with T.sblock("scores"):
                        vj, vi, vq, vt = T.axis.remap("SSRR", [j, i, q, t])
                        with T.init():
                            ST[vj, vi] = T.float32(0)
                        ST[vj, vi] = ST[vj, vi] + bits_value(Kp[hk, krow + vj, 2 * vq + vt]) * half(QT[vq, vi], vt)

    @T.macro
    def pack_p(PTw: T.Buffer, PT: T.Buffer):
        for unit in range(1):
            with T.sblock("pack_p_tile"):
                for q, i in T.grid(Bc // 2, Br):
                    with T.sblock("pack_p"):  # P rounded to bf16 as a product input only (rule 3)
                        vq, vi = T.axis.remap("SS", [q, i])
                        PTw[vq, vi] = rounded_pair_word(PT[2 * vq, vi], PT[2 * vq + 1, vi])

    @T.macro
    def pv_bf16(PVT: T.Buffer, Vp: T.Buffer, PTw: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("pv_tile"):
                for d, i, q, t in T.grid(D, Br, Bc // 2, 2):
                    with T.sblock("pv"):
                        vd, vi, vq, vt = T.axis.remap("SSRR", [d, i, q, t])
                        with T.init():
                            PVT[vd, vi] = T.float32(0)
                        PVT[vd, vi] = PVT[vd, vi] + half(Vp[hk, krow // 2 + vq, vd], vt) * half(PTw[vq, vi], vt)

    pack_kv, load_q, scores, pv = ((pack_kv_bf16, load_q_bf16, scores_bf16, pv_bf16) if bf16
                                   else (pack_kv_fp32, load_q_fp32, scores_fp32, pv_fp32))

    # --- softmax and accumulators ------------------------------------------------------------

    @T.macro
    def init_tile(OT: T.Buffer, m: T.Buffer, l: T.Buffer):
        for unit in range(1):
            with T.sblock("init_o_tile"):
                for d, i in T.grid(D, Br):
                    with T.sblock("init_o"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        OT[vd, vi] = T.float32(0)
        for unit in range(1):
            with T.sblock("init_stats_tile"):
                for i in T.serial(Br):
                    with T.sblock("init_stats"):
                        vi = T.axis.remap("S", [i])
                        # not -inf: 2^(-inf - m) must be 0 for masked scores before a row sees any key
                        m[vi] = T.float32(-FLT_MAX)
                        l[vi] = T.float32(0)

    @T.macro
    def score_mod(ST: T.Buffer, scale: T.float32, b: T.int64, h: T.int64, q0: T.int64, k0: T.int64):
        for unit in range(1):
            with T.sblock("score_mod_tile"):
                for j, i in T.grid(Bc, Br):
                    with T.sblock("score_mod"):
                        vj, vi = T.axis.remap("SS", [j, i])
                        ST[vj, vi] = args.modded(ST[vj, vi] * scale, b, h, q0 + vi, k0 + vj)

    @T.macro
    def mask(ST: T.Buffer, b: T.int64, h: T.int64, q0: T.int64, k0: T.int64, window_left: T.int64,
             window_right: T.int64):
        for unit in range(1):
            with T.sblock("mask_tile"):
                for j, i in T.grid(Bc, Br):
                    with T.sblock("mask"):
                        vj, vi = T.axis.remap("SS", [j, i])
                        ST[vj, vi] = T.Select(args.visible(b, h, q0 + vi, k0 + vj, (window_left, window_right)),
                                              ST[vj, vi], T.float32(NEG_INF))

    @T.macro
    def online_softmax(ST: T.Buffer, PT: T.Buffer, m: T.Buffer, m_next: T.Buffer, alpha: T.Buffer,
                       c_hi: T.float32, c_lo: T.float32):
        for unit in range(1):
            with T.sblock("row_max_tile"):
                for j, i in T.grid(Bc, Br):
                    with T.sblock("row_max"):
                        vj, vi = T.axis.remap("RS", [j, i])
                        with T.init():
                            m_next[vi] = m[vi]
                        m_next[vi] = T.max(m_next[vi], ST[vj, vi])  # of raw scores (c > 0)
        for unit in range(1):
            with T.sblock("rescale_tile"):
                for i in T.serial(Br):
                    with T.sblock("rescale"):
                        vi = T.axis.remap("S", [i])
                        # Equal maxima (also both -inf: nothing seen yet) rescale by exactly 1.
                        alpha[vi] = T.Select(m[vi] == m_next[vi], T.float32(1),
                                             exp2(shifted_log2_exponent(m[vi], m_next[vi], (c_hi, c_lo))))
        for unit in range(1):
            with T.sblock("probs_tile"):
                for j, i in T.grid(Bc, Br):
                    with T.sblock("probs"):
                        vj, vi = T.axis.remap("SS", [j, i])
                        PT[vj, vi] = exp2(shifted_log2_exponent(ST[vj, vi], m_next[vi], (c_hi, c_lo)))

    @T.macro
    def accumulate(OT: T.Buffer, PVT: T.Buffer, PT: T.Buffer, m: T.Buffer, m_next: T.Buffer, l: T.Buffer,
                   l_tile: T.Buffer, alpha: T.Buffer):
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

    @T.macro
    def store(O: T.Buffer, LSE: T.Buffer, OT: T.Buffer, m: T.Buffer, l: T.Buffer, scale_log2: T.float64,
              q_batch: T.int64, q_start: T.int64, q0: T.int64, q_len: T.int64, h: T.int64):
        for i, d in T.grid(Br, D):
            with T.sblock("store_o"):
                vi, vd = T.axis.remap("SS", [i, d])
                if q0 + vi < q_len:
                    O[q_batch, q_start + q0 + vi, h, vd] = T.Cast(out_dtype, OT[vd, vi] * normalizer(l[vi]))
        for i in T.serial(Br):
            with T.sblock("store_lse"):
                vi = T.axis.remap("S", [i])
                if q0 + vi < q_len:
                    LSE[q_batch, h, q_start + q0 + vi] = lse_from_raw_max(m[vi], scale_log2, l[vi])

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
        sq = (T.int64(), T.int64(), T.int64())
        sk = (T.int64(), T.int64(), T.int64())
        sv = (T.int64(), T.int64(), T.int64())
        so = (T.int64(), T.int64(), T.int64())
        # Strided views (q, k, v sliced from a packed qkv) are read in place; only the head dim
        # must be contiguous. align = element size: no alignment is assumed.
        Q = T.match_buffer(q_h, (Bq, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (Bk, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (Bk, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        O = T.match_buffer(o_h, (Bq, Nq, H, D), out_dtype, strides=(*so, 1), align=out_elem)
        LSE = T.match_buffer(lse_h, (Bq, H, Nq), F32, align=4)
        args.declare(H)
        # K (rows) and V (pairs of rows with bf16 products), zero-padded to whole key tiles
        Kp = T.alloc_buffer((Hk, args.key_tiles() * Bc, D), U16 if bf16 else F32)
        Vp = T.alloc_buffer((Hk, args.key_tiles() * (Bc // pair), D), U32 if bf16 else F32)
        for hk, t in T.grid(Hk, args.key_tiles()):
            with T.sblock("pack_kv_tile"):
                vhk, vt = T.axis.remap("SS", [hk, t])
                T.reads()
                T.writes()
                b: T.let[T.int64] = args.k_seq(vt)
                k0: T.let[T.int64] = (vt - args.col(b, plan.K_TILE0)) * Bc
                k_len: T.let[T.int64] = args.k_len(b)
                k_batch: T.let[T.int64] = args.col(b, plan.K_BATCH)
                k_start: T.let[T.int64] = args.col(b, plan.K_START)
                pack_kv(Kp, Vp, K, V, k_batch, k_start, k0, k_len, vhk, vt)
        for slot in T.serial(n_threads):
            with T.sblock("slot"):
                vslot = T.axis.remap("S", [slot])
                T.reads()
                T.writes()
                QT = T.sblock_alloc_buffer((D // pair, Br), U32 if bf16 else F32)  # query tile, transposed
                ST = T.sblock_alloc_buffer((Bc, Br), F32)  # scores, transposed
                PT = T.sblock_alloc_buffer((Bc, Br), F32)  # unnormalized probabilities
                PTw = T.sblock_alloc_buffer((Bc // 2, Br), U32) if bf16 else PT  # P as the input of PV
                OT = T.sblock_alloc_buffer((D, Br), F32)  # output accumulator
                PVT = T.sblock_alloc_buffer((D, Br), F32)  # this key tile's P V
                m = T.sblock_alloc_buffer((Br,), F32)  # running row max (log2 units)
                m_next = T.sblock_alloc_buffer((Br,), F32)
                l = T.sblock_alloc_buffer((Br,), F32)  # running denominator
                l_tile = T.sblock_alloc_buffer((Br,), F32)
                alpha = T.sblock_alloc_buffer((Br,), F32)  # 2^(m - m_next)
                # The task's indices, the key-tile range and the tile's state go through small
                # buffers, not let bindings: TVM's simplifier carries let values into every region
                # analysis below, and compiling took minutes (DEVELOPING.md).
                state = T.sblock_alloc_buffer((3,), I64)  # tile state, first and end key tile
                at = T.sblock_alloc_buffer((2,), I64)  # query head, sequence
                for e in T.serial(_cyclic_count(vslot, H * args.query_tiles(), n_threads)):
                    at[0] = (vslot + e * n_threads) // args.query_tiles()
                    at[1] = args.q_seq((vslot + e * n_threads) % args.query_tiles())
                    h: T.let[T.int64] = at[0]
                    hk: T.let[T.int64] = h // (H // Hk)
                    b: T.let[T.int64] = at[1]
                    q0: T.let[T.int64] = ((vslot + e * n_threads) % args.query_tiles() - args.col(b, plan.Q_TILE0)) * Br
                    q_len: T.let[T.int64] = args.q_len(b)
                    load_q(QT, Q, args.col(b, plan.Q_BATCH), args.col(b, plan.Q_START), q0, q_len, h)
                    init_tile(OT, m, l)
                    state[1] = args.key_tile_range(b, h, q0, (window_left, window_right))[0]
                    state[2] = args.key_tile_range(b, h, q0, (window_left, window_right))[1]
                    for kt in T.serial(state[1], state[2]):
                        k0: T.let[T.int64] = kt * Bc
                        krow: T.let[T.int64] = (args.col(b, plan.K_TILE0) + kt) * Bc
                        state[0] = args.tile_state(b, h, q0, k0, (window_left, window_right))
                        if state[0] != EMPTY:
                            scores(ST, Kp, QT, hk, krow)
                            if has_mods:
                                score_mod(ST, T.Cast(F32, softmax_scale), b, h, q0, k0)
                            if state[0] == PARTIAL:
                                mask(ST, b, h, q0, k0, window_left, window_right)
                            online_softmax(ST, PT, m, m_next, alpha, exponent_constant(spec, softmax_scale)[0],
                                           exponent_constant(spec, softmax_scale)[1])
                            if bf16:
                                pack_p(PTw, PT)
                            pv(PVT, Vp, PTw, hk, krow)
                            accumulate(OT, PVT, PT, m, m_next, l, l_tile, alpha)
                    store(O, LSE, OT, m, l, _exponent_scale(spec, softmax_scale), args.col(b, plan.Q_BATCH),
                          args.col(b, plan.Q_START), q0, q_len, h)

    return flash_fwd


def fused_backward(spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    D, Br, Bc, dtype, out_dtype = spec.head_dim, cfg.block_q, cfg.block_k, spec.dtype, spec.out_dtype
    elem, out_elem = DataType(dtype).bits // 8, DataType(out_dtype).bits // 8
    has_mods = bool(spec.score_mods)
    grad_inputs = spec.grad_inputs
    has_grads = bool(grad_inputs)
    grad_elements = max(sum(math.prod(i.shape) for i in grad_inputs), 1)
    bf16 = _bf16_products(spec, cfg)
    pair = 2 if bf16 else 1  # reduction elements per operand word
    args = KernelArgs(spec, cfg, backward=True)

    # --- the operands of the products, and the products: fp32 FMAs -----------------------------
    # Operands: Qp, dOp (rows of Q, dO), Qw, dOw (the same as B operands: pairs of rows with bf16
    # products), Kp (rows of K for dQ), KTp, VTp (K^T, V^T per key tile), Pw, dSw, dSb (P and dS
    # as product inputs). With fp32 FMAs: fp32 copies, Qw/dOw/Pw/dSw/dSb are Qp/dOp/P/dS.
    @T.macro
    def pack_q_do_fp32(Qp: T.Buffer, dOp: T.Buffer, Qw: T.Buffer, dOw: T.Buffer, Q: T.Buffer, dO: T.Buffer,
                       q_batch: T.int64, q_start: T.int64, q0: T.int64, q_len: T.int64, h: T.int64, t: T.int64):
        for i, d in T.grid(Br, D):
            with T.sblock("pack_q_do"):
                vi, vd = T.axis.remap("SS", [i, d])
                Qp[h, t * Br + vi, vd] = T.if_then_else(
                    q0 + vi < q_len, T.Cast(F32, Q[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, vd]), T.float32(0))
                dOp[h, t * Br + vi, vd] = T.if_then_else(
                    q0 + vi < q_len, T.Cast(F32, dO[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, vd]),
                    T.float32(0))

    @T.macro
    def pack_k_v_fp32(Kp: T.Buffer, KTp: T.Buffer, VTp: T.Buffer, K: T.Buffer, V: T.Buffer, k_batch: T.int64,
                      k_start: T.int64, k0: T.int64, k_len: T.int64, hk: T.int64, t: T.int64):
        for j, d in T.grid(Bc, D):
            with T.sblock("pack_k"):
                vj, vd = T.axis.remap("SS", [j, d])
                Kp[hk, t * Bc + vj, vd] = T.if_then_else(
                    k0 + vj < k_len, T.Cast(F32, K[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, vd]),
                    T.float32(0))
        for d, j in T.grid(D, Bc):
            with T.sblock("pack_kt"):
                vd, vj = T.axis.remap("SS", [d, j])
                KTp[hk, t, vd, vj] = Kp[hk, t * Bc + vj, vd]
        for d, j in T.grid(D, Bc):
            with T.sblock("pack_vt"):
                vd, vj = T.axis.remap("SS", [d, j])
                VTp[hk, t, vd, vj] = T.if_then_else(
                    k0 + vj < k_len, T.Cast(F32, V[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, vd]),
                    T.float32(0))

    @T.macro
    def scores_fp32(S: T.Buffer, Qp: T.Buffer, KTp: T.Buffer, h: T.int64, hk: T.int64, qrow: T.int64, gk: T.int64):
        for unit in range(1):
            with T.sblock("scores_tile"):
                for i, j, d in T.grid(Br, Bc, D):
                    with T.sblock("scores"):
                        vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                        with T.init():
                            S[vi, vj] = T.float32(0)
                        S[vi, vj] = S[vi, vj] + Qp[h, qrow + vi, vd] * KTp[hk, gk, vd, vj]

    @T.macro
    def dv_fp32(dVtile: T.Buffer, P: T.Buffer, dOp: T.Buffer, h: T.int64, qrow: T.int64):
        for unit in range(1):
            with T.sblock("dv_tile"):
                for j, d, i in T.grid(Bc, D, Br):
                    with T.sblock("dv"):
                        vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                        with T.init():
                            dVtile[vj, vd] = T.float32(0)
                        dVtile[vj, vd] = dVtile[vj, vd] + P[vi, vj] * dOp[h, qrow + vi, vd]

    @T.macro
    def dprobs_fp32(dP: T.Buffer, dOp: T.Buffer, VTp: T.Buffer, h: T.int64, hk: T.int64, qrow: T.int64, gk: T.int64):
        for unit in range(1):
            with T.sblock("dprobs_tile"):
                for i, j, d in T.grid(Br, Bc, D):
                    with T.sblock("dprobs"):
                        vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                        with T.init():
                            dP[vi, vj] = T.float32(0)
                        dP[vi, vj] = dP[vi, vj] + dOp[h, qrow + vi, vd] * VTp[hk, gk, vd, vj]

    @T.macro
    def dk_fp32(dKtile: T.Buffer, dS: T.Buffer, Qp: T.Buffer, h: T.int64, qrow: T.int64):
        for unit in range(1):
            with T.sblock("dk_tile"):
                for j, d, i in T.grid(Bc, D, Br):
                    with T.sblock("dk"):
                        vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                        with T.init():
                            dKtile[vj, vd] = T.float32(0)
                        dKtile[vj, vd] = dKtile[vj, vd] + dS[vi, vj] * Qp[h, qrow + vi, vd]

    @T.macro
    def dq_fp32(dQtile: T.Buffer, dS: T.Buffer, Kp: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("dq_tile"):
                for i, d, j in T.grid(Br, D, Bc):
                    with T.sblock("dq"):
                        vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                        with T.init():
                            dQtile[vi, vd] = T.float32(0)
                        dQtile[vi, vd] = dQtile[vi, vd] + dS[vi, vj] * Kp[hk, krow + vj, vd]

    # --- ... and bf16 dot products: reductions in pairs (q, t); A operands as bf16 bits or pair
    # words, B operands as pair words --------------------------------------------------------
    @T.macro
    def pack_q_do_bf16(Qp: T.Buffer, dOp: T.Buffer, Qw: T.Buffer, dOw: T.Buffer, Q: T.Buffer, dO: T.Buffer,
                       q_batch: T.int64, q_start: T.int64, q0: T.int64, q_len: T.int64, h: T.int64, t: T.int64):
        for i, d in T.grid(Br, D):
            with T.sblock("pack_q_do"):  # their bits, zero-padded
                vi, vd = T.axis.remap("SS", [i, d])
                Qp[h, t * Br + vi, vd] = T.if_then_else(
                    q0 + vi < q_len, bf16_bits(Q[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, vd]), T.uint16(0))
                dOp[h, t * Br + vi, vd] = T.if_then_else(
                    q0 + vi < q_len, bf16_bits(dO[q_batch, q_start + T.min(q0 + vi, q_len - 1), h, vd]), T.uint16(0))
        for p, d in T.grid(Br // 2, D):
            with T.sblock("pack_q_do_pairs"):  # pair words of rows 2p, 2p + 1
                vp, vd = T.axis.remap("SS", [p, d])
                Qw[h, t * (Br // 2) + vp, vd] = pair_word(Qp[h, t * Br + 2 * vp, vd], Qp[h, t * Br + 2 * vp + 1, vd])
                dOw[h, t * (Br // 2) + vp, vd] = pair_word(dOp[h, t * Br + 2 * vp, vd],
                                                           dOp[h, t * Br + 2 * vp + 1, vd])

    @T.macro
    def pack_k_v_bf16(Kp: T.Buffer, KTp: T.Buffer, VTp: T.Buffer, K: T.Buffer, V: T.Buffer, k_batch: T.int64,
                      k_start: T.int64, k0: T.int64, k_len: T.int64, hk: T.int64, t: T.int64):
        for p, d in T.grid(Bc // 2, D):
            with T.sblock("pack_k"):  # pair words of rows 2p, 2p + 1
                vp, vd = T.axis.remap("SS", [p, d])
                Kp[hk, t * (Bc // 2) + vp, vd] = pair_word(
                    T.if_then_else(k0 + 2 * vp < k_len,
                                   bf16_bits(K[k_batch, k_start + T.min(k0 + 2 * vp, k_len - 1), hk, vd]), T.uint16(0)),
                    T.if_then_else(k0 + 2 * vp + 1 < k_len,
                                   bf16_bits(K[k_batch, k_start + T.min(k0 + 2 * vp + 1, k_len - 1), hk, vd]),
                                   T.uint16(0)))
        for p, j in T.grid(D // 2, Bc):
            with T.sblock("pack_kt"):  # pair words of elements 2p, 2p + 1 of each key row
                vp, vj = T.axis.remap("SS", [p, j])
                KTp[hk, t, vp, vj] = T.if_then_else(k0 + vj < k_len, pair_word(
                    bf16_bits(K[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, 2 * vp]),
                    bf16_bits(K[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, 2 * vp + 1])), T.uint32(0))
        for p, j in T.grid(D // 2, Bc):
            with T.sblock("pack_vt"):
                vp, vj = T.axis.remap("SS", [p, j])
                VTp[hk, t, vp, vj] = T.if_then_else(k0 + vj < k_len, pair_word(
                    bf16_bits(V[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, 2 * vp]),
                    bf16_bits(V[k_batch, k_start + T.min(k0 + vj, k_len - 1), hk, 2 * vp + 1])), T.uint32(0))

    @T.macro
    def scores_bf16(S: T.Buffer, Qp: T.Buffer, KTp: T.Buffer, h: T.int64, hk: T.int64, qrow: T.int64, gk: T.int64):
        for unit in range(1):
            with T.sblock("scores_tile"):
                for i, j, q, t in T.grid(Br, Bc, D // 2, 2):
                    with T.sblock("scores"):
                        vi, vj, vq, vt = T.axis.remap("SSRR", [i, j, q, t])
                        with T.init():
                            S[vi, vj] = T.float32(0)
                        S[vi, vj] = S[vi, vj] + bits_value(Qp[h, qrow + vi, 2 * vq + vt]) * half(KTp[hk, gk, vq, vj], vt)

    @T.macro
    def pack_p(Pw: T.Buffer, P: T.Buffer):
        for unit in range(1):
            with T.sblock("pack_p_tile"):
                for q, j in T.grid(Br // 2, Bc):
                    with T.sblock("pack_p"):  # P rounded to bf16 as a product input only (rule 3)
                        vq, vj = T.axis.remap("SS", [q, j])
                        Pw[vq, vj] = rounded_pair_word(P[2 * vq, vj], P[2 * vq + 1, vj])

    @T.macro
    def dv_bf16(dVtile: T.Buffer, Pw: T.Buffer, dOw: T.Buffer, h: T.int64, qrow: T.int64):
        for unit in range(1):
            with T.sblock("dv_tile"):
                for j, d, q, t in T.grid(Bc, D, Br // 2, 2):
                    with T.sblock("dv"):
                        vj, vd, vq, vt = T.axis.remap("SSRR", [j, d, q, t])
                        with T.init():
                            dVtile[vj, vd] = T.float32(0)
                        dVtile[vj, vd] = dVtile[vj, vd] + half(Pw[vq, vj], vt) * half(dOw[h, qrow // 2 + vq, vd], vt)

    @T.macro
    def dprobs_bf16(dP: T.Buffer, dOp: T.Buffer, VTp: T.Buffer, h: T.int64, hk: T.int64, qrow: T.int64, gk: T.int64):
        for unit in range(1):
            with T.sblock("dprobs_tile"):
                for i, j, q, t in T.grid(Br, Bc, D // 2, 2):
                    with T.sblock("dprobs"):
                        vi, vj, vq, vt = T.axis.remap("SSRR", [i, j, q, t])
                        with T.init():
                            dP[vi, vj] = T.float32(0)
                        dP[vi, vj] = dP[vi, vj] + bits_value(dOp[h, qrow + vi, 2 * vq + vt]) * half(
                            VTp[hk, gk, vq, vj], vt)

    @T.macro
    def pack_ds(dSw: T.Buffer, dSb: T.Buffer, dS: T.Buffer):
        for unit in range(1):
            with T.sblock("pack_ds_tile"):  # dS rounded to bf16 as a product input only (rule 3)
                for q, j in T.grid(Br // 2, Bc):
                    with T.sblock("pack_ds_pairs"):  # for dK: pairs of rows
                        vq, vj = T.axis.remap("SS", [q, j])
                        dSw[vq, vj] = rounded_pair_word(dS[2 * vq, vj], dS[2 * vq + 1, vj])
                for i, j in T.grid(Br, Bc):
                    with T.sblock("pack_ds"):  # for dQ: rows
                        vi, vj = T.axis.remap("SS", [i, j])
                        dSb[vi, vj] = rounded_bits(dS[vi, vj])

    @T.macro
    def dk_bf16(dKtile: T.Buffer, dSw: T.Buffer, Qw: T.Buffer, h: T.int64, qrow: T.int64):
        for unit in range(1):
            with T.sblock("dk_tile"):
                for j, d, q, t in T.grid(Bc, D, Br // 2, 2):
                    with T.sblock("dk"):
                        vj, vd, vq, vt = T.axis.remap("SSRR", [j, d, q, t])
                        with T.init():
                            dKtile[vj, vd] = T.float32(0)
                        dKtile[vj, vd] = dKtile[vj, vd] + half(dSw[vq, vj], vt) * half(Qw[h, qrow // 2 + vq, vd], vt)

    @T.macro
    def dq_bf16(dQtile: T.Buffer, dSb: T.Buffer, Kp: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("dq_tile"):
                for i, d, q, t in T.grid(Br, D, Bc // 2, 2):
                    with T.sblock("dq"):
                        vi, vd, vq, vt = T.axis.remap("SSRR", [i, d, q, t])
                        with T.init():
                            dQtile[vi, vd] = T.float32(0)
                        dQtile[vi, vd] = dQtile[vi, vd] + bits_value(dSb[vi, 2 * vq + vt]) * half(
                            Kp[hk, krow // 2 + vq, vd], vt)

    pack_q_do, pack_k_v, scores, dv, dprobs, dk, dq = (
        (pack_q_do_bf16, pack_k_v_bf16, scores_bf16, dv_bf16, dprobs_bf16, dk_bf16, dq_bf16) if bf16
        else (pack_q_do_fp32, pack_k_v_fp32, scores_fp32, dv_fp32, dprobs_fp32, dk_fp32, dq_fp32))

    # --- the tile-pair stages --------------------------------------------------------------------
    @T.macro
    def recompute_probs(P: T.Buffer, S: T.Buffer, X: T.Buffer, row_stats: T.Buffer, RowStats: T.Buffer,
                        Qp: T.Buffer, KTp: T.Buffer, softmax_scale: T.float64, b: T.int64, h: T.int64, hk: T.int64,
                        q0: T.int64, k0: T.int64, qrow: T.int64, gk: T.int64, state: T.int64, window_left: T.int64,
                        window_right: T.int64):
        for unit in range(1):
            with T.sblock("load_row_stats_tile"):
                for r, i in T.grid(3, Br):
                    with T.sblock("load_row_stats"):
                        vr, vi = T.axis.remap("SS", [r, i])
                        row_stats[vr, vi] = RowStats[h, vr, qrow + vi]
        scores(S, Qp, KTp, h, hk, qrow, gk)
        if has_mods:
            for unit in range(1):
                with T.sblock("score_mod_tile"):
                    for i, j in T.grid(Br, Bc):
                        with T.sblock("score_mod"):
                            vi, vj = T.axis.remap("SS", [i, j])
                            X[vi, vj] = args.modded(S[vi, vj] * T.Cast(F32, softmax_scale), b, h, q0 + vi, k0 + vj)
        if state == PARTIAL:
            for unit in range(1):
                with T.sblock("mask_tile"):
                    for i, j in T.grid(Br, Bc):
                        with T.sblock("mask"):
                            vi, vj = T.axis.remap("SS", [i, j])
                            X[vi, vj] = T.Select(args.visible(b, h, q0 + vi, k0 + vj, (window_left, window_right)),
                                                 X[vi, vj], T.float32(NEG_INF))
        for unit in range(1):
            with T.sblock("probs_tile"):
                for i, j in T.grid(Br, Bc):
                    with T.sblock("probs"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        P[vi, vj] = exp2(masked_log2_exponent(
                            X[vi, vj], exponent_constant(spec, softmax_scale), (row_stats[0, vi], row_stats[1, vi])))

    @T.macro
    def accumulate_dv(dVtile: T.Buffer, dVrun: T.Buffer, Pw: T.Buffer, dOw: T.Buffer, h: T.int64, qrow: T.int64):
        dv(dVtile, Pw, dOw, h, qrow)
        for unit in range(1):
            with T.sblock("update_dv_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dVrun[vj, vd] = dVrun[vj, vd] + dVtile[vj, vd]

    @T.macro
    def grad_scores_stage(dS: T.Buffer, dP: T.Buffer, P: T.Buffer, S: T.Buffer, VTp: T.Buffer, dOp: T.Buffer,
                          row_stats: T.Buffer, partials: T.Buffer, softmax_scale: T.float64, slot: T.int64,
                          b: T.int64, h: T.int64, hk: T.int64, q0: T.int64, k0: T.int64, qrow: T.int64, gk: T.int64):
        dprobs(dP, dOp, VTp, h, hk, qrow, gk)
        for unit in range(1):
            with T.sblock("dscores_tile"):
                for i, j in T.grid(Br, Bc):
                    with T.sblock("dscores"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        dS[vi, vj] = grad_scores(P[vi, vj], dP[vi, vj], row_stats[2, vi])
        if has_grads:
            for i, j in T.grid(Br, Bc):  # scatter-adds: a plain serial loop
                with T.sblock("mod_grads"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    if P[vi, vj] != T.float32(0):
                        args.scatter_mod_grads(partials, slot, S[vi, vj] * T.Cast(F32, softmax_scale), b, h,
                                               q0 + vi, k0 + vj, dS[vi, vj])
        if has_mods:
            for unit in range(1):
                with T.sblock("dscores_mod_tile"):
                    for i, j in T.grid(Br, Bc):
                        with T.sblock("dscores_mod"):
                            vi, vj = T.axis.remap("SS", [i, j])
                            # masked and underflowed entries have dS = 0: keep it 0 even where the
                            # mods' derivative is not finite there
                            dS[vi, vj] = T.Select(dS[vi, vj] == T.float32(0), T.float32(0), dS[vi, vj] * args.modded_grad(
                                S[vi, vj] * T.Cast(F32, softmax_scale), b, h, q0 + vi, k0 + vj))

    @T.macro
    def accumulate_dk_dq(dKtile: T.Buffer, dKrun: T.Buffer, dQtile: T.Buffer, dQacc: T.Buffer, dSw: T.Buffer,
                         dSb: T.Buffer, Qw: T.Buffer, Kp: T.Buffer, h: T.int64, hk: T.int64, qrow: T.int64,
                         krow: T.int64):
        dk(dKtile, dSw, Qw, h, qrow)
        for unit in range(1):
            with T.sblock("update_dk_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dk"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dKrun[vj, vd] = dKrun[vj, vd] + dKtile[vj, vd]
        dq(dQtile, dSb, Kp, hk, krow)
        for unit in range(1):
            with T.sblock("update_dq_tile"):
                for i, d in T.grid(Br, D):
                    with T.sblock("update_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        dQacc[h, qrow + vi, vd] = dQacc[h, qrow + vi, vd] + dQtile[vi, vd]

    @T.macro
    def init_dkv(dKrun: T.Buffer, dVrun: T.Buffer):
        for unit in range(1):
            with T.sblock("init_dkv_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("init_dkv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dKrun[vj, vd] = T.float32(0)
                        dVrun[vj, vd] = T.float32(0)

    @T.macro
    def update_dkv(dKacc: T.Buffer, dVacc: T.Buffer, dKrun: T.Buffer, dVrun: T.Buffer, hk: T.int64, krow: T.int64):
        for unit in range(1):
            with T.sblock("update_dkv_tile"):
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dk_acc"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dKacc[hk, krow + vj, vd] = dKacc[hk, krow + vj, vd] + dKrun[vj, vd]
                for j, d in T.grid(Bc, D):
                    with T.sblock("update_dv_acc"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dVacc[hk, krow + vj, vd] = dVacc[hk, krow + vj, vd] + dVrun[vj, vd]

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
        sdo = (T.int64(), T.int64(), T.int64())
        sq = (T.int64(), T.int64(), T.int64())
        sk = (T.int64(), T.int64(), T.int64())
        sv = (T.int64(), T.int64(), T.int64())
        so = (T.int64(), T.int64(), T.int64())
        sdq = (T.int64(), T.int64(), T.int64())
        sdk = (T.int64(), T.int64(), T.int64())
        sdv = (T.int64(), T.int64(), T.int64())
        dO = T.match_buffer(do_h, (Bq, Nq, H, D), dtype, strides=(*sdo, 1), align=elem)
        Q = T.match_buffer(q_h, (Bq, Nq, H, D), dtype, strides=(*sq, 1), align=elem)
        K = T.match_buffer(k_h, (Bk, Nk, Hk, D), dtype, strides=(*sk, 1), align=elem)
        V = T.match_buffer(v_h, (Bk, Nk, Hk, D), dtype, strides=(*sv, 1), align=elem)
        O = T.match_buffer(o_h, (Bq, Nq, H, D), dtype, strides=(*so, 1), align=elem)
        LSE = T.match_buffer(lse_h, (Bq, H, Nq), F32, align=4)
        dQ = T.match_buffer(dq_h, (Bq, Nq, H, D), out_dtype, strides=(*sdq, 1), align=out_elem)
        dK = T.match_buffer(dk_h, (Bk, Nk, Hk, D), out_dtype, strides=(*sdk, 1), align=out_elem)
        dV = T.match_buffer(dv_h, (Bk, Nk, Hk, D), out_dtype, strides=(*sdv, 1), align=out_elem)
        args.declare(H)
        # Padded global rows: every sequence starts on a whole tile (plan.py). The operand layouts
        # the products read: fp32, or bf16 bits (U16) and pair words (U32) with bf16 products.
        Qp = T.decl_buffer((H, args.query_tiles() * Br, D), U16 if bf16 else F32)
        dOp = T.decl_buffer((H, args.query_tiles() * Br, D), U16 if bf16 else F32)
        Qw = T.decl_buffer((H, args.query_tiles() * (Br // 2), D), U32) if bf16 else Qp
        dOw = T.decl_buffer((H, args.query_tiles() * (Br // 2), D), U32) if bf16 else dOp
        # Per query row: LSE * log2(e) as fp32 hi + lo, and Delta = rowsum(dO * O).
        RowStats = T.decl_buffer((H, 3, args.query_tiles() * Br), F32)
        dQacc = T.decl_buffer((H, args.query_tiles() * Br, D), F32)
        # K (pairs of rows with bf16 products), K^T, V^T per key tile
        Kp = T.decl_buffer((Hk, args.key_tiles() * (Bc // pair), D), U32 if bf16 else F32)
        KTp = T.decl_buffer((Hk, args.key_tiles(), D // pair, Bc), U32 if bf16 else F32)
        VTp = T.decl_buffer((Hk, args.key_tiles(), D // pair, Bc), U32 if bf16 else F32)
        dKacc = T.decl_buffer((Hk, args.key_tiles() * Bc, D), F32)
        dVacc = T.decl_buffer((Hk, args.key_tiles() * Bc, D), F32)
        # each thread's partial gradients of captured tensors (summed in slot order at the end)
        partials = T.decl_buffer((n_threads, grad_elements), F32)
        for h, t in T.grid(H, args.query_tiles()):
            with T.sblock("prepare_q_tile"):
                vh, vt = T.axis.remap("SS", [h, t])
                T.reads()
                T.writes()
                b: T.let[T.int64] = args.q_seq(vt)
                q0: T.let[T.int64] = (vt - args.col(b, plan.Q_TILE0)) * Br
                q_len: T.let[T.int64] = args.q_len(b)
                q_batch: T.let[T.int64] = args.col(b, plan.Q_BATCH)
                q_start: T.let[T.int64] = args.col(b, plan.Q_START)
                pack_q_do(Qp, dOp, Qw, dOw, Q, dO, q_batch, q_start, q0, q_len, vh, vt)
                for i, d in T.grid(Br, D):
                    with T.sblock("delta"):
                        vi, vd = T.axis.remap("SR", [i, d])
                        with T.init():
                            RowStats[vh, 2, vt * Br + vi] = T.float32(0)
                        RowStats[vh, 2, vt * Br + vi] = RowStats[vh, 2, vt * Br + vi] + T.if_then_else(
                            q0 + vi < q_len, T.Cast(F32, dO[q_batch, q_start + T.min(q0 + vi, q_len - 1), vh, vd]) * T.Cast(
                                F32, O[q_batch, q_start + T.min(q0 + vi, q_len - 1), vh, vd]), T.float32(0))
                for i in T.serial(Br):
                    with T.sblock("lse_log2"):
                        vi = T.axis.remap("S", [i])
                        # rows that see no key (LSE -inf) get +inf: 2^(score - LSE) = 0 for all scores
                        RowStats[vh, 0, vt * Br + vi] = T.if_then_else(q0 + vi < q_len, T.Select(
                            LSE[q_batch, vh, q_start + T.min(q0 + vi, q_len - 1)] == T.float32(NEG_INF),
                            T.float32(-NEG_INF),
                            lse_log2_parts(LSE[q_batch, vh, q_start + T.min(q0 + vi, q_len - 1)])[0]), T.float32(0))
                        RowStats[vh, 1, vt * Br + vi] = T.if_then_else(q0 + vi < q_len, T.Select(
                            LSE[q_batch, vh, q_start + T.min(q0 + vi, q_len - 1)] == T.float32(NEG_INF), T.float32(0),
                            lse_log2_parts(LSE[q_batch, vh, q_start + T.min(q0 + vi, q_len - 1)])[1]), T.float32(0))
                for i, d in T.grid(Br, D):
                    with T.sblock("zero_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        dQacc[vh, vt * Br + vi, vd] = T.float32(0)
        for hk, t in T.grid(Hk, args.key_tiles()):
            with T.sblock("prepare_k_tile"):
                vhk, vt = T.axis.remap("SS", [hk, t])
                T.reads()
                T.writes()
                b: T.let[T.int64] = args.k_seq(vt)
                k0: T.let[T.int64] = (vt - args.col(b, plan.K_TILE0)) * Bc
                k_len: T.let[T.int64] = args.k_len(b)
                k_batch: T.let[T.int64] = args.col(b, plan.K_BATCH)
                k_start: T.let[T.int64] = args.col(b, plan.K_START)
                pack_k_v(Kp, KTp, VTp, K, V, k_batch, k_start, k0, k_len, vhk, vt)
                for j, d in T.grid(Bc, D):
                    with T.sblock("zero_dkv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dKacc[vhk, vt * Bc + vj, vd] = T.float32(0)
                        dVacc[vhk, vt * Bc + vj, vd] = T.float32(0)
        if has_grads:
            for s, x in T.grid(n_threads, partials.shape[1]):
                with T.sblock("zero_mod_grads"):
                    vs, vx = T.axis.remap("SS", [s, x])
                    partials[vs, vx] = T.float32(0)
        for rnd in T.serial(n_rounds):  # rounds run in order
            vrnd: T.let[T.int64] = rnd
            for slot in T.serial(n_threads):
                with T.sblock("round_slot"):
                    vslot = T.axis.remap("S", [slot])
                    T.reads()
                    T.writes()
                    S = T.sblock_alloc_buffer((Br, Bc), F32)  # raw dot products
                    X = T.sblock_alloc_buffer((Br, Bc), F32) if has_mods else S  # modded scores
                    P = T.sblock_alloc_buffer((Br, Bc), F32)
                    dP = T.sblock_alloc_buffer((Br, Bc), F32)
                    dS = T.sblock_alloc_buffer((Br, Bc), F32)
                    # P and dS as product inputs: pairs of rows (dV, dK) and rows (dQ) in bf16
                    Pw = T.sblock_alloc_buffer((Br // 2, Bc), U32) if bf16 else P
                    dSw = T.sblock_alloc_buffer((Br // 2, Bc), U32) if bf16 else dS
                    dSb = T.sblock_alloc_buffer((Br, Bc), U16) if bf16 else dS
                    dKtile = T.sblock_alloc_buffer((Bc, D), F32)  # one query tile's share
                    dVtile = T.sblock_alloc_buffer((Bc, D), F32)
                    dKrun = T.sblock_alloc_buffer((Bc, D), F32)  # this task's share
                    dVrun = T.sblock_alloc_buffer((Bc, D), F32)
                    dQtile = T.sblock_alloc_buffer((Br, D), F32)
                    row_stats = T.sblock_alloc_buffer((3, Br), F32)  # lse hi, lse lo, Delta
                    # The task's indices and the tile's state go through a small buffer, not let
                    # bindings: TVM's simplifier carries let values into every region analysis
                    # below, and compiling took minutes (DEVELOPING.md).
                    state = T.sblock_alloc_buffer((2,), I64)  # tile state; whether the key tile got work
                    at = T.sblock_alloc_buffer((4,), I64)  # kv head, sequence, J, I
                    for e in T.serial(_cyclic_count(vslot, Hk * args.key_super_tiles(), n_threads)):
                        at[0] = (vslot + e * n_threads) // args.key_super_tiles()
                        # super tiles rotate by kv head: under causal masks the busy tasks of a round
                        # are the low J, which would otherwise land on the same slots for every head
                        at[1] = _i64(args.k_super_seq[(vslot + e * n_threads + at[0]) % args.key_super_tiles()])
                        at[2] = (vslot + e * n_threads + at[0]) % args.key_super_tiles() - args.col(at[1], plan.K_SUPER0)
                        hk: T.let[T.int64] = at[0]
                        b: T.let[T.int64] = at[1]
                        J: T.let[T.int64] = at[2]
                        q_supers: T.let[T.int64] = _ceildiv(args.q_tiles(b), super_tile)
                        supers: T.let[T.int64] = T.max(q_supers, _ceildiv(args.k_tiles(b), super_tile))
                        at[3] = (J + vrnd) % supers
                        I: T.let[T.int64] = at[3]
                        if vrnd < supers and I < q_supers:
                            for jj in T.serial(super_tile):
                                kt: T.let[T.int64] = J * super_tile + jj
                                if kt < args.k_tiles(b):
                                    k0: T.let[T.int64] = kt * Bc
                                    gk: T.let[T.int64] = args.col(b, plan.K_TILE0) + kt
                                    krow: T.let[T.int64] = gk * Bc
                                    init_dkv(dKrun, dVrun)
                                    # added into dKacc/dVacc only if the round has work for this key
                                    # tile (most rounds have none under windows and causal masks)
                                    state[1] = T.int64(0)
                                    for g in T.serial(H // Hk):
                                        h: T.let[T.int64] = hk * (H // Hk) + g
                                        for ii in T.serial(super_tile):
                                            qt: T.let[T.int64] = I * super_tile + ii
                                            q0: T.let[T.int64] = qt * Br
                                            qrow: T.let[T.int64] = (args.col(b, plan.Q_TILE0) + qt) * Br
                                            state[0] = T.if_then_else(
                                                qt < args.q_tiles(b),
                                                args.tile_state(b, h, q0, k0, (window_left, window_right)),
                                                T.int64(EMPTY))
                                            if state[0] != EMPTY:
                                                state[1] = T.int64(1)
                                                recompute_probs(P, S, X, row_stats, RowStats, Qp, KTp, softmax_scale,
                                                                b, h, hk, q0, k0, qrow, gk, state[0], window_left,
                                                                window_right)
                                                if bf16:
                                                    pack_p(Pw, P)
                                                accumulate_dv(dVtile, dVrun, Pw, dOw, h, qrow)
                                                grad_scores_stage(dS, dP, P, S, VTp, dOp, row_stats, partials,
                                                                  softmax_scale, vslot, b, h, hk, q0, k0, qrow, gk)
                                                if bf16:
                                                    pack_ds(dSw, dSb, dS)
                                                accumulate_dk_dq(dKtile, dKrun, dQtile, dQacc, dSw, dSb, Qw, Kp, h, hk,
                                                                 qrow, krow)
                                    if state[1] == 1:
                                        update_dkv(dKacc, dVacc, dKrun, dVrun, hk, krow)
        for h, t in T.grid(H, args.query_tiles()):
            with T.sblock("store_dq_tile"):
                vh, vt = T.axis.remap("SS", [h, t])
                T.reads()
                T.writes()
                b: T.let[T.int64] = args.q_seq(vt)
                q0: T.let[T.int64] = (vt - args.col(b, plan.Q_TILE0)) * Br
                q_len: T.let[T.int64] = args.q_len(b)
                q_batch: T.let[T.int64] = args.col(b, plan.Q_BATCH)
                q_start: T.let[T.int64] = args.col(b, plan.Q_START)
                for i, d in T.grid(Br, D):
                    with T.sblock("store_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        if q0 + vi < q_len:
                            dQ[q_batch, q_start + q0 + vi, vh, vd] = T.Cast(
                                out_dtype, dQacc[vh, vt * Br + vi, vd] * T.Cast(F32, softmax_scale))
        for hk, t in T.grid(Hk, args.key_tiles()):
            with T.sblock("store_dkv_tile"):
                vhk, vt = T.axis.remap("SS", [hk, t])
                T.reads()
                T.writes()
                b: T.let[T.int64] = args.k_seq(vt)
                k0: T.let[T.int64] = (vt - args.col(b, plan.K_TILE0)) * Bc
                k_len: T.let[T.int64] = args.k_len(b)
                k_batch: T.let[T.int64] = args.col(b, plan.K_BATCH)
                k_start: T.let[T.int64] = args.col(b, plan.K_START)
                for j, d in T.grid(Bc, D):
                    with T.sblock("store_dkv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        if k0 + vj < k_len:
                            dK[k_batch, k_start + k0 + vj, vhk, vd] = T.Cast(
                                out_dtype, dKacc[vhk, vt * Bc + vj, vd] * T.Cast(F32, softmax_scale))
                            dV[k_batch, k_start + k0 + vj, vhk, vd] = T.Cast(out_dtype, dVacc[vhk, vt * Bc + vj, vd])
        if has_grads:
            sum_mod_grads(args, partials, n_threads)

    return flash_bwd


def sum_mod_grads(args: KernelArgs, partials, n_threads) -> None:
    """Each captured tensor's gradient: the slots' partials summed in slot order (emitted with
    the IR builder: one loop nest per tensor)."""
    offsets = args.grad_offsets()
    for name, grad in args.grad_buffers.items():
        with T.grid(grad.shape[0], n_threads) as (x, s):
            with T.sblock(f"sum_{name}_grad"):
                vx, vs = T.axis.remap("SR", [x, s])
                with T.init():
                    T.buffer_store(grad, T.float32(0), [vx])
                T.buffer_store(grad, grad[vx] + partials[vs, vx + offsets[name]], [vx])


def fused_kernel(kernel: str, spec: AttentionSpec, cfg: CPUKernelConfig) -> tirx.PrimFunc:
    """The fused "forward" or "backward" kernel."""
    return (fused_forward if kernel == "forward" else fused_backward)(spec, cfg)
