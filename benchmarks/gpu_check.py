"""GPU check of tvmflash: correctness, speed vs PyTorch SDPA, and one 512K-token head.

Made to run in one call of at most 8 minutes on a machine with one NVIDIA GPU (an H200):

    python benchmarks/gpu_check.py --out-dir $OUT                # everything, --budget-s 450
    python benchmarks/gpu_check.py --quick --out-dir $OUT        # fewer cases, a few minutes less
    python benchmarks/gpu_check.py --cases "N=8192,D=128,dtype=bfloat16" --stages speed
    python benchmarks/gpu_check.py --device cpu --quick          # same code on CPU, tiny shapes (tests)
    python benchmarks/gpu_check.py --precompile-only --arch sm_90   # fill $TVMFLASH_CACHE_DIR, no GPU

Stages (each runs in its own child process, so a crash, a hang or a poisoned CUDA context in one
is reported and the next still runs; a stage that outlives its time is killed and what it had
written is kept):

0. compile: every (dtype, head dim, mask) the run needs, in parallel processes (--jobs), into
   the disk cache; the stages then load the kernels from it instead of compiling one by one.
1. correctness: forward and backward on random shapes (odd lengths, seqlen_q != seqlen_k, causal
   and not, GQA/MQA, rows that see no key) against float64 PyTorch, by the flash-attn rule:
       max|ours - f64| <= 2 * max|torch_same_dtype - f64| + ULPS * eps(dtype) * magnitude
   where torch_same_dtype is plain (materialized) attention in the input dtype, eps(fp16) =
   2^-10, eps(bf16) = 2^-7, ULPS = 4, and magnitude = max(1, max|f64|, the size of the terms
   summed or cancelled on the way: max|v| for out, max|dout| for dv, scale * max_ij sum_d
   |dout_id v_jd| * max|k| (|q|) for dq (dk)) -- the rule of tests/test_attention.py. lse (fp32)
   must be finite exactly where the reference is and pass the same rule with eps(fp32).
   --deterministic also passes deterministic=True and checks that two backwards agree bitwise.
2. speed: TFLOP/s of tvmflash vs scaled_dot_product_attention with the FLASH backend
   (FlashAttention-2 inside PyTorch) and the cuDNN backend (a backend that cannot run a case is
   skipped with its error), N = 1K..16K, D = 64/128, causal and not, bf16 and fp16; batch =
   16384 // N and heads = 2048 // D (flash-attn's benchmark convention: 16K tokens, 2048
   channels). Forward and forward+backward are timed separately with CUDA events, after a
   warm-up, interleaving the implementations round by round; the median over rounds is
   reported; backward = (fwd+bwd) - fwd. FLOPs (flash-attn's count): forward 4 * B * H * Nq *
   Nk * D, halved when causal; backward 2.5x forward. Ratios are ours/ref in TFLOP/s (> 1:
   tvmflash faster). Each case also compares our output with the first reference (max abs diff).
3. long: one head (B = H = 1, D = 128, bf16, not causal) of --long-n = 524288 tokens, forward
   and forward+backward with our op: times and torch.cuda.max_memory_allocated, a float64 check
   of a few sampled query rows, and what standard attention would need: it keeps P = softmax(S)
   (B * H * N^2 elements) for the backward, and S and P (or P and dP/dS) are alive together, so
       standard bytes >= B * H * N^2 * sizeof(dtype)  (P alone)   ~ 2x that at its peak.
   If the time estimated from the speed stage does not fit the remaining budget, a smaller
   power-of-two N is used and said so. SDPA FLASH runs the same case if time is left.

A compact markdown table is printed last; every measurement, the environment (GPU, driver,
torch/CUDA/cuDNN/TVM versions, git commit) and notes go to --out-dir: gpu_check.json (all),
gpu_check.md (the table), stage_<name>.json (each stage, written as it goes). --budget-s bounds
the whole run: stages skip their remaining cases, with a note, once their share is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("compile", "correctness", "speed", "long")
ULPS = 4.0
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
GRACE_S = 15.0  # a stage child may overrun its budget by one case; killed after this much more
LONG_RESERVE_S = 75.0  # kept for the long stage while the speed stage runs (cuda)
CPU_PAUSE_S = 0.02  # before each timed call on cpu, as tvmflash/bench.py


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the real check; cpu: the same code on tiny shapes (default cuda)")
    p.add_argument("--dry-run", action="store_true", help="shorthand for --device cpu --quick")
    p.add_argument("--quick", action="store_true", help="fewer correctness and speed cases")
    p.add_argument("--cases", default=None, metavar="FILTER",
                   help='trim the speed grid, e.g. "N=8192/16384,D=128,dtype=bfloat16,causal=0" '
                        "(keys N, D, dtype (bf16/fp16/fp32 or full names), causal (0/1))")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (default: all)")
    p.add_argument("--budget-s", type=float, default=450.0, help="time for the whole run (default 450)")
    p.add_argument("--out-dir", type=Path, default=Path("gpu_check_results"),
                   help="where gpu_check.json/.md go (default gpu_check_results/)")
    p.add_argument("--deterministic", action="store_true",
                   help="pass deterministic=True to flash_attn_func (no atomics in dq) and check it")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per speed case (default cuda 7, cpu 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds per speed case (default cuda 2, cpu 1)")
    p.add_argument("--long-n", type=int, default=None, help="tokens of the long case (default cuda 524288, cpu 2048)")
    p.add_argument("--long-head-dim", type=int, default=None, choices=(64, 128),
                   help="head dim of the long case (default cuda 128, cpu 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPUs, at most 8)")
    p.add_argument("--arch", default=None, help="CUDA arch for compiling without a GPU, e.g. sm_90")
    p.add_argument("--precompile-only", action="store_true",
                   help="only compile the kernels the run needs into the disk cache (works without a GPU "
                        "given --arch) and exit")
    p.add_argument("--no-isolate", action="store_true", help="run the stages in this process (debugging)")
    # Internal: one stage in a child process.
    p.add_argument("--stage", choices=STAGES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage-budget-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--variants", default=None, help=argparse.SUPPRESS)
    p.add_argument("--long-estimate-s-per-n2", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.quick = "cpu", True
    cuda = args.device == "cuda"
    args.reps = args.reps if args.reps is not None else (7 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    args.long_n = args.long_n or (524288 if cuda else 2048)
    args.long_head_dim = args.long_head_dim or (128 if cuda else 64)
    args.jobs = args.jobs or max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                        else (os.cpu_count() or 1)))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)}")
    args.stage_list = stages
    if args.reps < 1 or args.warmup < 0 or args.budget_s <= 0:
        p.error("--reps must be >= 1, --warmup >= 0, --budget-s > 0")
    try:
        args.case_filter = parse_case_filter(args.cases)
    except ValueError as err:
        p.error(str(err))
    return args


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                  "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def parse_case_filter(text: str | None) -> dict:
    """ "N=8192/16384,D=128,dtype=bf16,causal=0" -> {"seqlen": {8192, 16384}, "head_dim": {128}, ...}."""
    if not text:
        return {}
    keys = {"n": "seqlen", "seqlen": "seqlen", "d": "head_dim", "head_dim": "head_dim", "dtype": "dtype",
            "causal": "causal"}
    result = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"--cases: expected key=value, got {part!r}")
        key, values = (s.strip() for s in part.split("=", 1))
        if key.lower() not in keys:
            raise ValueError(f"--cases: unknown key {key!r} (use N, D, dtype, causal)")
        name = keys[key.lower()]
        parsed = set()
        for v in values.split("/"):
            v = v.strip()
            if name in ("seqlen", "head_dim"):
                parsed.add(int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v))
            elif name == "dtype":
                if v not in _DTYPE_ALIASES:
                    raise ValueError(f"--cases: unknown dtype {v!r}")
                parsed.add(_DTYPE_ALIASES[v])
            else:
                if v.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"--cases: causal must be 0 or 1, got {v!r}")
                parsed.add(v.lower() in ("1", "true"))
        result[name] = parsed
    return result


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class CorrectnessCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: str
    causal: bool

    def label(self) -> str:
        mask = " causal" if self.causal else ""
        return (f"B{self.batch} Nq{self.seqlen_q} Nk{self.seqlen_k} H{self.heads}/{self.heads_k} "
                f"D{self.head_dim} {SHORT[self.dtype]}{mask}")


@dataclass(frozen=True)
class SpeedCase:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool

    def label(self) -> str:
        mask = " causal" if self.causal else ""
        return f"N{self.seqlen} D{self.head_dim} {SHORT[self.dtype]}{mask} (B{self.batch} H{self.heads})"

    def forward_flops(self) -> float:
        return forward_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)


def forward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """flash-attn's count: two matmuls of 2 * Nq * Nk * D each per head, halved when causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


