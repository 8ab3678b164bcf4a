"""Ring attention (issue 11): peak memory per rank, traffic, time, and what fits in 20 GB.

    python benchmarks/ring_scaling.py             # B1 H8 D64 fp32 causal zigzag, N 8K and 16K, worlds 1 2 4 (~5 min)
    python benchmarks/ring_scaling.py --quick     # N 1K, worlds 1 2 (~1 min)
    python benchmarks/ring_scaling.py --seqlens 8192 --dtypes float32 bfloat16   # memory table per dtype

Each point starts ``world`` fresh processes on 127.0.0.1 (gloo), each running
``python -m tvmflash.distributed.demo --json --no-check`` on its shard; a world of 1 also runs
plain ``flash_attn_func`` on the whole sequence (``--impl single``) for comparison. Threads: the
machine's cores split between the ranks (at least one each), so with more ranks than cores the
ranks time-share the cores. Per rank the demo reports:

- *peak added*: growth of the process's peak RSS (VmHWM, reset just before the call) during one
  forward+backward beyond what was resident before it (q, k, v, dout of its shard, the process's
  libraries); it holds out, lse, dq, dk, dv and the ring's buffers;
- bytes sent by the ring (counted at the send calls) against the formula: forward (world-1) K/V
  blocks, backward (world-1) K/V blocks + world fp32 dK/dV blocks;
- forward+backward wall time, time in block kernels + merges, time blocked waiting for transfers.

The memory table has one set of rows per ``--dtypes`` entry (16-bit inputs: K/V travel in 16
bits, partial results stay fp32); the extrapolation and the paper columns use the first dtype.

From the per-rank bytes per token (peak added + the shard's inputs) and the per-process baseline
this extrapolates the longest sequence that fits in 20 GB, and on paper what 512K and 1M tokens
need on 8 and 64 ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, markdown_table, out_dir, parser, write_report

GB = 2**30
MB = 2**20


def cpu_description() -> str:
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0))
    mem = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0) / 2**20
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
            f"{cores} CPUs, ISA {' '.join(isa)}, {mem:.0f} GB RAM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, demo_args: list[str], timeout: float) -> dict:
    """Run the demo on ``world`` local processes; returns rank 0's JSON report."""
    cores = len(os.sched_getaffinity(0))
    threads = str(max(1, cores // world))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "TVM_NUM_THREADS": threads, "OMP_NUM_THREADS": threads, "TVMFLASH_QUIET": "1"}
    cmd = [sys.executable, "-m", "tvmflash.distributed.demo", "--json", *demo_args]
    procs = []
    try:
        for rank in range(world):
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        out, err = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if procs[0].returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} (world {world}) failed:\n{err[-3000:]}")
    return json.loads(lines[-1])


def demo_args(seqlen: int, args, dtype: str, impl: str = "ring", repeat: int = 1) -> list[str]:
    out = ["--seqlen", str(seqlen), "--batch", "1", "--heads", str(args.heads), "--kv-heads", str(args.heads),
           "--head-dim", str(args.head_dim), "--dtype", dtype, "--layout", args.layout, "--impl", impl,
           "--no-check", "--repeat", str(repeat)]
    return out + ([] if args.causal else ["--no-causal"])


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--seqlens", type=int, nargs="+", default=None, help="total tokens (default 8192 16384)")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="default 1 2 4")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "float16", "bfloat16"),
                   help="input dtypes to measure (the first one feeds the extrapolation)")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "ring"))
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--budget-gb", type=float, default=20.0)
    p.add_argument("--validate", type=int, nargs=2, metavar=("N", "WORLD"), default=None,
                   help="also measure one large point to check the extrapolation (e.g. 65536 4)")
    p.add_argument("--gpu-tflops", type=float, default=400.0,
                   help="paper column: attention TFLOP/s of one GPU rank (bf16), for the bandwidth that hides transfers")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--from-json", type=Path, default=None,
                   help="re-render the report from a ring_scaling.json written before (no measuring)")
    args = p.parse_args()
    args.seqlens = args.seqlens or ([1024] if args.quick else [8192, 16384])
    args.worlds = args.worlds or ([1, 2] if args.quick else [1, 2, 4])
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for key, value in saved.get("config", {}).items():
            setattr(args, key, value)
        if "dtypes" not in saved.get("config", {}):  # written before --dtypes
            args.dtypes = [saved["config"]["dtype"]]
        runs = [(d["impl"], d["world"], d["seqlen"], {"ranks": d["ranks"]}, d.get("dtype", args.dtypes[0]))
                for d in saved["runs"]]
    else:
        args.load_average = os.getloadavg()[0]
        runs = measure(args)
    body, data = render(args, runs)
    config = {key: getattr(args, key, None) for key in ("seqlens", "worlds", "heads", "head_dim", "dtypes", "layout",
                                                         "causal", "budget_gb", "validate", "load_average")}
    write_report(out_dir(args), "ring_scaling", "Ring attention: memory, traffic and time per rank", body,
                 data={"config": config, "runs": data})
    return 0


