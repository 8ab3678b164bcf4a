"""bf16 inputs on native bf16 dot products: speed against our own fp32 and fp16, PyTorch's bf16
SDPA (FLASH backend), and the register-only peak of the instruction. Same process, interleaved
rounds, medians (``tvmflash.reference.median_times``).

    python benchmarks/bf16.py                  # issue 13's shapes, 7 rounds
    python benchmarks/bf16.py --quick          # one small shape, 3 rounds (smoke test)
    python benchmarks/bf16.py --markdown out.md

Per shape, forward+backward of:
* ``bf16``: tvmflash's default for bf16 inputs on this CPU (bf16 dot products where it has
  AVX512-BF16, config ``products="bf16_dot"``), ``bf16 fp32-FMA``: bf16 inputs converted to fp32
  tiles and fp32 FMAs (the path before, and the fallback), ``fp32``, ``fp16``: tvmflash's kernels
  called directly (outputs preallocated);
* ``bf16 autograd`` and ``SDPA bf16``: tvmflash's ``flash_attn_func`` and PyTorch's
  ``scaled_dot_product_attention`` (FLASH backend) through autograd, forward + ``autograd.grad``.
GFLOP/s count FlashAttention's model FLOPs (forward 4 B H N^2 D, backward 2.5x, causal half).
The peak: ``benchmarks/bf16_peak.c``, compiled here with gcc (skipped without gcc or
AVX512-BF16), on as many threads as the kernels use; the fraction is fwd+bwd GFLOP/s over that
peak (by CPU time: what the cores do while they run the loop).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import machine
from tvmflash import bench, compiler, settings
from tvmflash.config import FP32_FMA, KERNELS, default_cpu_config
from tvmflash.reference import median_times
from tvmflash.torch_op import flash_attn_func
from tvmflash.target import has_features, resolve, supports_bf16_dot

CASES = [bench.Case(1, 2048, 8, 64, "bfloat16"), bench.Case(1, 2048, 8, 64, "bfloat16", causal=True),
         bench.Case(1, 4096, 4, 128, "bfloat16", causal=True)]
QUICK_CASES = [bench.Case(1, 512, 2, 64, "bfloat16", causal=True)]
BARS = {"bf16 / fp32": 1.6, "bf16 autograd / SDPA bf16": 1.5, "fp16 / fp32": 0.9}
PEAK_SOURCE = Path(__file__).with_name("bf16_peak.c")


def _kernel_call(case: bench.Case, dtype: str, products: str | None = None):
    """forward + backward of tvmflash's kernels on fresh N(0, 1) inputs, outputs preallocated."""
    gen = torch.Generator().manual_seed(0)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(getattr(torch, dtype)) for _ in range(4))
    config = None
    if products is not None:
        avx512 = has_features(resolve("llvm"), "avx512f")
        config = {kernel: default_cpu_config(kernel, avx512, products) for kernel in KERNELS}
    kernels = compiler.compile("llvm", case.head_dim, dtype, case.causal, config=config)
    out, lse = torch.empty_like(q), torch.empty(case.batch, case.heads, case.seqlen)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))

    def run():
        kernels.forward(q, k, v, out, lse)
        kernels.backward(dout, q, k, v, out, lse, dq, dk, dv)

    return run, kernels


def _autograd_call(case: bench.Case, impl):
    gen = torch.Generator().manual_seed(0)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def run():
        torch.autograd.grad(impl(*leaves, case.causal), leaves, dout)

    return run


def _sdpa_flash(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def run_case(case: bench.Case, rounds: int) -> dict:
    calls, kinds = {}, {}
    for name, dtype, products in (("bf16", "bfloat16", None), ("bf16 fp32-FMA", "bfloat16", FP32_FMA),
                                  ("fp32", "float32", None), ("fp16", "float16", None)):
        calls[name], kern = _kernel_call(case, dtype, products)
        kinds[name] = kern.configs["forward"].products
    calls["bf16 autograd"] = _autograd_call(case, lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal))
    calls["SDPA bf16"] = _autograd_call(case, _sdpa_flash)
    load = os.getloadavg()[0]
    times = median_times(calls, rounds)
    flops = case.flops("fwd+bwd")
    return {"case": case, "times": times, "gflops": {n: flops / t / 1e9 for n, t in times.items()}, "kinds": kinds,
            "load": (load, os.getloadavg()[0])}


