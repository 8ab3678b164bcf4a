"""The long stage: one head of --long-n tokens, forward and forward+backward with our op (times,
peak memory, a float64 check of sampled rows), and what standard attention would need there."""

from __future__ import annotations

import torch

from tvmflash.reference import reference_attention

from .cases import SHORT, call_timed, draw, long_dtype, model_flops
from .stage import StageWriter, error_record


def standard_attention_bytes(batch, heads, seqlen_q, seqlen_k, dtype: str) -> dict:
    """Memory standard (materialized) attention needs for the N x N matrices."""
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    p = batch * heads * seqlen_q * seqlen_k * elt
    return {"P_saved_for_backward_bytes": p, "peak_estimate_bytes": 2 * p,
            "formula": f"P: B*H*Nq*Nk*{elt} bytes (kept for the backward); peak ~2x (S and P, or P and dP/dS, "
                       "alive together)"}


def flash_io_bytes(seqlen, head_dim, dtype: str) -> int:
    """What our forward+backward must hold for one head, O(N): q k v out dout dq dk dv, the fp32
    lse, and one fp32 dq accumulator (the deterministic CUDA backward keeps up to 8 of them)."""
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    return 8 * seqlen * head_dim * elt + 4 * seqlen + 4 * seqlen * head_dim


def sampled_rows_check(q, k, v, out, lse, dtype: str, seed: int, rows: int = 4) -> dict:
    """A few query rows (and the first and last) against float64 attention over all keys (a sanity
    check, not the rule): |out - f64| <= (4 eps(dtype) + 1e-4) * max|f64 row| and
    |lse - f64| <= 1e-3 * max(1, |lse|)."""
    gen = torch.Generator().manual_seed(seed + 1)
    n = q.shape[1]
    idx = sorted(set(torch.randint(0, n, (rows,), generator=gen).tolist() + [0, n - 1]))
    ref, ref_lse = reference_attention(q[:, idx], k, v, causal=False)  # not causal: rows are independent
    got = out[:, idx].double()
    err = float((got - ref).abs().max())
    tol = (4 * torch.finfo(getattr(torch, dtype)).eps + 1e-4) * float(ref.abs().max())
    lse_err = float((lse[:, :, idx].double() - ref_lse).abs().max())
    lse_tol = 1e-3 * max(1.0, float(ref_lse.abs().max()))
    return {"rows": idx, "out_max_abs_err": err, "out_tol": tol, "lse_max_abs_err": lse_err, "lse_tol": lse_tol,
            "ok": err <= tol and lse_err <= lse_tol and bool(torch.isfinite(got).all())}


def pick_seqlen(args, writer: StageWriter) -> int:
    """--long-n, halved (not below 4096) until fwd + 2 fwd+bwd (~3.3x one fwd+bwd), estimated from
    the speed stage, fits 80% of the time left."""
    n, per_n2 = args.long_n, args.long_estimate_s_per_n2
    if not per_n2:
        return n
    while n > 4096 and 3.3 * per_n2 * n * n > 0.8 * writer.left():
        n //= 2
    if n != args.long_n:
        writer.note(f"N={args.long_n} estimated at {per_n2 * args.long_n ** 2:.0f} s per fwd+bwd, more than the "
                    f"{writer.left():.0f} s left: ran N={n} instead")
    writer.data["estimated_fwd_bwd_s"] = per_n2 * n * n
    return n


