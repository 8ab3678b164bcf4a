"""Peak memory of one forward+backward, measured in a fresh process.

``peak_added_mb(impl, seqlen)`` starts ``python -m tvmflash.memory``, which allocates the inputs
and outputs (batch = heads = 1), warms the implementation up on a small slice, returns the free
heap to the OS (``malloc_trim``), resets the process's high-water mark (``VmHWM``, by writing 5
to ``/proc/self/clear_refs``) and reads it after one forward+backward at ``seqlen``. Its growth
over the resident size before the call is what the implementation itself needs on top of its
inputs and outputs. Without the reset, the peak left by compiling (hundreds of MB) would hide
everything smaller.

Implementations: ``tvmflash`` (fused kernels), ``standard`` (the unfused TE definitions, which
store the N x N score/probability matrices) and ``sdpa_math`` (PyTorch's materializing backend).
"""

from __future__ import annotations

import os
import subprocess
import sys

IMPLEMENTATIONS = ("tvmflash", "standard", "sdpa_math")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_high_water() -> float:
    """Give free heap pages back to the OS, reset VmHWM to VmRSS; returns that resident size."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed pages may stay resident (measures low)
        pass
    with open("/proc/self/clear_refs", "w") as f:  # Linux >= 4.0: "5" resets the peak RSS
        f.write("5")
    return _status_mb("VmRSS")


def _run(impl: str, seqlen: int, head_dim: int, dtype: str, causal: bool) -> float:
    import torch

    from . import compiler

    torch_dtype = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(1, seqlen, 1, head_dim).to(torch_dtype) for _ in range(4))
    # zeros, not empty: the outputs' pages must be resident before the measurement, which is
    # about what the implementation needs beyond its inputs and outputs
    out, dq, dk, dv = (torch.zeros_like(q) for _ in range(4))
    lse = torch.zeros(1, 1, seqlen)

    if impl in ("tvmflash", "standard"):
        kernels = (compiler.compile("llvm", head_dim, dtype, causal) if impl == "tvmflash"
                   else compiler.compile_standard(head_dim, dtype, causal))

        def step(n):
            s = [t[:, :n] for t in (q, k, v, out, dout, dq, dk, dv)]
            kernels.forward(s[0], s[1], s[2], s[3], lse[:, :, :n])
            kernels.backward(s[4], s[0], s[1], s[2], s[3], lse[:, :, :n], s[5], s[6], s[7])
    elif impl == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def step(n):
            leaves = [t[:, :n].transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(o, leaves, dout[:, :n].transpose(1, 2))
    else:
        raise ValueError(f"unknown implementation {impl!r}: one of {IMPLEMENTATIONS}")

    step(min(seqlen, 128))  # compile/load, start thread pools
    before = reset_high_water()
    step(seqlen)
    return _status_mb("VmHWM") - before


def peak_added_mb(impl: str, seqlen: int, head_dim: int = 64, dtype: str = "float32", causal: bool = False,
                  timeout: float = 1800) -> float:
    """MB added to a fresh process's peak by one forward+backward (B = H = 1)."""
    cmd = [sys.executable, "-m", "tvmflash.memory", impl, str(seqlen), str(head_dim), dtype, str(int(causal))]
    env = {**os.environ, "TVMFLASH_QUIET": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.split()[-1])


if __name__ == "__main__":
    impl_, seqlen_, head_dim_, dtype_, causal_ = sys.argv[1:6]
    print(f"{_run(impl_, int(seqlen_), int(head_dim_), dtype_, bool(int(causal_))):.2f}")
