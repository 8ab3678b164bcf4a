"""The whole run: the stages one after the other, each in a child process with its share of the
budget, the environment, gpu_check.json and the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .cases import long_dtype
from .cli import GRACE_S, STAGES, parse_args
from .compiling import cuda_arch, run_compile_stage, stage_compile
from .report import compile_summary, render, summarize
from .stage import ROOT, StageWriter, error_record, run_child

LONG_RESERVE_S = 75.0  # kept for the long stage while the speed stage runs (cuda)


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


def long_estimate_per_n2(speed: dict | None, head_dim: int, dtype: str) -> float | None:
    """Seconds per N^2 of one head's fwd+bwd, from our largest non-causal speed case of that kind."""
    best = None
    for rec in (speed or {}).get("cases", []):
        c = rec.get("case", {})
        t = rec.get("times", {}).get("tvmflash", {}).get("fwd+bwd")
        if t and c.get("head_dim") == head_dim and c.get("dtype") == dtype and not c.get("causal"):
            if best is None or c["seqlen"] > best[0]["seqlen"]:
                best = (c, t)
    if best is None:
        return None
    c, t = best
    return t / (c["batch"] * c["heads"] * c["seqlen"] ** 2)


def stage_budget(stage: str, left: float, later: list[str], cuda: bool) -> float:
    """A stage's share of the ``left`` seconds: compile up to 45%, correctness 30% (leaving the
    speed stage 30 s and the long stage its reserve), speed all but the long stage's reserve."""
    reserve_long = (LONG_RESERVE_S if cuda else 5.0) if "long" in later else 0.0
    if stage == "compile":
        return max(20.0, 0.45 * left)
    if stage == "correctness":
        return max(20.0, min(0.3 * left, left - reserve_long - (30 if "speed" in later else 0)))
    if stage == "speed":
        return max(20.0, left - reserve_long)
    return left


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


def precompile(args, report: dict, json_path: Path) -> dict:
    """--precompile-only: the compile stage for the kernels the selected stages would use."""
    if args.device == "cuda" and not args.arch and not torch.cuda.is_available():
        raise SystemExit("--precompile-only without a GPU needs --arch (e.g. sm_90)")
    args.stage_list = [s for s in args.stage_list if s != "compile"]
    report["stages"]["compile"] = run_compile_stage(args, args.budget_s, args.out_dir)
    write_json(report, json_path)
    print(compile_summary(report["stages"]["compile"]))
    return report


def run_stage(args) -> dict:
    """One stage in this process (a child of the orchestrator, or inline with --no-isolate).

    The other stages' modules load only here: the orchestrating parent, which runs each stage in a
    child, needs none of them."""
    from .correctness import stage_correctness
    from .long import stage_long
    from .speed import stage_speed

    funcs = {"compile": stage_compile, "correctness": stage_correctness, "speed": stage_speed, "long": stage_long}
    budget = args.stage_budget_s if args.stage_budget_s is not None else args.budget_s
    writer = StageWriter(args.stage_out, args.stage, budget)
    writer.flush()
    if args.device == "cuda" and args.stage != "compile":
        torch.backends.cuda.matmul.allow_tf32 = False  # not used by fp16/bf16; keeps fp32 refs exact
    try:
        funcs[args.stage](args, writer)
    except Exception as err:  # noqa: BLE001
        writer.note("stage failed: " + error_record(err)["error"])
        writer.data["stage_error"] = error_record(err)
    return writer.finish()


def run_one_stage(args, stage: str, budget: float, timeout: float, report: dict) -> dict:
    extra = []
    if stage == "long":
        est = long_estimate_per_n2(report["stages"].get("speed"), args.long_head_dim, long_dtype(args.device))
        extra = ["--long-estimate-s-per-n2", repr(est)] if est else []
    out = args.out_dir / f"stage_{stage}.json"
    if stage == "compile":
        return run_compile_stage(args, budget, args.out_dir)
    if args.no_isolate:
        child = argparse.Namespace(**vars(args))
        child.stage, child.stage_budget_s, child.stage_out = stage, budget, out
        child.long_estimate_s_per_n2 = float(extra[1]) if extra else None
        return run_stage(child)
    return run_child(args, stage, budget, timeout, out, extra)


def orchestrate(args) -> dict:
    start = time.monotonic()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": "python " + " ".join(sys.argv),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "case_filter"},
              "environment": environment(args.device), "stages": {}, "skipped_stages": []}
    json_path = args.out_dir / "gpu_check.json"
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available() and not args.precompile_only:
        report.update(notes=["no CUDA device: nothing run (use --device cpu for the CPU dry run)"], no_device=True)
        write_json(report, json_path)
        print("no CUDA device visible: use --device cpu, or --precompile-only --arch sm_90")
        return report
    if args.precompile_only:
        return precompile(args, report, json_path)
    hard_end = start + args.budget_s + GRACE_S
    if cuda and not args.arch:
        args.arch = cuda_arch()  # for the compile children, which then need no CUDA context
    for stage in [s for s in STAGES if s in args.stage_list]:
        left = args.budget_s - (time.monotonic() - start)
        if left < 5:
            report["skipped_stages"].append({"stage": stage, "why": f"budget exceeded ({left:.0f} s left)"})
            continue
        later = [s for s in args.stage_list if STAGES.index(s) > STAGES.index(stage)]
        budget = stage_budget(stage, left, later, cuda)
        print(f"== {stage} (budget {budget:.0f} s of {left:.0f} s left)", flush=True)
        timeout = max(5.0, min(budget + GRACE_S, hard_end - time.monotonic()))
        report["stages"][stage] = run_one_stage(args, stage, budget, timeout, report)
        report["elapsed_s"] = time.monotonic() - start
        write_json(report, json_path)
    report["elapsed_s"] = time.monotonic() - start
    report["summary"] = summarize(report)
    write_json(report, json_path)
    text = render(report)
    (args.out_dir / "gpu_check.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        data = run_stage(args)
        return 0 if "stage_error" not in data else 1
    report = orchestrate(args)
    if report.get("no_device"):
        return 2
    return 1 if report.get("summary", {}).get("correctness_failed") else 0
