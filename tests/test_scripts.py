"""The user-facing scripts run end to end (small sizes), so they cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=900):
    env = {**os.environ, "TVMFLASH_QUIET": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_demo_checks_itself():
    out = _run("-m", "tvmflash.demo", "--rounds", "1", "--lengths", "256", "512")
    assert out.count(": OK") == 2 and "FAILED" not in out
    assert "SDPA flash" in out and "512" in out


def test_speed_benchmark_quick(tmp_path):
    md = tmp_path / "speed.md"
    out = _run("benchmarks/speed.py", "--quick", "--no-math", "--markdown", str(md))
    assert "fp32 fwd vs SDPA flash" in out
    assert "| B1 N512 H2 D64 float32 |" in md.read_text()
