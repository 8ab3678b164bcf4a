"""Experiment 1: peak memory of forward+backward vs sequence length.

    python benchmarks/memory_scaling.py            # 1K..32K, head dims 64 and 128 (~10 min)
    python benchmarks/memory_scaling.py --quick    # 512 and 1K, head dim 64

For each implementation and length (batch = heads = 1, fp32), a fresh process runs one
forward+backward and reports how much its peak memory (VmHWM, reset after a warm-up) grew beyond
its inputs and outputs (tvmflash/memory.py). Implementations: tvmflash (fused), "standard" (the
unfused TE definitions of the same math, which store N x N matrices) and PyTorch's MATH backend.
A curve stops where the next point would need more than --limit-gb (from its own quadratic
fit) or more than --limit-s seconds (the last point's time x 4 for the baselines, x 2 for
tvmflash). Fits: tvmflash ~ a N, standard ~ b N^2; both extrapolated to 512K tokens.
"""

from __future__ import annotations

import time

import numpy as np

from common import markdown_table, out_dir, parser, plt, write_report
from tvmflash import memory

IMPLEMENTATIONS = {"tvmflash": "tvmflash (fused)", "standard": "standard attention (unfused TE)",
                   "sdpa_math": "PyTorch SDPA MATH"}


def fit_power(lengths, megabytes, power: int) -> float:
    """Least-squares c in MB = c * N^power, over the two largest measured points."""
    n = np.array(lengths[-2:], dtype=float)
    y = np.array(megabytes[-2:], dtype=float)
    return float((y * n**power).sum() / (n ** (2 * power)).sum())


