"""Programmable attention (issue 10): tvmflash's flex_attention and flash-attn variants vs PyTorch.

    python benchmarks/flex.py [--rounds 7] [--quick] [--markdown FILE]

1. Forward, B1 H8 N2048 D64 fp32, vs ``torch.compile(flex_attention)`` (PyTorch's only fused
   CPU flex path; its backward does not exist on CPUs): causal, softcap + causal, sliding window
   256, document masks (random boundaries, causal within documents).
2. Forward + backward of the same cases vs SDPA with the equivalent dense boolean mask (softcap:
   no SDPA equivalent, vs the materialised float32 attention with autograd).
3. Block sparsity: sliding window 256 at N = 8192, forward + backward, vs our own dense causal.
4. softcap's cost: flash_attn_func with softcap vs without, causal, forward + backward.

Same process, candidates interleaved per round, medians (tvmflash.reference.median_times).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention as torch_flex

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, markdown_table  # noqa: E402
from tvmflash import create_block_mask, flash_attn_func, flex_attention  # noqa: E402
from tvmflash.reference import geomean, median_times, reference_attention  # noqa: E402

SOFTCAP = 20.0


def cases(n: int, gen: torch.Generator) -> dict:
    """name -> (score_mod, mask_mod, dense bool mask (Nq, Nk) for SDPA)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    cuts = sorted(torch.randperm(n - 1, generator=gen)[:6].add(1).tolist())
    document = torch.zeros(n, dtype=torch.int32)
    for c in cuts:
        document[c:] += 1

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    def documents(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    return {
        "causal": (None, causal, j <= i),
        "softcap + causal": (softcap, causal, j <= i),
        "sliding window 256": (None, window, (j <= i) & (i - j < 256)),
        "document mask": (None, documents, (document[:, None] == document[None, :]) & (j <= i)),
    }


def dense_softcap_attention(q, k, v, mask):
    """The materialised fp32 attention (autograd through it), (B, H, N, D) layout."""
    out, _ = reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), softcap=SOFTCAP, mask=mask,
                                 dtype=torch.float32)
    return out.transpose(1, 2)


def forward_only(fn, q, k, v):
    with torch.no_grad():
        fn(q, k, v)


def forward_and_backward(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    torch.autograd.grad(out, leaves, dout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    n, heads, long_n = (256, 2, 1024) if args.quick else (2048, 8, 8192)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, n, 64, generator=gen) for _ in range(4))
    compiled_flex = torch.compile(torch_flex)
    rows, fwd_ratios, fb_ratios = [], [], []
    for name, (score_mod, mask_mod, dense) in cases(n, gen).items():
        mask = create_block_mask(mask_mod, None, None, n, n)
        ours = lambda q, k, v, s=score_mod, m=mask: flex_attention(q, k, v, score_mod=s, block_mask=m)  # noqa: E731
        theirs = lambda q, k, v, s=score_mod, m=mask: compiled_flex(q, k, v, score_mod=s, block_mask=m)  # noqa: E731
        if score_mod is None:
            sdpa = lambda q, k, v, d=dense: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=d)  # noqa: E731
        else:
            sdpa = lambda q, k, v, d=dense: dense_softcap_attention(q, k, v, d)  # noqa: E731
        with torch.no_grad():
            torch.testing.assert_close(ours(q, k, v), theirs(q, k, v), atol=5e-5, rtol=0)
        times = median_times({
            "ours fwd": lambda: forward_only(ours, q, k, v),
            "torch.compile(flex) fwd": lambda: forward_only(theirs, q, k, v),
            "ours fwd+bwd": lambda: forward_and_backward(ours, q, k, v, dout),
            "sdpa fwd+bwd": lambda: forward_and_backward(sdpa, q, k, v, dout),
        }, args.rounds)
        fwd = times["torch.compile(flex) fwd"] / times["ours fwd"]
        fb = times["sdpa fwd+bwd"] / times["ours fwd+bwd"]
        fwd_ratios.append(fwd)
        fb_ratios.append(fb)
        reference = "SDPA (dense mask)" if score_mod is None else "materialised fp32 attention"
        rows.append((name, f"{times['ours fwd'] * 1e3:.1f}", f"{times['torch.compile(flex) fwd'] * 1e3:.1f}",
                     f"{fwd:.2f}x", f"{times['ours fwd+bwd'] * 1e3:.1f}", f"{times['sdpa fwd+bwd'] * 1e3:.1f}",
                     f"{fb:.2f}x ({reference})"))
        print(f"  {name}: fwd {fwd:.2f}x torch.compile(flex), fwd+bwd {fb:.2f}x", flush=True)

    # block sparsity at length: window 256 vs dense causal, both ours
    ql, kl, vl, dl = (torch.randn(1, heads, long_n, 64, generator=gen) for _ in range(4))
    window_mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 256), None, None, long_n, long_n)
    causal_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, long_n, long_n)
    sparse = median_times({
        "window": lambda: forward_and_backward(lambda *t: flex_attention(*t, block_mask=window_mask), ql, kl, vl, dl),
        "causal": lambda: forward_and_backward(lambda *t: flex_attention(*t, block_mask=causal_mask), ql, kl, vl, dl),
        "causal flash_attn_func": lambda: forward_and_backward(
            lambda *t: flash_attn_func(*(x.transpose(1, 2) for x in t), causal=True).transpose(1, 2), ql, kl, vl, dl),
    }, max(3, args.rounds // 2))
    window_gain = sparse["causal"] / sparse["window"]

    # softcap's cost in flash_attn_func (B, N, H, D layout)
    qf, kf, vf, df = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    cap = median_times({
        "plain": lambda: forward_and_backward(lambda *t: flash_attn_func(*t, causal=True), qf, kf, vf, df),
        "softcap": lambda: forward_and_backward(lambda *t: flash_attn_func(*t, causal=True, softcap=SOFTCAP), qf, kf,
                                                vf, df),
    }, args.rounds)
    softcap_cost = cap["softcap"] / cap["plain"] - 1

    lines = [f"machine: {machine()}", f"command: python benchmarks/flex.py {' '.join(argv or sys.argv[1:])}", "",
             f"B1 H{heads} N{n} D64 fp32, medians of {args.rounds} interleaved rounds", "",
             markdown_table(["case", "ours fwd ms", "torch.compile(flex) fwd ms", "fwd speedup", "ours fwd+bwd ms",
                             "reference fwd+bwd ms", "fwd+bwd speedup"], rows), "",
             f"forward vs torch.compile(flex_attention), geomean: **{geomean(fwd_ratios):.2f}x**; "
             f"forward+backward vs the dense references, geomean: **{geomean(fb_ratios):.2f}x**", "",
             f"sliding window 256 at N={long_n} (B1 H{heads} D64 fp32), forward+backward: "
             f"{sparse['window'] * 1e3:.0f} ms vs dense causal {sparse['causal'] * 1e3:.0f} ms (flash_attn_func causal "
             f"{sparse['causal flash_attn_func'] * 1e3:.0f} ms): **{window_gain:.1f}x** (ideal ~{long_n / 2 / 256:.0f}x)",
             "",
             f"softcap {SOFTCAP:g} + causal vs causal, flash_attn_func forward+backward: **+{softcap_cost * 100:.0f} %**"]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