def peak(threads: int, rounds: int) -> dict | None:
    """Register-only GFLOP/s of vdpbf16ps and vfmadd231ps ({"vdpbf16ps": (wall, cpu), ...}), or None."""
    if shutil.which("gcc") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "bf16_peak"
        build = subprocess.run(["gcc", "-O2", "-fopenmp", str(PEAK_SOURCE), "-o", str(exe)], capture_output=True,
                               text=True)
        if build.returncode != 0:
            print(f"(peak: gcc failed: {build.stderr.strip()[-300:]})")
            return None
        run = subprocess.run([str(exe), str(threads), str(rounds)], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        return None
    found = {}
    for line in run.stdout.splitlines():
        name, _, wall, _, cpu = line.split()
        found[name] = (float(wall), float(cpu))
    return found


def report(results: list[dict], peaks: dict | None, threads: int) -> str:
    lines = ["| shape | products (bf16) | bf16 | bf16 fp32-FMA | fp32 | fp16 | bf16 autograd | SDPA bf16 | "
             "bf16 / fp32 | bf16 autograd / SDPA bf16 | fp16 / fp32 | load avg |", "|" + "---|" * 12]
    for r in results:
        g, t = r["gflops"], r["times"]
        ratios = {"bf16 / fp32": t["fp32"] / t["bf16"], "fp16 / fp32": t["fp32"] / t["fp16"],
                  "bf16 autograd / SDPA bf16": t["SDPA bf16"] / t["bf16 autograd"]}
        r["ratios"] = ratios
        label = r["case"].label().replace(" bfloat16", "")
        cells = " | ".join(f"{g[n]:.0f}" for n in ("bf16", "bf16 fp32-FMA", "fp32", "fp16", "bf16 autograd",
                                                   "SDPA bf16"))
        bars = " | ".join(f"{ratios[n]:.2f}x {'ok' if ratios[n] >= BARS[n] else 'SHORT'}" for n in BARS)
        lines.append(f"| {label} | {r['kinds']['bf16']} | {cells} | {bars} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    lines.append("\nGFLOP/s of forward+backward (model FLOPs); ratios of median times, bars: " +
                 ", ".join(f"{n} >= {b}" for n, b in BARS.items()))
    if peaks and "vdpbf16ps" in peaks:
        wall, cpu = peaks["vdpbf16ps"]
        fma_cpu = peaks["vfmadd231ps"][1]
        best = max(r["gflops"]["bf16"] for r in results)
        lines.append(f"\nregister-only peak on {threads} threads (benchmarks/bf16_peak.c, gcc): vdpbf16ps {cpu:.0f} "
                     f"GFLOP/s by CPU time ({wall:.0f} by wall clock in this run), vfmadd231ps {fma_cpu:.0f}; "
                     f"bf16 fwd+bwd reaches " + ", ".join(
                         f"{r['gflops']['bf16'] / cpu:.0%} ({r['case'].label().replace(' bfloat16', '')})"
                         for r in results) + f" of the vdpbf16ps peak (best {best:.0f} GFLOP/s)")
    else:
        lines.append("\n(no vdpbf16ps peak: gcc or AVX512-BF16 missing)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    parser.add_argument("--markdown", help="also write the report to this file")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    threads = settings.num_threads()
    print(f"machine: {machine()}", flush=True)
    print(f"bf16 dot products on this CPU: {supports_bf16_dot(resolve('llvm'))}", flush=True)
    results = []
    for i, case in enumerate(QUICK_CASES if args.quick else CASES, 1):
        start = time.perf_counter()
        print(f"[{i}] {case.label()} ...", end=" ", flush=True)
        results.append(run_case(case, rounds))
        print(f"{time.perf_counter() - start:.0f} s", flush=True)
    peaks = peak(threads, rounds)
    text = report(results, peaks, threads)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(f"machine: {machine()}\n\ncommand: `python {' '.join(sys.argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
