"""The user-facing scripts run end to end (small sizes), so they cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=900):
    env = {**os.environ, "TVMFLASH_QUIET": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_demo_checks_itself():
    out = _run("-m", "tvmflash.demo", "--rounds", "1", "--lengths", "256", "512")
    assert out.count(": OK") == 6 and "FAILED" not in out  # 3 checks in each timed dtype
    assert "float32: fp32 FMAs" in out and "bfloat16: " in out  # the instruction-set path of each dtype
    assert "compiled in" in out or "loaded from the cache" in out
    assert "SDPA flash" in out and "512" in out and "load average" in out
    assert out.count("x (") == 6  # each ratio with its spread over the rounds
    assert "GiB, standard" in out


def test_startup_script_measures_a_warm_start():
    """benchmarks/startup.py: a fresh process's import and first calls, tvmflash's without ``tvm``."""
    out = _run("benchmarks/startup.py", "--runs", "1")
    for row in ("`import torch`", "`import tvmflash` (after torch)", "first training call", "first decode step"):
        assert f"| {row}" in out
    assert "`tvm` imported by tvmflash's processes: [False]; tvmflash from [" in out


def test_issue23_session_script_names_what_model_speed_takes():
    """benchmarks/issue23_session.sh (a session's worth of model_speed.py runs) parses, and each
    part it runs is one of model_speed.py's."""
    import re

    script = ROOT / "benchmarks" / "issue23_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    parts = set(re.findall(r'"([a-z-]+)"', re.search(r"parts = \[(.*?)\]", (ROOT / "benchmarks" / "model_speed.py")
                                                   .read_text(), re.S).group(1)))
    named = re.findall(r'"\$\{speed\[@\]\}" ([a-z -]+?) --', script.read_text())
    assert len(named) == 6 and parts >= {p for line in named for p in line.split()}, named


def test_model_speed_benchmark_quick():
    """model_speed.py's in-process parts (fixed cost per call; one layer's attention on
    left-padded rows; the attention calls timed inside a model): its cases still match SDPA (each
    asserts so) and print their tables."""
    pytest.importorskip("transformers")
    out = _run("benchmarks/model_speed.py", "fixed", "padded", "in-model", "--rounds", "3", "--train-lengths", "24",
               "--dtypes", "float32", "--head-dim", "32", "--prompts", "8", "--new-tokens", "3", "--runs", "1")
    assert "| forward fp32 B1 N16 H8 D64 causal |" in out and "| decode bf16 H8/2 D64, 128-token cache |" in out
    assert "attention (H8/2 D32)" in out and "| float32 4 left-padded rows of 24 |" in out
    assert "| float32 generate(), prompt 8: a new token's call |" in out
    assert "| float32 training step, sequence 24: a forward's call |" in out
    assert "load average at the end" in out


def test_flash_margins_plugin_reports_each_tests_closest_check(tmp_path):
    """tools/flash_margins.py (a pytest plugin) in a pytest of its own: one line per test with its
    checks' largest error / bound (passing: in [0, 1]), the count of checks, no file left behind."""
    env = {k: v for k, v in os.environ.items() if k != "FLASH_MARGINS_LOG"}
    env.update(PYTHONPATH=str(ROOT / "tools"), TMPDIR=str(tmp_path), TVMFLASH_QUIET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "flash_margins", "-p", "no:cacheprovider",
                           "tests/test_documents.py", "-k", "per_document"], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.split("closest to their bound")[1].splitlines()[1:]
    rows = [line.split(maxsplit=1) for line in lines if "::test_the_op_matches_float64_per_document[" in line]
    assert len(rows) == 4 and all(0.0 <= float(ratio) <= 1.0 for ratio, _ in rows)
    assert "20 checks in 4 tests" in proc.stdout  # out, lse, dq, dk, dv of each
    assert not list(tmp_path.glob("flash_margins.*"))


def test_bf16_benchmark_quick(tmp_path):
    md = tmp_path / "bf16.md"
    out = _run("benchmarks/bf16.py", "--quick", "--rounds", "1", "--markdown", str(md))
    assert "bf16 / SDPA fwd+bwd" in out and "**geomean**" in out
    assert "| B1 N512 H4/2 D64 causal |" in md.read_text()


def test_speed_benchmark_quick(tmp_path):
    md = tmp_path / "speed.md"
    out = _run("benchmarks/speed.py", "--quick", "--no-math", "--markdown", str(md))
    assert "fp32 fwd vs SDPA flash" in out
    assert "| B1 N512 H2 D64 float32 |" in md.read_text()


def test_float64_reference_of_the_experiments_matches_autograd(gen):
    """benchmarks/common.reference_f64 (chunked formulas) == autograd through plain attention."""
    import torch

    from conftest import random_inputs, reference_attention
    from tvmflash.reference import chunked_reference_f64 as reference_f64

    for causal in (False, True):
        q, k, v = random_inputs(gen, 2, 70, 50, 4, 2, 32, "float32")
        dout = torch.randn(q.shape, generator=gen)
        out, lse, dq, dk, dv = reference_f64(q, k, v, dout, causal, chunk=16)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference_attention(*leaves, causal)
        ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
        torch.testing.assert_close(out, ref_out.detach())
        torch.testing.assert_close(lse, ref_lse.detach())
        for ours, ref in zip((dq, dk, dv), ref_grads):
            torch.testing.assert_close(ours, ref)


