"""Forward (or backward) kernels of two or more commits, in one process: an A/B without
process drift.

Timing each version in a process of its own measures the machine as much as the code (on a
shared 2-vCPU VM two processes differ by 15 % and more). This script loads the CPU kernel
libraries that earlier commits left in tvmflash's cache directory and calls their ``flash_fwd``
(``--backward``: ``flash_bwd``) in turn on the same tensors, round by round. It checks that
every version's outputs equal this checkout's, bit for bit, and prints the 10th percentile and
the median of each. It needs versions whose forward has the same arguments and tables
(``plan.py``); one with other arguments fails the equality check or raises.

    git checkout OLD && python benchmarks/kernel_ab.py --list   # builds this commit's kernels
    git checkout NEW && python benchmarks/kernel_ab.py --seqlen 128 --threads 2 OLD_ENTRY
    git checkout NEW && python benchmarks/kernel_ab.py --backward --seqlen 16 OLD_ENTRY

``--list`` runs the forward once (compiling it if needed) and prints the cache entry it used;
entries are named by the 24-digit digest of their request.

``--block N``: each version runs N calls in a row, the versions in turn block by block, and the
first quarter of each block is not timed. Called in turn call by call, each version finds the
tensors' cache lines where the other left them: a change of which thread touches which lines
(the task dealing) does not show there. ``--after-linear``: q, k and v come from a torch
``linear`` before each call, as in a model (the lines are then where torch's threads wrote them).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from tvmflash import cache, flash_attn_func, threads, torch_op  # noqa: E402


def _entry(directory: Path, name: str, function: str):
    """A cache entry's ``function``, loaded by ``cache.load`` (its owner, mode and checksum
    checks), on torch's threads as tvmflash runs it (``threads.route``)."""
    if not re.fullmatch(r"[0-9a-f]{24}", name):
        raise SystemExit(f"{name!r} is not a cache entry name (24 hex digits)")
    request = json.loads((directory / f"{name}.json").read_text())["request"]
    loaded = cache.load(name, request, (function,))
    if loaded is None:
        raise SystemExit(f"cache entry {name} cannot be loaded (see the warning above)")
    module, _, so = loaded
    threads.route(so)
    return module[function]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("entries", nargs="*", help="cache entries (digests) to compare with this checkout's kernels")
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--heads-k", type=int, default=None, help="kv heads (default: --heads)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--list", action="store_true", help="print this checkout's cache entry for the problem")
    p.add_argument("--backward", action="store_true", help="compare flash_bwd (dq, dk, dv of one forward)")
    p.add_argument("--block", type=int, default=1, help="calls of one version in a row (see above)")
    p.add_argument("--after-linear", action="store_true", help="q, k, v from a torch linear before each call")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    causal = not args.no_causal
    dtype = getattr(torch, args.dtype)
    heads_k = args.heads_k or args.heads
    q = torch.randn(1, args.seqlen, args.heads, args.head_dim, dtype=dtype)
    k, v = (torch.randn(1, args.seqlen, heads_k, args.head_dim, dtype=dtype) for _ in range(2))
    expected = flash_attn_func(q, k, v, causal=causal)
    call = next(iter(torch_op._calls.values()))  # this checkout's plan of the call above
    directory = cache.safe_directory(create=False)
    if call.kernels._library is None:
        raise SystemExit("this checkout's kernels are not in the cache directory (TVMFLASH_CACHE_DIR)")
    ours = Path(call.kernels._library).stem
    if args.list:
        print(f"this checkout's forward: {ours}")
        return
    # (this checkout's library is loaded from the cache like the others, all on torch's threads)
    function = "flash_bwd" if args.backward else "flash_fwd"
    functions = {f"{name}{' (this checkout)' * (name == ours)}": _entry(directory, name, function)
                 for name in dict.fromkeys([ours, *args.entries])}
    lse = call.new_lse()
    if args.backward:  # (the backward of this checkout's forward, its tables planned by call.backward)
        out, dout = call.forward(q, k, v, lse), torch.randn_like(q)
        expected = call.backward(dout, q, k, v, out, lse)
    outs = {name: [torch.full_like(t, float("nan")) for t in ((q, k, v) if args.backward else (q,))]
            for name in functions}

    def run(name):
        if args.backward:
            functions[name](dout, q, k, v, out, lse, *outs[name], call.scale, *call.window, args.threads,
                            *call._backward_tables)
        else:
            functions[name](q, k, v, outs[name][0], lse, call.scale, *call.window, args.threads, *call.tables,
                            *call.mods)

    for name in functions:
        run(name)
        if not all(torch.equal(a, b) for a, b in zip(outs[name], expected if args.backward else (expected,))):
            raise SystemExit(f"{name}: outputs differ from this checkout's (other arguments or numerics)")
    times = {name: [] for name in functions}
    if args.after_linear:  # (the projection's output holds q, k and v: the kernels read views of it)
        hidden = torch.randn(args.seqlen, args.heads * args.head_dim, dtype=dtype)
        weight = torch.randn(3 * args.heads * args.head_dim, args.heads * args.head_dim, dtype=dtype) * 0.02
        projected = torch.nn.functional.linear(hidden, weight).view(1, args.seqlen, 3, args.heads, args.head_dim)
        q, k, v = (projected[:, :, i, :heads_k if i else args.heads] for i in range(3))

    def call_of(name):
        if args.after_linear:
            torch.nn.functional.linear(hidden, weight, out=projected.view(args.seqlen, -1))
        start = time.perf_counter()
        run(name)
        return time.perf_counter() - start

    untimed = args.block // 4
    for _ in range(max(1, args.rounds // args.block)):
        for name in functions:
            for i in range(args.block):
                elapsed = call_of(name)
                if i >= untimed:
                    times[name].append(elapsed)
    kind = "backward" if args.backward else "forward"
    print(f"{machine()}\n{kind} B1 N{args.seqlen} H{args.heads}/{heads_k} D{args.head_dim} {args.dtype}"
          f"{' causal' * causal}, "
          f"{args.threads} threads, {args.rounds} rounds interleaved in blocks of {args.block}"
          f"{', q, k, v from a linear' * args.after_linear}\n")
    print("| kernels | p10 (us) | median (us) |\n|---|---|---|")
    for name, t in times.items():
        t.sort()
        print(f"| {name} | {t[len(t) // 10] * 1e6:.1f} | {statistics.median(t) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
