"""Speed inside a model (issue 23): tvmflash next to torch ops, against SDPA.

* ``fixed``: the fixed cost per call at tiny shapes (forward B1 N16 H8 D64, N128; bf16 and fp32
  decode steps against a 128- and 1,030-token cache, GQA 8/2), interleaved with SDPA call by call;
* ``linear``: a torch ``linear`` right before the attention call (the pattern every model
  has), bf16/fp32 decode and fp32 forward, interleaved: the cost of two thread pools fighting
  shows here; medians, and the 90th percentile of each (a bimodal distribution puts it far above
  the median);
* ``generate``: transformers ``generate()`` with an 8-layer Llama from a config (GQA 8/2,
  D64 or ``--head-dim``, random weights), bf16 and fp32, short and long prompts (tokens/s); ``--batch B``: B
  prompts at once, left-padded (row b by b / 2B of the prompt), as batched generation pads them;
* ``train``: a training step (forward, backward, AdamW step) of the same Llama on one sequence
  per length (ms per step, median of the steps of a process);
* ``--dtypes``: bfloat16 and float32 models, and ``autocast``: an fp32 model whose forward runs
  under bf16 CPU autocast (mixed-precision training; ``generate()`` under it too);
* ``compiled``: one attention call inside an inductor graph (warm, and with the caches
  flushed), then training steps of ``torch.compile``d models (inductor; the integration's
  attention one op per layer, no graph break), ours and SDPA's in a random order each round,
  forward, backward and AdamW timed apart;
* ``compiled-generate``: ``generate()`` with a static cache and compiled forwards (transformers'
  recipe for fast generation), ours and SDPA's in a random order each round;
* ``in-model``: the attention function's own time per call where the model calls it, in
  ``generate()`` (a new token's calls) and training steps (the forward's calls and their
  backward), both implementations on one model, switched between runs;
* ``padded``: one layer's attention alone, forward + backward, on ``--batch`` padded rows
  (default 4) of each ``--train-lengths``, through the transformers integration's function
  against transformers' SDPA function with the 4D mask it would get, interleaved call by call;
* ``first-step``: a model's first training steps in a fresh process, tvmflash's on an empty
  compile cache (a new user's first run: kernels compile at the first call of each size class);
* ``--documents K``: training rows packed with K documents each (padding-free training:
  position_ids restart, no mask; transformers' masks keep each document to itself);
* ``--train-padding right``: padded training batches (and ``padded``'s rows) padded on the right,
  as tokenizers pad training batches by default (left: as ``generate()`` pads prompts, where the
  padding queries before a row's first token see no key).

``generate`` and ``train`` run each implementation alone in a process of its own (``--worker``),
the implementations alternated process by process (``--runs`` processes each), medians over the
processes. Between processes, models differ by a few per cent even with one implementation
(allocation: pages, huge pages), which limits what those ratios resolve; ``swap`` measures the
same ``generate()`` cases and training steps on one model in one process, switching its
attention implementation (``set_attn_implementation``) between calls, in ABBA order
(``--runs`` rounds): the ratio of medians then compares only the attention. (It also shows that
one implementation's threads do not slow the other's: they run on the same torch threads.)
Ratios are tvmflash / SDPA of times (for tokens/s: sdpa / tvm, so that below 1 is tvmflash
faster everywhere). The load average is printed with the results: on a shared machine
the numbers are preliminary.

    python benchmarks/model_speed.py                 # all four
    python benchmarks/model_speed.py fixed linear --rounds 2000 --threads 1
    python benchmarks/model_speed.py generate train --runs 5 --prompts 32 1024 --train-lengths 512
    python benchmarks/model_speed.py generate --batch 4 --prompts 40 --new-tokens 32
    python benchmarks/model_speed.py swap --runs 8
    python benchmarks/model_speed.py swap --runs 6 --batch 4 --prompts 40 --train-lengths 40 256
    python benchmarks/model_speed.py in-model --runs 6 --prompts 32 1024 --train-lengths 16 512
    python benchmarks/model_speed.py in-model --runs 6 --batch 4 --prompts --train-lengths 16 40 --train-padding right
    python benchmarks/model_speed.py swap --runs 6 --prompts --train-lengths 512 2048 --documents 8
    python benchmarks/model_speed.py padded --train-lengths 40 256 1024 --rounds 200
    python benchmarks/model_speed.py compiled --runs 20 --train-lengths 16 512
    python benchmarks/model_speed.py compiled --runs 12 --batch 4 --train-lengths 40 256 --dtypes float32
    python benchmarks/model_speed.py compiled-generate --runs 8 --batch 4 --prompts 40 256 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import tvmflash  # noqa: E402
from tvmflash import flash_attn_func, flash_attn_with_kvcache  # noqa: E402


def interleaved_times(cases: dict, rounds: int, warmup: int = 20) -> dict:
    """Seconds of every call of each case, the cases called in turn round by round."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved(cases: dict, rounds: int, warmup: int = 20) -> dict:
    """Median seconds per call of each case, the cases called in turn round by round."""
    return {name: statistics.median(t) for name, t in interleaved_times(cases, rounds, warmup).items()}


