"""Independent references: dense attention in any dtype, and the timing helper (torch only).

Everything that checks or times tvmflash uses these (tests, benchmarks, the GPU check, the
demo); they import neither TVM nor the rest of tvmflash, so they run anywhere torch does.

``reference_attention`` materialises the (batch, heads, seqlen_q, seqlen_k) scores and applies
the same masks and score modifications as the kernels, written as plain torch: flash-attn's
window (bottom-right aligned), softcap ``c tanh(s / c)``, ALiBi ``-slope |i + off - j|``, a
score_mod applied to broadcast index tensors, a boolean mask. With ``dtype=torch.float64`` it is
the ground truth; in the inputs' dtype it is "plain PyTorch attention in the same dtype", whose
error sets the tolerance (flash-attn's rule). Differentiable: gradients come from autograd.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

PAUSE_S = 0.02


def window_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False, diagonal: int | None = None,
                device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True = query i sees key j: flash-attn's bottom-right aligned
    window (``diagonal``, the key query 0 is aligned with, defaults to seqlen_k - seqlen_q)."""
    left, right = window_size
    if causal:
        right = 0
    off = seqlen_k - seqlen_q if diagonal is None else diagonal
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + off + right
    if left >= 0:
        keep &= j >= i + off - left
    return keep


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, batch: int, diagonal: int | None = None):
    """(batch, heads, seqlen_q, seqlen_k): -slope * |i + off - j| (slopes (heads,) or (batch, heads))."""
    off = seqlen_k - seqlen_q if diagonal is None else diagonal
    i = torch.arange(seqlen_q, device=slopes.device)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (i + off - j).abs().to(torch.float64)
    slopes = slopes.to(torch.float64).reshape(-1, slopes.shape[-1]).expand(batch, -1)
    return -slopes[:, :, None, None] * distance


