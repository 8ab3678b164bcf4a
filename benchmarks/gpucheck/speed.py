"""The speed stage: TFLOP/s of tvmflash vs PyTorch's SDPA backends, forward and forward+backward."""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import torch

from tvmflash.reference import PAUSE_S, median_times

from .cases import SpeedCase, call_timed, draw, speed_cases, sync
from .stage import StageWriter, run_cases

PHASES = ("fwd", "bwd", "fwd+bwd")
# CUDA: the clock of a timed call stops after a synchronize (tens of us); a call shorter than this
# runs several times inside one timing, so that the synchronize is a small part of it.
MIN_TIMED_S = 0.005
MAX_REPEAT = 64


def ours_impl(deterministic: bool):
    from tvmflash import flash_attn_func

    def run(q, k, v, causal):
        return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    return run


def sdpa_impl(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return run


def reference_impls(device: str) -> dict:
    """name -> SDPA backend. On CPU, cuDNN stays in the list: it cannot run there, which exercises
    the skip-an-unavailable-backend path the GPU run relies on."""
    from torch.nn.attention import SDPBackend

    refs = {"sdpa_flash": getattr(SDPBackend, "FLASH_ATTENTION", None),
            "sdpa_cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}
    if device == "cpu":
        refs["sdpa_math"] = SDPBackend.MATH
    return refs


def phase_calls(impl, q, k, v, dout, causal):
    """(forward under no_grad, forward+backward) closures on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return impl(*leaves, causal)

    def fwd_bwd():
        out = impl(*leaves, causal)
        return torch.autograd.grad(out, leaves, dout)

    return fwd, fwd_bwd


def repeated(fn, times: int):
    if times == 1:
        return fn

    def run():
        for _ in range(times):
            fn()
    return run


def _warm(impl, q, k, v, dout, case: SpeedCase, args) -> tuple[dict, dict, torch.Tensor]:
    """Warm-up rounds, then one call of each phase timed alone (it sizes the timed rounds).
    Returns the phase calls, those times and the forward's output."""
    calls = dict(zip(("fwd", "fwd+bwd"), phase_calls(impl, q, k, v, dout, case.causal)))
    for _ in range(args.warmup):
        for fn in calls.values():
            fn()
    out, t_fwd = call_timed(calls["fwd"], args.device)
    _, t_fwd_bwd = call_timed(calls["fwd+bwd"], args.device)
    return calls, {"fwd": t_fwd, "fwd+bwd": t_fwd_bwd}, out


def timed_rounds(calls: dict, once: dict, args, deadline: float, result: dict) -> dict[str, float]:
    """Median seconds per call over interleaved rounds: as many rounds as fit half the time left (at
    most 30 s, at least 2, at most --reps); ``once`` (one call's seconds) sizes them."""
    cuda = args.device == "cuda"
    repeat = {key: min(MAX_REPEAT, math.ceil(MIN_TIMED_S / max(t, 1e-9))) if cuda else 1 for key, t in once.items()}
    round_s = sum(once[key] * repeat[key] for key in calls)
    left = deadline - time.monotonic()
    rounds = max(2, min(args.reps, int(min(30.0, 0.5 * max(left, 0.0)) / max(round_s, 1e-6)) - 1))  # -1: warm-up
    result["rounds"], result["calls_per_timing"] = rounds, repeat
    medians = median_times({key: repeated(fn, repeat[key]) for key, fn in calls.items()}, rounds,
                           pause=0.0 if cuda else PAUSE_S, sync=torch.cuda.synchronize if cuda else None)
    return {key: t / repeat[key] for key, t in medians.items()}


def time_speed_case(case: SpeedCase, args, deadline: float, seed: int) -> dict:
    device = args.device
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (draw(gen, (case.batch, case.seqlen, case.heads, case.head_dim), case.dtype, device)
                     for _ in range(4))
    impls = {"tvmflash": ours_impl(args.deterministic)}
    unavailable = {}
    for name, backend in reference_impls(device).items():
        if backend is None:
            unavailable[name] = "not in this torch"
        else:
            impls[name] = sdpa_impl(backend)
    result = {"case": asdict(case), "label": case.label(), "unavailable": unavailable}
    # First call of ours: compiles (or loads from the cache); outside the timed region.
    t0 = time.perf_counter()
    fwd, fwd_bwd = phase_calls(impls["tvmflash"], q, k, v, dout, case.causal)
    ours_out = fwd()
    fwd_bwd()
    sync(device)
    result["ours_first_call_s"] = time.perf_counter() - t0
    calls, once, ref_out = {}, {}, None
    for name, impl in impls.items():
        try:
            phase_fns, phase_s, out = _warm(impl, q, k, v, dout, case, args)
        except Exception as err:  # noqa: BLE001 - a backend that cannot run this case is skipped
            if name == "tvmflash":
                raise
            first_line = (str(err).strip().splitlines() or [""])[0]
            unavailable[name] = f"{type(err).__name__}: {first_line[:200]}"
            continue
        if ref_out is None and name != "tvmflash":
            ref_out = (name, out)
        for phase, fn in phase_fns.items():
            calls[f"{name}/{phase}"], once[f"{name}/{phase}"] = fn, phase_s[phase]
    if ref_out is not None:  # a coarse check at sizes the correctness stage does not reach
        diff = float((ours_out.float() - ref_out[1].float()).abs().max())
        ref_max = float(ref_out[1].float().abs().max())
        result["max_abs_diff_vs"] = {"ref": ref_out[0], "out": diff, "ref_out_max": ref_max}
        result["out_matches_ref"] = diff <= 0.05 * ref_max + 1e-3  # within 5% of the output range
    result["ours_nan"] = bool(torch.isnan(ours_out).any())
    times = timed_rounds(calls, once, args, deadline, result)
    result["times"], result["tflops"] = {}, {}
    for name in impls:
        if f"{name}/fwd" not in times:
            continue
        t_f, t_fb = times[f"{name}/fwd"], times[f"{name}/fwd+bwd"]
        t_b = t_fb - t_f if t_fb > t_f else None  # noise can make it <= 0 for tiny cases: no number then
        result["times"][name] = {"fwd": t_f, "bwd": t_b, "fwd+bwd": t_fb}
        result["tflops"][name] = {p: case.flops(p) / t / 1e12 if t else None
                                  for p, t in result["times"][name].items()}
    ours = result["tflops"]["tvmflash"]
    result["ratio"] = {ref: {p: ours[p] / tf[p] if ours[p] and tf[p] else None for p in PHASES}
                       for ref, tf in result["tflops"].items() if ref != "tvmflash"}
    return result


def stage_speed(args, writer: StageWriter) -> None:
    cases = speed_cases(args.device, args.quick, args.case_filter)
    if not cases:
        writer.note("no speed case matches --cases")

    def one(i, case):
        record = time_speed_case(case, args, writer.deadline, args.seed * 1000 + i)
        record["ok"] = not record["ours_nan"] and record.get("out_matches_ref", True)
        return record

    run_cases(writer, cases, one, args.device)