def measure(args) -> list:
    runs = []  # (label, world, N, rank 0's report, dtype)
    for dtype in args.dtypes:
        for n_total in args.seqlens:
            started = time.time()
            runs.append(("single", 1, n_total, launch(1, demo_args(n_total, args, dtype, "single"), args.timeout),
                         dtype))
            for world in args.worlds:
                runs.append(("ring", world, n_total, launch(world, demo_args(n_total, args, dtype), args.timeout),
                             dtype))
            print(f"{dtype} N={n_total}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    if args.validate:
        n_total, world = args.validate
        dtype = args.dtypes[0]
        runs.append(("ring", world, n_total, launch(world, demo_args(n_total, args, dtype), args.timeout), dtype))
    return runs


def render(args, runs) -> tuple[str, list]:
    seqlens, worlds = args.seqlens, args.worlds
    element_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}
    bytes_el = element_bytes[args.dtypes[0]]

    # ---- memory and time table
    rows, data = [], []
    single_time = {(n, dt): r["ranks"][0]["fwd_bwd_s"] for label, _, n, r, dt in runs if label == "single"}
    for label, world, n_total, report, dtype in runs:
        ranks = report["ranks"]
        local = ranks[0]["local_tokens"]
        added = max(r["peak_added_mb"] for r in ranks)
        peak = max(r["peak_mb"] for r in ranks)
        inputs = ranks[0]["inputs_mb"]
        wall = max(r["fwd_bwd_s"] for r in ranks)
        compute = sum(r["stats"].get("forward", {}).get("compute_s", 0) + r["stats"].get("backward", {}).get("compute_s", 0)
                      for r in ranks)
        waited = max(r["stats"].get("forward", {}).get("wait_s", 0) + r["stats"].get("backward", {}).get("wait_s", 0)
                     for r in ranks)
        per_token = (added + inputs) * MB / local
        name = "flash_attn_func (1 process)" if label == "single" else f"{args.layout} ring"
        # in units of one fp32 shard of q (ring.py counts its buffers in these units)
        units = added * MB / (local * args.heads * args.head_dim * 4)
        single = single_time.get((n_total, dtype))
        rows.append((name, dtype, world, n_total, local, f"{added:,.1f}", f"{units:.1f}", f"{inputs:,.1f}",
                     f"{per_token:,.0f}", f"{peak:,.0f}", f"{wall:.2f}", f"{wall / single:.2f}x" if single else "",
                     f"{compute:.2f}" if label == "ring" else "", f"{waited:.3f}" if label == "ring" else ""))
        data.append({"impl": label, "dtype": dtype, "world": world, "seqlen": n_total, "local_tokens": local,
                     "peak_added_mb": added, "peak_added_fp32_q_shards": units,
                     "inputs_mb": inputs, "bytes_per_token": per_token, "process_peak_mb": peak, "fwd_bwd_s": wall,
                     "compute_s_all_ranks": compute, "max_wait_s": waited,
                     "baseline_mb": peak - added - inputs, "ranks": ranks})
    table = markdown_table(
        ("implementation", "dtype", "world", "N total", "tokens / rank", "peak added MB / rank",
         "peak added / fp32 q shard", "inputs MB / rank", "bytes / token / rank (added + inputs)", "process peak MB",
         "fwd+bwd s (slowest rank)", "vs 1 process", "kernel+merge s (all ranks)", "waited for transfers s"), rows)

    # ---- traffic vs formula
    traffic_rows = []
    for d in data:
        if d["impl"] != "ring" or d["world"] == 1:
            continue
        world, n = d["world"], d["local_tokens"]
        kv = 2 * n * args.heads * args.head_dim * element_bytes[d["dtype"]]
        dkv = 2 * n * args.heads * args.head_dim * 4
        fwd_formula, bwd_formula = (world - 1) * kv, (world - 1) * kv + world * dkv
        st = d["ranks"][0]["stats"]
        traffic_rows.append((d["dtype"], world, d["seqlen"], f"{kv / MB:.1f}", f"{dkv / MB:.1f}",
                             f"{st['forward']['bytes_sent'] / MB:.1f} / {fwd_formula / MB:.1f}",
                             f"{st['backward']['bytes_sent'] / MB:.1f} / {bwd_formula / MB:.1f}",
                             f"{st['forward']['messages']} / {st['backward']['messages']}"))
    traffic = markdown_table(("dtype", "world", "N total", "K/V block MB (fwd, per step)", "fp32 dK/dV block MB (bwd, per step)",
                              "forward sent MB: measured / formula", "backward sent MB: measured / formula",
                              "messages fwd / bwd"), traffic_rows)

    # ---- extrapolation: per-rank memory = baseline + c * local tokens
    largest = max(seqlens)
    fit = {}
    for d in data:
        if d["seqlen"] == largest and d["dtype"] == args.dtypes[0]:
            fit[(d["impl"], d["world"])] = d
    budget = args.budget_gb * GB
    fit_rows = []
    for (impl, world), d in sorted(fit.items(), key=lambda kv: (kv[0][0] != "single", kv[0][1])):
        c = d["bytes_per_token"]
        base = d["baseline_mb"] * MB
        # c is per local token: rank memory = base + c N / world; all ranks together = world base + c N.
        per_rank_budget = world * (budget - base) / c  # every rank has its own 20 GB (a GPU each)
        machine_budget = (budget - world * base) / c  # all ranks share one 20 GB machine
        fit_rows.append(("flash_attn_func (1 process)" if impl == "single" else f"{args.layout} ring", world,
                         f"{c:,.0f}", f"{base / MB:,.0f}", f"{per_rank_budget / 1e3:,.0f}K",
                         f"{machine_budget / 1e3:,.0f}K"))
    fits = markdown_table(("implementation", "world", "bytes / token / rank", "baseline MB / process",
                           f"longest N, {args.budget_gb:g} GB per rank", f"longest N, {args.budget_gb:g} GB machine shared by all ranks"),
                          fit_rows)

    # ---- paper: 512K and 1M tokens on 8 and 64 ranks, from the largest world's per-rank numbers
    ring = fit.get(("ring", max(worlds)))
    single = fit.get(("single", 1))
    paper_rows, core_rate = [], None
    if ring is not None and single is not None:
        c, base = ring["bytes_per_token"], ring["baseline_mb"] * MB
        cores = len(os.sched_getaffinity(0))
        # This machine's rate per core, from the single-process call: fwd 4 N^2 H D, bwd 2.5x, causal halves.
        flops = 3.5 * 4 * largest**2 * args.heads * args.head_dim * (0.5 if args.causal else 1)
        core_rate = flops / (single["fwd_bwd_s"] * cores)
        for n_total in (512 * 1024, 1024 * 1024):
            for world in (8, 64):
                n = n_total // world
                kv = 2 * n * args.heads * args.head_dim * bytes_el
                dkv = 2 * n * args.heads * args.head_dim * 4
                # A zigzag causal step is a half block (the diagonal step too, about): fwd+bwd FLOPs.
                step_flops = 3.5 * 4 * n * n * args.heads * args.head_dim * (0.5 if args.causal else 1)
                step_s = step_flops / core_rate
                gpu_s = step_flops / (args.gpu_tflops * 1e12)
                kv16 = kv * 2 // bytes_el  # bf16 K/V on a GPU; dK/dV stay fp32
                paper_rows.append((f"{n_total // 1024}K", world, f"{n:,}", f"{(base + c * n) / GB:.1f}",
                                   f"{kv / MB:.0f}", f"{(kv + dkv) / MB:.0f}", f"{step_flops / 1e12:.2f}",
                                   f"{step_s:,.0f}", f"{world * step_s / 3600:,.1f}", f"{(2 * kv + dkv) / step_s / MB:,.1f}",
                                   f"{gpu_s * 1e3:.1f}", f"{(2 * kv16 + dkv) / gpu_s / GB:,.0f}"))
    paper = markdown_table(("N", "ranks", "tokens / rank", "GB / rank (measured bytes/token x tokens + baseline)",
                            "fwd step: K/V MB", "bwd step: K/V + fp32 dK/dV MB", "TFLOP / rank / step (fwd+bwd)",
                            "s / step on one core here", "h per fwd+bwd (world steps)",
                            "MB/s per link to hide the transfers", f"GPU at {args.gpu_tflops:g} TFLOP/s: ms / step",
                            "GPU: GB/s per link to hide the transfers (bf16 K/V)"), paper_rows)
    if core_rate:
        paper += f"\n\n(per-core rate measured here: {core_rate / 1e9:.0f} GFLOP/s, from the single-process call at N={largest})"

    body = (f"CPU: {cpu_description()}\n\n"
            f"Problem: B1 H{args.heads} (K/V heads {args.heads}) D{args.head_dim} {' and '.join(args.dtypes)}, "
            f"{'causal' if args.causal else 'non-causal'}, {args.layout} layout; one forward+backward per fresh set "
            f"of processes on 127.0.0.1 (gloo); threads per rank = max(1, cores / world)."
            + (f" Load average (1 min) when measuring began: {args.load_average:.1f} on "
               f"{len(os.sched_getaffinity(0))} CPUs (other work on the cores makes the times indicative only; "
               f"the memory is per process)." if getattr(args, "load_average", None) is not None else "")
            + "\n\n"
            "*peak added / fp32 q shard*: the peak in units of one fp32 shard of q (n x H x D x 4 bytes), the unit "
            "ring.py counts its buffers in (forward 6, backward 12; 16-bit K/V halve theirs), on top of which come "
            "the kernels' workspace (backward: 3 fp32 copies of the call's q rows and 5 of its k rows) and the "
            "outputs (out, dq, dk, dv).\n\n"
            f"#### Peak memory per rank and time\n\n{table}\n\n"
            f"#### Traffic per call (rank 0; per step: one block of each kind)\n\n{traffic}\n\n"
            f"#### Longest sequence in {args.budget_gb:g} GB (extrapolated from N = {largest}, {args.dtypes[0]}, with the "
            f"per-rank bytes/token and baseline above)\n\n{fits}\n\n"
            f"#### On paper: 512K and 1M tokens\n\n{paper}\n")
    return body, data


if __name__ == "__main__":
    sys.exit(main())
