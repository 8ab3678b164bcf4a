"""Single-token decoding against a KV cache: tvmflash.flash_attn_with_kvcache vs torch SDPA.

Decoding reads the whole cache once per token and does ~2 FLOPs per byte: it is bound by the
memory's read bandwidth, which this script measures in the same run (torch's sum over 256 MB,
interleaved with the attention calls) and reports next to the bytes of cache each method reads
per second.

Cases: q (B, 1, 32, 128) against a GQA cache (B, L, 8, 128) in flash-attn's layout, B = 1 filled
to 16K tokens and B = 4 filled to 16K, 12K, 8K, 4K, fp32 and bf16. tvmflash appends the new
token's k and v at cache_seqlens (in place) and attends to the filled part of every sequence.
SDPA (``enable_gqa=True``) attends to each sequence's filled prefix (one call per sequence, as
its lengths differ), twice: on views of the same cache (``transpose(1, 2)``) and on a copy in its
own (B, 8, L, 128) layout, its fastest case. Speed-ups are against the faster of the two.
Timings: medians of interleaved rounds in one process, a pause before each call
(``reference.median_times``).

    python benchmarks/decode.py                 # the table above; writes docs/decode.md
    python benchmarks/decode.py --quick         # small sizes, a few seconds
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from common import markdown_table, out_dir, parser, write_report

from tvmflash import flash_attn_with_kvcache, settings
from tvmflash.reference import geomean, median_times

HEADS, HEADS_K, HEAD_DIM = 32, 8, 128


def cpu_description() -> str:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if f in flags]
    from tvmflash import target

    return f"{model} (LLVM: {target.host_cpu()}; ISA: {' '.join(isa) or 'baseline'}), {os.cpu_count()} CPUs"


def read_bandwidth_fn(megabytes: int):
    x = torch.ones(megabytes * 1024 * 1024 // 4)
    return x.numel() * 4, (lambda: x.sum())


def case(batch: int, lengths: list[int], dtype: torch.dtype, capacity: int, gen: torch.Generator):
    """The tensors and the three calls of one case."""
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k_cache = torch.randn(batch, capacity, HEADS_K, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(batch, capacity, HEADS_K, HEAD_DIM, generator=gen).to(dtype)
    k_new = torch.randn(batch, 1, HEADS_K, HEAD_DIM, generator=gen).to(dtype)
    v_new = torch.randn(batch, 1, HEADS_K, HEAD_DIM, generator=gen).to(dtype)
    seqlens = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)  # + the new token = n keys
    k_bhld, v_bhld = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    qt = q.transpose(1, 2)
    out = {}

    def ours():
        out["ours"] = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)

    def sdpa_views():
        out["sdpa"] = [F.scaled_dot_product_attention(qt[b:b + 1], k_cache[b:b + 1, :n].transpose(1, 2),
                                                      v_cache[b:b + 1, :n].transpose(1, 2), enable_gqa=True)
                       for b, n in enumerate(lengths)]

    def sdpa_bhld():
        out["sdpa_bhld"] = [F.scaled_dot_product_attention(qt[b:b + 1], k_bhld[b:b + 1, :, :n],
                                                           v_bhld[b:b + 1, :, :n], enable_gqa=True)
                            for b, n in enumerate(lengths)]

    def check():
        """The three agree (after the first call wrote the new token into both layouts)."""
        ours()
        for b, n in enumerate(lengths):
            k_bhld[b, :, n - 1], v_bhld[b, :, n - 1] = k_new[b, 0], v_new[b, 0]
        sdpa_views()
        sdpa_bhld()
        ref = torch.cat(out["sdpa_bhld"]).transpose(1, 2).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name in ("ours", "sdpa"):
            got = out[name] if name == "ours" else torch.cat(out[name]).transpose(1, 2)
            err = (got.float() - ref).abs().max().item()
            assert err < tol, f"{name} differs from SDPA by {err}"

    cache_bytes = 2 * sum(lengths) * HEADS_K * HEAD_DIM * k_cache.element_size()
    return cache_bytes, {"tvmflash": ours, "SDPA on cache views": sdpa_views, "SDPA on (B,H,L,D) copy": sdpa_bhld}, check


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--length", type=int, default=16384, help="tokens of the longest sequence")
    args = p.parse_args()
    length, rounds, megabytes = (1024, 3, 64) if args.quick else (args.length, args.rounds, 256)
    gen = torch.Generator().manual_seed(0)
    torch.set_num_threads(settings.num_threads())
    load_before = os.getloadavg()
    bw_bytes, bw_fn = read_bandwidth_fn(megabytes)
    rows, speedups, data = [], [], {"cases": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for batch, lengths in ((1, [length]), (4, [length, length * 3 // 4, length // 2, length // 4])):
            cache_bytes, calls, check = case(batch, lengths, dtype, length, gen)
            check()
            times = median_times({**calls, "read bandwidth": bw_fn}, rounds)
            bandwidth = bw_bytes / times.pop("read bandwidth")
            rate = {name: cache_bytes / t for name, t in times.items()}
            sdpa_best = max(rate["SDPA on cache views"], rate["SDPA on (B,H,L,D) copy"])
            speedup = rate["tvmflash"] / sdpa_best
            speedups.append(speedup)
            sizes = "/".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths)
            name = f"{str(dtype).removeprefix('torch.')} B={batch} L={sizes}"
            rows.append([name, f"{cache_bytes / 2**20:.0f} MiB",
                         *(f"{times[c] * 1e3:.2f} ms, {rate[c] / 1e9:.1f} GB/s" for c in calls),
                         f"{speedup:.1f}x", f"{bandwidth / 1e9:.1f} GB/s", f"{rate['tvmflash'] / bandwidth:.0%}"])
            data["cases"][name] = {"seconds": times, "cache_bytes": cache_bytes, "read_bandwidth": bandwidth,
                                   "speedup": speedup}
    load_after = os.getloadavg()
    data["geomean_speedup"] = geomean(speedups)
    headers = ["case", "cache read", *calls, "speed-up vs best SDPA", "read bandwidth (sum 256 MB)",
               "tvmflash / bandwidth"]
    body = (f"CPU: {cpu_description()}; {settings.num_threads()} threads (tvmflash and torch); load average "
            f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1-minute).\n\n"
            f"{markdown_table(headers, rows)}\n\n"
            f"**Geomean speed-up over SDPA: {data['geomean_speedup']:.1f}x** (medians of {rounds} interleaved rounds; "
            "GB/s = bytes of K and V cache attended to per second).")
    write_report(out_dir(args), "decode", "Single-token decode against a GQA KV cache (flash_attn_with_kvcache)",
                 body, data=data)


if __name__ == "__main__":
    sys.exit(main())