def _check_memory_scaling(data):
    """Standard attention's memory grows ~4x per doubling and exceeds tvmflash's; tvmflash's ~2x."""
    flash, standard = data["results"]["tvmflash/64"]["mb"], data["results"]["standard/64"]["mb"]
    assert data["results"]["tvmflash/64"]["seqlen"] == [512, 1024]
    assert 1.5 < flash[1] / flash[0] < 2.8, flash
    assert standard[1] / standard[0] > 3.0, standard
    assert standard[1] > 2 * flash[1], (standard, flash)
    assert data["results"]["sdpa_math/64"]["mb"][1] > 2 * flash[1]


def _check_rule1(data):
    """An fp16 LSE costs >= 10x the gradient accuracy of the fp32 one at every point."""
    fp32 = {(n, s): e for n, s, e in data["errors"]["fp32 LSE (tvmflash)"]}
    fp16 = {(n, s): e for n, s, e in data["errors"]["fp16 LSE (experiment)"]}
    assert fp32.keys() == fp16.keys() and len(fp32) == 2
    for key in fp32:
        assert fp32[key] < 1e-4, (key, fp32[key])
        assert fp16[key] > 10 * fp32[key], (key, fp16[key], fp32[key])


def _check_rule2(data):
    """The naive backward does ~0.5 forward more work (one more S and P), same gradients."""
    once, twice = data["flops_over_forward"]["once"], data["flops_over_forward"]["twice"]
    assert 2.3 <= once <= 2.6, once
    assert 0.3 <= twice - once <= 0.7, (once, twice)
    assert data["max_difference"] < 1e-5
    assert all(t > 0 for t in data["seconds"].values())


def _check_rule3(data):
    """fp16 accumulators lose accuracy as N grows; fp32 ones stay within 2x of PyTorch MATH."""
    errs = data["errors"]["float16"]
    ours, low = errs["tvmflash, fp32 accumulators"], errs["fp16 accumulators (experiment)"]
    assert not any(data["identical"]["float16"])
    assert low[-1] > 2 * ours[-1], (low, ours)
    assert low[-1] > 1.5 * low[0], low
    assert all(e <= 2 * m + 1e-4 for e, m in zip(ours, errs["PyTorch SDPA MATH"])), (ours, errs)


EXPERIMENTS = {"memory_scaling": _check_memory_scaling, "rule1_fp32_stats": _check_rule1,
               "rule2_one_recompute": _check_rule2, "rule3_fp32_accumulators": _check_rule3}


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_quick(name, tmp_path):
    """Each experiment's --quick mode runs, writes its report (and plot), and shows its effect."""
    out = _run(f"benchmarks/{name}.py", "--quick", "--out-dir", str(tmp_path))
    assert "**Conclusion:**" in out
    report = (tmp_path / f"{name}.md").read_text()
    assert "command:" in report and "machine:" in report and "|---|" in report
    if name != "rule2_one_recompute":
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    EXPERIMENTS[name](json.loads((tmp_path / f"{name}.json").read_text()))


def test_train_tiny_llama_quick(tmp_path):
    """The training experiment's --quick mode (2 layers, seq 128, 3 steps of each run): from one
    init, sdpa and tvmflash give the same loss and gradients (fp32) and the same step-0 loss
    (bf16); the experiment's attention wrapper is the integration bit for bit; the rule-1 and
    rule-3 variants really change the gradients; every loss is finite; the tables, CSVs and plot
    are written."""
    pytest.importorskip("transformers")
    out = _run("benchmarks/train_tiny_llama.py", "--quick", "--out-dir", str(tmp_path))
    assert "**Conclusion:**" in out
    data = json.loads((tmp_path / "train_tiny_llama.json").read_text())
    runs, checks, steps = data["runs"], data["checks"], data["size"]["steps"]
    assert all(data["finite"].values()), data["finite"]
    assert all(len(r["loss"]) == steps and len(r["val"]) == len(data["val_steps"]) for r in runs.values())

    fp32 = checks["sdpa_vs_tvmflash_fp32"]
    assert fp32["loss_rel"] <= 1e-4 and fp32["grad_rel"] <= 1e-3, fp32
    assert checks["sdpa_vs_tvmflash_bf16"]["loss_rel"] <= 1e-3, checks["sdpa_vs_tvmflash_bf16"]
    assert abs(runs["tvmflash"]["loss"][0] - runs["sdpa"]["loss"][0]) <= 1e-3 * runs["sdpa"]["loss"][0]
    assert checks["control_vs_tvmflash_bf16"]["bit_identical"], checks["control_vs_tvmflash_bf16"]
    for variant in ("fp16 LSE", "bf16 accumulators"):
        changed = checks[f"{variant}_vs_tvmflash_bf16"]
        assert not changed["bit_identical"] and 0 < changed["grad_rel"] < 0.1, (variant, changed)
    # the stored LSE was rounded, and to fp16: within half an fp16 ulp of |LSE| (2^-11 relative)
    lse = data["lse_per_step"]
    assert len(lse["max_rounding"]) == steps
    for largest, rounding in zip(lse["max_abs_lse"], lse["max_rounding"]):
        assert 0 < rounding <= largest * 2.0 ** -11, (rounding, largest)
    assert all(t > 0 for t in data["tokens_per_second"].values())

    report = (tmp_path / "train_tiny_llama.md").read_text()
    assert "command:" in report and "machine:" in report and "| tvmflash - sdpa |" in report
    with open(tmp_path / "train_tiny_llama_steps.csv") as f:
        assert len(f.read().splitlines()) == steps + 1
    with open(tmp_path / "train_tiny_llama_val.csv") as f:
        assert len(f.read().splitlines()) == len(data["val_steps"]) + 1
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "train_tiny_llama.png").stat().st_size > 10_000
