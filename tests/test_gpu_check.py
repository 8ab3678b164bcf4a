"""benchmarks/gpu_check.py (the package benchmarks/gpucheck) without a GPU: arguments, grids, the
reference it relies on, error rule, FLOPs, timing, the bundle, and the whole script end to end on
CPU tensors (--device cpu --quick), so it cannot rot between GPU runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tvmflash.reference import reference_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gpu_bundle
    import gpu_profile
    from gpucheck import cases, cli, correctness, long, orchestrate, report, speed, stage
finally:
    sys.path.pop(0)


# ----------------------------------------------------------------------------- arguments and grids


def test_defaults_fit_one_gpu_call():
    args = cli.parse_args([])
    assert args.device == "cuda" and not args.quick and not args.deterministic
    assert args.budget_s == 450 and args.out_dir == Path("gpu_check_results")
    assert args.stage_list == ["compile", "correctness", "speed", "long"]
    assert args.long_n == 524288 and args.long_head_dim == 128 and args.reps == 7
    # the whole run stays under 8 minutes even if the last stage overruns by its grace
    assert args.budget_s + cli.GRACE_S < 8 * 60


def test_dry_run_and_flags():
    args = cli.parse_args(["--dry-run", "--deterministic", "--stages", "correctness,long", "--budget-s", "60"])
    assert args.device == "cpu" and args.quick and args.deterministic
    assert args.stage_list == ["correctness", "long"] and args.budget_s == 60
    assert args.long_n == 2048 and args.reps == 3


def test_a_stage_child_reads_back_the_run_arguments(tmp_path):
    args = cli.parse_args(["--dry-run", "--deterministic", "--cases", "N=256", "--stages", "speed,long",
                           "--reps", "5", "--seed", "3", "--arch", "sm_90"])
    child = cli.parse_args(cli.child_argv(args, "speed", 42.0, tmp_path / "s.json", ["--variants", "x"]))
    assert child.stage == "speed" and child.stage_budget_s == 42.0 and child.stage_out == tmp_path / "s.json"
    assert child.variants == "x"
    for key in ("device", "quick", "deterministic", "cases", "case_filter", "stage_list", "reps", "warmup",
                "seed", "long_n", "long_head_dim", "arch", "budget_s"):
        assert getattr(child, key) == getattr(args, key), key


@pytest.mark.parametrize("bad", [["--stages", "speed,bogus"], ["--cases", "N=8192,X=1"], ["--cases", "dtype=int8"],
                                 ["--cases", "N8192"], ["--reps", "0"], ["--device", "tpu"]])
def test_bad_arguments_are_rejected(bad, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(bad)


def test_case_filter_trims_the_grid():
    f = cli.parse_case_filter("N=8k/16384, D=128, dtype=bf16, causal=0")
    assert f == {"seqlen": {8192, 16384}, "head_dim": {128}, "dtype": {"bfloat16"}, "causal": {False}}
    grid = cases.speed_cases("cuda", False, f)
    assert [(c.seqlen, c.head_dim, c.dtype, c.causal) for c in grid] == [
        (8192, 128, "bfloat16", False), (16384, 128, "bfloat16", False)]
    assert cases.speed_cases("cuda", False, cli.parse_case_filter("N=3")) == []


def test_speed_grid_covers_the_issue_and_leads_with_the_bar():
    grid = cases.speed_cases("cuda", False)
    keys = {(c.seqlen, c.head_dim, c.dtype, c.causal) for c in grid}
    assert keys == {(n, d, dt, c) for n in (1024, 2048, 4096, 8192, 16384) for d in (64, 128)
                    for dt in ("bfloat16", "float16") for c in (False, True)}
    assert len(grid) == len(keys) == 40
    assert (grid[0].seqlen, grid[0].head_dim, grid[0].dtype) == (8192, 128, "bfloat16")
    for c in grid:  # flash-attn's benchmark sizes: 16K tokens, 2048 channels
        assert c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048
    quick = cases.speed_cases("cuda", True)
    assert 3 <= len(quick) < len(grid) and quick[0].seqlen == 8192
    assert {c.dtype for c in quick} == {"bfloat16", "float16"}


def test_correctness_cases_cover_odd_lengths_masks_gqa_dtypes():
    grid = cases.correctness_cases("cuda", False)
    lengths = {c.seqlen_q for c in grid} | {c.seqlen_k for c in grid}
    assert {1, 77, 333, 1000} <= lengths
    assert any(c.seqlen_q > c.seqlen_k and c.causal for c in grid)  # rows without a visible key
    assert any(c.seqlen_q < c.seqlen_k and c.causal for c in grid)
    assert any((c.heads, c.heads_k) == (8, 2) for c in grid) and any(c.heads_k == 1 for c in grid)
    assert {(c.dtype, c.head_dim, c.causal) for c in grid} == {
        (dt, d, cz) for dt in ("bfloat16", "float16") for d in (64, 128) for cz in (False, True)}
    quick = cases.correctness_cases("cuda", True)
    assert len(quick) < len(grid)
    assert {(c.dtype, c.head_dim, c.causal) for c in quick} == {(c.dtype, c.head_dim, c.causal) for c in grid}
    # flash-attn's variants: windows on both sides, softcap and ALiBi, with and without causal
    variants = [c for c in grid if c.variant() != cases.CorrectnessCase(1, 1, 1, 1, 1, 64, "float16", False).variant()]
    assert any(c.window[0] >= 0 and c.window[1] > 0 for c in variants) and any(c.softcap and c.alibi for c in variants)
    assert all(c in quick for c in variants)
    for c in grid:
        assert c.heads % c.heads_k == 0


def test_variants_needed_are_what_the_stages_use():
    # kernels take the mask per call: one kernel per (dtype, head dim)
    args = cli.parse_args(["--device", "cpu", "--quick"])
    assert set(cases.variants_needed(args)) == {("float32", 64, False), ("bfloat16", 64, False)}
    args = cli.parse_args(["--stages", "long"])
    assert cases.variants_needed(args) == [("bfloat16", 128, False)]
    full = cases.variants_needed(cli.parse_args([]))
    assert set(full) == {(dt, d, False) for dt in ("bfloat16", "float16") for d in (64, 128)}
    assert cases.parse_variant(cases.format_variant(("float16", 64, True))) == ("float16", 64, True)


# ----------------------------------------------------------------------------- FLOPs and memory


def test_flop_formulas():
    n, d = 4096, 128
    # two matmuls (Q K^T and P V) of 2 * N * N * D multiply-adds each, per head
    assert cases.model_flops("fwd", 1, 1, n, n, d, False) == 2 * (2 * n * n * d)
    assert cases.model_flops("fwd", 2, 3, n, n, d, False) == 6 * 4 * n * n * d
    assert cases.model_flops("fwd", 1, 1, n, n, d, True) == 2 * n * n * d  # causal: half
    assert cases.model_flops("fwd", 1, 1, 100, 300, 64, False) == 4 * 100 * 300 * 64
    assert cases.model_flops("bwd", 1, 1, n, n, d, False) == 2.5 * cases.model_flops("fwd", 1, 1, n, n, d, False)
    case = cases.SpeedCase(2, 8192, 16, 128, "bfloat16", True)
    assert case.flops("fwd") == 4 * 2 * 16 * 8192**2 * 128 / 2


def test_flop_formula_is_the_package_model():
    """gpu_check keeps its own copy (tvmflash.analysis needs TVM's compiler, absent on the GPU machine)."""
    from tvmflash.analysis import model_flops

    kernels = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward"}
    for phase, kernel in kernels.items():
        for shape in [(1, 1, 4096, 4096, 128, False), (2, 3, 100, 300, 64, True), (4, 16, 8192, 8192, 64, True)]:
            assert cases.model_flops(phase, *shape) == model_flops(kernel, *shape)


def test_standard_attention_memory_at_512k():
    std = long.standard_attention_bytes(1, 1, 524288, 524288, "bfloat16")
    assert std["P_saved_for_backward_bytes"] == 512 * 2**30  # N^2 * 2 bytes = 512 GiB
    assert std["peak_estimate_bytes"] == 2 * std["P_saved_for_backward_bytes"]
    assert long.standard_attention_bytes(1, 1, 1024, 1024, "float32")["P_saved_for_backward_bytes"] == 4 * 2**20
    # ours is linear: ~ a GiB at 512K, D=128, bf16
    assert 2**29 < long.flash_io_bytes(524288, 128, "bfloat16") < 2 * 2**30
    assert report._fmt_bytes(512 * 2**30) == "512.0 GiB"


def test_long_estimate_scales_from_the_largest_matching_speed_case():
    speed_stage = {"cases": [
        {"case": {"batch": 2, "heads": 16, "seqlen": 8192, "head_dim": 128, "dtype": "bfloat16", "causal": False},
         "times": {"tvmflash": {"fwd+bwd": 0.1}}},
        {"case": {"batch": 1, "heads": 16, "seqlen": 16384, "head_dim": 128, "dtype": "bfloat16", "causal": False},
         "times": {"tvmflash": {"fwd+bwd": 0.2}}},
        {"case": {"batch": 1, "heads": 16, "seqlen": 16384, "head_dim": 128, "dtype": "bfloat16", "causal": True},
         "times": {"tvmflash": {"fwd+bwd": 0.05}}},
    ]}
    per_n2 = orchestrate.long_estimate_per_n2(speed_stage, 128, "bfloat16")
    assert per_n2 == pytest.approx(0.2 / (16 * 16384**2))
    assert per_n2 * 524288**2 == pytest.approx(0.2 * 1024 / 16)
    assert orchestrate.long_estimate_per_n2(speed_stage, 64, "bfloat16") is None


# ----------------------------------------------------------------------------- the reference it relies on, the rule


def _leaves(gen, shapes, dtype=torch.float64):
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("nq,nk,causal", [(37, 37, False), (37, 37, True), (20, 45, True), (45, 20, False)])
def test_reference_matches_torch_autograd(nq, nk, causal):
    """tvmflash.reference (out, lse, grads) == SDPA MATH in float64 with an explicit bottom-right mask."""
    gen = torch.Generator().manual_seed(nq * 100 + nk)
    q, k, v = _leaves(gen, [(2, nq, 4, 16), (2, nk, 2, 16), (2, nk, 2, 16)])
    dout = torch.randn(2, nq, 4, 16, generator=gen, dtype=torch.float64)
    out, lse = reference_attention(q, k, v, causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kk, vv = (t.transpose(1, 2).repeat_interleave(2, dim=1) for t in (k2, v2))
    mask = None
    if causal:
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    expected = torch.nn.functional.scaled_dot_product_attention(q2.transpose(1, 2), kk, vv, attn_mask=mask)
    expected = expected.transpose(1, 2)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), dout)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for ours, ref in zip(grads, expected_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    scores = (q2.detach().transpose(1, 2) @ kk.detach().transpose(-1, -2)) / 4.0
    if causal:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_reference_rows_without_keys_are_zero():
    """Causal with Nq > Nk: the first Nq - Nk queries see no key (flash-attn >= 2.1)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = _leaves(gen, [(1, 9, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)])
    out, lse = reference_attention(q, k, v, True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen, dtype=torch.float64))
    assert torch.all(out[:, :5] == 0) and torch.all(dq[:, :5] == 0) and torch.isfinite(dq).all()
    assert torch.isinf(lse[..., :5]).all() and torch.isfinite(lse[..., 5:]).all()
    # the last query sees every key: plain softmax attention
    last = torch.softmax(q[0, -1, 0] @ k[0, :, 0].T / math.sqrt(8), -1) @ v[0, :, 0]
    torch.testing.assert_close(out[0, -1, 0], last)


def _plain(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen) for s in [(1, 200, 2, 64), (1, 300, 2, 64), (1, 300, 2, 64)])
    f64 = reference_attention(q, k, v, True, dtype=torch.float64)[0]
    same = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), True, dtype=dtype)[0]
    return f64, same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_error_rule_accepts_correct_and_flags_wrong(dtype):
    f64, same = _plain(dtype)
    ok = correctness.flash_rule(same, f64, same, dtype)
    assert ok["ok"] and ok["err"] == ok["err_torch"] and ok["ratio"] < 1
    rounded = correctness.flash_rule(f64.to(dtype), f64, same, dtype)  # f64 rounded once: better than torch
    assert rounded["ok"] and rounded["err"] <= rounded["err_torch"]

    wrong = same.clone()
    wrong[0, 17, 1, 5] += 0.1  # one element off by 0.1 (> 4 ulps of bf16 at magnitude 1)
    bad = correctness.flash_rule(wrong, f64, same, dtype)
    assert not bad["ok"] and bad["err"] > bad["bound"]
    assert not correctness.flash_rule(same * 1.25, f64, same, dtype)["ok"]  # every value 25% off
    nan = same.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not correctness.flash_rule(nan, f64, same, dtype)["ok"]
    assert not correctness.flash_rule(same[:, :-1], f64, same, dtype)["ok"]  # shape mismatch
    # a large magnitude (terms of size 100 cancelled on the way) widens the bound proportionally
    assert correctness.flash_rule(wrong, f64, same, dtype, magnitude=100.0)["ok"]


def _fake_op(mask_top_left=False, scale_factor=1.0):
    """Stand-ins for flash_attn_func: plain attention in the input dtype (correct), or with bugs."""
    def op(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
           alibi_slopes=None, deterministic=False, return_attn_probs=False):
        scale = scale_factor / math.sqrt(q.shape[-1])
        if mask_top_left and causal:  # the pre-2.1 flash-attn alignment: wrong when Nq != Nk
            nq, nk = q.shape[1], k.shape[1]
            pad = torch.zeros(q.shape[0], nk - nq, *q.shape[2:], dtype=q.dtype) if nk > nq else None
            qq = torch.cat([q, pad], 1) if pad is not None else q
            out, lse = reference_attention(qq, k, v, True, scale, dtype=q.dtype)
            out, lse = out[:, :nq], lse[..., :nq]
        else:
            out, lse = reference_attention(q, k, v, causal, scale, dtype=q.dtype)
        return (out, lse.float(), None) if return_attn_probs else out
    return op


@pytest.mark.parametrize("fake,should_pass", [(_fake_op(), True), (_fake_op(mask_top_left=True), False),
                                              (_fake_op(scale_factor=1.1), False)])
def test_check_case_catches_wrong_ops(monkeypatch, fake, should_pass):
    """The harness itself: a correct op passes every check, a mis-aligned mask or a wrong scale fails."""
    import tvmflash

    monkeypatch.setattr(tvmflash, "flash_attn_func", fake, raising=False)
    case = cases.CorrectnessCase(1, 33, 70, 4, 2, 32, "bfloat16", True)
    result = correctness.check_case(case, "cpu", seed=3)
    assert set(result["checks"]) == {"out", "lse", "dq", "dk", "dv"}
    assert result["ok"] is should_pass, result["checks"]
    if not should_pass:
        assert not result["checks"]["out"]["ok"]


def test_check_case_judges_packed_sequences_one_by_one(monkeypatch):
    """varlen cases: flash_attn_varlen_func on packed sequences, each judged against float64 on
    its own rows. The real (CPU) kernels pass; the same results with the rows reversed fail."""
    import tvmflash

    case = cases.CorrectnessCase(3, 70, 90, 4, 2, 32, "float32", True, window=(20, 5), alibi=True, packed=True)
    result = correctness.check_case(case, "cpu", seed=5)
    assert result["ok"], result["checks"]
    real = tvmflash.flash_attn_varlen_func

    def reversed_rows(*args, **kwargs):
        out, lse, probs = real(*args, **kwargs)
        return out.flip(0), lse, probs

    monkeypatch.setattr(tvmflash, "flash_attn_varlen_func", reversed_rows)
    assert not correctness.check_case(case, "cpu", seed=5)["checks"]["out"]["ok"]


def test_check_case_deterministic_compares_two_backwards(monkeypatch):
    """--deterministic: the op gets deterministic=True, and two backwards must agree bitwise."""
    import tvmflash

    seen, noisy = [], _fake_op()

    def op(*args, **kw):
        seen.append(kw["deterministic"])
        out, lse, _ = noisy(*args, **kw)
        if len(seen) == 2:  # the second call (and its backward) differs in the last bits
            out = out * (1 + 2**-20)
        return out, lse, None

    monkeypatch.setattr(tvmflash, "flash_attn_func", noisy, raising=False)
    case = cases.CorrectnessCase(1, 17, 17, 2, 1, 16, "float32", False)
    result = correctness.check_case(case, "cpu", seed=0, deterministic=True)
    assert result["ok"] and result["checks"]["deterministic"] == {"ok": True}
    monkeypatch.setattr(tvmflash, "flash_attn_func", op, raising=False)
    result = correctness.check_case(case, "cpu", seed=0, deterministic=True)
    assert seen == [True, True] and not result["deterministic_bitwise"] and not result["ok"]


def test_timed_rounds_repeat_short_cuda_calls_inside_one_timing(monkeypatch):
    """On CUDA a call shorter than MIN_TIMED_S runs several times per timing (the synchronize that
    ends each timing is then a small part of it); the medians come back per call."""
    counts = {"short": 0, "long": 0}
    calls = {name: (lambda name=name: counts.__setitem__(name, counts[name] + 1)) for name in counts}
    once = {"short": speed.MIN_TIMED_S / 4, "long": 2 * speed.MIN_TIMED_S}

    def fake_median_times(candidates, rounds, pause, sync):
        assert pause == 0.0 and sync is torch.cuda.synchronize
        for fn in candidates.values():
            fn()
        return {"short": 0.008, "long": 0.010}

    monkeypatch.setattr(speed, "median_times", fake_median_times)
    args = cli.parse_args(["--reps", "5"])
    result = {}
    times = speed.timed_rounds(calls, once, args, time.monotonic() + 100, result)
    assert counts == {"short": 4, "long": 1} and result["calls_per_timing"] == {"short": 4, "long": 1}
    assert times == {"short": 0.002, "long": 0.010} and result["rounds"] == 5
    # little time left: still 2 rounds; on CPU every call is timed alone, after the pause
    monkeypatch.undo()
    args = cli.parse_args(["--device", "cpu"])
    real = speed.timed_rounds(calls, once, args, time.monotonic(), result)
    assert result["rounds"] == 2 and result["calls_per_timing"] == {"short": 1, "long": 1}
    assert set(real) == {"short", "long"} and all(t >= 0 for t in real.values())


def test_sampled_rows_of_the_long_case():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 1, 32, generator=gen) for _ in range(3))
    out, lse = reference_attention(q, k, v, dtype=torch.float32)
    ok = long.sampled_rows_check(q, k, v, out, lse, "float32", seed=0)
    assert ok["ok"] and {0, 299} <= set(ok["rows"]) and ok["out_max_abs_err"] < 1e-5
    out[:, ok["rows"][1]] += 0.01
    assert not long.sampled_rows_check(q, k, v, out, lse, "float32", seed=0)["ok"]


def test_the_bundle_has_the_kernels_of_its_runs():
    """gpu_bundle exports every CUDA kernel its gpu_check runs call (the GPU machine cannot compile)."""
    bundled = set(gpu_bundle.bundled_variants())
    for argv in gpu_bundle.BUNDLED_RUNS:
        args = cli.parse_args(argv)
        assert {(*v, args.deterministic) for v in cases.variants_needed(args)} <= bundled
    assert len(bundled) == 4 + 2  # fp16/bf16 x D64/128 (any mask); bf16 deterministic D64/128
    mods = gpu_bundle.bundled_mod_variants()  # the correctness stage's softcap/ALiBi cases
    assert set(mods) == {(c.dtype, c.head_dim, bool(c.softcap), c.alibi)
                         for c in cases.correctness_cases("cuda", False) if c.softcap or c.alibi}
    assert "exec python3 benchmarks/gpu_check.py \"$@\"" in gpu_bundle.RUN_SH
    assert (ROOT / "benchmarks" / "gpu_check.py").is_file()


def test_the_session_script_runs_only_bundled_kernels():
    """gpu_session.sh (one device call) parses, and the profilers' calls need only bundled kernels."""
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], check=True)
    bundled = {(dtype, head_dim) for dtype, head_dim, _causal, deterministic in gpu_bundle.bundled_variants()
               if not deterministic}
    for case in [gpu_profile.NCU_CASE, *gpu_profile.SANITIZE_CASES]:
        assert (str(case[6]).removeprefix("torch."), case[5]) in bundled, case
    session = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    assert "--deterministic --stages speed" in session and "--cases N=8192,D=128,dtype=bf16,causal=0" in session
    assert ("bfloat16", 128, False, True) in gpu_bundle.bundled_variants()


