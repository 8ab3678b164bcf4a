"""What every stage uses: its budget and records (written as it goes), running its cases, its
child process. The stages (``compiling``, ``correctness``, ``speed``, ``long``) import this module;
``orchestrate`` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from .cli import child_argv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


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

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

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

    def replace(self, record: dict) -> None:
        """The stage's one record, updated (the long stage writes its case as it progresses)."""
        self.data["cases"] = [record]
        self.flush()

    def skip(self, labels, why: str) -> None:
        self.data["skipped"] += [{"label": label, "why": why} for label in labels]
        self.flush()

    def finish(self) -> dict:
        self.data["finished"] = True
        self.flush()
        return self.data


def error_record(err: BaseException) -> dict:
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


def run_cases(writer: StageWriter, items, run_one, device: str, label=lambda c: c.label()) -> None:
    """``run_one(i, item)`` -> record for each item while the budget lasts; an error is recorded and
    the next item runs, unless it left the CUDA context unusable."""
    items = list(items)
    for i, item in enumerate(items):
        if writer.left() <= 0:
            writer.note(f"budget exceeded: {len(items) - i} case(s) skipped")
            writer.skip([label(c) for c in items[i:]], "budget exceeded")
            print(f"  budget exceeded: skipping {len(items) - i} case(s)", flush=True)
            return
        t0 = time.perf_counter()
        try:
            record = run_one(i, item)
        except Exception as err:  # noqa: BLE001 - reported, the next case runs
            record = {"label": label(item), "ok": False, **error_record(err)}
        record["wall_s"] = time.perf_counter() - t0
        writer.add(record)
        status = "ok" if record.get("ok", "error" not in record) else "FAILED"
        print(f"  [{i + 1}/{len(items)}] {label(item)}: {status} ({record['wall_s']:.1f} s)"
              + (f" {record['error'][:160]}" if "error" in record else ""), flush=True)
        if "error" in record and not device_alive(device):
            writer.note("CUDA context lost: remaining cases skipped")
            writer.skip([label(c) for c in items[i + 1:]], "CUDA context lost after an error")
            return


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_child(args, stage: str, budget_s: float, timeout_s: float, out: Path, extra=()) -> dict:
    """The stage in a child process, killed after ``timeout_s``; its records, and how it ended."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(SCRIPT), *child_argv(args, stage, budget_s, out, extra)]
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
    data = read_json(out) or {"stage": stage, "cases": [], "skipped": [], "notes": []}
    data.setdefault("notes", [])
    if info.get("killed_after_s") is not None:
        data["notes"].append(f"stage killed after {timeout_s:.0f} s (past its budget); results so far kept")
    elif info["returncode"] != 0:
        data["notes"].append(f"stage process exited with {info['returncode']} (crash?); results so far kept")
    data["process"] = {**info, "wall_s": time.monotonic() - t0}
    return data
