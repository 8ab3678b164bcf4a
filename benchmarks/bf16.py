"""bf16 inputs: tvmflash's bf16 path (AMX tiles, bf16 dot products or fp32 FMAs, as this CPU
gets by default) against PyTorch's bf16 SDPA and tvmflash's own fp32, forward and forward +
backward, with the register-only peaks beside the figures. Same process, interleaved rounds,
medians (``tvmflash.reference.median_times``).

    python benchmarks/bf16.py                  # training-like shapes, 7 rounds
    python benchmarks/bf16.py --quick          # one small shape, 3 rounds (smoke test)
    python benchmarks/bf16.py --markdown out.md

Per shape (causal and not, head dims 64 / 96 / 128, GQA, batches), through autograd as a model
calls them: ``bf16`` and ``fp32``: tvmflash's ``flash_attn_func``; ``SDPA bf16``: PyTorch's
``scaled_dot_product_attention`` (its default CPU backend, FLASH; GQA by ``enable_gqa``).
``fwd``: the forward under ``no_grad``; ``fwd+bwd``: forward + ``autograd.grad``. GFLOP/s count
FlashAttention's model FLOPs (forward 4 B H N^2 D, backward 2.5x, causal half). The bars are
issue 24's where bf16 runs on AMX (2x SDPA, 3x our fp32) and issue 13's with bf16 dot products.
The peaks: ``benchmarks/bf16_peak.c``, compiled here with gcc, on as many threads as the
kernels use (skipped without gcc or AVX512-BF16): fp32 FMAs, ``vdpbf16ps`` and AMX's
``tdpbf16ps`` where this CPU has it.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import machine
from tvmflash import compiler, settings
from tvmflash.analysis import model_flops
from tvmflash.config import AMX, BF16_DOT
from tvmflash.reference import median_times
from tvmflash.torch_op import flash_attn_func


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads: int
    heads_k: int
    head_dim: int
    causal: bool

    def label(self) -> str:
        heads = f"H{self.heads}" + (f"/{self.heads_k}" if self.heads_k != self.heads else "")
        return f"B{self.batch} N{self.seqlen} {heads} D{self.head_dim}{' causal' if self.causal else ''}"

    def flops(self, phase: str) -> float:
        kernel = {"fwd": "forward", "fwd+bwd": "forward+backward"}[phase]
        return model_flops(kernel, self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)


SHAPES = [Shape(1, 2048, 8, 8, 64, True), Shape(1, 2048, 8, 8, 64, False), Shape(2, 1024, 16, 4, 128, True),
          Shape(1, 4096, 8, 2, 96, True), Shape(4, 512, 8, 8, 128, False), Shape(1, 2048, 8, 8, 128, False)]
QUICK_SHAPES = [Shape(1, 512, 4, 2, 64, True)]
# bar: (numerator, denominator, least ratio of their times) by the bf16 products of this CPU
BARS = {AMX: (("SDPA bf16 fwd", "bf16 fwd", 2.0), ("SDPA bf16 fwd+bwd", "bf16 fwd+bwd", 2.0),
              ("fp32 fwd+bwd", "bf16 fwd+bwd", 3.0)),
        BF16_DOT: (("SDPA bf16 fwd+bwd", "bf16 fwd+bwd", 1.5), ("fp32 fwd+bwd", "bf16 fwd+bwd", 1.6))}
PEAK_SOURCE = Path(__file__).with_name("bf16_peak.c")


def _calls(shape: Shape) -> dict:
    """name -> zero-argument call, for each implementation and phase."""
    gen = torch.Generator().manual_seed(0)
    calls = {}

    def inputs(dtype):
        q = torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads_k, shape.head_dim, generator=gen).to(dtype)
                for _ in range(2))
        return [t.requires_grad_() for t in (q, k, v)], torch.randn(q.shape, generator=gen).to(dtype)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=shape.causal,
            enable_gqa=shape.heads != shape.heads_k).transpose(1, 2)

    def ours(q, k, v):
        return flash_attn_func(q, k, v, causal=shape.causal)

    for name, impl, dtype in (("bf16", ours, torch.bfloat16), ("SDPA bf16", sdpa, torch.bfloat16),
                              ("fp32", ours, torch.float32)):
        leaves, dout = inputs(dtype)

        def forward(impl=impl, leaves=leaves):
            with torch.no_grad():
                impl(*leaves)

        def forward_backward(impl=impl, leaves=leaves, dout=dout):
            torch.autograd.grad(impl(*leaves), leaves, dout)

        calls[f"{name} fwd"], calls[f"{name} fwd+bwd"] = forward, forward_backward
    return calls


def run_shape(shape: Shape, rounds: int) -> dict:
    kernels = compiler.compile("llvm", shape.head_dim, "bfloat16", shape.causal, seqlen=shape.seqlen)
    load = os.getloadavg()[0]
    times = median_times(_calls(shape), rounds)
    gflops = {name: shape.flops(name.rsplit(" ", 1)[1]) / t / 1e9 for name, t in times.items()}
    return {"shape": shape, "times": times, "gflops": gflops, "products": kernels.configs["forward"].products,
            "load": (load, os.getloadavg()[0])}


def peak(threads: int, rounds: int) -> dict | None:
    """Register-only GFLOP/s per instruction ({"tdpbf16ps": (wall, cpu), ...}), or None."""
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


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def report(results: list[dict], peaks: dict | None, threads: int) -> str:
    names = ("bf16", "SDPA bf16", "fp32")
    lines = ["| shape | bf16 products | " + " | ".join(f"{n} {p}" for p in ("fwd", "fwd+bwd") for n in names) +
             " | bf16 / SDPA fwd | bf16 / SDPA fwd+bwd | bf16 / fp32 fwd+bwd | load avg |", "|" + "---|" * 12]
    ratios = []
    for r in results:
        t, g = r["times"], r["gflops"]
        ratio = (t["SDPA bf16 fwd"] / t["bf16 fwd"], t["SDPA bf16 fwd+bwd"] / t["bf16 fwd+bwd"],
                 t["fp32 fwd+bwd"] / t["bf16 fwd+bwd"])
        ratios.append(ratio)
        cells = " | ".join(f"{t[f'{n} {p}'] * 1e3:.1f} ms ({g[f'{n} {p}']:.0f})" for p in ("fwd", "fwd+bwd")
                           for n in names)
        lines.append(f"| {r['shape'].label()} | {r['products']} | {cells} | " +
                     " | ".join(f"{x:.2f}x" for x in ratio) + f" | {r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    means = [_geomean(r[i] for r in ratios) for i in range(3)]
    lines.append("| **geomean** | | " + " | " * 5 + " | ".join(f"**{x:.2f}x**" for x in means) + " | |")
    lines.append("\nmedian time (GFLOP/s, model FLOPs) per call; ratios of median times (> 1: bf16 faster)")
    products = results[0]["products"]
    for num, den, bar in BARS.get(products, ()):
        worst = min(r["times"][num] / r["times"][den] for r in results)
        mean = _geomean(r["times"][num] / r["times"][den] for r in results)
        lines.append(f"- bar ({products}): {num} / {den} >= {bar}: geomean {mean:.2f}x, lowest {worst:.2f}x "
                     f"{'ok' if mean >= bar else 'SHORT'}")
    if peaks:
        best = max(r["gflops"]["bf16 fwd+bwd"] for r in results)
        text = ", ".join(f"{name} {cpu:.0f} GFLOP/s" for name, (_, cpu) in sorted(peaks.items()))
        lines.append(f"\nregister-only peaks on {threads} threads (benchmarks/bf16_peak.c, by CPU time): {text}; "
                     f"the best bf16 fwd+bwd here: {best:.0f} GFLOP/s")
    else:
        lines.append("\n(no peaks: gcc or AVX512-BF16 missing)")
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
    results = []
    for i, shape in enumerate(QUICK_SHAPES if args.quick else SHAPES, 1):
        start = time.perf_counter()
        print(f"[{i}] {shape.label()} ...", end=" ", flush=True)
        results.append(run_shape(shape, rounds))
        print(f"{time.perf_counter() - start:.0f} s", flush=True)
    text = report(results, peak(threads, rounds), threads)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(f"machine: {machine()}\n\ncommand: `python {' '.join(sys.argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
