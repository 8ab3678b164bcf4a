"""A short CPU demo that checks itself: ``python -m tvmflash.demo``.

1. compiles the fused kernels for this CPU (cached after the first run),
2. checks forward and gradients against float64 PyTorch (flash-attn's error rule),
3. times forward and forward+backward against PyTorch's own CPU FlashAttention (SDPA),
4. measures the peak memory of forward+backward as the sequence grows, next to what standard
   attention allocates.

Exits with status 1 if the correctness check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from . import analysis, bench, memory, settings, target
from .reference import reference_attention
from .torch_op import flash_attn_func, kernels_for


def _step(message: str) -> None:
    print(f"\n== {message}", flush=True)


CHECKS = (  # label, flash_attn_func keywords (the same masks and mods in the reference)
    ("full", {}),
    ("causal", {"causal": True}),
    ("sliding window (64, 0), softcap 20, ALiBi", {"window_size": (64, 0), "softcap": 20.0, "alibi": True}),
)


def check_correctness(seed: int = 0) -> bool:
    """Outputs and gradients vs float64, by flash-attn's rule (2 x PyTorch fp32's error + 4 ulp)."""
    gen = torch.Generator().manual_seed(seed)
    ok = True
    for label, options in CHECKS:
        q, k, v = (torch.randn(2, n, h, 64, generator=gen).requires_grad_() for n, h in ((300, 4), (333, 2), (333, 2)))
        dout = torch.randn(2, 300, 4, 64, generator=gen)
        kwargs = {key: value for key, value in options.items() if key != "alibi"}
        if options.get("alibi"):
            kwargs["alibi_slopes"] = torch.rand(4, generator=gen)
        ours = [flash_attn_func(q, k, v, **kwargs)]
        ours += torch.autograd.grad(ours[0], (q, k, v), dout)
        results = {}
        for dtype in (torch.float64, torch.float32):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out, _ = reference_attention(*leaves, kwargs.get("causal", False), window_size=kwargs.get("window_size", (-1, -1)),
                                         softcap=kwargs.get("softcap", 0.0), alibi_slopes=kwargs.get("alibi_slopes"),
                                         dtype=dtype)
            results[dtype] = [out] + list(torch.autograd.grad(out, leaves, dout.to(dtype)))
        worst = 0.0
        for a, ref, pt in zip(ours, results[torch.float64], results[torch.float32]):
            err = (a.double() - ref).abs().max().item()
            err_pt = (pt.double() - ref).abs().max().item()
            bound = 2 * err_pt + 4 * torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())
            worst = max(worst, err / bound)
            ok &= err <= bound
        verdict = "OK" if worst <= 1 else "FAILED"
        print(f"  {label}: out, dq, dk, dv: worst error / bound = {worst:.2f}: {verdict}")
    return ok


def show_speed(rounds: int) -> None:
    cases = [bench.Case(1, 2048, 8, 64), bench.Case(1, 2048, 8, 64, causal=True)]
    print(f"  {'shape':42s} {'tvmflash GF/s':>16s} {'SDPA flash GF/s':>16s} {'ratio':>12s}")
    for case in cases:
        r = bench.run_case(case, rounds=rounds, implementations=("tvmflash", "sdpa_flash"))
        g = r["gflops"]
        for phase in ("fwd", "fwd+bwd"):
            print(f"  {case.label() + ' ' + phase:42s} {g['tvmflash/' + phase]:16.0f} "
                  f"{g['sdpa_flash/' + phase]:16.0f} {bench.ratio(r, 'sdpa_flash', phase):11.2f}x", flush=True)


def show_memory(lengths) -> None:
    """Short version of benchmarks/memory_scaling.py: tvmflash measured, standard attention analysed."""
    print(f"  {'seqlen':>7s} {'tvmflash (measured)':>20s} {'standard attention (allocates, static)':>39s}")
    fwd, bwd = analysis.standard_kernels()
    measured, standard = [], []
    for n in lengths:
        measured.append(memory.peak_added_mb("tvmflash", n))
        sizes = dict(batch=1, heads=1, heads_k=1, seqlen_q=n, seqlen_k=n)
        standard.append(max(analysis.standard_allocated_bytes(f, **sizes) for f in (fwd, bwd)) / 2**20)
        print(f"  {n:7d} {measured[-1]:17.1f} MB {standard[-1]:36.0f} MB", flush=True)
    if len(lengths) >= 2 and lengths[-1] > lengths[0] and min(measured) > 0:
        def slope(mb):
            return math.log(mb[-1] / mb[0]) / math.log(lengths[-1] / lengths[0])

        def size(mb):
            return f"{mb / 1024:,.1f} GB" if mb >= 1024 else f"{mb:,.0f} MB"

        n512k = 512 * 1024
        print(f"  log-log slope {lengths[0]}..{lengths[-1]}: tvmflash {slope(measured):.2f} (linear = 1), standard "
              f"{slope(standard):.2f} (quadratic = 2); at 512K tokens: tvmflash ~{size(measured[-1] * n512k / lengths[-1])}"
              f", standard ~{size(standard[-1] * (n512k / lengths[-1]) ** 2)} (benchmarks/memory_scaling.py: the "
              f"full experiment)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"tvmflash demo on {target.host_cpu()} ({settings.num_threads()} threads), torch {torch.__version__}")

    _step("1/4 compile (or load from cache) the fused kernels")
    kernels_for(torch.empty(1, 1, 1, 64))
    print("  ready")

    _step("2/4 correctness vs float64 PyTorch (B2 Nq300 Nk333 H4 Hkv2 D64 fp32, GQA; error / bound with bound "
          "= 2 x PyTorch fp32's error + 4 ulp)")
    ok = check_correctness()

    _step(f"3/4 speed vs PyTorch SDPA (FLASH backend), medians of {args.rounds} interleaved rounds")
    show_speed(args.rounds)

    _step("4/4 peak memory of forward+backward (B=H=1, D=64, fp32) beyond inputs and outputs")
    show_memory(args.lengths)

    print(f"\ndone in {time.perf_counter() - start:.0f} s" + ("" if ok else " -- CORRECTNESS CHECK FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
