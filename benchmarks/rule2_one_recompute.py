"""Experiment 3 (rule 2): the backward recomputes each P tile once.

    python benchmarks/rule2_one_recompute.py          # B1 H8 N2048 D64
    python benchmarks/rule2_one_recompute.py --quick

Compares the real backward (one recompute of S and P per tile, from which dV, dP, dS, dK, dQ
all come) with the seed's naive structure, built only for this experiment
(``recompute="twice"``: one pass over the query tiles recomputes P for dV, a second recomputes
it again for dK and dQ). FLOPs from TVM's estimate_tir_flops on the kernels at these sizes;
time from interleaved runs of both compiled kernels (medians), same process.
"""

from __future__ import annotations

import torch

from common import markdown_table, out_dir, parser, write_report
from tvmflash import analysis, bench, compiler, kernels


def flops(kernel: str, n: int, recompute: str) -> float:
    spec = kernels.KernelSpec(64, "float32", False, 64, 64, exp2="intrinsic", recompute=recompute)
    return analysis.flops(analysis.specialize(kernels.fused_kernel(kernel, spec), batch=1, heads=1, heads_k=1, seqlen_q=n, seqlen_k=n,
                                              n_split=1))


def main() -> int:
    args = parser(__doc__).parse_args()
    batch, heads, n = (1, 2, 512) if args.quick else (1, 8, 2048)
    fwd_flops = flops("forward", 1024, "once")
    ratios = {r: flops("backward", 1024, r) / fwd_flops for r in ("once", "twice")}

    variants = {"once": compiler.compile("llvm", 64, "float32", False, tuned=False),
                "twice": compiler.compile_variant(64, "float32", False, recompute="twice")}
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, n, heads, 64, generator=gen) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(batch, heads, n)
    variants["once"].forward(q, k, v, out, lse)
    grads = {r: [torch.empty_like(t) for t in (q, k, v)] for r in variants}
    calls = {r: (lambda r=r: variants[r].backward(dout, q, k, v, out, lse, *grads[r])) for r in variants}
    rounds = 3 if args.quick else 9
    times = bench.median_times(calls, rounds=rounds)
    same = max(float((a - b).abs().max()) for a, b in zip(grads["once"], grads["twice"]))
    backward_model = analysis.model_flops("backward", batch, heads, n, n, 64, False)
    rows = []
    for r, label in (("once", "one recompute (tvmflash)"), ("twice", "two recomputes (naive, experiment)")):
        rows.append((label, f"{ratios[r]:.2f}", f"{times[r] * 1e3:.1f}",
                     f"{backward_model / times[r] / 1e9:.0f}", f"{times['twice'] / times[r]:.2f}x"))
    speedup = times["twice"] / times["once"]
    verdict = (f"the fused one runs {speedup:.2f}x as fast" if speedup >= 1.05 else
               f"yet the fused one is {1 / speedup:.2f}x as slow as the naive one on this CPU" if speedup <= 0.95 else
               f"and both take the same time within 5% ({speedup:.2f}x)")
    conclusion = (f"the fused backward does {ratios['once']:.2f}x the forward's FLOPs (model: 2.5x, 5 vs 2 matrix "
                  f"products), the naive two-pass one {ratios['twice']:.2f}x ({ratios['twice'] / ratios['once']:.2f}x "
                  f"the fused one's work), {verdict}; both give the same gradients (max difference {same:.1e}).")
    body = (f"B{batch} H{heads} N{n} D64 fp32, non-causal, backward only, both kernels with the same (default, "
            f"untuned) schedule; medians of {rounds} interleaved rounds. FLOPs counted at N=1024 with TVM's "
            f"estimate_tir_flops (every float op, exp2 as one).\n\n"
            + markdown_table(["backward", "FLOPs / forward FLOPs", "time (ms)",
                              "GFLOP/s (2.5x model)", "speed vs naive"], rows)
            + f"\n\n**Conclusion:** {conclusion}")
    data = {"shape": [batch, heads, n, 64], "flops_over_forward": ratios, "seconds": times, "max_difference": same}
    write_report(out_dir(args), "rule2_one_recompute", "Experiment 3 (rule 2): one recompute of P", body,
                 data=data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
