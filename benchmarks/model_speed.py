"""Speed inside a model (issue 23): tvmflash next to torch ops, against SDPA, in one process.

Three measurements, each interleaving tvmflash and SDPA call by call (medians of many rounds,
ratios tvmflash / SDPA), so that both see the same machine load:

* ``fixed``: the fixed cost per call at tiny shapes (forward B1 N16 H8 D64, N128; bf16 decode
  step against a 128- and 1,030-token cache, GQA 8/2);
* ``linear``: a torch ``linear`` right before the attention call (the pattern every model
  has), bf16 decode and fp32 forward: the cost of two thread pools fighting shows here;
* ``generate``: transformers ``generate()`` with an 8-layer Llama from a config (GQA 8/2,
  D64, random weights), bf16 and fp32, short and long prompts (tokens/s), the implementations
  alternated run by run in this process (``--only`` runs one, for a process of its own).

The load average is printed with the results: on a shared machine the numbers are preliminary.

    python benchmarks/model_speed.py                 # all three
    python benchmarks/model_speed.py fixed linear --rounds 2000
    python benchmarks/model_speed.py generate --only tvm --prompts 32 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import tvmflash  # noqa: E402
from tvmflash import flash_attn_func, flash_attn_with_kvcache  # noqa: E402


def interleaved(cases: dict, rounds: int, warmup: int = 20) -> dict:
    """Median seconds per call of each case, the cases called in turn round by round."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _row(label: str, ours: float, sdpa: float) -> str:
    return f"| {label} | {ours * 1e6:.1f} | {sdpa * 1e6:.1f} | {ours / sdpa:.2f} |"


def _table(title: str, rows: list[str]) -> None:
    print(f"\n{title}\n\n| case | tvmflash (us) | SDPA (us) | ratio |\n|---|---|---|---|")
    print("\n".join(rows), flush=True)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _decode_case(dtype, cache_len: int, heads=8, heads_k=2, head_dim=64, capacity=2048):
    """One decode step: q (1, 1, H, D) against the first ``cache_len`` rows of a flash-attn
    layout cache, and SDPA on the same rows in its (B, H, N, D) layout (a contiguous copy, as
    transformers' cache holds)."""
    k_cache = torch.randn(1, capacity, heads_k, head_dim, dtype=dtype)
    v_cache = torch.randn(1, capacity, heads_k, head_dim, dtype=dtype)
    q = torch.randn(1, 1, heads, head_dim, dtype=dtype)
    k_sdpa, v_sdpa = (_bhsd(c[:, :cache_len]).contiguous() for c in (k_cache, v_cache))
    q_sdpa = _bhsd(q)

    def ours():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_len)

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)

    torch.testing.assert_close(_bhsd(ours()).float(), sdpa().float(), atol=2e-2, rtol=2e-2)
    return ours, sdpa


def _forward_case(dtype, seqlen: int, heads=8, head_dim=64, causal=True):
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, dtype=dtype) for _ in range(3))
    qs, ks, vs = (_bhsd(t) for t in (q, k, v))

    def ours():
        return flash_attn_func(q, k, v, causal=causal)

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    torch.testing.assert_close(_bhsd(ours()).float(), sdpa().float(), atol=2e-2, rtol=2e-2)
    return ours, sdpa


def fixed_cost(rounds: int) -> None:
    rows = []
    with torch.inference_mode():
        for label, (ours, sdpa) in (
                ("forward fp32 B1 N16 H8 D64 causal", _forward_case(torch.float32, 16)),
                ("forward bf16 B1 N16 H8 D64 causal", _forward_case(torch.bfloat16, 16)),
                ("forward fp32 B1 N128 H8 D64 causal", _forward_case(torch.float32, 128)),
                ("decode bf16 H8/2 D64, 128-token cache", _decode_case(torch.bfloat16, 128)),
                ("decode bf16 H8/2 D64, 1030-token cache", _decode_case(torch.bfloat16, 1030)),
                ("decode fp32 H8/2 D64, 128-token cache", _decode_case(torch.float32, 128))):
            t = interleaved({"ours": ours, "sdpa": sdpa}, rounds)
            rows.append(_row(label, t["ours"], t["sdpa"]))
    _table("Fixed cost per call (median per call)", rows)