def reference_attention(q, k, v, causal: bool = False, scale: float | None = None, *, window_size=(-1, -1),
                        softcap: float = 0.0, alibi_slopes=None, score_mod=None, mask=None, diagonal=None,
                        sinks=None, dtype=torch.float64):
    """Plain attention in ``dtype``: out (B, Nq, H, D) and lse (B, H, Nq) (natural log).

    q (B, Nq, H, D), k and v (B, Nk, Hk, D) with H % Hk == 0. ``score_mod(scores, b, h, i, j)``
    gets the scaled (and softcapped) scores (B, H, Nq, Nk) and broadcastable index tensors;
    ``mask`` is a bool tensor broadcastable to (B, H, Nq, Nk) (True = keep), applied with the
    window. Rows that see no key: output 0, lse -inf, zero gradients (no NaN in autograd).
    ``sinks`` (H,): attention sinks as gpt-oss's ``eager`` has them, one more logit per row in the
    softmax, whose probability is dropped (its value is 0); the lse then counts it (a row that
    sees no key: lse = its sink).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    group = heads // k.shape[2]
    qt = q.to(dtype).transpose(1, 2)
    kt = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if score_mod is not None:
        b = torch.arange(batch, device=q.device)[:, None, None, None]
        h = torch.arange(heads, device=q.device)[None, :, None, None]
        i = torch.arange(seqlen_q, device=q.device)[None, None, :, None]
        j = torch.arange(seqlen_k, device=q.device)[None, None, None, :]
        scores = score_mod(scores, b, h, i, j)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, batch, diagonal).to(scores.dtype)
    keep = window_mask(seqlen_q, seqlen_k, window_size, causal, diagonal, q.device).expand(batch, heads, -1, -1)
    if mask is not None:
        keep = keep & mask
    sees_a_key = keep.any(-1, keepdim=True)
    # Rows that see no key: give them finite scores before the softmax and zero their
    # probabilities after, so autograd produces no NaN.
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(batch, -1, seqlen_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        lse = torch.logsumexp(scores.to(torch.promote_types(dtype, torch.float32)), -1)
        return (probs[..., :-1] @ vt).transpose(1, 2), lse
    scores = scores.masked_fill(~sees_a_key, 0.0)
    probs = torch.softmax(scores, dim=-1) * sees_a_key
    lse = torch.logsumexp(scores.to(torch.promote_types(dtype, torch.float32)), -1)
    lse = lse.masked_fill(~sees_a_key[..., 0], float("-inf"))
    return (probs @ vt).transpose(1, 2), lse


def reference_magnitudes(q, k, v, dout, scale=None, lse=None) -> dict:
    """Size of the terms summed or cancelled on the way to each result (an upper bound under any
    mask: masks only remove terms): out averages rows of v, dv sums P-weighted rows of dO;
    lse moves with the scores (d lse = sum_j P_j d s_j), whose rounding scales with
    scale * sum_d |q_d k_d|: the head dim's terms; dS = P (dP - Delta) subtracts two dot products
    dO . v and dO . o whose rounding scales with sum_d |dO_d v_d|, which dq and dk then scale by
    |k| and |q|. (B, N, H, D) tensors.

    ``lse`` (the reference's, optional): the backward recomputes P = exp(s - lse) from the fp32
    LSE, whose rounding (half an ulp of |lse|) is a relative error of |lse| u on every P, where
    plain attention's exp(s - max) has none; the 4 ulps of the rule cover 8 u, so the backward's
    terms scale by max(1, |lse| / 8) (at scale 3, D 32, |lse| reaches 70: dv's error did too)."""
    with torch.no_grad():
        group = q.shape[2] // k.shape[2]

        def largest_dot(a, b):  # max over rows i, j of sum_d |a_id b_jd|
            return torch.einsum("bihd,bjhd->bhij", a.float().abs(), b.float().abs().repeat_interleave(group, 2)).max()

        dp = largest_dot(dout, v)
        sm_scale = scale or q.shape[-1] ** -0.5
        finite = lse[torch.isfinite(lse)].abs() if lse is not None else torch.zeros(0)
        recompute = max(1.0, float(finite.max()) / 8) if finite.numel() else 1.0
        return {"out": float(v.abs().max()), "lse": float(sm_scale * largest_dot(q, k)),
                "dv": recompute * float(dout.abs().max()), "dq": recompute * float(sm_scale * dp * k.abs().max()),
                "dk": recompute * float(sm_scale * dp * q.abs().max())}


def flash_rule(ours, ref64, same, dtype: torch.dtype, magnitude: float = 1.0, ulps: float = 4.0) -> dict:
    """flash-attn's rule: err(ours vs float64) <= 2 * err(plain torch in the same dtype) + a few ulps.

    The ulps are those of the largest value involved: the result, or ``magnitude``, the size of
    the terms summed or cancelled on the way to it (``reference_magnitudes``). FlashAttention
    rounds differently from plain attention at exactly those places: it recomputes P from the
    fp32 LSE (a relative error of a few ulps on every P, times the rows of V or dO it weights),
    and dS = P (dP - Delta) subtracts two numbers of size |dO| |V| even where the gradient is ~0.
    Returns the numbers and ``ok`` (False on a NaN or a shape mismatch too).
    """
    ours, ref64, same = ours.detach(), ref64.detach(), same.detach()
    if tuple(ours.shape) != tuple(ref64.shape):
        return {"ok": False, "error": f"shape {tuple(ours.shape)} != {tuple(ref64.shape)}"}
    if ours.numel() == 0:
        return {"ok": True, "err": 0.0, "err_torch": 0.0, "bound": 0.0, "ratio": 0.0}
    nan = bool(torch.isnan(ours).any())
    scale = max(1.0, float(magnitude), float(ref64.abs().max()))
    err = float((ours.double() - ref64).abs().max())
    err_torch = float((same.double() - ref64).abs().max())
    bound = 2 * err_torch + ulps * torch.finfo(dtype).eps * scale
    ok = (not nan) and err <= bound
    return {"ok": ok, "err": err, "err_torch": err_torch, "bound": bound,
            "ratio": err / bound if bound > 0 else math.inf, **({"error": "NaN in result"} if nan else {})}


def chunked_reference_f64(q, k, v, dout, causal: bool, scale: float | None = None, chunk: int = 1024):
    """float64 attention forward and backward, query chunk by query chunk: O(N * chunk) memory,
    for lengths where ``reference_attention``'s autograd would hold too much.

    The textbook formulas (P = softmax(S), dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q); the tests check them against autograd through
    ``reference_attention``. Returns (out, lse, dq, dk, dv) as float64, layout (batch, seqlen,
    heads, dim) and lse (batch, heads, seqlen).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    qd, kd, vd, dod = (t.detach().double().transpose(1, 2) for t in (q, k, v, dout))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    nq, nk = qd.shape[2], kd.shape[2]
    out, lse = torch.zeros_like(qd), torch.full(qd.shape[:3], -math.inf, dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for start in range(0, nq, chunk):
        rows = slice(start, min(start + chunk, nq))
        s = (qd[:, :, rows] @ kd.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~window_mask(nq, nk, causal=True)[rows], -math.inf)
        m = s.amax(-1, keepdim=True).clamp_min(-1e300)  # rows that see no key: keep finite
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        p = torch.where(l > 0, p / l.clamp_min(1e-300), 0.0)
        lse[:, :, rows] = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0].clamp_min(1e-300)), -math.inf)
        o = p @ vd
        out[:, :, rows] = o
        do = dod[:, :, rows]
        dv += p.transpose(-1, -2) @ do
        dp = do @ vd.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[:, :, rows] = scale * (ds @ kd)
        dk += scale * (ds.transpose(-1, -2) @ qd[:, :, rows])
    b, hk = k.shape[0], k.shape[2]
    dk = dk.reshape(b, hk, group, nk, -1).sum(2)
    dv = dv.reshape(b, hk, group, nk, -1).sum(2)
    return tuple(t.transpose(1, 2) if t.dim() == 4 else t for t in (out, lse, dq, dk, dv))


def median_times(candidates: dict, rounds: int, pause: float = PAUSE_S, sync=None) -> dict[str, float]:
    """Median seconds per candidate over interleaved rounds (``interleaved_times``)."""
    return {name: statistics.median(t) for name, t in interleaved_times(candidates, rounds, pause, sync).items()}


def interleaved_times(candidates: dict, rounds: int, pause: float = PAUSE_S, sync=None) -> dict[str, list[float]]:
    """Seconds of each candidate in each round (after one warm-up call each).

    Every candidate runs once per round, rounds interleave the candidates, and a short pause
    precedes each timed call, so thread pools that spin after their last job (TVM's and
    PyTorch's OpenMP) have gone idle. ``sync``: called after each call (CUDA: synchronize).
    """
    for fn in candidates.values():
        fn()
        if sync:
            sync()
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            time.sleep(pause)
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - start)
    return times


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))
