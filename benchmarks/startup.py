"""What a fresh process pays before its first attention call returns, with the kernels cached.

Each measurement is a process of its own (the import and the first calls happen once per process),
tvmflash's and SDPA's alternated; medians and ranges over ``--runs`` of each, seconds:

- ``import tvmflash``: after ``import torch`` (and numpy), ``import tvmflash`` and the names a
  user imports (``flash_attn_func``, ``flash_attn_with_kvcache``);
- the first training call: ``flash_attn_func`` forward + backward, B1 N16 H8 D64 causal, fp32
  (SDPA: ``scaled_dot_product_attention`` on the same tensors);
- the first decode step: bf16 H8/2 D64 against a 128-token cache (SDPA: the same step with
  ``enable_gqa``);
- whether the process imported TVM's Python package (``tvm`` in ``sys.modules``).

A first process (untimed) fills the compile cache. ``PYTHONPATH`` picks the package measured
(another checkout's, to compare commits)::

    python benchmarks/startup.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_WORKER = r"""
import json, sys, time
start = time.perf_counter()
import numpy, torch
torch_done = time.perf_counter()
implementation = sys.argv[1]
if implementation == "tvmflash":
    from tvmflash import flash_attn_func, flash_attn_with_kvcache
imported = time.perf_counter()
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, 16, 8, 64, generator=gen) for _ in range(4))
q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
t0 = time.perf_counter()
if implementation == "tvmflash":
    flash_attn_func(q, k, v, causal=True).backward(dout)
else:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2).backward(dout)
t1 = time.perf_counter()
qd = torch.randn(1, 1, 8, 64, generator=gen).bfloat16()
cache_k, cache_v = (torch.randn(1, 128, 2, 64, generator=gen).bfloat16() for _ in range(2))
with torch.no_grad():
    t2 = time.perf_counter()
    if implementation == "tvmflash":
        flash_attn_with_kvcache(qd, cache_k, cache_v)
    else:
        sdpa(qd.transpose(1, 2), cache_k.transpose(1, 2), cache_v.transpose(1, 2), enable_gqa=True)
    t3 = time.perf_counter()
print(json.dumps({"torch": torch_done - start, "import": imported - torch_done, "training call": t1 - t0,
                  "decode step": t3 - t2, "tvm imported": "tvm" in sys.modules,
                  "package": sys.modules["tvmflash"].__file__ if "tvmflash" in sys.modules else None}))
"""


def _run(implementation: str) -> dict:
    # (run from this folder: ``python -c`` puts its working directory first on the path, and the
    # repository root's tvmflash would shadow the one PYTHONPATH names)
    done = subprocess.run([sys.executable, "-c", _WORKER, implementation], capture_output=True, text=True,
                          env={**os.environ, "TVMFLASH_QUIET": "1"}, timeout=600, cwd=Path(__file__).parent)
    if done.returncode != 0:
        raise RuntimeError(f"the {implementation} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine

    _run("tvmflash")  # (fills the compile cache)
    results = {"tvmflash": [], "sdpa": []}
    for _ in range(args.runs):
        for implementation, runs in results.items():
            runs.append(_run(implementation))
    print(f"A fresh process's start, kernels cached: {machine()}; medians (min-max) of {args.runs} processes, "
          "seconds\n")
    print("| | tvmflash | SDPA |\n|---|---|---|")
    for field in ("torch", "import", "training call", "decode step"):
        cells = []
        for runs in results.values():
            values = [run[field] for run in runs]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        name = {"torch": "`import torch`", "import": "`import tvmflash` (after torch)",
                "training call": "first training call (fwd + bwd, fp32 N16)",
                "decode step": "first decode step (bf16, 128-token cache)"}[field]
        print(f"| {name} | {' | '.join(cells)} |")
    imported = sorted({run["tvm imported"] for run in results["tvmflash"]})
    packages = sorted({run["package"] for run in results["tvmflash"]})
    print(f"\n`tvm` imported by tvmflash's processes: {imported}; tvmflash from {packages}")


if __name__ == "__main__":
    main()