def after_linear(rounds: int) -> None:
    """linear (hidden 512 -> 2048, one token or the prompt) right before the attention call."""
    rows = []
    with torch.inference_mode():
        for label, dtype, (ours, sdpa), tokens in (
                ("linear + decode bf16, 1030-token cache", torch.bfloat16, _decode_case(torch.bfloat16, 1030), 1),
                ("linear + decode fp32, 1030-token cache", torch.float32, _decode_case(torch.float32, 1030), 1),
                ("linear + forward fp32 N128 causal", torch.float32, _forward_case(torch.float32, 128), 128)):
            x = torch.randn(tokens, 512, dtype=dtype)
            w = torch.randn(2048, 512, dtype=dtype)
            t = interleaved({"linear": lambda: F.linear(x, w), "ours": lambda: (F.linear(x, w), ours()),
                             "sdpa": lambda: (F.linear(x, w), sdpa())}, rounds)
            rows.append(_row(label, t["ours"], t["sdpa"]) + f" (linear alone {t['linear'] * 1e6:.1f} us)")
    _table("A torch op right before the attention (median per pair)", rows)


def _llama(dtype, implementation: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                         dtype=dtype).eval()


def generate(prompts: list[int], new_tokens: int, runs: int, only: str | None) -> None:
    from tvmflash.integrations import transformers as tvm_hf

    names = {"tvm": tvm_hf.register(), "sdpa": "sdpa"}
    if only:
        names = {only: names[only]}
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        models = {short: _llama(dtype, impl) for short, impl in names.items()}
        for prompt in prompts:
            ids = torch.randint(0, 1024, (1, prompt), generator=torch.Generator().manual_seed(prompt))
            kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            speed = {short: [] for short in models}
            with torch.no_grad():  # (inference_mode: the integration reads position_ids._version)
                for model in models.values():
                    model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # compile, warm
                for _ in range(runs):
                    for short, model in models.items():
                        start = time.perf_counter()
                        model.generate(ids, **kwargs)
                        speed[short].append(new_tokens / (time.perf_counter() - start))
            medians = {short: statistics.median(s) for short, s in speed.items()}
            cells = [f"{m:.1f}" for m in medians.values()]
            if len(medians) == 2:
                cells.append(f"{medians['tvm'] / medians['sdpa']:.2f}")
            rows.append(f"| {str(dtype).removeprefix('torch.')} prompt {prompt} | {' | '.join(cells)} |")
    headers = [f"{short} tokens/s" for short in names] + (["tvm / sdpa"] if len(names) == 2 else [])
    print(f"\ngenerate(), 8-layer Llama (GQA 8/2, D64), {new_tokens} new tokens (median of {runs} runs)\n")
    print(f"| case | {' | '.join(headers)} |\n|{'---|' * (len(headers) + 1)}")
    print("\n".join(rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", default=["fixed", "linear", "generate"],
                   choices=["fixed", "linear", "generate"])
    p.add_argument("--rounds", type=int, default=1000, help="interleaved rounds per case (fixed, linear)")
    p.add_argument("--prompts", type=int, nargs="+", default=[32, 1024])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="generate() runs per implementation and case")
    p.add_argument("--only", choices=["tvm", "sdpa"], help="generate() with one implementation only")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}\ntvmflash {tvmflash.__version__}, load average at start: {os.getloadavg()}")
    if "fixed" in args.parts:
        fixed_cost(args.rounds)
    if "linear" in args.parts:
        after_linear(args.rounds)
    if "generate" in args.parts:
        generate(args.prompts, args.new_tokens, args.runs, args.only)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
