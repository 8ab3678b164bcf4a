"""Experiment 3 (rule 2): the backward recomputes each P tile once.

    python benchmarks/rule2_one_recompute.py          # B1 H8 N2048 D64
    python benchmarks/rule2_one_recompute.py --quick

Compares the real backward (one recompute of S and P per tile, from which dV, dP, dS, dK, dQ
all come) with the seed's naive structure, built only for this experiment
(``variants.recompute_twice``: after dV, S and P are recomputed a second time for dP, dS, dK
and dQ). FLOPs: TVM's estimate_tir_flops on the matrix products of one (query tile, key tile)
step, relative to the forward's; time from interleaved runs of both compiled kernels (medians),
same process.
"""

from __future__ import annotations

import torch

from common import markdown_table, out_dir, parser, write_report
from tvmflash import analysis, bench, compiler
from variants import compile_variant, recompute_twice


def product_flops(func) -> float:
    """FLOPs of the matrix products (2 x 64 x 64 x D each) of one tile-pair step."""
    return sum(f for f in analysis.pair_flops(func).values() if f == 2.0 * 64 * 64 * 64)


def main() -> int:
    args = parser(__doc__).parse_args()
    batch, heads, n = (1, 2, 512) if args.quick else (1, 8, 2048)
    forward, backward = analysis.fused_kernels(64)
    ratios = {"once": product_flops(backward) / product_flops(forward),
              "twice": product_flops(recompute_twice("backward", backward)) / product_flops(forward)}

    variants = {"once": compiler.compile("llvm", 64, "float32", False, tuned=False),
                "twice": compile_variant(64, "float32", recompute_twice, "two recomputes")}
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
            f"untuned) schedule; medians of {rounds} interleaved rounds. FLOPs: the matrix products of one "
            f"tile-pair step, counted by TVM's estimate_tir_flops on the kernels' IR.\n\n"
            + markdown_table(["backward", "FLOPs / forward FLOPs", "time (ms)",
                              "GFLOP/s (2.5x model)", "speed vs naive"], rows)
            + f"\n\n**Conclusion:** {conclusion}")
    data = {"shape": [batch, heads, n, 64], "flops_over_forward": ratios, "seconds": times, "max_difference": same}
    write_report(out_dir(args), "rule2_one_recompute", "Experiment 3 (rule 2): one recompute of P", body,
                 data=data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
