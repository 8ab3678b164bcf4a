"""A short CPU demo that checks itself: ``python -m tvmflash.demo``.

1. compiles the fused kernels for this CPU (or loads them from the cache) and says which
   instruction-set path each dtype takes,
2. checks forward and gradients against float64 PyTorch (flash-attn's error rule) in every
   dtype it times,
3. times forward and forward+backward against PyTorch's own CPU FlashAttention (SDPA),
   interleaved rounds, with the spread of the rounds and the machine's load,
4. measures the peak memory of forward+backward as the sequence grows, next to the buffers
   standard attention needs (computed from its compiled graph).

Exits with status 1 if the correctness check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from . import analysis, bench, compiler, memory, settings, target
from .config import AMX, BF16_DOT
from .reference import reference_attention
from .torch_op import flash_attn_func, kernels_for


def _step(message: str) -> None:
    print(f"\n== {message}", flush=True)


CHECKS = (  # label, flash_attn_func keywords (the same masks and mods in the reference)
    ("full", {}),
    ("causal", {"causal": True}),
    ("sliding window (64, 0), softcap 20, ALiBi", {"window_size": (64, 0), "softcap": 20.0, "alibi": True}),
)


DTYPES = (torch.float32, torch.bfloat16)  # checked and timed


def check_correctness(seed: int = 0) -> bool:
    """Outputs and gradients vs float64, by flash-attn's rule (2 x PyTorch's error in the same
    dtype + 4 ulp of that dtype), for each dtype the demo times."""
    gen = torch.Generator().manual_seed(seed)
    ok = True
    for dtype in DTYPES:
        for label, options in CHECKS:
            q, k, v = (torch.randn(2, n, h, 64, generator=gen).to(dtype).requires_grad_()
                       for n, h in ((300, 4), (333, 2), (333, 2)))
            dout = torch.randn(2, 300, 4, 64, generator=gen).to(dtype)
            kwargs = {key: value for key, value in options.items() if key != "alibi"}
            if options.get("alibi"):
                kwargs["alibi_slopes"] = torch.rand(4, generator=gen)
            ours = [flash_attn_func(q, k, v, **kwargs)]
            ours += torch.autograd.grad(ours[0], (q, k, v), dout)
            results = {}
            for ref_dtype in (torch.float64, dtype):
                leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
                out, _ = reference_attention(*leaves, kwargs.get("causal", False),
                                             window_size=kwargs.get("window_size", (-1, -1)),
                                             softcap=kwargs.get("softcap", 0.0), alibi_slopes=kwargs.get("alibi_slopes"),
                                             dtype=ref_dtype)
                results[ref_dtype] = [out] + list(torch.autograd.grad(out, leaves, dout.to(ref_dtype)))
            worst = 0.0
            for a, ref, pt in zip(ours, results[torch.float64], results[dtype]):
                err = (a.double() - ref).abs().max().item()
                err_pt = (pt.double() - ref).abs().max().item()
                bound = 2 * err_pt + 4 * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item())
                worst = max(worst, err / bound)
                ok &= err <= bound
            verdict = "OK" if worst <= 1 else "FAILED"
            print(f"  {_name(dtype)} {label}: out, dq, dk, dv: worst error / bound = {worst:.2f}: {verdict}")
    return ok


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_paths() -> None:
    """The CPU's vector extensions, and how each dtype's matrix products run on it."""
    wanted = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512bf16": "AVX512-BF16", "amx-tile": "AMX"}
    missing = set(target.missing_isa_features(list(wanted)))
    have = [name for flag, name in wanted.items() if flag not in missing]
    lack = [name for flag, name in wanted.items() if flag in missing]
    print(f"  CPU {target.host_cpu()}: {', '.join(have) or 'none of ' + ', '.join(wanted.values())}"
          + (f"; no {', no '.join(lack)}" if lack else ""))
    for dtype in DTYPES:
        before = compiler.builds
        start = time.perf_counter()
        kernels = kernels_for(torch.empty(1, 1, 1, 64, dtype=dtype))
        origin = (f"compiled in {time.perf_counter() - start:.1f} s" if compiler.builds > before
                  else f"loaded from the cache ({settings.cache_dir()})")
        cfg = kernels.configs["forward"]
        width = {8: "256-bit vectors", 16: "512-bit vectors"}.get(cfg.lanes, f"{cfg.lanes} fp32 lanes")
        if cfg.products == AMX:
            products = "AMX tiles (tdpbf16ps, fp32 accumulation)"
        elif cfg.products == BF16_DOT:
            products = "bf16 dot products (AVX512-BF16 vdpbf16ps, fp32 accumulation)"
        elif dtype == torch.float32:
            products = "fp32 FMAs"
        else:
            products = "tiles widened to fp32, fp32 FMAs (no AVX512-BF16 dot products used)"
        print(f"  {_name(dtype)}: {products}, {width}; {origin}")


def _load_note() -> str:
    """The machine's load before timing: other work on the cores moves the ratios."""
    if not hasattr(os, "getloadavg"):
        return "load average unknown"
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    busy = load > 0.5 * cpus
    return (f"load average {load:.1f} on {cpus} CPUs" +
            (": the machine is BUSY, expect noisy ratios (rerun when it is quiet)" if busy else ": quiet"))


