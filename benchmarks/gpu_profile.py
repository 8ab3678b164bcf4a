"""A few tvmflash calls on a GPU for the profilers: Nsight Compute (ncu) and compute-sanitizer.

    python benchmarks/gpu_profile.py ncu        # B2 H16 N8192 D128 bf16: 2 x (forward, backward)
    python benchmarks/gpu_profile.py sanitize   # small odd shapes, every mask kind, fp16 and bf16

Run under the tool (benchmarks/gpu_session.sh does), e.g.
    ncu --clock-control none --kernel-name regex:"flash_(fwd|bwd)_kernel" --launch-skip 2 --launch-count 2 \\
        python benchmarks/gpu_profile.py ncu
    compute-sanitizer --tool racecheck python benchmarks/gpu_profile.py sanitize

Each call's output is compared with float64 attention on a few rows (a profiler run is no
correctness check, but a kernel that ran wrong under the tool should not go unnoticed).
"""

from __future__ import annotations

import sys

import torch

from tvmflash import flash_attn_func
from tvmflash.reference import reference_attention

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, causal, window)
SANITIZE_CASES = [
    (2, 77, 129, 4, 2, 64, torch.bfloat16, False, (-1, -1)),
    (1, 129, 77, 4, 1, 128, torch.float16, True, (-1, -1)),
    (1, 200, 200, 2, 2, 64, torch.bfloat16, False, (50, 10)),
]
NCU_CASE = (2, 8192, 8192, 16, 16, 128, torch.bfloat16, False, (-1, -1))


def run(case, repeats: int) -> float:
    """``repeats`` forward+backward calls; the largest |out - float64| over the first 64 rows."""
    batch, nq, nk, heads, heads_k, head_dim, dtype, causal, window = case
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for n, h in ((nq, heads), (nk, heads_k), (nk, heads_k)))
    for _ in range(repeats):
        out = flash_attn_func(q, k, v, causal=causal, window_size=window)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    rows = min(nq, 64)
    qr = q.detach()[:, :rows].double()
    if causal or window != (-1, -1):  # the rows keep their positions: compute the full reference
        qr = q.detach().double()
    want, _ = reference_attention(qr, k.detach().double(), v.detach().double(), causal, window_size=window)
    return (out.detach()[:, :rows].double() - want[:, :rows]).abs().max().item()


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "sanitize"
    cases, repeats = ([NCU_CASE], 2) if mode == "ncu" else (SANITIZE_CASES, 1)
    worst = 0.0
    for case in cases:
        err = run(case, repeats)
        worst = max(worst, err)
        print(f"{mode}: {case[:6]} {str(case[6])[6:]} causal={case[7]} window={case[8]}: max|out - f64| {err:.2e}",
              flush=True)
    return 0 if worst < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
