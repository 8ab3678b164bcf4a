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


def assemble(source: str, arch: str, nvcc: str = "nvcc", ptxas: str = "ptxas") -> tuple[dict[str, str], str]:
    """CUDA C -> PTX (nvcc) -> cubin (ptxas -v). Returns the PTX of each kernel entry and ptxas's
    resource report; raises RuntimeError with the tool's messages if either step fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, ptx = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        cu.write_text(source)
        report = ""
        for command in ([nvcc, f"-arch={arch}", "-ptx", "-o", str(ptx), str(cu)],
                        [ptxas, f"-arch={arch}", "-v", "-o", str(Path(tmp) / "k.cubin"), str(ptx)]):
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"{Path(command[0]).name} failed:\n{run.stderr[-4000:]}")
            report = run.stderr
        entries = {c.split("(")[0].strip(): c for c in ptx.read_text().split(".entry ")[1:]}
    return entries, report


def kernel_resources(entries: dict[str, str], report: str, kernel: str) -> dict:
    """Registers and spill bytes (ptxas) and tensor-core instructions (PTX) of one kernel."""
    block = report.split(f"Function properties for {kernel}\n")[1]
    return {"registers": int(re.search(r"Used (\d+) registers", block).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", block).group(1)),
            "mma": entries[kernel].count("mma.sync"), "ldmatrix": entries[kernel].count("ldmatrix")}


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
                    entries, report = assemble(kern.source(), arch)
                    for kernel in KERNELS:
                        r = kernel_resources(entries, report, kernel)
                        print(f"| {dtype} | {head_dim} | {'causal' if causal else 'full'} | "
                              f"{'deterministic' if deterministic else 'atomic'} | {kernel} | {r['registers']} | "
                              f"{r['spill_bytes']} | {r['mma']} | {r['ldmatrix']} |", flush=True)


if __name__ == "__main__":
    main()