def fitted_slope(lengths, megabytes) -> float:
    """Slope of log(MB) vs log(N) over the measured points of at least 4K (ignores fixed overheads)."""
    pts = [(n, m) for n, m in zip(lengths, megabytes) if n >= 4096 and m > 0]
    if len(pts) < 2:
        pts = [(n, m) for n, m in zip(lengths, megabytes) if m > 0][-2:]
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def growth_word(slope: float) -> str:
    if 0.8 <= slope <= 1.25:
        return "linearly"
    if 1.75 <= slope <= 2.25:
        return "quadratically"
    return f"as N^{slope:.2f} (neither linear nor quadratic)"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--limit-gb", type=float, default=16.0, help="stop a curve above this (default 16)")
    p.add_argument("--limit-s", type=float, default=240.0,
                   help="stop a curve whose next point would take longer than this (default 240)")
    p.add_argument("--head-dims", type=int, nargs="+", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    args = p.parse_args()
    lengths = args.lengths or ([512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768])
    head_dims = args.head_dims or ([64] if args.quick else [64, 128])
    results = {}  # (impl, head_dim) -> (lengths, MB)
    rows, stops = [], []
    for head_dim in head_dims:
        for impl in IMPLEMENTATIONS:
            done_n, done_mb, last_s = [], [], 0.0
            for n in lengths:
                growth = 1 if impl == "tvmflash" else 2
                if len(done_n) >= 2 and impl != "tvmflash":
                    projected = fit_power(done_n, done_mb, 2) * n**2
                    if projected > args.limit_gb * 1024:
                        why = f"not run: ~{projected / 1024:.0f} GB projected (limit {args.limit_gb:.0f} GB)"
                        rows.append((IMPLEMENTATIONS[impl], head_dim, n, why, ""))
                        stops.append(f"{IMPLEMENTATIONS[impl]}, D={head_dim}: stopped before N={n} ({why})")
                        print(f"  {impl} D{head_dim} N{n}: {why}", flush=True)
                        break
                if done_n and last_s * (n / done_n[-1]) ** growth > args.limit_s:
                    why = f"not run: ~{last_s * (n / done_n[-1]) ** growth:.0f} s projected (limit {args.limit_s:.0f} s)"
                    rows.append((IMPLEMENTATIONS[impl], head_dim, n, why, ""))
                    stops.append(f"{IMPLEMENTATIONS[impl]}, D={head_dim}: stopped before N={n} ({why})")
                    print(f"  {impl} D{head_dim} N{n}: {why}", flush=True)
                    break
                start = time.perf_counter()
                mb = memory.peak_added_mb(impl, n, head_dim)
                last_s = time.perf_counter() - start
                print(f"  {impl} D{head_dim} N{n}: {mb:.1f} MB ({last_s:.0f} s)", flush=True)
                done_n.append(n)
                done_mb.append(mb)
                rows.append((IMPLEMENTATIONS[impl], head_dim, n, f"{mb:,.1f}", f"{mb * 2**20 / n:,.0f}"))
            results[(impl, head_dim)] = (done_n, done_mb)

    fits = []
    target_n = 512 * 1024
    extrapolated = {}
    for (impl, head_dim), (ns, mbs) in results.items():
        slope = fitted_slope(ns, mbs)
        power = 1 if impl == "tvmflash" else 2
        at_512k = fit_power(ns, mbs, power) * target_n**power
        extrapolated[(impl, head_dim)] = at_512k
        fits.append((IMPLEMENTATIONS[impl], head_dim, f"{ns[0]}-{ns[-1]}", f"{slope:.2f}", f"N^{power}",
                     f"{at_512k / 1024:,.1f} GB" if at_512k >= 1024 else f"{at_512k:,.0f} MB"))

    figure = None
    if out_dir(args):
        pyplot = plt()
        figure, ax = pyplot.subplots(figsize=(7, 5))
        for (impl, head_dim), (ns, mbs) in results.items():
            ax.loglog(ns, mbs, marker="o", linestyle="-" if head_dim == head_dims[0] else "--",
                      label=f"{IMPLEMENTATIONS[impl]}, D={head_dim}")
        ax.set_xlabel("sequence length (batch = heads = 1)")
        ax.set_ylabel("peak memory added by forward+backward (MB)")
        ax.set_title("Memory of attention forward+backward (fp32, CPU)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    def gb(x):
        return f"{x / 1024:,.1f} GB" if x >= 1024 else f"{x:,.0f} MB"

    flash = {d: fitted_slope(*results[("tvmflash", d)]) for d in head_dims}
    standard = {d: fitted_slope(*results[("standard", d)]) for d in head_dims}
    matrix_gb = 4 * target_n**2 / 2**30
    conclusion = (
        f"tvmflash's memory grows {growth_word(max(flash.values()))} "
        f"(log-log slope {', '.join(f'{v:.2f}' for v in flash.values())} for "
        f"D={'/'.join(map(str, head_dims))}), standard attention's {growth_word(min(standard.values()))} "
        f"({', '.join(f'{v:.2f}' for v in standard.values())}); extrapolated to 512K tokens (B=H=1, fp32): "
        f"tvmflash {' / '.join(gb(extrapolated[('tvmflash', d)]) for d in head_dims)}, standard attention "
        f"{' / '.join(gb(extrapolated[('standard', d)]) for d in head_dims)}, PyTorch MATH "
        f"{' / '.join(gb(extrapolated[('sdpa_math', d)]) for d in head_dims)}. The seed says \"~512 GB vs a few "
        f"GB\": 512 GB is one 512K x 512K matrix in 16-bit; in fp32 one such matrix is {matrix_gb:,.0f} GB.")
    body = ("B = H = 1, fp32, non-causal, one forward + one backward per fresh process; peak RSS added beyond "
            "inputs and outputs.\n\n"
            + markdown_table(["implementation", "head dim", "seqlen", "peak MB added", "bytes per token"], rows)
            + ("\n\nStopped curves:\n\n" + "\n".join(f"- {s}" for s in stops) if stops else "")
            + "\n\nFits (slope of log MB vs log N over the points with N >= 4K, else the last two; extrapolation "
              "with the model through the two largest points):\n\n"
            + markdown_table(["implementation", "head dim", "measured N", "log-log slope", "model", "at 512K tokens"],
                             fits)
            + f"\n\n**Conclusion:** {conclusion}")
    data = {"lengths": lengths, "head_dims": head_dims,
            "results": {f"{impl}/{d}": {"seqlen": ns, "mb": mbs} for (impl, d), (ns, mbs) in results.items()},
            "slopes": {f"{impl}/{d}": fitted_slope(ns, mbs) for (impl, d), (ns, mbs) in results.items()},
            "at_512k_mb": {f"{impl}/{d}": v for (impl, d), v in extrapolated.items()}}
    write_report(out_dir(args), "memory_scaling", "Experiment 1: memory scaling", body, figure, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
