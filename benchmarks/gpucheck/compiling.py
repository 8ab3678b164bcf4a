"""The compile stage: every kernel the run needs, compiled (or loaded) into the disk cache by
parallel child processes, so that the later stages load them instead of compiling one by one."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .cases import format_variant, parse_variant, variants_needed
from .cli import GRACE_S
from .stage import StageWriter, run_child, run_cases


def cuda_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def stage_compile(args, writer: StageWriter) -> None:
    """Compile (or load) the given variants in this process: fills the disk cache."""
    import tvmflash

    target = "llvm" if args.device == "cpu" else {"kind": "cuda", "arch": args.arch or cuda_arch()}
    variants = [parse_variant(s) for s in args.variants.split(";")] if args.variants else variants_needed(args)

    def one(_i, variant):
        dtype, head_dim, causal = variant
        t0 = time.perf_counter()
        # deterministic: what flash_attn_func(deterministic=True) will ask for (CUDA; CPU ignores it)
        tvmflash.compile(target, head_dim=head_dim, dtype=dtype, causal=causal, deterministic=args.deterministic)
        return {"label": format_variant(variant), "compile_s": time.perf_counter() - t0, "ok": True}

    run_cases(writer, variants, one, "cpu", label=format_variant)  # compiling does not touch the GPU


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
        for key in ("cases", "skipped", "notes"):
            merged[key] += part.get(key, [])
        merged["processes"].append(part.get("process"))
    merged["elapsed_s"] = time.monotonic() - t0
    for i in range(len(groups)):
        (out_dir / f"stage_compile_{i}.json").unlink(missing_ok=True)
    (out_dir / "stage_compile.json").write_text(json.dumps(merged, indent=1, default=str))
    return merged

