"""Speed of tvmflash vs PyTorch's CPU attention (SDPA FLASH and MATH backends), same process.

    python benchmarks/speed.py                 # the core issue's shapes, 7 interleaved rounds
    python benchmarks/speed.py --quick         # two small shapes, 3 rounds (CI smoke test)
    python benchmarks/speed.py --markdown out.md

Prints one row per shape: GFLOP/s of each implementation for forward, backward and
forward+backward, and tvmflash's speed relative to SDPA FLASH (> 1 means tvmflash is faster).
Ends with the summary the core issue's bars are about.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from tvmflash import bench, target

QUICK_CASES = [bench.Case(1, 512, 2, 64), bench.Case(1, 512, 2, 64, "bfloat16", causal=True)]


def machine() -> str:
    return (f"{target.host_cpu()} ({os.cpu_count()} CPUs), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def table(results) -> str:
    head = ("| shape | tvmflash fwd / bwd / fwd+bwd GF/s | SDPA flash fwd / bwd / fwd+bwd GF/s | "
            "SDPA math fwd+bwd GF/s | vs flash: fwd | bwd | fwd+bwd |")
    rows = [head, "|" + "---|" * 7]
    for r in results:
        g = r["gflops"]
        ours = " / ".join(f"{g[f'tvmflash/{p}']:.0f}" for p in ("fwd", "bwd", "fwd+bwd"))
        flash = " / ".join(f"{g[f'sdpa_flash/{p}']:.0f}" for p in ("fwd", "bwd", "fwd+bwd"))
        math_ = f"{g['sdpa_math/fwd+bwd']:.0f}" if "sdpa_math/fwd+bwd" in g else "-"
        ratios = " | ".join(f"{bench.ratio(r, 'sdpa_flash', p):.2f}x" for p in ("fwd", "bwd", "fwd+bwd"))
        rows.append(f"| {r['case'].label()} | {ours} | {flash} | {math_} | {ratios} |")
    return "\n".join(rows)


def summary(results) -> str:
    fp32 = [r for r in results if r["case"].dtype == "float32"]
    lines = []
    if fp32:
        for phase in ("fwd", "fwd+bwd"):
            g = bench.geomean(bench.ratio(r, "sdpa_flash", phase) for r in fp32)
            lines.append(f"fp32 {phase} vs SDPA flash, geomean over {len(fp32)} shapes: {g:.2f}x")
    for r in results:
        c = r["case"]
        if c.dtype != "float32":
            lines.append(f"{c.label()} fwd+bwd vs SDPA flash: {bench.ratio(r, 'sdpa_flash', 'fwd+bwd'):.2f}x")
        if c.batch * c.heads == 1:
            lines.append(f"{c.label()} (batch*heads = 1) bwd vs SDPA flash: {bench.ratio(r, 'sdpa_flash', 'bwd'):.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small shapes, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    parser.add_argument("--no-math", action="store_true", help="skip the (slow) SDPA MATH backend")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    cases = QUICK_CASES if args.quick else bench.STANDARD_CASES
    rounds = args.rounds or (3 if args.quick else 7)
    impls = ("tvmflash", "sdpa_flash") if args.no_math else ("tvmflash", "sdpa_flash", "sdpa_math")
    print(f"machine: {machine()}", flush=True)
    results = []
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        print(f"[{i}/{len(cases)}] {case.label()} ...", end=" ", flush=True)
        results.append(bench.run_case(case, rounds=rounds, implementations=impls))
        print(f"{time.perf_counter() - start:.0f} s", flush=True)
    text = f"{table(results)}\n\n{summary(results)}"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"machine: {machine()}\n\ncommand: python {' '.join(sys.argv)}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
