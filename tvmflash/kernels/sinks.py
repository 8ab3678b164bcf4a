"""Attention sinks (``tvmflash/sinks.py``) as two CPU kernels in TensorIR: the forward's rescale
of an attention's fp32 out and the sinks' gradient, each one launch where torch takes ~10 small
ops (~50 and ~75 us at 128 tokens: their cost is per op, not per element).

With a row's log-sum-exp ``lse`` (fp32) and its head's sink logit ``s`` (rows i, heads h)::

    sink_rescale(out32, lse, sinks, real, out, lse_out):
      for (b, i) in parallel, head h:
        real row:    out[b, i, h]  = cast(out32[b, i, h] * sigmoid(lse - s))      (fp32, cast once)
                     lse_out[b, h, i] = logaddexp(lse, s)
        padding row: out = 0, lse_out = s          (the sink takes the whole weight, as eager's)

    sink_gradient(dout, out, lse_out, sinks, dsinks):
      for h in parallel:
        acc[d] = sum over (b, i) of exp(s - lse_out[b, h, i]) * dout[b, i, h, d] * out[b, i, h, d]
        dsinks[h] = -sum_d acc[d]             (= -sum_i P(sink)_i Delta_i, fp32 throughout)

``sigmoid(lse - s) = exp(lse - lse_out)`` is the share of the row's weight its keys keep, and
``exp(s - lse_out) <= 1`` the sink's. Rows that see no key (lse = -inf) get share 0 and lse_out
= s. ``out`` and ``dout`` are in the spec's dtype (the stored out'); ``real`` is (batch, rows)
uint8, 1 at real query rows, any strides (a mask's view, or a broadcast 1).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import io_buffer

F32 = "float32"


def _rows_buffer(handle, B, H, N):
    """A (batch, heads, rows) fp32 row statistic, any strides but a unit last one (an int64 1,
    as the shape: ``io_buffer``'s literal 1 binds only beside a literal head dim)."""
    s0 = T.int64()
    s1 = T.int64()
    return T.match_buffer(handle, (B, H, N), F32, strides=(s0, s1, T.int64(1)))


def sink_kernels(spec: AttentionSpec) -> dict[str, tirx.PrimFunc]:
    """``sink_rescale`` and ``sink_gradient`` for the spec's head dim and dtype (of out and dO)."""
    D, dtype = spec.head_dim, spec.dtype

    def f32(x):
        return T.Cast(F32, x)

    @T.prim_func
    def sink_rescale(o_h: T.handle, lse_h: T.handle, sink_h: T.handle, real_h: T.handle, out_h: T.handle,
                     lse_out_h: T.handle):
        T.func_attr({"global_symbol": "sink_rescale", "tirx.noalias": True})
        B = T.int64()
        N = T.int64()
        H = T.int64()
        sr0 = T.int64()
        sr1 = T.int64()
        O32 = io_buffer(o_h, (B, N, H, D), F32, "so")
        LSE = _rows_buffer(lse_h, B, H, N)
        S = T.match_buffer(sink_h, (H,), F32)
        REAL = T.match_buffer(real_h, (B, N), "uint8", strides=(sr0, sr1))
        O = io_buffer(out_h, (B, N, H, D), dtype, "sout")
        LSE_OUT = _rows_buffer(lse_out_h, B, H, N)
        for t in T.parallel(B * N):
            b: T.let[T.int64] = t // N
            i: T.let[T.int64] = t % N
            for h in range(H):
                # (a padding row: share 0, its lse the sink's; as torch's formula, 0 * out32)
                real: T.let[T.bool] = REAL[b, i] != T.uint8(0)
                share: T.let[T.float32] = T.Select(
                    real, T.float32(1) / (T.float32(1) + T.exp(S[h] - LSE[b, h, i])), T.float32(0))
                for d in T.vectorized(D):
                    O[b, i, h, d] = T.Cast(dtype, O32[b, i, h, d] * share)
                LSE_OUT[b, h, i] = T.Select(
                    real, T.max(LSE[b, h, i], S[h]) + T.log1p(T.exp(-T.abs(LSE[b, h, i] - S[h]))), S[h])

    @T.prim_func
    def sink_gradient(do_h: T.handle, out_h: T.handle, lse_h: T.handle, sink_h: T.handle, dsink_h: T.handle):
        T.func_attr({"global_symbol": "sink_gradient", "tirx.noalias": True})
        B = T.int64()
        N = T.int64()
        H = T.int64()
        dO = io_buffer(do_h, (B, N, H, D), dtype, "sdo")
        O = io_buffer(out_h, (B, N, H, D), dtype, "sout")
        LSE = _rows_buffer(lse_h, B, H, N)
        S = T.match_buffer(sink_h, (H,), F32)
        dS = T.match_buffer(dsink_h, (H,), F32)
        for h in T.parallel(H):
            acc = T.decl_buffer((D,), F32)  # per lane of the head dim: summed once at the end
            total = T.decl_buffer((1,), F32)
            for d in T.vectorized(D):
                acc[d] = T.float32(0)
            for b, i in T.grid(B, N):
                weight: T.let[T.float32] = T.exp(S[h] - LSE[b, h, i])
                for d in T.vectorized(D):
                    acc[d] = acc[d] + weight * f32(dO[b, i, h, d]) * f32(O[b, i, h, d])
            total[0] = T.float32(0)
            for d in range(D):
                total[0] = total[0] + acc[d]
            dS[h] = -total[0]

    return {"sink_rescale": sink_rescale, "sink_gradient": sink_gradient}
