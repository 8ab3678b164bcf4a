"""The correctness stage: our forward and backward against float64 by the flash-attn rule."""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from tvmflash.reference import flash_rule, reference_attention, reference_magnitudes

from .cases import CorrectnessCase, correctness_cases, draw, sync
from .stage import StageWriter, run_cases

GRADS = ("dq", "dk", "dv")


def references(q, k, v, dout, causal: bool, **variant) -> dict[str, tuple]:
    """(out, lse, dq, dk, dv) of plain attention in float64 ("f64") and in the inputs' dtype ("same");
    ``variant``: reference_attention's window_size, softcap, alibi_slopes."""
    refs = {}
    for name, dt in (("f64", torch.float64), ("same", q.dtype)):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, lse = reference_attention(*leaves, causal, dtype=dt, **variant)
        refs[name] = (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, dout.to(dt)))
    return refs


def packed_references(q, k, v, dout, cu_q, cu_k, causal: bool, **variant) -> dict[str, tuple]:
    """``references`` of packed sequences (rows cu[i] ... cu[i + 1] - 1 of (total, heads, dim)
    tensors), each on its own rows, concatenated like flash_attn_varlen_func's results (lse
    (heads, total))."""
    per_sequence = [references(q[None, a:b], k[None, c:d], v[None, c:d], dout[None, a:b], causal, **variant)
                    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
    return {name: tuple(torch.cat([r[name][i][0] for r in per_sequence], dim=-1 if i == 1 else 0) for i in range(5))
            for name in ("f64", "same")}


def compare(results: dict, refs: dict, dtype: torch.dtype, magnitude: dict) -> dict[str, dict]:
    """The rule per tensor of ``results`` (out, lse, dq, dk, dv); lse must be -inf exactly where
    the reference's is (rows without a visible key) and is compared elsewhere, with eps(fp32)."""
    checks = {}
    for i, name in enumerate(("out", "lse", *GRADS)):
        ours, f64, same = results[name].detach(), refs["f64"][i], refs["same"][i]
        if name == "lse":
            finite = torch.isfinite(f64)
            if not torch.equal(torch.isfinite(ours), finite):
                checks[name] = {"ok": False, "error": "lse finite/-inf pattern differs from the reference"}
            else:
                checks[name] = flash_rule(ours[finite], f64[finite], same[finite].float(), torch.float32)
        elif ours.dtype != dtype:
            checks[name] = {"ok": False, "error": f"dtype {ours.dtype} != {dtype}"}
        else:
            checks[name] = flash_rule(ours, f64, same, dtype, magnitude[name])
    return checks


def check_case(case: CorrectnessCase, device: str, seed: int, deterministic: bool = False) -> dict:
    """Our forward+backward vs float64 autograd on one case; returns the per-tensor rule results."""
    from tvmflash import flash_attn_func, flash_attn_varlen_func

    gen = torch.Generator().manual_seed(seed)
    b, nq, nk, h, hk, d = case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_k, case.head_dim
    if case.packed:  # b sequences of random lengths, packed into (total, heads, dim)
        lengths = [torch.randint(1, n + 1, (b,), generator=gen) for n in (nq, nk)]
        cu_q, cu_k = ([0, *n.cumsum(0).tolist()] for n in lengths)
        shapes = ((cu_q[-1], h, d), (cu_k[-1], hk, d), (cu_k[-1], hk, d), (cu_q[-1], h, d))
    else:
        shapes = ((b, nq, h, d), (b, nk, hk, d), (b, nk, hk, d), (b, nq, h, d))
    q, k, v, dout = (draw(gen, s, case.dtype, device) for s in shapes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    variant = case.variant()
    if variant["alibi_slopes"] is not None:
        variant["alibi_slopes"] = variant["alibi_slopes"].to(device)

    def ours():
        if case.packed:
            cu = [torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k)]
            return flash_attn_varlen_func(*leaves, *cu, nq, nk, causal=case.causal, deterministic=deterministic,
                                          return_attn_probs=True, **variant)
        return flash_attn_func(*leaves, causal=case.causal, deterministic=deterministic, return_attn_probs=True,
                               **variant)

    start = time.perf_counter()
    out, lse, _ = ours()
    grads = torch.autograd.grad(out, leaves, dout)
    sync(device)
    ours_s = time.perf_counter() - start
    results = {"out": out, "lse": lse, **dict(zip(GRADS, grads))}
    refs = (packed_references(q, k, v, dout, cu_q, cu_k, case.causal, **variant) if case.packed
            else references(q, k, v, dout, case.causal, **variant))
    batched = (t[None] if case.packed else t for t in (q, k, v, dout))
    checks = compare(results, refs, getattr(torch, case.dtype), reference_magnitudes(*batched))
    result = {"case": asdict(case), "label": case.label(), "seed": seed, "ours_s": ours_s, "checks": checks}
    if deterministic:
        again = torch.autograd.grad(ours()[0], leaves, dout)
        result["deterministic_bitwise"] = all(torch.equal(a, b) for a, b in zip(grads, again))
        checks["deterministic"] = {"ok": result["deterministic_bitwise"]}
    result["ok"] = all(c.get("ok") for c in checks.values())
    return result


def stage_correctness(args, writer: StageWriter) -> None:
    cases = correctness_cases(args.device, args.quick)
    run_cases(writer, cases, lambda i, case: check_case(case, args.device, args.seed * 1000 + i, args.deterministic),
              args.device)
