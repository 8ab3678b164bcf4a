"""Helpers shared by the experiment scripts in benchmarks/ (each script is run as a file)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from tvmflash.reference import chunked_reference_f64 as reference_f64  # noqa: F401 - the experiments' name

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def machine() -> str:
    from tvmflash import settings, target

    try:
        llvm_cpu = target.host_cpu()
    except ValueError:  # (TVM's runtime alone: LLVM is in its compiler library)
        llvm_cpu = "TVM's runtime alone"
    return (f"{cpu_model()} ({llvm_cpu}; {isa()}), {settings.num_threads()} threads, torch "
            f"{torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def isa() -> str:
    """The vector extensions that matter here, as /proc/cpuinfo lists them."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "unknown ISA"
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    return " ".join(f for f in wanted if f in flags) or "no AVX2"



def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds (CI smoke test)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the report (.md) and plot (.png) go; default docs/ (quick: no files)")
    return p


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path | None, name: str, title: str, body: str, figure=None, data=None) -> None:
    """Print the report; with an output dir also write <name>.md, <name>.png and <name>.json
    (``data``: the measured numbers, for tests and for re-plotting) there."""
    command = "python " + " ".join(sys.argv)
    text = f"### {title}\n\ncommand: `{command}`\n\nmachine: {machine()}\n\n{body}\n"
    print(text)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if figure is not None:
        figure.savefig(out_dir / f"{name}.png", dpi=120, bbox_inches="tight")
        text += f"\n![{title}]({name}.png)\n"
    (out_dir / f"{name}.md").write_text(text)
    if data is not None:
        (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def out_dir(args) -> Path | None:
    if args.out_dir is not None:
        return args.out_dir
    return None if args.quick else DOCS


def relative_error(ours, ref) -> float:
    """max |ours - ref| / max |ref| (ref in float64)."""
    return float((ours.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def plt():
    try:
        import matplotlib
    except ImportError as missing:
        raise ImportError("the benchmark plots need matplotlib: pip install 'tvmflash[bench]' "
                          "(in this repository: .venv/bin/pip install -e '.[bench]')") from missing

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
