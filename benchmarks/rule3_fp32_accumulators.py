"""Experiment 4 (rule 3): accumulate dQ, dK, dV in fp32, cast once at the end.

    python benchmarks/rule3_fp32_accumulators.py          # N in 512..16K, fp16 and bf16 inputs
    python benchmarks/rule3_fp32_accumulators.py --quick  # N in 256, 2K, fp16 inputs

16-bit inputs. The real kernels keep the running dQ/dK/dV sums in fp32; the experiment variant
(``variants.low_precision_accumulators``, built only here) rounds them to that dtype after every
query tile (dK, dV) or key tile (dQ), as a kernel accumulating in the input dtype would.
PyTorch's CPU attention backward is measured alongside (FLASH and MATH backends). Errors:
max |grad - ref| / max |ref| over dq, dk, dv against float64 math on the same 16-bit inputs.
The report also says whether the variant's gradients differ from the real kernels' at all
(a compiler that silently keeps the accumulators in fp32 would make them identical).
"""

from __future__ import annotations

import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import markdown_table, out_dir, parser, plt, reference_f64, relative_error, write_report
from tvmflash import compiler
from variants import compile_variant, low_precision_accumulators, vector_products_for_experiments


def tvmflash_grads(kernels, q, k, v, dout):
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1])
    kernels.forward(q, k, v, out, lse)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads)
    return grads


def sdpa_grads(backend, q, k, v, dout):
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
    return [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, dout.transpose(1, 2))]


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--dtypes", nargs="+", default=None, choices=["float16", "bfloat16"])
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    args = p.parse_args()
    if vector_products_for_experiments():  # (AMX keeps the sums the bf16 variant rounds in tile registers)
        print(f"bf16 kernels on {os.environ['TVMFLASH_BF16_PRODUCTS']} products in this experiment, not AMX")
    lengths = args.lengths or ([256, 2048] if args.quick else [512, 2048, 8192, 16384])
    dtypes = args.dtypes or (["float16"] if args.quick else ["float16", "bfloat16"])
    short = {"float16": "fp16", "bfloat16": "bf16"}
    errors, identical, rows = {}, {}, []  # errors[dtype][method] = [err per length]
    for dtype in dtypes:
        fp32_acc = compiler.compile("llvm", 64, dtype, False, tuned=False)
        low_acc = compile_variant(64, dtype, low_precision_accumulators(dtype), f"{dtype} accumulators")
        methods = {
            "tvmflash, fp32 accumulators": lambda *a: tvmflash_grads(fp32_acc, *a),
            f"{short[dtype]} accumulators (experiment)": lambda *a: tvmflash_grads(low_acc, *a),
            "PyTorch SDPA FLASH": lambda *a: sdpa_grads(SDPBackend.FLASH_ATTENTION, *a),
            "PyTorch SDPA MATH": lambda *a: sdpa_grads(SDPBackend.MATH, *a),
        }
        names = list(methods)
        errors[dtype] = {name: [] for name in methods}
        identical[dtype] = []
        gen = torch.Generator().manual_seed(0)
        for n in lengths:
            q, k, v, dout = (torch.randn(1, n, 2, 64, generator=gen).to(getattr(torch, dtype)) for _ in range(4))
            _, _, *ref = reference_f64(q, k, v, dout, causal=False)
            grads = {name: method(q, k, v, dout) for name, method in methods.items()}
            same = all(torch.equal(a, b) for a, b in zip(grads[names[0]], grads[names[1]]))
            identical[dtype].append(same)
            line = [short[dtype], n]
            for name in methods:
                err = max(relative_error(g, r) for g, r in zip(grads[name], ref))
                errors[dtype][name].append(err)
                line.append(f"{err:.1e}" + (" (bit-identical to fp32 acc.)" if same and name == names[1] else ""))
            line.append(f"{errors[dtype][names[1]][-1] / errors[dtype][names[0]][-1]:.1f}x")
            rows.append(line)
            print(f"  {dtype} N={n}: " + ", ".join(line[2:]), flush=True)

    figure = None
    if out_dir(args):
        pyplot = plt()
        figure, ax = pyplot.subplots(figsize=(7, 5))
        markers = {"float16": "o", "bfloat16": "s"}
        for dtype in dtypes:
            for i, (name, errs) in enumerate(errors[dtype].items()):
                note = " (bit-identical to fp32 acc.)" if i == 1 and all(identical[dtype]) else ""
                ax.loglog(lengths, errs, marker="x" if note else markers[dtype],
                          linestyle="-" if dtype == "float16" else "--", label=f"{short[dtype]} inputs: {name}{note}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("max relative gradient error vs float64")
        ax.set_title("Rule 3: gradient accumulators in fp32 vs the input dtype (D=64)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))

    parts = []
    for dtype in dtypes:
        names = list(errors[dtype])
        ours, low = errors[dtype][names[0]], errors[dtype][names[1]]
        if all(identical[dtype]):
            parts.append(f"{short[dtype]}: the {short[dtype]}-accumulator variant gave gradients bit-identical to the "
                         f"fp32 kernels at every length, so the compiled variant did not round its accumulators "
                         f"(no evidence either way for bf16)")
            continue
        trend = "grows" if low[-1] > 1.5 * low[0] else "does not grow much"
        parts.append(f"{short[dtype]}: with {short[dtype]} accumulators the error {trend} with the sequence length "
                     f"({low[0]:.1e} -> {low[-1]:.1e} from N={lengths[0]} to {lengths[-1]}, "
                     f"{low[-1] / ours[-1]:.1f}x the fp32 accumulators' {ours[-1]:.1e} at N={lengths[-1]}); "
                     f"with fp32 accumulators it goes {ours[0]:.1e} -> {ours[-1]:.1e}")
    for dtype in dtypes:
        errs = errors[dtype]
        ours = errs["tvmflash, fp32 accumulators"]
        parts.append(f"{short[dtype]} at N={lengths[-1]}: PyTorch FLASH's error is "
                     f"{errs['PyTorch SDPA FLASH'][-1] / ours[-1]:.1f}x tvmflash's, MATH's "
                     f"{errs['PyTorch SDPA MATH'][-1] / ours[-1]:.1f}x")
    conclusion = "; ".join(parts) + "."
    headers = ["inputs", "seqlen", "tvmflash, fp32 accumulators", "16-bit accumulators (experiment)",
               "PyTorch SDPA FLASH", "PyTorch SDPA MATH", "16-bit acc. / fp32 acc."]
    body = ("B1 H2 D64, non-causal; error = max |grad - ref| / max |ref| over dq, dk, dv (ref: float64 on the same "
            "16-bit inputs).\n\n" + markdown_table(headers, rows) + f"\n\n**Conclusion:** {conclusion}")
    data = {"lengths": lengths, "errors": errors, "identical": identical}
    write_report(out_dir(args), "rule3_fp32_accumulators", "Experiment 4 (rule 3): fp32 accumulators", body,
                 figure, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
