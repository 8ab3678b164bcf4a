"""The command line: arguments, their defaults per device, and the --cases filter."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

STAGES = ("compile", "correctness", "speed", "long")
GRACE_S = 15.0  # a stage child may overrun its budget by one case; killed after this much more
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def parse_args(argv=None) -> argparse.Namespace:
    from . import __doc__ as description

    p = argparse.ArgumentParser(prog="gpu_check.py", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds per speed case before the one that sizes the timed rounds "
                        "(default cuda 2, cpu 1)")
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
    args.stage_list = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stage_list if s not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)}")
    if args.reps < 1 or args.warmup < 0 or args.budget_s <= 0:
        p.error("--reps must be >= 1, --warmup >= 0, --budget-s > 0")
    try:
        args.case_filter = parse_case_filter(args.cases)
    except ValueError as err:
        p.error(str(err))
    return args


def child_argv(args, stage: str, budget_s: float, out: Path, extra=()) -> list[str]:
    """The arguments that run one stage of this run in a child process (``parse_args`` reads them)."""
    argv = ["--device", args.device, "--stage", stage, "--stage-budget-s", f"{budget_s:.1f}", "--stage-out", str(out),
            "--seed", str(args.seed), "--reps", str(args.reps), "--warmup", str(args.warmup),
            "--long-n", str(args.long_n), "--long-head-dim", str(args.long_head_dim),
            "--stages", ",".join(args.stage_list), "--budget-s", f"{args.budget_s}"]
    argv += ["--quick"] * args.quick + ["--deterministic"] * args.deterministic
    if args.cases:
        argv += ["--cases", args.cases]
    if args.arch:
        argv += ["--arch", args.arch]
    return argv + list(extra)


def parse_case_filter(text: str | None) -> dict:
    """ "N=8192/16384,D=128,dtype=bf16,causal=0" -> {"seqlen": {8192, 16384}, "head_dim": {128}, ...}."""
    if not text:
        return {}
    keys = {"n": "seqlen", "seqlen": "seqlen", "d": "head_dim", "head_dim": "head_dim", "dtype": "dtype",
            "causal": "causal"}
    result = {}
    for part in filter(str.strip, text.split(",")):
        if "=" not in part:
            raise ValueError(f"--cases: expected key=value, got {part!r}")
        key, values = (s.strip() for s in part.split("=", 1))
        if key.lower() not in keys:
            raise ValueError(f"--cases: unknown key {key!r} (use N, D, dtype, causal)")
        name = keys[key.lower()]
        result[name] = {_case_value(name, v.strip()) for v in values.split("/")}
    return result


def _case_value(name: str, v: str):
    if name in ("seqlen", "head_dim"):
        return int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v)
    if name == "dtype":
        if v not in DTYPE_ALIASES:
            raise ValueError(f"--cases: unknown dtype {v!r}")
        return DTYPE_ALIASES[v]
    if v.lower() not in ("0", "1", "true", "false"):
        raise ValueError(f"--cases: causal must be 0 or 1, got {v!r}")
    return v.lower() in ("1", "true")
