"""The rows whose softmax is uniform over all keys (``tvmflash/uniform_rows.py``), as two CPU
kernels in TensorIR: eager's output and gradients of left padding's query rows.

transformers' ``eager`` gives a query row whose every key its mask hides a softmax uniform over
all n keys of the layer: P_rj = 1 / n, the output the mean of v, and softmax's Jacobian at that
P for the gradients. With u_j = v_j - mean(v): dS_rj = dO_r . u_j / n. Such rows are a span of
query positions ``first .. first + R - 1`` of every batch row with a 0/1 weight per (batch row,
span row): ``W[b, r] = 1`` where the row's softmax is uniform, 0 where the flash kernels own it
(rows with 0 are skipped, and batch rows without a 1 altogether).
Each head of a GQA group is a row of its kv head. Per (batch row b, kv head hk)::

    uniform_means(v, out_span, W, 1/n):
      for (b, hk) in parallel:
        mean = sum_j v_j / n                                          (fp32)
        out_r += mean                  at every row r of the span with W != 0, each head of hk

    uniform_grads(q, k, v, dout_span, W, dq, dk, dv, first, scale/n, 1/n):
      for (b, hk) in parallel:
        mean = sum_j v_j / n,  s[d] = sum_r dO_r[d]                   (rows r with W != 0, fp32)
        R' = the rows' count (each head of hk's group a row)
        if 3 R' n < 2 D (R' + n) and R' <= ROWS_THROUGH_SCORES:       [through the scores]
          for each key j:
            for each row r:  ds = dO_r . u_j;  dk_acc += ds q_r;  dq_acc[r] += ds k_j
            dk_j += scale/n dk_acc          dv_j += s / n
          for each row r:    dq_r += scale/n dq_acc[r]
        else:                                                         [head_dim x head_dim products]
          M[e, d] = sum_j u_j[e] k_j[d],  A^T[e, d] = sum_r dO_r[e] q_r[d]     (D x D, fp32)
          for each key j:    dk_j += scale/n A u_j          dv_j += s / n
          for each row r:    dq_r += scale/n M^T dO_r

The D x D products cost O((rows + keys) D^2), 4 D^2 (R' + n) FLOPs against the scores' 6 R' n D:
long sequences take them, a few rows or keys the scores (6 padding rows of a GQA group of 4 at 16
keys, D 64: 4.4x fewer FLOPs; the kernel 1.6x faster), whose dq sums for at most
ROWS_THROUGH_SCORES rows stay in the task's buffer, dk's in registers, so that each gradient is
still rounded once. Either way one launch instead of ~15 torch ops (whose cost at a few tens of
tokens is per op, not per FLOP: DEVELOPING.md). Sums in fp32; each gradient is read, added to
and rounded to its dtype once (rule 3). Softcap's derivative weighs each score: it keeps the
torch formulation (``uniform_rows.py``).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import io_buffer

F32 = "float32"
ROWS_THROUGH_SCORES = 64  # (three rows x head_dim fp32 buffers per task: 48 KB at head dim 64)
LANES = 16  # rows of one dS vector


def uniform_kernels(spec: AttentionSpec) -> dict[str, tirx.PrimFunc]:
    """``uniform_means`` and ``uniform_grads`` for the spec's head dim and dtype."""
    D, dtype = spec.head_dim, spec.dtype
    E = 4 if D % 4 == 0 else 1  # rows of a product held in registers at a time

    def f32(x):
        return T.Cast(F32, x)

    def cast(x):
        return T.Cast(dtype, x)

    @T.macro
    def mean_of_v(mean, V, b, hk, N, inv_n):
        """mean = sum_j v_j / n over the keys of (b, hk), in fp32 (both kernels start with it)."""
        for d in T.vectorized(D):
            mean[d] = T.float32(0)
        for j in range(N):
            for d in T.vectorized(D):
                mean[d] = mean[d] + f32(V[b, j, hk, d])
        for d in T.vectorized(D):
            mean[d] = mean[d] * inv_n

    @T.macro
    def count_uniform_rows(count, W, b, R):
        """count[0] = the rows of batch row b's span with W != 0 (0: nothing to add there)."""
        count[0] = T.float32(0)
        for r in range(R):
            count[0] = count[0] + W[b, r]

    @T.macro
    def grads_through_products(Q, K, V, dO, W, dQ, dK, dV, mean, s, b, hk, G, R, N, first, alpha, inv_n):
        """dq, dk, dv through M = U^T K and A = Q^T dO (head_dim x head_dim), E rows at a time."""
        acc = T.decl_buffer((E, D), F32)  # register tile: E rows of a product
        M = T.decl_buffer((D, D), F32)  # M[e, d] = sum_j u_j[e] k_j[d]
        At = T.decl_buffer((D, D), F32)  # A^T[e, d] = sum_r dO_r[e] q_r[d]
        for e0 in range(D // E):
            for ei in T.unroll(E):
                for d in T.vectorized(D):
                    acc[ei, d] = T.float32(0)
            for j in range(N):
                for ei in T.unroll(E):
                    for d in T.vectorized(D):
                        acc[ei, d] = acc[ei, d] + (f32(V[b, j, hk, e0 * E + ei]) - mean[e0 * E + ei]) * f32(
                            K[b, j, hk, d])
            for ei in T.unroll(E):
                for d in T.vectorized(D):
                    M[e0 * E + ei, d] = acc[ei, d]
                    acc[ei, d] = T.float32(0)
            for r, g in T.grid(R, G):
                if W[b, r] != T.float32(0):
                    for ei in T.unroll(E):
                        for d in T.vectorized(D):
                            acc[ei, d] = acc[ei, d] + f32(dO[b, r, hk * G + g, e0 * E + ei]) * f32(
                                Q[b, first + r, hk * G + g, d])
            for ei in T.unroll(E):
                for d in T.vectorized(D):
                    At[e0 * E + ei, d] = acc[ei, d]
        # dk_j += scale/n A u_j, dv_j += s / n
        for j in range(N):
            for d in T.vectorized(D):
                acc[0, d] = T.float32(0)
            for e in range(D):
                for d in T.vectorized(D):
                    acc[0, d] = acc[0, d] + (f32(V[b, j, hk, e]) - mean[e]) * At[e, d]
            for d in T.vectorized(D):
                dK[b, j, hk, d] = cast(f32(dK[b, j, hk, d]) + alpha * acc[0, d])
                dV[b, j, hk, d] = cast(f32(dV[b, j, hk, d]) + s[d] * inv_n)
        # dq_r += scale/n M^T dO_r at the uniform rows
        for r, g in T.grid(R, G):
            if W[b, r] != T.float32(0):
                for d in T.vectorized(D):
                    acc[0, d] = T.float32(0)
                for e in range(D):
                    for d in T.vectorized(D):
                        acc[0, d] = acc[0, d] + f32(dO[b, r, hk * G + g, e]) * M[e, d]
                for d in T.vectorized(D):
                    dQ[b, first + r, hk * G + g, d] = cast(f32(dQ[b, first + r, hk * G + g, d]) + alpha * acc[0, d])

    @T.macro
    def grads_through_scores(Q, K, V, dO, W, dQ, dK, dV, mean, s, b, hk, G, R, N, first, alpha, inv_n):
        """dq, dk, dv through each score's dS = dO_r . u_j, key by key: the uniform rows gathered
        first (dO transposed, so that a key's dS for 16 rows is one vector: no horizontal sums;
        q in fp32), dk_j's sum over the rows in registers, the rows' dq sums in the task's buffer."""
        dOt = T.decl_buffer((D, ROWS_THROUGH_SCORES), F32)  # dOt[d, row] (rows past the count: 0)
        qs = T.decl_buffer((ROWS_THROUGH_SCORES, D), F32)
        dq_acc = T.decl_buffer((ROWS_THROUGH_SCORES, D), F32)
        u = T.decl_buffer((D,), F32)  # u_j = v_j - mean
        k32 = T.decl_buffer((D,), F32)
        dk_acc = T.decl_buffer((D,), F32)
        ds = T.decl_buffer((ROWS_THROUGH_SCORES,), F32)
        count = T.decl_buffer((1,), "int32")  # the uniform rows gathered so far
        count[0] = 0
        for r, g in T.grid(R, G):
            if W[b, r] != T.float32(0):
                for d in T.vectorized(D):
                    dOt[d, count[0]] = f32(dO[b, r, hk * G + g, d])
                    qs[count[0], d] = f32(Q[b, first + r, hk * G + g, d])
                    dq_acc[count[0], d] = T.float32(0)
                count[0] = count[0] + 1
        blocks: T.let[T.int32] = (count[0] + LANES - 1) // LANES
        for d, i in T.grid(D, blocks * LANES - count[0]):  # (the last block's rows past the count: dS 0)
            dOt[d, count[0] + i] = T.float32(0)
        for j in range(N):
            for d in T.vectorized(D):
                u[d] = f32(V[b, j, hk, d]) - mean[d]
                k32[d] = f32(K[b, j, hk, d])
                dk_acc[d] = T.float32(0)
            for c in range(blocks):  # dS of the rows, LANES at a time
                for l in T.vectorized(LANES):
                    ds[c * LANES + l] = T.float32(0)
                for d in range(D):
                    for l in T.vectorized(LANES):
                        ds[c * LANES + l] = ds[c * LANES + l] + dOt[d, c * LANES + l] * u[d]
            for i in range(count[0]):
                for d in T.vectorized(D):
                    dk_acc[d] = dk_acc[d] + ds[i] * qs[i, d]
                    dq_acc[i, d] = dq_acc[i, d] + ds[i] * k32[d]
            for d in T.vectorized(D):
                dK[b, j, hk, d] = cast(f32(dK[b, j, hk, d]) + alpha * dk_acc[d])
                dV[b, j, hk, d] = cast(f32(dV[b, j, hk, d]) + s[d] * inv_n)
        count[0] = 0
        for r, g in T.grid(R, G):
            if W[b, r] != T.float32(0):
                for d in T.vectorized(D):
                    dQ[b, first + r, hk * G + g, d] = cast(f32(dQ[b, first + r, hk * G + g, d])
                                                           + alpha * dq_acc[count[0], d])
                count[0] = count[0] + 1

    @T.prim_func
    def uniform_means(v_h: T.handle, o_h: T.handle, w_h: T.handle, inv_n: T.float32):
        T.func_attr({"global_symbol": "uniform_means", "tirx.noalias": True})
        B = T.int64()
        N = T.int64()
        Hk = T.int64()
        R = T.int64()
        H = T.int64()
        V = io_buffer(v_h, (B, N, Hk, D), dtype, "sv")
        O = io_buffer(o_h, (B, R, H, D), dtype, "so")  # the span's rows of the output
        W = T.match_buffer(w_h, (B, R), F32)
        for t in T.parallel(B * Hk):  # (kv head outer: the threads' contiguous chunks then mix short and long spans)
            b: T.let[T.int64] = t % B
            hk: T.let[T.int64] = t // B
            G: T.let[T.int64] = H // Hk
            count = T.decl_buffer((1,), F32)
            count_uniform_rows(count, W, b, R)
            if count[0] != T.float32(0):
                mean = T.decl_buffer((D,), F32)
                mean_of_v(mean, V, b, hk, N, inv_n)
                for r, g in T.grid(R, G):
                    if W[b, r] != T.float32(0):
                        for d in T.vectorized(D):
                            O[b, r, hk * G + g, d] = cast(f32(O[b, r, hk * G + g, d]) + mean[d])

    @T.prim_func
    def uniform_grads(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, w_h: T.handle, dq_h: T.handle,
                      dk_h: T.handle, dv_h: T.handle, first: T.int64, alpha: T.float32, inv_n: T.float32):
        T.func_attr({"global_symbol": "uniform_grads", "tirx.noalias": True})
        B = T.int64()
        Nq = T.int64()
        N = T.int64()
        H = T.int64()
        Hk = T.int64()
        R = T.int64()
        Q = io_buffer(q_h, (B, Nq, H, D), dtype, "sq")
        K = io_buffer(k_h, (B, N, Hk, D), dtype, "sk")
        V = io_buffer(v_h, (B, N, Hk, D), dtype, "sv")
        dO = io_buffer(do_h, (B, R, H, D), dtype, "sdo")  # the span's rows of dO
        W = T.match_buffer(w_h, (B, R), F32)
        dQ = io_buffer(dq_h, (B, Nq, H, D), dtype, "sdq")
        dK = io_buffer(dk_h, (B, N, Hk, D), dtype, "sdk")
        dV = io_buffer(dv_h, (B, N, Hk, D), dtype, "sdv")
        for t in T.parallel(B * Hk):  # (kv head outer: the threads' contiguous chunks then mix short and long spans)
            b: T.let[T.int64] = t % B
            hk: T.let[T.int64] = t // B
            G: T.let[T.int64] = H // Hk
            count = T.decl_buffer((1,), F32)
            count_uniform_rows(count, W, b, R)
            if count[0] != T.float32(0):
                mean = T.decl_buffer((D,), F32)
                s = T.decl_buffer((D,), F32)  # sum of the rows' dO
                # mean of v; s = sum of the uniform rows' dO
                mean_of_v(mean, V, b, hk, N, inv_n)
                for d in T.vectorized(D):
                    s[d] = T.float32(0)
                for r, g in T.grid(R, G):
                    if W[b, r] != T.float32(0):
                        for d in T.vectorized(D):
                            s[d] = s[d] + f32(dO[b, r, hk * G + g, d])
                rows: T.let[T.float32] = count[0] * T.Cast(F32, G)  # R': each head of the group a row
                keys: T.let[T.float32] = T.Cast(F32, N)
                if rows <= T.float32(ROWS_THROUGH_SCORES) and T.float32(3) * rows * keys < T.float32(2 * D) * (rows + keys):
                    grads_through_scores(Q, K, V, dO, W, dQ, dK, dV, mean, s, b, hk, G, R, N, first, alpha, inv_n)
                else:
                    grads_through_products(Q, K, V, dO, W, dQ, dK, dV, mean, s, b, hk, G, R, N, first, alpha, inv_n)

    return {"uniform_means": uniform_means, "uniform_grads": uniform_grads}