def test_run_cases_reports_errors_and_skips_past_the_budget(tmp_path):
    path = tmp_path / "stage.json"
    writer = stage.StageWriter(path, "speed", budget_s=60)

    def one(i, item):
        if item == "boom":
            raise RuntimeError("kernel exploded")
        return {"label": item, "ok": True}

    stage.run_cases(writer, ["a", "boom", "c"], one, "cpu", label=str)
    data = json.loads(path.read_text())
    assert [c["label"] for c in data["cases"]] == ["a", "boom", "c"]
    assert data["cases"][1]["ok"] is False and "kernel exploded" in data["cases"][1]["error"]

    late = stage.StageWriter(tmp_path / "late.json", "speed", budget_s=0)
    time.sleep(0.01)
    stage.run_cases(late, ["x", "y"], one, "cpu", label=str)
    data = json.loads((tmp_path / "late.json").read_text())
    assert data["cases"] == [] and [s["label"] for s in data["skipped"]] == ["x", "y"]
    assert "budget exceeded" in data["notes"][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_lost_cuda_context_skips_the_rest(tmp_path):
    """After an error, a CUDA context that no longer works (here: none at all) ends the stage."""
    writer = stage.StageWriter(tmp_path / "s.json", "correctness", budget_s=60)

    def one(i, item):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    stage.run_cases(writer, ["a", "b", "c"], one, "cuda", label=str)
    assert [c["label"] for c in writer.data["cases"]] == ["a"]
    assert [s["label"] for s in writer.data["skipped"]] == ["b", "c"]
    assert "CUDA context lost" in writer.data["notes"][0]


def test_a_stage_past_its_time_is_killed_and_reported(tmp_path):
    args = cli.parse_args(["--device", "cpu", "--quick", "--out-dir", str(tmp_path)])
    start = time.monotonic()
    data = stage.run_child(args, "long", budget_s=60, timeout_s=0.5, out=tmp_path / "stage_long.json")
    assert time.monotonic() - start < 30
    assert data["process"]["returncode"] is None and data["process"]["killed_after_s"] == 0.5
    assert any("killed" in n for n in data["notes"])


def test_without_a_gpu_the_cuda_run_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert orchestrate.main(["--out-dir", str(tmp_path)]) == 2
    assert json.loads((tmp_path / "gpu_check.json").read_text())["no_device"] is True


def test_render_speed_table_and_bar_summary():
    rec = {"label": "N8192 D128 bf16 (B2 H16)",
           "case": {"batch": 2, "seqlen": 8192, "heads": 16, "head_dim": 128, "dtype": "bfloat16", "causal": False},
           "tflops": {"tvmflash": {"fwd": 200.0, "bwd": 100.0, "fwd+bwd": 120.0},
                      "sdpa_flash": {"fwd": 400.0, "bwd": 250.0, "fwd+bwd": 280.0}},
           "ratio": {"sdpa_flash": {"fwd": 0.5, "bwd": 0.4, "fwd+bwd": 120 / 280}}, "unavailable": {}}
    rep = {"environment": {"gpu": "NVIDIA H200", "torch": "2.x", "tvm": "0.27"}, "args": {"out_dir": "x"},
              "stages": {"speed": {"cases": [rec], "skipped": [], "notes": []}}, "elapsed_s": 1}
    rep["summary"] = report.summarize(rep)
    assert rep["summary"]["bar_N8K_D128_bf16"]["meets_0.5x"] is False  # bwd 0.4x
    text = report.render(rep)
    assert "| N8192 D128 bf16 (B2 H16) | 200.0 | 400.0 | 120.0 | 280.0 | 0.50x | 0.40x | 0.43x |" in text
    assert "BELOW 0.5x" in text


# ----------------------------------------------------------------------------- end to end


def test_cpu_dry_run_end_to_end(tmp_path):
    """The real script, all stages in child processes, on CPU tensors: table printed last, JSON written."""
    env = {**os.environ, "TVMFLASH_QUIET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
                           "--out-dir", str(tmp_path), "--budget-s", "400", "--jobs", "1"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    table_start = out.index("## tvmflash gpu_check: CPU")
    assert "| case | ours fwd | flash fwd |" in out[table_start:]  # the table comes last
    assert "correctness: 4/4 passed" in out
    assert (tmp_path / "gpu_check.md").read_text().strip() == out[table_start:].strip()

    result = json.loads((tmp_path / "gpu_check.json").read_text())
    env_info = result["environment"]
    assert env_info["torch"] == torch.__version__ and env_info["tvm"] and env_info["device"] == "cpu"
    stages = result["stages"]
    assert set(stages) == {"compile", "correctness", "speed", "long"}
    assert all(c["ok"] for c in stages["compile"]["cases"]) and len(stages["compile"]["cases"]) == 2
    corr = stages["correctness"]["cases"]
    assert len(corr) == 4 and all(c["ok"] for c in corr)
    for c in corr:
        assert set(c["checks"]) == {"out", "lse", "dq", "dk", "dv"}
        assert all(ch["err"] <= ch["bound"] for ch in c["checks"].values())
    speed_records = stages["speed"]["cases"]
    assert len(speed_records) == 2
    for rec in speed_records:
        assert rec["tflops"]["tvmflash"]["fwd"] > 0 and rec["tflops"]["sdpa_flash"]["fwd+bwd"] > 0
        assert "sdpa_cudnn" in rec["unavailable"]  # no cuDNN on CPU: skipped, not fatal
        assert rec["rounds"] >= 2 and rec["calls_per_timing"]["tvmflash/fwd"] == 1
        times, flops = rec["times"]["tvmflash"], cases.SpeedCase(**rec["case"]).flops("fwd")
        assert rec["tflops"]["tvmflash"]["fwd"] == pytest.approx(flops / times["fwd"] / 1e12)
        assert rec["max_abs_diff_vs"]["out"] < 0.05
    (long_record,) = stages["long"]["cases"]
    assert long_record["ok"] and long_record["sampled_rows"]["ok"] and long_record["grads_finite"]
    assert long_record["case"]["seqlen"] == 2048 and long_record["fwd_bwd_s"] > 0
    assert long_record["standard_attention"]["P_saved_for_backward_bytes"] == 2048**2 * 4
    assert result["summary"]["correctness_passed"] == result["summary"]["correctness_total"] == 4