def _p90(times: list[float]) -> float:
    return sorted(times)[int(0.9 * (len(times) - 1))]


def _row(label: str, ours: float, sdpa: float) -> str:
    return f"| {label} | {ours * 1e6:.1f} | {sdpa * 1e6:.1f} | {ours / sdpa:.2f} |"


def _report(rows: list[str], part: str, row: str) -> None:
    """Add a table row, and show it on stderr as it is measured."""
    rows.append(row)
    print(f"  {part}: {row}", file=sys.stderr, flush=True)


def _table(title: str, rows: list[str], columns=("tvmflash (us)", "SDPA (us)", "ratio")) -> None:
    """A markdown table of ``rows`` (one line each) under ``title``, a "case" column first."""
    print(f"\n{title}\n\n| case | {' | '.join(columns)} |\n|{'---|' * (len(columns) + 1)}")
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
                ("decode fp32 H8/2 D64, 128-token cache", _decode_case(torch.float32, 128)),
                ("decode fp32 H8/2 D64, 1030-token cache", _decode_case(torch.float32, 1030))):
            t = interleaved({"ours": ours, "sdpa": sdpa}, rounds)
            rows.append(_row(label, t["ours"], t["sdpa"]))
    _table("Fixed cost per call (median per call)", rows)


def after_linear(rounds: int) -> None:
    """linear (hidden 512 -> 2048, one token or the prompt) right before the attention call."""
    rows = []
    with torch.inference_mode():
        for label, dtype, (ours, sdpa), tokens in (
                ("linear + decode bf16, 128-token cache", torch.bfloat16, _decode_case(torch.bfloat16, 128), 1),
                ("linear + decode fp32, 128-token cache", torch.float32, _decode_case(torch.float32, 128), 1),
                ("linear + decode bf16, 1030-token cache", torch.bfloat16, _decode_case(torch.bfloat16, 1030), 1),
                ("linear + decode fp32, 1030-token cache", torch.float32, _decode_case(torch.float32, 1030), 1),
                ("linear + forward fp32 N128 causal", torch.float32, _forward_case(torch.float32, 128), 128)):
            x = torch.randn(tokens, 512, dtype=dtype)
            w = torch.randn(2048, 512, dtype=dtype)
            t = interleaved_times({"linear": lambda: F.linear(x, w), "ours": lambda: (F.linear(x, w), ours()),
                                   "sdpa": lambda: (F.linear(x, w), sdpa())}, rounds)
            med = {name: statistics.median(v) for name, v in t.items()}
            rows.append(_row(label, med["ours"], med["sdpa"])
                        + f" {_p90(t['ours']) * 1e6:.1f} | {_p90(t['sdpa']) * 1e6:.1f} | {med['linear'] * 1e6:.1f} |")
    print("\nA torch op right before the attention (per pair: median, ratio of medians, 90th percentiles)\n\n"
          "| case | tvmflash (us) | SDPA (us) | ratio | tvmflash p90 | SDPA p90 | linear alone |\n"
          "|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


def _precision(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    """The model's dtype and the autocast region's ("autocast": fp32 weights, bf16 CPU autocast
    around the forward, as mixed-precision training runs)."""
    return (torch.float32, torch.bfloat16) if name == "autocast" else (getattr(torch, name), None)


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


HEAD_DIM = 64  # (--head-dim) the model's; hidden size 8 x head dim, GQA 8/2, as Llama 3's ratios


def _model_name() -> str:
    return f"8-layer Llama (GQA 8/2, D{HEAD_DIM}, hidden {8 * HEAD_DIM})"


def _dims() -> dict:
    """The models' shared dimensions (``_model_name``): 8 layers, GQA 8/2, hidden 8 x head dim."""
    return dict(vocab_size=1024, hidden_size=8 * HEAD_DIM, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096, attention_dropout=0.0)


def _llama(dtype, implementation: str, sliding_window: int | None = None):
    """The 8-layer Llama of every part (``_model_name``); with ``sliding_window``, the same model
    as a Mistral (a window on every layer)."""
    import transformers

    dims = {**_dims(), "intermediate_size": 8 * HEAD_DIM * 11 // 4}
    config = (transformers.LlamaConfig(**dims) if sliding_window is None
              else transformers.MistralConfig(**dims, sliding_window=sliding_window))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=dtype)


def _gpt_oss(dtype):
    """``_llama``'s model as a gpt-oss (``--model gpt-oss``): attention sinks (``s_aux``; drawn as
    N(1, 1.5^2), of the size trained ones reach), sliding windows of 128 on every other layer,
    4 experts of which 2 per token; transformers runs it on ``eager`` attention only (no SDPA;
    its flex path refuses sinks on CPU)."""
    import transformers

    config = transformers.GptOssConfig(**_dims(), intermediate_size=8 * HEAD_DIM, sliding_window=128,
                                       num_local_experts=4, num_experts_per_tok=2,
                                       layer_types=["sliding_attention", "full_attention"] * 4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 1.5 + 1)
    return model


def _implementation(short: str) -> str:
    if short == "sdpa":
        return "sdpa"
    from tvmflash.integrations import transformers as tvm_hf

    return tvm_hf.register()


def worker_generate(precision: str, prompt: int, new_tokens: int, implementation: str, batch: int = 1) -> dict:
    """tokens/s (all rows') of one timed generate() after a warm-up (compiles, caches) in this
    process; rows after the first left-padded by b / 2B of the prompt."""
    dtype, autocast = _precision(precision)
    model = _llama(dtype, _implementation(implementation)).eval()
    ids, kwargs = _generate_inputs(prompt, new_tokens, batch)
    with torch.no_grad(), _autocast(autocast):  # (inference_mode: the integration reads position_ids._version)
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return {"value": batch * new_tokens / (time.perf_counter() - start)}


def worker_first_step(precision: str, length: int, implementation: str) -> dict:
    """Seconds of this process's first training forward and backward (``value``) and of its second (``then``)."""
    dtype, autocast = _precision(precision)
    model = _llama(dtype, _implementation(implementation)).train()
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(length))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with _autocast(autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"value": times[0], "then": times[1]}


def worker_train(precision: str, length: int, steps: int, implementation: str) -> dict:
    """Median seconds of a training step (forward, backward, AdamW) after two warm-up steps."""
    dtype, autocast = _precision(precision)
    model = _llama(dtype, _implementation(implementation)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(length))
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        with _autocast(autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return {"value": statistics.median(times)}


def _padded_batch(length: int, batch: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of ``batch`` rows, row b padded by b / 2B of ``length`` on ``side``
    (left: as generate() pads prompts; right: as tokenizers pad training batches by default)."""
    # Token 0 is the pad token: generate() would mask every 0 inside the prompt (holes in the mask).
    ids = torch.randint(1, 1024, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = length * b // (2 * batch)
        mask[b, slice(None, pad) if side == "left" else slice(length - pad, None)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def padded_attention(args: argparse.Namespace) -> None:
    """One layer's attention, forward + backward, on padded rows (``_padded_batch``'s), the
    module's layout (q, k, v as (B, H, N, D) views): the integration's ``attention_forward``
    with the 2D mask against transformers' ``sdpa_attention_forward`` with the 4D mask
    (causal and padding) it gets, interleaved. Rows that see no key take eager's uniform softmax
    on our side; SDPA's are whatever its kernel gives them (they are the same on real rows)."""
    import types

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tvmflash.integrations import transformers as tvm_hf

    batch = args.batch if args.batch > 1 else 4
    heads, heads_k, head_dim = 8, 2, HEAD_DIM
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // heads_k, training=True)
    rows = []
    for dtype_name in args.dtypes:
        dtype, autocast = _precision(dtype_name)
        for length in args.train_lengths:
            mask = _padded_batch(length, batch, args.train_padding)[1].bool()
            mask_4d = (torch.ones(length, length, dtype=torch.bool).tril()[None] & mask[:, None, :])[:, None]
            q = torch.randn(batch, length, heads, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
            k, v = (torch.randn(batch, length, heads_k, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
                    for _ in range(2))
            dout = torch.randn(batch, length, heads, head_dim, dtype=autocast or dtype)

            def ours():
                with _autocast(autocast):
                    return tvm_hf.attention_forward(module, q, k, v, mask, scaling=head_dim ** -0.5)[0]

            def sdpa():
                with _autocast(autocast):
                    return sdpa_attention_forward(module, q, k, v, mask_4d, scaling=head_dim ** -0.5,
                                                  is_causal=False)[0]

            with torch.no_grad():  # the same attention on the real rows
                torch.testing.assert_close(ours()[mask].float(), sdpa()[mask].float(), atol=2e-2, rtol=2e-2)
            t = interleaved({"ours": lambda: ours().backward(dout), "sdpa": lambda: sdpa().backward(dout)},
                            args.rounds)
            rows.append(_row(f"{dtype_name} {batch} {args.train_padding}-padded rows of {length}", t["ours"],
                             t["sdpa"]))
    _table(f"One layer's attention (H{heads}/{heads_k} D{head_dim}), forward + backward, padded rows "
           "(median per call)", rows)


def sink_calls(args: argparse.Namespace) -> None:
    """One gpt-oss layer's attention with sinks, the module's layout: the integration's
    ``attention_forward`` against gpt-oss's ``eager_attention_forward`` (transformers' only CPU
    attention for it), interleaved: a training call's forward + backward (one causal sequence of
    each --train-lengths; eager gets its additive 4D mask) and a decode step against a cache of
    each --prompts keys (no mask)."""
    import types

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from tvmflash.integrations import transformers as tvm_hf

    heads, heads_k, head_dim = 8, 2, HEAD_DIM
    scale = head_dim ** -0.5
    rows = []
    for dtype_name in args.dtypes:
        dtype, autocast = _precision(dtype_name)
        sinks = (torch.randn(heads) * 1.5 + 1).to(dtype).requires_grad_()
        module = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // heads_k, training=True,
                                       sinks=sinks)
        for length in args.train_lengths:
            q = torch.randn(1, length, heads, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
            k, v = (torch.randn(1, length, heads_k, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
                    for _ in range(2))
            dout = torch.randn(1, length, heads, head_dim, dtype=autocast or dtype)
            causal = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]

            def ours():
                with _autocast(autocast):
                    return tvm_hf.attention_forward(module, q, k, v, None, scaling=scale, s_aux=sinks)[0]

            def eager():
                with _autocast(autocast):
                    return eager_attention_forward(module, q, k, v, causal, scaling=scale)[0]

            with torch.no_grad():
                torch.testing.assert_close(ours().float(), eager().float(), atol=2e-2, rtol=2e-2)
            t = interleaved({"ours": lambda: ours().backward(dout), "eager": lambda: eager().backward(dout)},
                            args.rounds, warmup=3)
            _report(rows, "sinks", _row(f"{dtype_name} training call, forward + backward, {length} tokens", t["ours"],
                                        t["eager"]))
        for n in args.prompts:
            q = torch.randn(1, 1, heads, head_dim, dtype=dtype).transpose(1, 2)
            k, v = (torch.randn(1, n, heads_k, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))

            def ours_step():
                return tvm_hf.attention_forward(module, q, k, v, None, scaling=scale, s_aux=sinks)[0]

            def eager_step():
                return eager_attention_forward(module, q, k, v, None, scaling=scale)[0]

            with torch.no_grad(), _autocast(autocast):
                torch.testing.assert_close(ours_step().float(), eager_step().float(), atol=2e-2, rtol=2e-2)
                t = interleaved({"ours": ours_step, "eager": eager_step}, args.rounds * 10)
            _report(rows, "sinks", _row(f"{dtype_name} decode step, {n}-token cache", t["ours"], t["eager"]))
    _table(f"One gpt-oss layer's attention with sinks (H{heads}/{heads_k} D{head_dim}), median per call",
           rows, ("tvmflash (us)", "eager (us)", "ratio"))


def _generate_inputs(prompt: int, new_tokens: int, batch: int):
    ids, mask = _padded_batch(prompt, batch)
    return ids, dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                     pad_token_id=0)


def _abba_seconds(run, implementations: list[str], rounds: int) -> dict:
    """Seconds of ``run()`` per implementation, switched on one model in ABBA order (a drift
    over the rounds then weighs on both alike)."""
    times = {impl: [] for impl in implementations}
    for r in range(rounds):
        for impl in (implementations if r % 2 == 0 else implementations[::-1]):
            start = time.perf_counter()
            run(impl)
            times[impl].append(time.perf_counter() - start)
    return times


def _model_cases(args: argparse.Namespace, names: dict):
    """One model per dtype: yields (dtype name, "generate" or "train", prompt or length, run), where
    ``run(impl)`` runs one ``generate()`` or training step (forward, backward, AdamW) with the
    attention implementation ``names[impl]``."""
    for dtype_name in args.dtypes:
        dtype, autocast = _precision(dtype_name)
        model = (_gpt_oss(dtype) if args.model == "gpt-oss" else _llama(dtype, "sdpa")).eval()
        for prompt in args.prompts:
            ids, kwargs = _generate_inputs(prompt, args.new_tokens, args.batch)

            def generate(impl, kwargs=kwargs, ids=ids):
                model.set_attn_implementation(names[impl])
                with torch.no_grad(), _autocast(autocast):
                    model.generate(ids, **kwargs)

            yield dtype_name, "generate", prompt, generate
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for length in args.train_lengths:
            ids, mask = _padded_batch(length, args.batch, args.train_padding)
            labels = ids.masked_fill(mask == 0, -100)
            inputs = {"attention_mask": mask}
            if args.documents > 1:  # (rows packed with documents: no padding, position_ids restart)
                inputs = _packed_documents(length, args.batch, args.documents)
                labels = ids.masked_fill(inputs["position_ids"] == 0, -100)  # (no prediction across documents)

            def step(impl, ids=ids, inputs=inputs, labels=labels):
                model.set_attn_implementation(names[impl])
                with _autocast(autocast):
                    loss = model(input_ids=ids, **inputs, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            yield dtype_name, "train", length, step


def _packed_documents(length: int, batch: int, documents: int) -> dict:
    """A training forward's inputs for ``batch`` rows of ``length`` tokens, each row ``documents``
    documents of random lengths packed together (transformers' padding-free training, as
    ``DataCollatorWithFlattening`` packs them): position_ids restart at each document, no mask,
    no KV cache (transformers' masks then keep each document to itself)."""
    generator = torch.Generator().manual_seed(length + documents)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(length - 1, generator=generator)[:documents - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, length]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return {"position_ids": torch.stack(rows), "use_cache": False}


def _case_label(args: argparse.Namespace, dtype_name: str, kind: str, size: int) -> str:
    if kind == "generate":
        return f"{dtype_name} generate(), {'prompt' if args.batch == 1 else f'{args.batch} left-padded prompts'} {size}"
    what = "sequence" if args.batch == 1 else f"{args.batch} {args.train_padding}-padded sequences"
    if args.documents > 1:
        what = f"{args.batch} row{'s' if args.batch > 1 else ''} of {args.documents} packed documents,"
    return f"{dtype_name} training step, {what} {size}"


def swapped(args: argparse.Namespace) -> None:
    """generate() and training steps on one model per dtype, its attention switched call by call
    (against SDPA; a gpt-oss against eager, its only other CPU attention)."""
    reference = "eager" if args.model == "gpt-oss" else "sdpa"
    names = {"ref": reference, "tvm": _implementation("tvm")}
    rows = []
    for dtype_name, kind, size, run in _model_cases(args, names):
        _abba_seconds(run, list(names), 1)  # warm-up: compiles, caches
        times = _abba_seconds(run, list(names), args.runs)
        medians = {impl: statistics.median(v) for impl, v in times.items()}
        paired = statistics.median(t / s for t, s in zip(times["tvm"], times["ref"]))
        unit = f"ms per {args.new_tokens} tokens" if kind == "generate" else "ms per step"
        _report(rows, "swap", f"| {_case_label(args, dtype_name, kind, size)} | {medians['tvm'] * 1e3:.1f} | "
                f"{medians['ref'] * 1e3:.1f} | {unit} | {medians['tvm'] / medians['ref']:.3f} | {paired:.3f} | "
                f"{min(times['tvm']) / min(times['ref']):.3f} |")
    model = _model_name().replace("Llama", "gpt-oss, 4 experts, sinks") if args.model == "gpt-oss" else _model_name()
    _table(f"One model per dtype in one process, attention switched between calls (ABBA, {args.runs} rounds): "
           f"{model}", rows, ("tvmflash", reference, "unit", "ratio of medians", "median of paired ratios",
                              "ratio of minima"))


def in_model(args: argparse.Namespace) -> None:
    """The attention function's own time per call inside ``generate()`` and training steps: one
    model per dtype, its implementation switched between runs (ABBA), each implementation's
    function (ours, transformers' SDPA function) timed where the model calls it. What a call
    costs there (the model's products between the calls evict what a loop of calls keeps in
    cache) is what ``fixed`` cannot show. Medians over every call of the runs: a new token's
    calls in ``generate()``, the forward's in a training step, and each call's backward there:
    from its output's gradient to its query's (autograd hooks; what the engine runs between
    them besides the attention's own nodes, the other layers' nodes it may interleave, is the
    same model's for both)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tvmflash.integrations import transformers as tvm_hf

    names = {"sdpa": "sdpa", "tvm": _implementation("tvm")}
    calls: dict[tuple, list[int]] = {}

    def timed(impl: str, function):
        def attention(module, query, *rest, **kwargs):
            start = time.perf_counter_ns()
            result = function(module, query, *rest, **kwargs)
            calls.setdefault((impl, "decode" if query.shape[2] == 1 else "forward"), []).append(
                time.perf_counter_ns() - start)
            if result[0].requires_grad and query.requires_grad:
                arrived = []
                result[0].register_hook(lambda grad: arrived.append(time.perf_counter_ns()))
                query.register_hook(lambda grad: arrived and calls.setdefault((impl, "backward"), []).append(
                    time.perf_counter_ns() - arrived[0]))
            return result
        return attention

    def row(label: str, part: str) -> str:
        us = {impl: statistics.median(calls[(impl, part)]) / 1e3 for impl in names}
        return (f"| {label} | {us['tvm']:.1f} | {us['sdpa']:.1f} | {us['tvm'] / us['sdpa']:.2f} | "
                f"{len(calls[('tvm', part)])} |")

    rows: list[str] = []
    AttentionInterface.register("sdpa", timed("sdpa", sdpa_attention_forward))
    AttentionInterface.register(names["tvm"], timed("tvm", tvm_hf.attention_forward))
    try:
        for dtype_name, kind, size, run in _model_cases(args, names):
            _abba_seconds(run, list(names), 1)  # warm-up: compiles, caches
            calls.clear()
            _abba_seconds(run, list(names), args.runs)
            case = _case_label(args, dtype_name, kind, size)
            parts = (("decode", "a new token's call"),) if kind == "generate" else (
                ("forward", "a forward's call"), ("backward", "its backward"))
            for part, what in parts:
                _report(rows, "in-model", row(f"{case}: {what}", part))
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
        AttentionInterface.register(names["tvm"], tvm_hf.attention_forward)
    _table(f"The attention function's time per call inside the model (medians, us; {args.runs} runs each, ABBA): "
           f"{_model_name()}", rows, ("tvmflash", "SDPA", "ratio", "calls"))


def compiled_calls(rounds: int) -> None:
    """One attention call inside an inductor graph: a compiled function of 8 chained calls at
    B1 N16 H8/2 D64 fp32 (no autograd), per call, warm and with the caches flushed (a 64 MB
    copy before each graph call, as a model's other layers leave them); the two compiled
    functions called in turn."""
    q, k, v = torch.randn(1, 16, 8, 64), torch.randn(1, 16, 2, 64), torch.randn(1, 16, 2, 64)

    def ours(q, k, v):
        for _ in range(8):
            q = tvmflash.flash_attn_func(q, k, v, causal=True) * 1.01
        return q

    def sdpa(q, k, v):
        k, v = (_bhsd(t).repeat_interleave(4, 1) for t in (k, v))
        for _ in range(8):
            q = _bhsd(F.scaled_dot_product_attention(_bhsd(q), k, v, is_causal=True)) * 1.01
        return q

    graphs = {name: torch.compile(fn, fullgraph=True) for name, fn in (("ours", ours), ("sdpa", sdpa))}
    source, sink = torch.empty(16 << 20), torch.empty(16 << 20)
    rows = []
    with torch.no_grad():
        for graph in (*graphs.values(), *graphs.values()):  # compile, warm up
            graph(q, k, v)
        for flushed in (False, True):
            times = {name: [] for name in graphs}
            for _ in range(rounds):
                for name, graph in graphs.items():
                    if flushed:
                        sink.copy_(source)
                    start = time.perf_counter()
                    graph(q, k, v)
                    times[name].append(time.perf_counter() - start)
            ours, theirs = (statistics.median(times[name]) / 8 for name in graphs)
            rows.append(_row(f"op call in an inductor graph, {'caches flushed' if flushed else 'warm'} (N16 fp32)",
                             ours, theirs))
    _table("torch.compile: one attention call inside a compiled graph (median per call)", rows)


def compiled_steps(args: argparse.Namespace) -> None:
    """Training steps of ``torch.compile``d models (inductor), the Llama on tvmflash and on SDPA
    with the same weights, in a random order each round; forward, backward and AdamW timed apart.
    (A compiled model cannot switch its attention between calls without compiling again.)"""
    import copy
    import random

    rows = []
    for dtype_name in args.dtypes:
        dtype, autocast = _precision(dtype_name)
        base = _llama(dtype, "sdpa", args.sliding_window)
        models = {}
        for impl in ("tvm", "sdpa"):
            model = copy.deepcopy(base)
            model.set_attn_implementation(_implementation(impl))
            models[impl] = torch.compile(model.train()), torch.optim.AdamW(model.parameters(), lr=1e-6)
        for length in args.train_lengths:
            ids, mask = _padded_batch(length, args.batch, args.train_padding)
            inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
            if args.batch > 1:  # (a padded batch: the integration's padded path, graph breaks included)
                inputs["attention_mask"] = mask
            times = {impl: [] for impl in models}

            def step(impl, record=True):
                model, optimizer = models[impl]
                start = time.perf_counter()
                with _autocast(autocast):
                    loss = model(**inputs).loss
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                end = time.perf_counter()
                if record:
                    times[impl].append((forward - start, backward - forward, end - backward, end - start))

            for impl in (*models, *models, *models):  # compiles (a new length: again), warm-up
                step(impl, record=False)
            order = list(models)
            for _ in range(args.runs):
                random.shuffle(order)
                for impl in order:
                    step(impl)
            cells = []
            for part in range(4):
                ours, theirs = ([t[part] for t in times[impl]] for impl in ("tvm", "sdpa"))
                paired = statistics.median(a / b for a, b in zip(ours, theirs))
                cells.append(f"{statistics.median(ours) * 1e3:.1f} / {statistics.median(theirs) * 1e3:.1f} "
                             f"({paired:.3f})")
            what = "sequence" if args.batch == 1 else f"{args.batch} {args.train_padding}-padded sequences"
            _report(rows, "compiled", f"| {dtype_name} training step, {what} {length} | " + " | ".join(cells) + " |")
    model = "Llama" if args.sliding_window is None else f"Mistral (sliding window {args.sliding_window})"
    _table(f"torch.compile'd models, ours and SDPA's in a random order each round ({args.runs} rounds): "
           f"{_model_name().replace('Llama', model)}; ms tvmflash / SDPA (median of the paired ratios)", rows,
           ("forward", "backward", "AdamW", "step"))


def compiled_generate(args: argparse.Namespace) -> None:
    """``generate()`` as transformers recommends it for speed: a static KV cache and the model's
    forward compiled (inductor), prefill and decode steps alike; the Llama on tvmflash and on
    SDPA with the same weights, in a random order each round (tokens/s; greedy, so the tokens
    must agree: counted)."""
    import copy
    import random

    rows = []
    for dtype_name in args.dtypes:
        dtype, autocast = _precision(dtype_name)
        base = _llama(dtype, "sdpa").eval()
        models = {}
        for impl in ("tvm", "sdpa"):
            model = copy.deepcopy(base)
            model.set_attn_implementation(_implementation(impl))
            model.forward = torch.compile(model.forward)
            models[impl] = model
        for prompt in args.prompts:
            ids, kwargs = _generate_inputs(prompt, args.new_tokens, args.batch)
            times, tokens = {impl: [] for impl in models}, {}

            def run(impl, record=True):
                start = time.perf_counter()
                with torch.no_grad(), _autocast(autocast):
                    tokens[impl] = models[impl].generate(ids, **kwargs, cache_implementation="static")
                if record:
                    times[impl].append(time.perf_counter() - start)

            for impl in (*models, *models):  # compiles (a new prompt length: again), warm-up
                run(impl, record=False)
            order, agree = list(models), 0
            for _ in range(args.runs):
                random.shuffle(order)
                for impl in order:
                    run(impl)
                agree += torch.equal(tokens["tvm"], tokens["sdpa"])
            new = args.batch * args.new_tokens
            ours, theirs = (new / statistics.median(times[impl]) for impl in ("tvm", "sdpa"))
            paired = statistics.median(b / a for a, b in zip(times["tvm"], times["sdpa"]))
            what = "prompt" if args.batch == 1 else f"{args.batch} left-padded prompts"
            _report(rows, "compiled generate", f"| {dtype_name} {what} of {prompt}, {args.new_tokens} new tokens | "
                    f"{ours:,.0f} | {theirs:,.0f} | {paired:.3f} | {agree} / {args.runs} |")
    _table(f"generate() with a static cache and torch.compile'd forwards, ours and SDPA's in a random order each "
           f"round ({args.runs} rounds): {_model_name()}; tokens/s", rows,
           ("tvmflash", "SDPA", "speed ratio (paired median)", "same tokens"))


def _in_own_process(args: argparse.Namespace, worker: list[str], **env) -> dict:
    """The worker's result (``{"value": ...}``) from a process of its own, ``env`` added to its environment."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *worker]
    if args.threads:
        command += ["--threads", str(args.threads)]
    command += ["--head-dim", str(HEAD_DIM)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TVMFLASH_QUIET": "1", **env})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_steps(args: argparse.Namespace) -> None:
    """A model's first training steps in a fresh process, tvmflash's on an empty compile cache
    (what a new user's first run waits for: its kernels compile at the first call of each size
    class), against SDPA's first steps; processes alternated, medians."""
    rows = []
    for dtype in args.dtypes:
        for length in args.train_lengths:
            results = {"tvm": [], "sdpa": []}
            for _ in range(args.runs):
                for impl in results:
                    with tempfile.TemporaryDirectory() as cache:
                        results[impl].append(_in_own_process(args, ["first-step", dtype, str(length), impl, "0", "0",
                                                                    "1"], TVMFLASH_CACHE_DIR=cache))
            first, then = ({impl: statistics.median(r[key] for r in runs) for impl, runs in results.items()}
                           for key in ("value", "then"))
            _report(rows, "first steps", f"| {dtype} first training step, {length} tokens | {first['tvm']:.2f} | "
                    f"{first['sdpa']:.2f} | {then['tvm'] * 1e3:.0f} | {then['sdpa'] * 1e3:.0f} |")
    _table(f"A fresh process's first training steps (forward and backward; tvmflash on an empty compile cache), "
           f"{_model_name()}, medians of {args.runs} processes each", rows,
           ("tvmflash first (s)", "SDPA first (s)", "tvmflash second (ms)", "SDPA second (ms)"))


def alternated(args: argparse.Namespace, part: str, cases: list, unit: str, higher_is_faster: bool) -> None:
    """Each case as processes of one implementation each, tvm and sdpa alternated, medians."""
    implementations = [args.only] if args.only else ["tvm", "sdpa"]
    rows = []
    for dtype, size in cases:
        values = {impl: [] for impl in implementations}
        for _ in range(args.runs):
            for impl in implementations:
                values[impl].append(_in_own_process(args, [part, dtype, str(size), impl, str(args.new_tokens),
                                                           str(args.train_steps), str(args.batch)])["value"])
        medians = {impl: statistics.median(v) for impl, v in values.items()}
        scale = 1 if higher_is_faster else 1e3
        cells = [f"{medians[i] * scale:.1f} ({min(values[i]) * scale:.1f}-{max(values[i]) * scale:.1f})"
                 for i in implementations]
        if len(implementations) == 2:
            ratio = medians["sdpa"] / medians["tvm"] if higher_is_faster else medians["tvm"] / medians["sdpa"]
            cells.append(f"{ratio:.2f}")
        what = "sequence" if part == "train" else "prompt" if args.batch == 1 else f"{args.batch} left-padded prompts"
        _report(rows, part, f"| {dtype} {what} {size} | {' | '.join(cells)} |")
    headers = [f"{impl} {unit} (min-max)" for impl in implementations] + (
        ["tvm / sdpa time"] if len(implementations) == 2 else [])
    title = (f"generate(), {_model_name()}, {args.new_tokens} new tokens" if part == "generate" else
             f"training step (forward, backward, AdamW), {_model_name()}, {args.train_steps} steps")
    _table(f"{title}: median of {args.runs} processes per implementation, alternated", rows, headers)


def worker(argv: list[str]) -> None:
    part, dtype, size, implementation, new_tokens, steps, batch = argv
    if part == "generate":
        result = worker_generate(dtype, int(size), int(new_tokens), implementation, int(batch))
    elif part == "first-step":
        result = worker_first_step(dtype, int(size), implementation)
    else:
        result = worker_train(dtype, int(size), int(steps), implementation)
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["fixed", "linear", "generate", "train", "padded", "swap", "in-model", "compiled", "compiled-generate",
             "first-step", "sinks"]
    p.add_argument("parts", nargs="*", help=f"of {', '.join(parts)} (default: the first four)")
    p.add_argument("--rounds", type=int, default=1000, help="interleaved rounds per case (fixed, linear)")
    p.add_argument("--prompts", type=int, nargs="*", default=[32, 1024])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1,
                   help="generate(): prompts per call; swap, compiled: sequences per training step too "
                        "(padded: --train-padding); padded: rows (default 4)")
    p.add_argument("--train-padding", choices=["left", "right"], default="left",
                   help="the side training sequences and padded's rows are padded on (with --batch)")
    p.add_argument("--documents", type=int, default=1,
                   help="swap, in-model: each training row packed with this many documents (position_ids, no mask)")
    p.add_argument("--train-lengths", type=int, nargs="*", default=[16, 512])
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "autocast"],
                   help="generate() and training dtypes; autocast: an fp32 model under bf16 CPU autocast")
    p.add_argument("--runs", type=int, default=3,
                   help="processes per implementation and case (generate, train); rounds (swap, compiled)")
    p.add_argument("--only", choices=["tvm", "sdpa"], help="generate() / train with one implementation only")
    p.add_argument("--model", choices=["llama", "gpt-oss"], default="llama",
                   help="swap: the model (gpt-oss: attention sinks, against eager attention)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="compiled: the model as a Mistral with this sliding window on every layer")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--head-dim", type=int, default=64,
                   help="the model's head dim (hidden size 8 x it; default 64); fixed and linear keep D64")
    p.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    global HEAD_DIM
    HEAD_DIM = args.head_dim
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker)
        return
    args.parts = args.parts or parts[:4]
    if set(args.parts) - set(parts):
        p.error(f"unknown parts {sorted(set(args.parts) - set(parts))}: choose from {parts}")
    if args.model != "llama" and set(args.parts) != {"swap"}:
        p.error("--model gpt-oss: the swap part only")
    print(f"machine: {machine()}\ntvmflash {tvmflash.__version__}, {torch.get_num_threads()} threads, "
          f"load average at start: {os.getloadavg()}")
    if "fixed" in args.parts:
        fixed_cost(args.rounds)
    if "linear" in args.parts:
        after_linear(args.rounds)
    if "generate" in args.parts:
        alternated(args, "generate", [(d, n) for d in args.dtypes for n in args.prompts], "tokens/s", True)
    if "train" in args.parts:
        alternated(args, "train", [(d, n) for d in args.dtypes for n in args.train_lengths], "ms/step", False)
    if "padded" in args.parts:
        padded_attention(args)
    if "swap" in args.parts:
        swapped(args)
    if "in-model" in args.parts:
        in_model(args)
    if "compiled" in args.parts:
        compiled_calls(args.rounds)
        compiled_steps(args)
    if "compiled-generate" in args.parts:
        compiled_generate(args)
    if "first-step" in args.parts:
        first_steps(args)
    if "sinks" in args.parts:
        sink_calls(args)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
