"""Tuned configs: the records ``compile()`` reads (read-only, pure Python).

A record file is ``<root>/<target key>/<variant>.json`` (e.g. ``llvm-znver4/d64-float32.json``;
the key names the model and any extensions this CPU has beyond or short of it, ``target.key``)
with, per kernel, the tuned config and how it was verified::

    {"version": 3, "forward": {"config": {...}, "tuned_at": {"batch": 1, "heads": 8,
     "seqlen": 2048}, "speedup": 1.14, "verified": true}, "backward": {...}}

``python -m tvmflash.tune`` writes them (its MetaSchedule databases are working files beside
them, never package data); ``speedup`` is the same-run, interleaved comparison with the
hand-written config, and ``verified`` says it reached ``MIN_VERIFIED_SPEEDUP``. Roots, first
match wins: ``$TVMFLASH_TUNE_LOGS`` (default ``<cache dir>/tune_logs``), then the records shipped
in the package (``tvmflash/tune_logs``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .config import CPUKernelConfig
from .settings import cache_dir, read_json
from .spec import AttentionSpec

# 3: configs name how the products run (``products``); version-2 records were tuned before
# bf16 dot products existed, against other hand-written defaults, and are not used.
VERSION = 3
# The hand-written config measured against itself in the same-run check came out up to 1.06x
# on these machines (BENCHMARKS.md): smaller gains are noise.
MIN_VERIFIED_SPEEDUP = 1.10


def variant_name(spec: AttentionSpec) -> str:
    """File name of a spec's records: head dim and dtype; score/mask mods add their digest."""
    name = f"d{spec.head_dim}-{spec.dtype}"
    if spec.out_dtype != spec.dtype:
        name += f"-out-{spec.out_dtype}"
    if spec.score_mods or spec.mask_mod is not None or spec.block_sparse:
        name += f"-{spec.digest()}"
    return name


def user_root() -> Path:
    return Path(os.environ.get("TVMFLASH_TUNE_LOGS", cache_dir() / "tune_logs"))


def shipped_root() -> Path:
    """The package's ``tvmflash.tune_logs`` (the repository's ``tune_logs/``, mapped by pyproject;
    in an editable install it is not beside this file)."""
    from . import tune_logs

    return Path(tune_logs.__file__).parent


def record_path(root: Path, target_key: str, spec: AttentionSpec) -> Path:
    return Path(root) / target_key / f"{variant_name(spec)}.json"


def read(path: Path) -> dict:
    """A record file's kernels ({} if missing); a malformed file is an error naming it."""
    if not path.exists():
        return {}
    try:
        data = read_json(path)
        if data.get("version") != VERSION:
            return {}  # written for other kernels: not applicable
        return {kernel: data[kernel] for kernel in ("forward", "backward") if kernel in data}
    except (ValueError, AttributeError) as err:
        raise ValueError(f"tuning record {path} is not valid JSON ({err}); delete it or re-run the tuner") from err


def lookup(target_key: str, spec: AttentionSpec, kernel: str, seqlen: int | None = None):
    """(config, description) of the verified tuned config for this kernel, or None.

    With several records (user and shipped), the one tuned at the sequence length nearest to
    ``seqlen`` (log scale) wins, then the user's.
    """
    found = []
    for root in (user_root(), shipped_root()):
        path = record_path(root, target_key, spec)
        entry = read(path).get(kernel)
        if entry and entry.get("verified"):
            found.append((entry, path))
    if not found:
        return None
    if seqlen:
        found.sort(key=lambda ep: abs(math.log(max(ep[0].get("tuned_at", {}).get("seqlen", seqlen), 1) / seqlen)))
    entry, path = found[0]
    config = CPUKernelConfig.from_json(entry["config"])
    shape = entry.get("tuned_at", {})
    return config, (f"{path}: tuned at B{shape.get('batch')} H{shape.get('heads')} N{shape.get('seqlen')}, "
                    f"{entry['speedup']:.2f}x the hand-written config in the same-run check")


# Bumped by every write in this process: compiler.compile_spec memoizes its config choice per
# request and re-chooses after a tuner run (records written by other processes are read at the
# next process start, or by compiling with an explicit config).
generation = 0


def write(root: Path, target_key: str, spec: AttentionSpec, kernel: str, entry: dict) -> Path:
    """Add or replace one kernel's record (the tuner's output)."""
    global generation
    generation += 1
    path = record_path(root, target_key, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": VERSION, **read(path), kernel: entry}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