def backward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Five matmuls instead of two (dV, dP, dQ, dK and the recomputed S): 2.5x the forward."""
    return 2.5 * forward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


def low_dtypes(device: str) -> tuple[str, ...]:
    return ("bfloat16", "float16") if device == "cuda" else ("float32", "bfloat16")


# Shapes (batch, seqlen_q, seqlen_k, heads, heads_k): odd lengths, Nq != Nk both ways (with the
# causal mask, Nq > Nk leaves the first Nq - Nk rows without a visible key), GQA and MQA,
# single-token queries/keys, lengths just past a tile.
CUDA_SHAPES = [
    (2, 77, 77, 8, 2),
    (1, 333, 1000, 8, 2),
    (1, 1000, 333, 8, 8),
    (2, 1000, 1000, 8, 2),
    (1, 1, 1000, 8, 1),
    (3, 1, 1, 8, 2),
    (1, 129, 65, 8, 4),
]
CPU_SHAPES = [(2, 77, 50, 4, 2), (1, 1, 33, 4, 1), (1, 65, 129, 4, 4)]


def correctness_cases(device: str, quick: bool) -> list[CorrectnessCase]:
    if device == "cuda":
        variants = [(dt, d, c) for dt in low_dtypes(device) for d in (64, 128) for c in (False, True)]
        shapes = CUDA_SHAPES
    else:
        variants = [("float32", 64, False), ("bfloat16", 64, True)]
        shapes = CPU_SHAPES
    cases = []
    for i, (dtype, head_dim, causal) in enumerate(variants):
        # quick: 2 shapes per variant, rotating, so every shape still meets both masks.
        chosen = [shapes[(2 * i + j) % len(shapes)] for j in range(2)] if quick else shapes
        for b, nq, nk, h, hk in chosen:
            cases.append(CorrectnessCase(b, nq, nk, h, hk, head_dim, dtype, causal))
    return cases


def speed_cases(device: str, quick: bool, case_filter: dict | None = None) -> list[SpeedCase]:
    """The grid, most important first: the issue's bar (N=8K, D=128, bf16) leads."""
    if device == "cuda":
        seqlens = [2048, 8192, 16384] if quick else [1024, 2048, 4096, 8192, 16384]
        dtypes = ["bfloat16"] if quick else ["bfloat16", "float16"]
        grid = []
        for dtype in dtypes:
            for d in (128, 64):
                for causal in (False, True):
                    for n in seqlens:
                        if quick and d == 64 and n != 8192:
                            continue
                        grid.append(SpeedCase(max(1, 16384 // n), n, 2048 // d, d, dtype, causal))
        if quick:
            grid.append(SpeedCase(2, 8192, 16, 128, "float16", False))
    else:
        grid = [SpeedCase(1, 256, 2, 64, "float32", False), SpeedCase(1, 256, 2, 64, "bfloat16", True)]
        if not quick:
            grid.append(SpeedCase(1, 512, 2, 64, "float32", False))
    bar = [c for c in grid if c.seqlen == 8192 and c.head_dim == 128 and c.dtype == "bfloat16"]
    grid = bar + [c for c in grid if c not in bar]
    if case_filter:
        grid = [c for c in grid if all(getattr(c, k) in v for k, v in case_filter.items())]
    return grid


def long_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def variants_needed(args) -> list[tuple[str, int, bool]]:
    """(dtype, head_dim, causal) of every kernel the selected stages will call."""
    found = []
    if "correctness" in args.stage_list:
        found += [(c.dtype, c.head_dim, c.causal) for c in correctness_cases(args.device, args.quick)]
    if "speed" in args.stage_list:
        found += [(c.dtype, c.head_dim, c.causal) for c in speed_cases(args.device, args.quick, args.case_filter)]
    if "long" in args.stage_list:
        found.append((long_dtype(args.device), args.long_head_dim, False))
    return list(dict.fromkeys(found))


# ----------------------------------------------------------------------------- reference and rule


def reference_attention(q, k, v, causal: bool, scale: float | None = None, dtype=torch.float64):
    """Plain materialized attention in ``dtype`` (differentiable): out (B,Nq,H,D), lse (B,H,Nq).

    Causal: bottom-right aligned, query i sees key j iff j <= i + Nk - Nq; a row that sees no key
    gets out 0, lse -inf and zero gradients (as flash-attn and tvmflash).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    qt = q.to(dtype).transpose(1, 2)
    kt = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    lse_dtype = torch.promote_types(dtype, torch.float32)
    if not causal:
        return (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2), torch.logsumexp(scores.to(lse_dtype), -1)
    nq, nk = q.shape[1], k.shape[1]
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    mask = j <= i + (nk - nq)
    sees = mask.any(-1)[:, None]
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~sees, 0.0)  # no NaN in autograd
    probs = torch.softmax(scores, dim=-1) * sees
    lse = torch.logsumexp(scores.to(lse_dtype), -1).masked_fill(~sees[:, 0], float("-inf"))
    return (probs @ vt).transpose(1, 2), lse


def flash_rule(ours, ref64, same, dtype: torch.dtype, magnitude: float = 1.0, ulps: float = ULPS) -> dict:
    """The flash-attn rule: err(ours) <= 2 * err(plain torch in the same dtype) + ulps * eps * scale.

    scale = max(1, magnitude, max|ref64|). Returns the numbers and ``ok`` (False on any NaN or a
    shape mismatch too).
    """
    ours, ref64, same = ours.detach(), ref64.detach(), same.detach()
    if tuple(ours.shape) != tuple(ref64.shape):
        return {"ok": False, "error": f"shape {tuple(ours.shape)} != {tuple(ref64.shape)}"}
    if ours.numel() == 0:
        return {"ok": True, "err": 0.0, "err_torch": 0.0, "bound": 0.0, "ratio": 0.0}
    nan = bool(torch.isnan(ours).any())
    scale = max(1.0, float(magnitude), float(ref64.abs().max()))
    err = float((ours.double() - ref64).abs().max())
    err_torch = float((same.double() - ref64).abs().max())
    bound = 2 * err_torch + ulps * torch.finfo(dtype).eps * scale
    ok = (not nan) and err <= bound
    return {"ok": ok, "err": err, "err_torch": err_torch, "bound": bound,
            "ratio": err / bound if bound > 0 else math.inf, **({"error": "NaN in result"} if nan else {})}


def _draw(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=getattr(torch, dtype))


def op_kwargs(causal: bool, deterministic: bool) -> dict:
    kw = {"causal": causal}
    if deterministic:
        kw["deterministic"] = True  # only when asked: the argument may not exist in every version
    return kw


def check_case(case: CorrectnessCase, device: str, seed: int, deterministic: bool = False) -> dict:
    """Our forward+backward vs float64 autograd on one case; returns the per-tensor rule results."""
    from tvmflash import flash_attn_func

    gen = torch.Generator().manual_seed(seed)
    b, nq, nk, h, hk, d = case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_k, case.head_dim
    q, k, v = (_draw(gen, s, case.dtype, device) for s in ((b, nq, h, d), (b, nk, hk, d), (b, nk, hk, d)))
    dout = _draw(gen, (b, nq, h, d), case.dtype, device)
    tdtype = getattr(torch, case.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = op_kwargs(case.causal, deterministic)
    start = time.perf_counter()
    try:
        out, lse = flash_attn_func(*leaves, return_lse=True, **kw)
    except TypeError as err:  # an op without return_lse: check out and the gradients only
        if "return_lse" not in str(err):
            raise
        out, lse = flash_attn_func(*leaves, **kw), None
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    _sync(device)
    ours_s = time.perf_counter() - start

    refs = {}
    for name, dt in (("f64", torch.float64), ("same", tdtype)):
        ref_leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference_attention(*ref_leaves, case.causal, dtype=dt)
        refs[name] = (o.detach(), l.detach(), *torch.autograd.grad(o, ref_leaves, dout.to(dt)))
    with torch.no_grad():
        group = h // hk
        dp = torch.einsum("bihd,bjhd->bhij", dout.float().abs(), v.float().abs().repeat_interleave(group, 2)).max()
        sm_scale = d ** -0.5
        magnitude = {"out": float(v.abs().max()), "dv": float(dout.abs().max()),
                     "dq": float(sm_scale * dp * k.abs().max()), "dk": float(sm_scale * dp * q.abs().max())}
    checks = {}
    for i, (name, ours) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))):
        f64, same = refs["f64"][i], refs["same"][i]
        if name == "lse":
            if ours is None:
                continue
            finite = torch.isfinite(f64)
            if not torch.equal(torch.isfinite(ours), finite):
                checks["lse"] = {"ok": False, "error": "lse finite/-inf pattern differs from the reference"}
                continue
            checks["lse"] = flash_rule(ours[finite], f64[finite], same[finite].float(), torch.float32)
            continue
        if ours.dtype != tdtype:
            checks[name] = {"ok": False, "error": f"dtype {ours.dtype} != {tdtype}"}
            continue
        checks[name] = flash_rule(ours.detach(), f64, same, tdtype, magnitude.get(name, 1.0))
    result = {"case": asdict(case), "label": case.label(), "seed": seed, "ours_s": ours_s, "checks": checks}
    if deterministic:
        again = torch.autograd.grad(flash_attn_func(*leaves, **kw), leaves, dout)
        result["deterministic_bitwise"] = all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))
        checks["deterministic"] = {"ok": result["deterministic_bitwise"]}
    result["ok"] = all(c.get("ok") for c in checks.values())
    return result


# ----------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ours_impl(deterministic: bool):
    from tvmflash import flash_attn_func

    def run(q, k, v, causal):
        return flash_attn_func(q, k, v, **op_kwargs(causal, deterministic))
    return run


def sdpa_impl(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return run


def reference_impls(device: str) -> dict:
    """name -> SDPA backend. On CPU, cuDNN stays in the list: it cannot run there, which exercises
    the skip-an-unavailable-backend path the GPU run relies on."""
    from torch.nn.attention import SDPBackend

    refs = {"sdpa_flash": getattr(SDPBackend, "FLASH_ATTENTION", None),
            "sdpa_cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}
    if device == "cpu":
        refs["sdpa_math"] = SDPBackend.MATH
    return refs


def phase_calls(impl, q, k, v, dout, causal):
    """(forward under no_grad, forward+backward) closures on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return impl(*leaves, causal)

    def fwd_bwd():
        out = impl(*leaves, causal)
        return torch.autograd.grad(out, leaves, dout)

    return fwd, fwd_bwd


def interleaved_medians(calls: dict, device: str, rounds: int) -> dict[str, dict]:
    """Time every call once per round, rounds interleaved; CUDA events on cuda, wall clock on cpu."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        pending = []
        for name, fn in calls.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pending.append((name, start, end))
            else:
                time.sleep(CPU_PAUSE_S)  # let spinning thread pools (TVM's, torch's OpenMP) go idle
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        _sync(device)
        for name, start, end in pending:
            samples[name].append(start.elapsed_time(end) / 1e3)
    return {name: {"median_s": statistics.median(s), "min_s": min(s), "samples_s": s}
            for name, s in samples.items()}


def time_speed_case(case: SpeedCase, args, deadline: float, seed: int) -> dict:
    device = args.device
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (_draw(gen, shape, case.dtype, device) for _ in range(4))
    impls = {"tvmflash": ours_impl(args.deterministic)}
    unavailable = {}
    for name, backend in reference_impls(device).items():
        if backend is None:
            unavailable[name] = "not in this torch"
        else:
            impls[name] = sdpa_impl(backend)
    result = {"case": asdict(case), "label": case.label(), "unavailable": unavailable}
    # First call of ours: compiles (or loads from the cache); outside the timed region.
    t0 = time.perf_counter()
    fwd, fwd_bwd = phase_calls(impls["tvmflash"], q, k, v, dout, case.causal)
    ours_out = fwd()
    fwd_bwd()
    _sync(device)
    result["ours_first_call_s"] = time.perf_counter() - t0
    calls = {}
    ref_out = None
    for name, impl in impls.items():
        f, fb = phase_calls(impl, q, k, v, dout, case.causal)
        try:
            for _ in range(max(1, args.warmup)):
                o = f()
                fb()
            _sync(device)
        except Exception as err:  # noqa: BLE001 - a backend that cannot run this case is skipped
            if name == "tvmflash":
                raise
            first_line = (str(err).strip().splitlines() or [""])[0]
            unavailable[name] = f"{type(err).__name__}: {first_line[:200]}"
            continue
        if ref_out is None and name != "tvmflash":
            ref_out = (name, o)
        calls[f"{name}/fwd"], calls[f"{name}/fwd+bwd"] = f, fb
    if ref_out is not None:  # a coarse check at sizes the correctness stage does not reach
        diff = float((ours_out.float() - ref_out[1].float()).abs().max())
        ref_max = float(ref_out[1].float().abs().max())
        result["max_abs_diff_vs"] = {"ref": ref_out[0], "out": diff, "ref_out_max": ref_max}
        result["out_matches_ref"] = diff <= 0.05 * ref_max + 1e-3  # within 5% of the output range
    result["ours_nan"] = bool(torch.isnan(ours_out).any())
    # One round to size the timed rounds to the time left (a slow kernel still gets >= 2 rounds).
    t0 = time.perf_counter()
    for fn in calls.values():
        fn()
    _sync(device)
    round_s = time.perf_counter() - t0
    left = deadline - time.monotonic()
    rounds = max(2, min(args.reps, int(min(30.0, 0.5 * max(left, 0.0)) / max(round_s, 1e-6))))
    result["rounds"] = rounds
    times = interleaved_medians(calls, device, rounds)
    fl = case.forward_flops()
    for name in impls:
        if f"{name}/fwd" not in times:
            continue
        t_f, t_fb = times[f"{name}/fwd"]["median_s"], times[f"{name}/fwd+bwd"]["median_s"]
        t_b = t_fb - t_f if t_fb > t_f else None  # noise can make it <= 0 for tiny cases: no number then
        result.setdefault("times", {})[name] = {"fwd": times[f"{name}/fwd"], "fwd+bwd": times[f"{name}/fwd+bwd"],
                                                "bwd_derived_s": t_b}
        result.setdefault("tflops", {})[name] = {"fwd": fl / t_f / 1e12,
                                                 "bwd": 2.5 * fl / t_b / 1e12 if t_b else None,
                                                 "fwd+bwd": 3.5 * fl / t_fb / 1e12}
    ours = result["tflops"]["tvmflash"]
    result["ratio"] = {ref: {p: ours[p] / tf[p] if ours[p] and tf[p] else None for p in ("fwd", "bwd", "fwd+bwd")}
                       for ref, tf in result["tflops"].items() if ref != "tvmflash"}
    return result


# ----------------------------------------------------------------------------- stages (child side)


class StageWriter:
    """Accumulates a stage's results and rewrites its JSON file after every case (atomically),
    so a stage killed for time still leaves everything it measured."""

    def __init__(self, path: Path | None, stage: str, budget_s: float):
        self.path, self.start = path, time.monotonic()
        self.deadline = self.start + budget_s
        self.data = {"stage": stage, "budget_s": budget_s, "cases": [], "skipped": [], "notes": [],
                     "finished": False}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def flush(self) -> None:
        self.data["elapsed_s"] = time.monotonic() - self.start
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def add(self, record: dict) -> None:
        self.data["cases"].append(record)
        self.flush()

    def skip(self, labels, why: str) -> None:
        self.data["skipped"] += [{"label": label, "why": why} for label in labels]
        self.flush()

    def finish(self) -> dict:
        self.data["finished"] = True
        self.flush()
        return self.data


def _error_record(err: BaseException) -> dict:
    return {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def device_alive(device: str) -> bool:
    """False once the CUDA context is poisoned (e.g. an illegal address): later cases would fail too."""
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").add_(1).item()) == 2.0
    except Exception:  # noqa: BLE001
        return False


def _run_cases(writer: StageWriter, items, run_one, device: str, label=lambda c: c.label()) -> None:
    items = list(items)
    for i, item in enumerate(items):
        if writer.left() <= 0:
            writer.data["notes"].append(f"budget exceeded: {len(items) - i} case(s) skipped")
            writer.skip([label(c) for c in items[i:]], "budget exceeded")
            print(f"  budget exceeded: skipping {len(items) - i} case(s)", flush=True)
            return
        t0 = time.perf_counter()
        try:
            record = run_one(i, item)
        except Exception as err:  # noqa: BLE001 - reported, the next case runs
            record = {"label": label(item), "ok": False, **_error_record(err)}
        record["wall_s"] = time.perf_counter() - t0
        writer.add(record)
        status = "ok" if record.get("ok", "error" not in record) else "FAILED"
        print(f"  [{i + 1}/{len(items)}] {label(item)}: {status} ({record['wall_s']:.1f} s)"
              + (f" {record['error'][:160]}" if "error" in record else ""), flush=True)
        if "error" in record and not device_alive(device):
            writer.data["notes"].append("CUDA context lost: remaining cases skipped")
            writer.skip([label(c) for c in items[i + 1:]], "CUDA context lost after an error")
            return


def stage_compile(args, writer: StageWriter) -> None:
    """Compile (or load) the given variants in this process: fills the disk cache."""
    import tvmflash

    target = "llvm" if args.device == "cpu" else {"kind": "cuda", "arch": args.arch or cuda_arch()}
    variants = [parse_variant(s) for s in args.variants.split(";")] if args.variants else variants_needed(args)

    extra = {}
    if args.deterministic and args.device == "cuda":
        import inspect

        if "deterministic" in inspect.signature(tvmflash.compile).parameters:
            extra["deterministic"] = True  # what flash_attn_func(deterministic=True) will ask for

    def one(_i, variant):
        dtype, head_dim, causal = variant
        t0 = time.perf_counter()
        tvmflash.compile(target, head_dim=head_dim, dtype=dtype, causal=causal, **extra)
        return {"label": format_variant(variant), "compile_s": time.perf_counter() - t0, "ok": True}

    _run_cases(writer, variants, one, "cpu", label=format_variant)  # compiling does not touch the GPU


def stage_correctness(args, writer: StageWriter) -> None:
    cases = correctness_cases(args.device, args.quick)

    def one(i, case):
        return check_case(case, args.device, args.seed * 1000 + i, args.deterministic)

    _run_cases(writer, cases, one, args.device)


def stage_speed(args, writer: StageWriter) -> None:
    cases = speed_cases(args.device, args.quick, args.case_filter)
    if not cases:
        writer.data["notes"].append("no speed case matches --cases")

    def one(i, case):
        record = time_speed_case(case, args, writer.deadline, args.seed * 1000 + i)
        record["ok"] = not record["ours_nan"] and record.get("out_matches_ref", True)
        return record

    _run_cases(writer, cases, one, args.device)


def standard_attention_bytes(batch, heads, seqlen_q, seqlen_k, dtype: str) -> dict:
    """Memory standard (materialized) attention needs for the N x N matrices."""
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    p = batch * heads * seqlen_q * seqlen_k * elt
    return {"P_saved_for_backward_bytes": p, "peak_estimate_bytes": 2 * p,
            "formula": f"P: B*H*Nq*Nk*{elt} bytes (kept for the backward); peak ~2x (S and P, or P and dP/dS, "
                       "alive together)"}


def flash_io_bytes(seqlen, head_dim, dtype: str) -> int:
    """What our forward+backward must hold for one head, O(N): q k v out dout dq dk dv, the fp32
    lse, and one fp32 dq accumulator (the deterministic CUDA backward keeps up to 8 of them)."""
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    return 8 * seqlen * head_dim * elt + 4 * seqlen + 4 * seqlen * head_dim


def stage_long(args, writer: StageWriter) -> None:
    from tvmflash import flash_attn_func

    device, dtype, d = args.device, long_dtype(args.device), args.long_head_dim
    n = args.long_n
    # Pick the largest N (halving from --long-n) whose estimated time fits: fwd + 2 fwd+bwd ~ 3.3x.
    per_n2 = args.long_estimate_s_per_n2
    if per_n2:
        while n > 4096 and 3.3 * per_n2 * n * n > 0.8 * writer.left():
            n //= 2
        if n != args.long_n:
            writer.data["notes"].append(
                f"N={args.long_n} estimated at {per_n2 * args.long_n ** 2:.0f} s per fwd+bwd, more than the "
                f"{writer.left():.0f} s left: ran N={n} instead")
        writer.data["estimated_fwd_bwd_s"] = per_n2 * n * n
    case = {"batch": 1, "seqlen": n, "heads": 1, "head_dim": d, "dtype": dtype, "causal": False}
    label = f"long N={n} D{d} {SHORT[dtype]} B1 H1"
    record = {"label": label, "case": case, "standard_attention": standard_attention_bytes(1, 1, n, n, dtype),
              "flash_io_bytes": flash_io_bytes(n, d, dtype),
              "flops": {"fwd": forward_flops(1, 1, n, n, d, False),
                        "fwd+bwd": forward_flops(1, 1, n, n, d, False) + backward_flops(1, 1, n, n, d, False)}}
    cuda = device == "cuda"

    def timed(fn):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            res = fn()
            end.record()
            torch.cuda.synchronize()
            return res, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        res = fn()
        return res, time.perf_counter() - t0

    try:
        gen = torch.Generator().manual_seed(args.seed)
        q, k, v, dout = (_draw(gen, (1, n, 1, d), dtype, device) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kw = op_kwargs(False, args.deterministic)
        # Load (or compile) the kernels and run them once on a small input, outside the timing.
        t0 = time.perf_counter()
        small = [t[:, :256].clone().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(flash_attn_func(*small, **kw), small, dout[:, :256])
        _sync(device)
        record["warmup_s"] = time.perf_counter() - t0
        del small
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            record["inputs_allocated_bytes"] = torch.cuda.memory_allocated()
        with torch.no_grad():
            (out, lse), t_fwd = timed(lambda: flash_attn_func(*leaves, return_lse=True, **kw))
        record["fwd_s"] = t_fwd
        record["fwd_tflops"] = record["flops"]["fwd"] / t_fwd / 1e12
        if cuda:
            record["fwd_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["sampled_rows"] = sampled_rows_check(q, k, v, out, lse, dtype, args.seed)
        del out, lse
        writer.add(dict(record, partial=True))
        runs = []
        for attempt in range(2):
            if attempt and (not runs or writer.left() < 1.5 * runs[-1]):
                writer.data["notes"].append("no time for a second fwd+bwd: the first one is reported")
                break
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            grads, t = timed(lambda: torch.autograd.grad(flash_attn_func(*leaves, **kw), leaves, dout))
            runs.append(t)
            record["grads_finite"] = bool(all(torch.isfinite(g).all() for g in grads))
            del grads
            if cuda:
                record["fwd_bwd_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["fwd_bwd_s_runs"] = runs
        record["fwd_bwd_s"] = runs[-1]
        record["fwd_bwd_tflops"] = record["flops"]["fwd+bwd"] / runs[-1] / 1e12
        record["ok"] = record["grads_finite"] and record["sampled_rows"]["ok"]
        writer.data["cases"] = []
        writer.add(record)
    except Exception as err:  # noqa: BLE001
        record.update(ok=False, **_error_record(err))
        writer.data["cases"] = [record]
        writer.flush()
        print(f"  {label}: FAILED {record['error'][:300]}", flush=True)
        return
    print(f"  {label}: fwd {record['fwd_s']:.2f} s, fwd+bwd {record['fwd_bwd_s']:.2f} s"
          + (f", peak {record['fwd_bwd_peak_allocated_bytes'] / 2**30:.2f} GiB" if cuda else ""), flush=True)
    # PyTorch's FLASH backend on the same case, if there is time (about our fwd+bwd again, or less).
    if not cuda:
        return
    if writer.left() < 2.0 * record["fwd_bwd_s"] + 10:
        writer.data["notes"].append("no time left for SDPA FLASH at this N")
        return
    try:
        leaves = None  # free our gradients' inputs before the reference runs
        torch.cuda.reset_peak_memory_stats()
        from torch.nn.attention import SDPBackend

        impl = sdpa_impl(SDPBackend.FLASH_ATTENTION)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        _, t = timed(lambda: torch.autograd.grad(impl(*ref_leaves, False), ref_leaves, dout))
        record["sdpa_flash"] = {"fwd_bwd_s": t, "fwd_bwd_tflops": record["flops"]["fwd+bwd"] / t / 1e12,
                                "fwd_bwd_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                                "note": "one call, includes its first-call overheads at this shape"}
    except Exception as err:  # noqa: BLE001
        record["sdpa_flash"] = _error_record(err)
    writer.data["cases"] = []
    writer.add(record)


def sampled_rows_check(q, k, v, out, lse, dtype: str, seed: int, rows: int = 4) -> dict:
    """A few query rows of the long case against float64 over all keys (a sanity check, not the rule):
    |out - f64| <= (4 eps(dtype) + 1e-4) * max|f64 row| and |lse - f64| <= 1e-3 * max(1, |lse|)."""
    gen = torch.Generator().manual_seed(seed + 1)
    n, d = q.shape[1], q.shape[-1]
    idx = torch.randint(0, n, (rows,), generator=gen).tolist()
    idx = sorted(set(idx + [0, n - 1]))
    qs = q[0, idx, 0].double()
    s = (qs @ k[0, :, 0].double().T) * d ** -0.5
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.softmax(s, -1) @ v[0, :, 0].double()
    got = out[0, idx, 0].double()
    err = float((got - ref).abs().max())
    tol = (4 * torch.finfo(getattr(torch, dtype)).eps + 1e-4) * float(ref.abs().max())
    lse_err = float((lse[0, 0, idx].double() - ref_lse).abs().max())
    lse_tol = 1e-3 * max(1.0, float(ref_lse.abs().max()))
    return {"rows": idx, "out_max_abs_err": err, "out_tol": tol, "lse_max_abs_err": lse_err, "lse_tol": lse_tol,
            "ok": err <= tol and lse_err <= lse_tol and bool(torch.isfinite(got).all())}


STAGE_FUNCS = {"compile": stage_compile, "correctness": stage_correctness, "speed": stage_speed, "long": stage_long}


def run_stage(args) -> dict:
    """One stage in this process (a child of the orchestrator, or inline with --no-isolate)."""
    budget = args.stage_budget_s if args.stage_budget_s is not None else args.budget_s
    writer = StageWriter(args.stage_out, args.stage, budget)
    writer.flush()
    if args.device == "cuda" and args.stage != "compile":
        torch.backends.cuda.matmul.allow_tf32 = False  # not used by fp16/bf16; keeps fp32 refs exact
    try:
        STAGE_FUNCS[args.stage](args, writer)
    except Exception as err:  # noqa: BLE001
        writer.data["notes"].append("stage failed: " + _error_record(err)["error"])
        writer.data["stage_error"] = _error_record(err)
    return writer.finish()


# ----------------------------------------------------------------------------- orchestration


def cuda_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def format_variant(v) -> str:
    dtype, head_dim, causal = v
    return f"{dtype}:{head_dim}:{int(causal)}"


def parse_variant(text: str):
    dtype, head_dim, causal = text.split(":")
    return dtype, int(head_dim), causal == "1"


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "host": platform.node(), "cpu_count": os.cpu_count(), "device": device}
    try:
        import tvm

        env["tvm"] = tvm.__version__
    except Exception as err:  # noqa: BLE001
        env["tvm"] = f"unavailable ({err})"
    try:
        import tvmflash

        env["tvmflash"] = tvmflash.__version__
        env["tvmflash_cache_dir"] = str(tvmflash.cache_dir())
    except Exception as err:  # noqa: BLE001
        env["tvmflash"] = f"unavailable ({err})"
    for key, cmd in (("git_commit", ["git", "rev-parse", "HEAD"]), ("git_status", ["git", "status", "--short"]),
                     ("nvcc", ["nvcc", "--version"]),
                     ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                     "--format=csv,noheader"])):
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
            env[key] = r.stdout.strip()[-2000:] if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            env[key] = None
    if device == "cuda":
        try:
            props = torch.cuda.get_device_properties(0)
            env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}",
                       gpu_memory_bytes=props.total_memory, sm_count=props.multi_processor_count,
                       cudnn=torch.backends.cudnn.version())
        except Exception as err:  # noqa: BLE001
            env["gpu"] = f"unavailable ({err})"
    return env


def _child_command(args, stage: str, budget_s: float, out: Path, extra=()) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--stage", stage,
           "--stage-budget-s", f"{budget_s:.1f}", "--stage-out", str(out), "--seed", str(args.seed),
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--long-n", str(args.long_n),
           "--long-head-dim", str(args.long_head_dim), "--stages", ",".join(args.stage_list),
           "--budget-s", f"{args.budget_s}"]
    if args.quick:
        cmd.append("--quick")
    if args.cases:
        cmd += ["--cases", args.cases]
    if args.deterministic:
        cmd.append("--deterministic")
    if args.arch:
        cmd += ["--arch", args.arch]
    return cmd + list(extra)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_child(args, stage: str, budget_s: float, timeout_s: float, out: Path, extra=()) -> dict:
    out.unlink(missing_ok=True)
    cmd = _child_command(args, stage, budget_s, out, extra)
    t0 = time.monotonic()
    info = {}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=max(timeout_s, 1.0), stderr=subprocess.PIPE, text=True)
        info["returncode"] = proc.returncode
        stderr = proc.stderr
    except subprocess.TimeoutExpired as err:
        info["returncode"] = None
        info["killed_after_s"] = timeout_s
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
    if stderr:
        sys.stderr.write(stderr[-4000:])
        info["stderr_tail"] = stderr[-3000:]
    data = _read_json(out) or {"stage": stage, "cases": [], "skipped": [], "notes": []}
    data.setdefault("notes", [])
    if info.get("killed_after_s") is not None:
        data["notes"].append(f"stage killed after {timeout_s:.0f} s (past its budget); results so far kept")
    elif info["returncode"] != 0:
        data["notes"].append(f"stage process exited with {info['returncode']} (crash?); results so far kept")
    data["process"] = {**info, "wall_s": time.monotonic() - t0}
    return data


def run_compile_stage(args, budget_s: float, out_dir: Path) -> dict:
    """Compile every needed variant in parallel child processes (they share the disk cache)."""
    variants = variants_needed(args)
    groups = [variants[i::args.jobs] for i in range(min(args.jobs, len(variants)))]
    t0 = time.monotonic()

    def one(i, group):
        spec = ";".join(format_variant(v) for v in group)
        return run_child(args, "compile", budget_s, budget_s + GRACE_S, out_dir / f"stage_compile_{i}.json",
                         ["--variants", spec])

    with ThreadPoolExecutor(max(1, len(groups))) as pool:
        parts = list(pool.map(lambda ig: one(*ig), enumerate(groups)))
    merged = {"stage": "compile", "cases": [], "skipped": [], "notes": [], "processes": []}
    for part in parts:
        merged["cases"] += part.get("cases", [])
        merged["skipped"] += part.get("skipped", [])
        merged["notes"] += part.get("notes", [])
        merged["processes"].append(part.get("process"))
    merged["elapsed_s"] = time.monotonic() - t0
    for i in range(len(groups)):
        (out_dir / f"stage_compile_{i}.json").unlink(missing_ok=True)
    (out_dir / "stage_compile.json").write_text(json.dumps(merged, indent=1, default=str))
    return merged


def long_estimate_per_n2(speed: dict | None, head_dim: int, dtype: str) -> float | None:
    """Seconds per N^2 of one head's fwd+bwd, from our largest non-causal speed case of that kind."""
    best = None
    for rec in (speed or {}).get("cases", []):
        c = rec.get("case", {})
        t = rec.get("times", {}).get("tvmflash", {}).get("fwd+bwd", {}).get("median_s")
        if t and c.get("head_dim") == head_dim and c.get("dtype") == dtype and not c.get("causal"):
            if best is None or c["seqlen"] > best[0]["seqlen"]:
                best = (c, t)
    if best is None:
        return None
    c, t = best
    return t / (c["batch"] * c["heads"] * c["seqlen"] ** 2)


def orchestrate(args) -> dict:
    start = time.monotonic()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": "python " + " ".join(sys.argv), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                   for k, v in vars(args).items()
                                                                   if k != "case_filter"},
              "environment": environment(args.device), "stages": {}, "skipped_stages": []}
    json_path = args.out_dir / "gpu_check.json"
    if args.device == "cuda" and not torch.cuda.is_available() and not args.precompile_only:
        report["notes"] = ["no CUDA device: nothing run (use --device cpu for the CPU dry run)"]
        report["no_device"] = True
        json_path.write_text(json.dumps(report, indent=1, default=str))
        print("no CUDA device visible: use --device cpu, or --precompile-only --arch sm_90")
        return report
    if args.precompile_only:
        if args.device == "cuda" and not args.arch and not torch.cuda.is_available():
            raise SystemExit("--precompile-only without a GPU needs --arch (e.g. sm_90)")
        args.stage_list = [s for s in args.stage_list if s != "compile"]  # the kernels these stages use
        report["stages"]["compile"] = run_compile_stage(args, args.budget_s, args.out_dir)
        json_path.write_text(json.dumps(report, indent=1, default=str))
        print(compile_summary(report["stages"]["compile"]))
        return report
    hard_end = start + args.budget_s + GRACE_S
    cuda = args.device == "cuda"
    if cuda and not args.arch:
        args.arch = cuda_arch()  # for the compile children, which then need no CUDA context
    for stage in [s for s in STAGES if s in args.stage_list]:
        left = args.budget_s - (time.monotonic() - start)
        if left < 5:
            report["skipped_stages"].append({"stage": stage, "why": f"budget exceeded ({left:.0f} s left)"})
            continue
        later = [s for s in args.stage_list if STAGES.index(s) > STAGES.index(stage)]
        reserve_long = (LONG_RESERVE_S if cuda else 5.0) if "long" in later else 0.0
        if stage == "compile":
            budget = max(20.0, 0.45 * left)
        elif stage == "correctness":
            budget = max(20.0, min(0.3 * left, left - reserve_long - (30 if "speed" in later else 0)))
        elif stage == "speed":
            budget = max(20.0, left - reserve_long)
        else:
            budget = left
        print(f"== {stage} (budget {budget:.0f} s of {left:.0f} s left)", flush=True)
        timeout = max(5.0, min(budget + GRACE_S, hard_end - time.monotonic()))
        extra = []
        if stage == "long":
            est = long_estimate_per_n2(report["stages"].get("speed"), args.long_head_dim, long_dtype(args.device))
            if est:
                extra = ["--long-estimate-s-per-n2", repr(est)]
        out = args.out_dir / f"stage_{stage}.json"
        if stage == "compile":
            data = run_compile_stage(args, budget, args.out_dir)
        elif args.no_isolate:
            child = argparse.Namespace(**vars(args))
            child.stage, child.stage_budget_s, child.stage_out = stage, budget, out
            child.long_estimate_s_per_n2 = float(extra[1]) if extra else None
            data = run_stage(child)
        else:
            data = run_child(args, stage, budget, timeout, out, extra)
        report["stages"][stage] = data
        report["elapsed_s"] = time.monotonic() - start
        json_path.write_text(json.dumps(report, indent=1, default=str))
    report["elapsed_s"] = time.monotonic() - start
    report["summary"] = summarize(report)
    json_path.write_text(json.dumps(report, indent=1, default=str))
    text = render(report)
    (args.out_dir / "gpu_check.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return report


# ----------------------------------------------------------------------------- report


def _fmt_tf(x) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 1 else f"{x:.3f}")


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def compile_summary(stage: dict) -> str:
    cases = stage.get("cases", [])
    ok = [c for c in cases if c.get("ok")]
    longest = max((c.get("compile_s", 0) for c in ok), default=0)
    line = (f"compile: {len(ok)}/{len(cases)} variants ready in {stage.get('elapsed_s', 0):.0f} s "
            f"(slowest {longest:.0f} s)")
    bad = [f"{c['label']}: {c.get('error', '?')[:200]}" for c in cases if not c.get("ok")]
    return line + "".join(f"\n  FAILED {b}" for b in bad)


def summarize(report: dict) -> dict:
    stages = report["stages"]
    out = {}
    corr = stages.get("correctness")
    if corr:
        cases = corr.get("cases", [])
        out["correctness_passed"] = sum(bool(c.get("ok")) for c in cases)
        out["correctness_total"] = len(cases) + len(corr.get("skipped", []))
        out["correctness_failed"] = [c["label"] for c in cases if not c.get("ok")]
    speed = stages.get("speed")
    if speed:
        for rec in speed.get("cases", []):
            c = rec.get("case", {})
            if (c.get("seqlen"), c.get("head_dim"), c.get("dtype")) == (8192, 128, "bfloat16") and "ratio" in rec:
                r = rec["ratio"].get("sdpa_flash")
                if r:
                    key = "bar_N8K_D128_bf16" + ("_causal" if c["causal"] else "")
                    out[key] = {"fwd": r["fwd"], "bwd": r["bwd"], "fwd+bwd": r["fwd+bwd"],
                                "meets_0.5x": r["fwd"] >= 0.5 and r["bwd"] >= 0.5}
    return out


def render(report: dict) -> str:
    env, stages = report["environment"], report["stages"]
    where = env.get("gpu") or "CPU"
    lines = [f"## tvmflash gpu_check: {where}, torch {env.get('torch')}, tvm {env.get('tvm')}, "
             f"commit {(env.get('git_commit') or '?')[:10]}, {report.get('elapsed_s', 0):.0f} s"]
    if "compile" in stages:
        lines.append(compile_summary(stages["compile"]))
    corr = stages.get("correctness")
    if corr is not None:
        cases = corr.get("cases", [])
        passed = [c for c in cases if c.get("ok")]
        worst = max((max((ch.get("ratio", 0) for ch in c.get("checks", {}).values()), default=0), c["label"])
                    for c in passed) if passed else None
        lines.append(f"correctness: {len(passed)}/{len(cases)} passed"
                     + (f", {len(corr['skipped'])} skipped" if corr.get("skipped") else "")
                     + (f"; worst err/bound {worst[0]:.2f} ({worst[1]})" if worst else ""))
        for c in [c for c in cases if not c.get("ok")][:12]:
            if "error" in c:
                why = c["error"].splitlines()[0][:200]
            else:
                why = ", ".join(f"{k} err {v.get('err', float('nan')):.3g} > bound {v.get('bound', float('nan')):.3g}"
                                if "err" in v else f"{k}: {v.get('error', 'failed')}"
                                for k, v in c.get("checks", {}).items() if not v.get("ok"))
            lines.append(f"  FAILED {c['label']}: {why}")
    speed = stages.get("speed")
    if speed is not None:
        refs = []
        for rec in speed.get("cases", []):
            for name in rec.get("tflops", {}):
                if name != "tvmflash" and name not in refs:
                    refs.append(name)
        head = (["case", "ours fwd"] + [f"{r[5:]} fwd" for r in refs] + ["ours f+b"] + [f"{r[5:]} f+b" for r in refs]
                + [f"fwd/{r[5:]}" for r in refs] + [f"bwd/{r[5:]}" for r in refs[:1]] + [f"f+b/{r[5:]}" for r in refs])
        rows = []
        for rec in speed.get("cases", []):
            if "tflops" not in rec:
                rows.append([rec["label"], "ERROR: " + rec.get("error", "?").splitlines()[0][:120]]
                            + [""] * (len(head) - 2))
                continue
            tf, ratio = rec["tflops"], rec.get("ratio", {})

            def g(name, phase, src=tf):
                return src.get(name, {}).get(phase)
            flag = " NaN!" if rec.get("ours_nan") else " MISMATCH!" if rec.get("out_matches_ref") is False else ""
            row = ([rec["label"] + flag, _fmt_tf(g("tvmflash", "fwd"))]
                   + [_fmt_tf(g(r, "fwd")) for r in refs] + [_fmt_tf(g("tvmflash", "fwd+bwd"))]
                   + [_fmt_tf(g(r, "fwd+bwd")) for r in refs]
                   + [_ratio(g(r, "fwd", ratio)) for r in refs] + [_ratio(g(r, "bwd", ratio)) for r in refs[:1]]
                   + [_ratio(g(r, "fwd+bwd", ratio)) for r in refs])
            rows.append(row)
        lines.append("")
        lines.append("speed (TFLOP/s; ratios ours/ref, > 1: tvmflash faster):")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        unavailable = sorted({f"{k}: {v[:100]}" for rec in speed.get("cases", [])
                              for k, v in rec.get("unavailable", {}).items()})
        lines += [f"  unavailable {u}" for u in unavailable[:6]]
        if speed.get("skipped"):
            lines.append(f"  {len(speed['skipped'])} speed case(s) skipped: {speed['skipped'][0]['why']}")
    summary = report.get("summary", {})
    for key in ("bar_N8K_D128_bf16", "bar_N8K_D128_bf16_causal"):
        if key in summary:
            s = summary[key]
            lines.append(f"bar {key[4:]}: fwd {s['fwd']:.2f}x, bwd {s['bwd']:.2f}x, fwd+bwd {s['fwd+bwd']:.2f}x "
                         f"SDPA flash -> {'meets' if s['meets_0.5x'] else 'BELOW'} 0.5x")
    long = stages.get("long")
    if long is not None:
        recs = long.get("cases", [])
        if not recs:
            lines.append("long: no result")
        for rec in recs:
            if "error" in rec:
                lines.append(f"{rec['label']}: FAILED {rec['error'].splitlines()[0][:200]}")
                continue
            std = rec["standard_attention"]
            text = (f"{rec['label']}: fwd {rec.get('fwd_s', float('nan')):.2f} s "
                    f"({_fmt_tf(rec.get('fwd_tflops'))} TF/s)")
            if "fwd_bwd_s" in rec:
                text += f", fwd+bwd {rec['fwd_bwd_s']:.2f} s ({_fmt_tf(rec.get('fwd_bwd_tflops'))} TF/s)"
            if "fwd_bwd_peak_allocated_bytes" in rec:
                text += f", peak {_fmt_bytes(rec['fwd_bwd_peak_allocated_bytes'])}"
            text += (f"; standard attention: P alone {_fmt_bytes(std['P_saved_for_backward_bytes'])}, "
                     f"peak ~{_fmt_bytes(std['peak_estimate_bytes'])}")
            sr = rec.get("sampled_rows", {})
            text += f"; sampled rows vs f64 {'ok' if sr.get('ok') else 'FAILED'}"
            if isinstance(rec.get("sdpa_flash"), dict) and "fwd_bwd_s" in rec["sdpa_flash"]:
                text += f"; SDPA flash fwd+bwd {rec['sdpa_flash']['fwd_bwd_s']:.2f} s"
            if rec.get("partial"):
                text += " (fwd+bwd did not finish)"
            lines.append(text)
    for name, data in stages.items():
        for note in data.get("notes", []):
            lines.append(f"note ({name}): {note[:300]}")
    for s in report.get("skipped_stages", []):
        lines.append(f"stage {s['stage']} skipped: {s['why']}")
    lines.append(f"details: {report['args'].get('out_dir')}/gpu_check.json")
    return "\n".join(lines)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        data = run_stage(args)
        return 0 if "stage_error" not in data else 1
    report = orchestrate(args)
    if report.get("no_device"):
        return 2
    summary = report.get("summary", {})
    return 1 if summary.get("correctness_failed") else 0


if __name__ == "__main__":
    sys.exit(main())
