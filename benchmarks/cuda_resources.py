"""Registers, spills and tensor-core instructions of the CUDA kernels, from nvcc + ptxas (no GPU).

    python benchmarks/cuda_resources.py [--arch sm_90]

Compiles every variant with ``tvmflash.compile`` (fp16/bf16, head dim 64/128, causal or not,
and the deterministic backward for bf16), assembles its CUDA source with ``nvcc -ptx`` and
``ptxas -v``, and prints one markdown row per variant and kernel.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import tvmflash

KERNELS = ("flash_fwd_kernel", "flash_bwd_kernel")


def resources(source: str, arch: str) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cu, ptx = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        cu.write_text(source)
        subprocess.run(["nvcc", f"-arch={arch}", "-ptx", "-o", str(ptx), str(cu)], check=True, capture_output=True)
        report = subprocess.run(["ptxas", f"-arch={arch}", "-v", "-o", str(Path(tmp) / "k.cubin"), str(ptx)],
                                check=True, capture_output=True, text=True).stderr
        entries = {c.split("(")[0].strip(): c for c in ptx.read_text().split(".entry ")[1:]}
    found = {}
    for kernel in KERNELS:
        block = report.split(f"Function properties for {kernel}\n")[1]
        found[kernel] = {"registers": int(re.search(r"Used (\d+) registers", block).group(1)),
                         "spill_bytes": int(re.search(r"(\d+) bytes spill stores", block).group(1)),
                         "mma": entries[kernel].count("mma.sync"), "ldmatrix": entries[kernel].count("ldmatrix")}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90")
    arch = parser.parse_args().arch
    print("| dtype | D | mask | dQ | kernel | registers | spill bytes | mma.sync | ldmatrix |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128):
            for causal in (False, True):
                for deterministic in ((False, True) if dtype == "bfloat16" and not causal else (False,)):
                    kern = tvmflash.compile({"kind": "cuda", "arch": arch}, head_dim=head_dim, dtype=dtype,
                                            causal=causal, deterministic=deterministic)
                    for kernel, r in resources(kern.source(), arch).items():
                        print(f"| {dtype} | {head_dim} | {'causal' if causal else 'full'} | "
                              f"{'deterministic' if deterministic else 'atomic'} | {kernel} | {r['registers']} | "
                              f"{r['spill_bytes']} | {r['mma']} | {r['ldmatrix']} |", flush=True)


if __name__ == "__main__":
    main()