def show_speed(rounds: int) -> None:
    cases = [bench.Case(1, 2048, 8, 64), bench.Case(1, 2048, 8, 64, causal=True),
             bench.Case(1, 2048, 8, 64, "bfloat16", causal=True)]
    print(f"  {_load_note()}")
    print(f"  {'shape':42s} {'tvmflash GF/s':>14s} {'SDPA flash GF/s':>16s} {'ratio (median, min-max over rounds)':>38s}")
    for case in cases:
        r = bench.run_case(case, rounds=rounds, implementations=("tvmflash", "sdpa_flash"))
        g, per_round = r["gflops"], r["per_round"]
        for phase in ("fwd", "fwd+bwd"):
            ratios = [theirs / ours for theirs, ours in zip(per_round[f"sdpa_flash/{phase}"], per_round[f"tvmflash/{phase}"])]
            spread = f"{bench.ratio(r, 'sdpa_flash', phase):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"
            print(f"  {case.label() + ' ' + phase:42s} {g['tvmflash/' + phase]:14.0f} "
                  f"{g['sdpa_flash/' + phase]:16.0f} {spread:>38s}", flush=True)
    print(f"  after: {_load_note()}")


def show_memory(lengths) -> None:
    """Short version of benchmarks/memory_scaling.py: tvmflash measured, standard attention
    computed (the largest buffer set of its unfused forward or backward, from the compiled graph)."""
    print(f"  {'seqlen':>7s} {'tvmflash, measured peak':>24s} {'standard attention, its buffers':>32s}")
    fwd, bwd = analysis.standard_kernels()
    measured, standard = [], []
    for n in lengths:
        measured.append(memory.peak_added_mb("tvmflash", n))
        sizes = dict(batch=1, heads=1, heads_k=1, seqlen_q=n, seqlen_k=n)
        standard.append(max(analysis.standard_allocated_bytes(f, **sizes) for f in (fwd, bwd)) / 2**20)
        print(f"  {n:7d} {_mib(measured[-1]):>24s} {_mib(standard[-1]):>32s}", flush=True)
    if len(lengths) >= 2 and lengths[-1] > lengths[0] and min(measured) > 0:
        def slope(mb):
            return math.log(mb[-1] / mb[0]) / math.log(lengths[-1] / lengths[0])

        n512k = 512 * 1024
        print(f"  log-log slope {lengths[0]}..{lengths[-1]}: tvmflash {slope(measured):.2f} (linear = 1), standard "
              f"{slope(standard):.2f} (quadratic = 2); extrapolated to 512K tokens: tvmflash "
              f"{_gib(measured[-1] * n512k / lengths[-1])}, standard {_gib(standard[-1] * (n512k / lengths[-1]) ** 2)} "
              "(benchmarks/memory_scaling.py: the full experiment)")


def _mib(mib: float) -> str:
    return f"{mib:,.1f} MiB"


def _gib(mib: float) -> str:
    return f"{mib / 1024:,.1f} GiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"tvmflash demo on {target.host_cpu()} ({settings.num_threads()} threads), torch {torch.__version__}")

    _step("1/4 the fused kernels: compiled for this CPU, or loaded from the cache")
    describe_paths()

    _step("2/4 correctness vs float64 PyTorch (B2 Nq300 Nk333 H4 Hkv2 D64, GQA; error / bound with bound "
          "= 2 x PyTorch's error in the same dtype + 4 ulp)")
    ok = check_correctness()

    _step(f"3/4 speed vs PyTorch SDPA (FLASH backend), {args.rounds} interleaved rounds; ratio > 1: tvmflash faster")
    show_speed(args.rounds)

    _step("4/4 peak memory of forward+backward (B=H=1, D=64, fp32) beyond inputs and outputs")
    show_memory(args.lengths)

    print(f"\ndone in {time.perf_counter() - start:.0f} s" + ("" if ok else " -- CORRECTNESS CHECK FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