def _peak_bytes(device: str, reset: bool = False) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def measure_ours(record: dict, args, inputs, writer: StageWriter) -> None:
    """Fills ``record``: a warm-up on 256 tokens, the forward (+ sampled rows), then up to two
    forward+backward runs (the second if time allows; the last one is reported)."""
    from tvmflash import flash_attn_func

    device, dtype = args.device, record["case"]["dtype"]
    q, k, v, dout = inputs
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = {"causal": False, "deterministic": args.deterministic}
    # Load (or compile) the kernels and run them once on a small input, outside the timing.
    small = [t[:, :256].clone().requires_grad_() for t in (q, k, v)]
    _, record["warmup_s"] = call_timed(
        lambda: torch.autograd.grad(flash_attn_func(*small, **kw), small, dout[:, :256]), device)
    del small
    _peak_bytes(device, reset=True)
    if device == "cuda":
        record["inputs_allocated_bytes"] = torch.cuda.memory_allocated()
    with torch.no_grad():
        (out, lse, _), record["fwd_s"] = call_timed(lambda: flash_attn_func(*leaves, return_attn_probs=True, **kw),
                                                    device)
    record["fwd_tflops"] = record["flops"]["fwd"] / record["fwd_s"] / 1e12
    record["fwd_peak_allocated_bytes"] = _peak_bytes(device)
    record["sampled_rows"] = sampled_rows_check(q, k, v, out, lse, dtype, args.seed)
    del out, lse
    writer.replace(dict(record, partial=True))
    runs = []
    for attempt in range(2):
        if attempt and writer.left() < 1.5 * runs[-1]:
            writer.note("no time for a second fwd+bwd: the first one is reported")
            break
        _peak_bytes(device, reset=True)
        grads, t = call_timed(lambda: torch.autograd.grad(flash_attn_func(*leaves, **kw), leaves, dout), device)
        runs.append(t)
        record["grads_finite"] = bool(all(torch.isfinite(g).all() for g in grads))
        del grads
        record["fwd_bwd_peak_allocated_bytes"] = _peak_bytes(device)
    record["fwd_bwd_s_runs"], record["fwd_bwd_s"] = runs, runs[-1]
    record["fwd_bwd_tflops"] = record["flops"]["fwd+bwd"] / runs[-1] / 1e12
    record["ok"] = record["grads_finite"] and record["sampled_rows"]["ok"]
    writer.replace(record)


def measure_sdpa_flash(record: dict, inputs, writer: StageWriter) -> None:
    """PyTorch's FLASH backend on the same case (CUDA), if there is time (about our fwd+bwd again)."""
    from torch.nn.attention import SDPBackend

    from .speed import sdpa_impl

    if writer.left() < 2.0 * record["fwd_bwd_s"] + 10:
        writer.note("no time left for SDPA FLASH at this N")
        return
    q, k, v, dout = inputs
    try:
        impl = sdpa_impl(SDPBackend.FLASH_ATTENTION)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        _peak_bytes("cuda", reset=True)
        _, t = call_timed(lambda: torch.autograd.grad(impl(*leaves, False), leaves, dout), "cuda")
        record["sdpa_flash"] = {"fwd_bwd_s": t, "fwd_bwd_tflops": record["flops"]["fwd+bwd"] / t / 1e12,
                                "fwd_bwd_peak_allocated_bytes": _peak_bytes("cuda"),
                                "note": "one call, includes its first-call overheads at this shape"}
    except Exception as err:  # noqa: BLE001
        record["sdpa_flash"] = error_record(err)
    writer.replace(record)


def stage_long(args, writer: StageWriter) -> None:
    device, dtype, d = args.device, long_dtype(args.device), args.long_head_dim
    n = pick_seqlen(args, writer)
    label = f"long N={n} D{d} {SHORT[dtype]} B1 H1"
    record = {"label": label, "case": {"batch": 1, "seqlen": n, "heads": 1, "head_dim": d, "dtype": dtype,
                                       "causal": False},
              "standard_attention": standard_attention_bytes(1, 1, n, n, dtype),
              "flash_io_bytes": flash_io_bytes(n, d, dtype),
              "flops": {p: model_flops(p, 1, 1, n, n, d, False) for p in ("fwd", "fwd+bwd")}}
    try:
        gen = torch.Generator().manual_seed(args.seed)
        inputs = [draw(gen, (1, n, 1, d), dtype, device) for _ in range(4)]
        measure_ours(record, args, inputs, writer)
    except Exception as err:  # noqa: BLE001
        record.update(ok=False, **error_record(err))
        writer.replace(record)
        print(f"  {label}: FAILED {record['error'][:300]}", flush=True)
        return
    peak = record["fwd_bwd_peak_allocated_bytes"]
    print(f"  {label}: fwd {record['fwd_s']:.2f} s, fwd+bwd {record['fwd_bwd_s']:.2f} s"
          + (f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""), flush=True)
    if device == "cuda":
        measure_sdpa_flash(record, inputs, writer)
