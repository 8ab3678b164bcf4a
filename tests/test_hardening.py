"""Issue 9's defects, each with a regression test: non-finite inputs, the disk cache (broken,
planted or mismatched entries, unsafe directories, failing writes), prebuilt kernels for other
CPUs, softmax_scale, clear errors, aliased outputs; plus thread-count independence."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tvmflash
from conftest import assert_flash_rule, assert_matches_reference, causal_mask, random_inputs, reference_attention
from tvmflash import cache, checks, compiler
from tvmflash.settings import TvmflashWarning
from tvmflash.spec import AttentionSpec

SPEC32 = AttentionSpec(32, "float32")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernels():
    return tvmflash.compile("llvm", head_dim=32, dtype="float32")


def _run(kernels, q, k, v, dout, **mask):
    out, lse = torch.full_like(q, 7.0), torch.full((q.shape[0], q.shape[2], q.shape[1]), 7.0)
    kernels.forward(q, k, v, out, lse, **mask)
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads, **mask)
    return out, lse, grads


# --- 1. non-finite inputs propagate: NaN in every row that sees one ------------------------------
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_spreads_to_every_row_that_sees_it(kernels, gen, where):
    """Causal, seqlen_k - seqlen_q = 20: query i sees key j iff j <= i + 20. A NaN in key 40 (or
    its value) reaches rows 20..69 (PyTorch's attention gives NaN there too; its MATH backend also
    spreads it into rows that do not see the key, through the -inf + NaN of its additive mask)."""
    q, k, v = random_inputs(gen, 1, 70, 90, 2, 1, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    {"q": q, "k": k, "v": v}[where][0, 40, 0, 3] = float("nan")
    out, lse, (dq, dk, dv) = _run(kernels, q, k, v, dout, causal=True)
    rows_nan = out.isnan().any(-1).any(-1)[0]  # (seqlen_q,)
    sees = torch.arange(70) + 20 >= 40
    if where == "q":  # one query row
        assert rows_nan.tolist() == [i == 40 for i in range(70)]
        assert dq[0, 40, 0].isnan().all() and torch.isfinite(dq[0, 40, 1]).all()  # its head only
        assert dk[0, :61].isnan().any(-1).all()  # every key row 40 sees
    elif where == "k":  # exactly the rows that see it: masked scores never reach the softmax
        assert torch.equal(rows_nan, sees)
        assert out[0, sees].isnan().all() and lse[0, :, sees].isnan().all()
    else:  # v: every row that sees it, in the value's own dimension (P V spreads it further within
        # a tile through 0 x NaN, as PyTorch's attention does across all rows); the LSE stays finite
        assert out[0, sees, :, 3].isnan().all() and torch.isfinite(out[0, :, :, :3]).all()
        assert torch.isfinite(lse).all()
    if where != "q":
        # gradients: NaN in every row that sees it (0 x NaN spreads it further within a tile pair, as
        # in PyTorch's backward, whose dQ = dS K multiplies the NaN key row by the masked zeros)
        assert dq[0, sees].isnan().any(-1).all()
        assert dv[0, 40].isnan().any() or dk[0, 40].isnan().any()
    ref, _ = reference_attention(*(t.double() for t in (q, k, v)), True)
    finite = ~out.isnan() & ~ref.isnan()
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=1e-5, rtol=0)


def test_infinite_query_gives_nan_not_zero(kernels, gen):
    q, k, v = random_inputs(gen, 1, 20, 30, 1, 1, 32, "float32")
    q[0, 5] = float("inf")
    out, lse, _ = _run(kernels, q, k, v, torch.randn(q.shape, generator=gen))
    leaves = [t.transpose(1, 2) for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves).transpose(1, 2)
    assert out[0, 5].isnan().all() and ref_out[0, 5].isnan().all()
    assert torch.isfinite(out[0, :5]).all() and torch.isfinite(out[0, 6:]).all()


def test_fully_masked_rows_stay_zero_not_nan(kernels, gen):
    q, k, v = random_inputs(gen, 1, 100, 30, 2, 2, 32, "float32")
    out, lse, grads = _run(kernels, q, k, v, torch.randn(q.shape, generator=gen), causal=True)
    assert torch.all(out[:, :70] == 0) and torch.all(lse[:, :, :70] == float("-inf"))
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :70] == 0)


# --- 7. softmax_scale: any finite scale > 0 works, everything else is a clear error ----------------
def _fp32_recompute_error_bound(q, k, v, dout, scale, lse):
    """First-order bounds on |dq|, |dk|, |dv - exact| for a backward that recomputes P from an fp32
    LSE (B, H, Nq), with bottom-right causal masking, elementwise, in float64.

    Each exponent s_ij * scale - lse_i carries rounding of about u (|lse_i| + |s_ij scale| + D scale
    |q_i|.|k_j|) (the stored LSE, the score, its D-term dot product), and the sums add u (D + Nk):
    gamma_ij. Then |dP_ij| error <= gamma_ij P_ij, O and Delta_i = dO_i . O_i inherit it, and
    dS_ij = P_ij (dP_ij - Delta_i) carries gamma_ij P_ij (|dP_ij - Delta_i| + A_ij) + P_ij sum_j'
    gamma_ij' P_ij' A_ij', A_ij = |dO_i| . |v_j|; dq, dk, dv are its products with |k|, |q|, |dO|."""
    q, k, v, dout = (t.double().transpose(1, 2) for t in (q, k, v, dout))  # (B, H, N, D)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    visible = causal_mask(n, m)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, -1)
    u = torch.finfo(torch.float32).eps / 2
    gamma = u * (lse.double().abs().unsqueeze(-1) + scores.masked_fill(~visible, 0).abs()
                 + d * scale * (q.abs() @ k.abs().transpose(-1, -2)) + d + m)
    dp = dout @ v.transpose(-1, -2)
    delta = (dp * p).sum(-1, keepdim=True)
    a = dout.abs() @ v.abs().transpose(-1, -2)
    ds_error = gamma * p * ((dp - delta).abs() + a) + p * (gamma * p * a).sum(-1, keepdim=True)
    bounds = (scale * ds_error @ k.abs(), scale * ds_error.transpose(-1, -2) @ q.abs(),
              (gamma * p).transpose(-1, -2) @ dout.abs())
    return [b.transpose(1, 2) for b in bounds]


def _plain_fp32_worst_order(q, k, v, scale, ref64, orders: int = 4):
    """Plain fp32 attention (out, lse) with the largest output error over a few summation orders
    of the scores (the head dim of q and k permuted alike: the same math, other roundings).

    At large scales the output error is the scores' rounding times the scale, and which order
    (ours or PyTorch's) happens to round less is chance: over 100 seeds at scale 300 our error is
    PyTorch's (one order) x 1.0 in the median but up to x 3.5 on single seeds, while against the
    worst of 4 orders it stays below 0.7 of the flash-attn bound."""
    perms = torch.Generator().manual_seed(0)
    worst = None
    for i in range(orders):
        perm = torch.arange(q.shape[-1]) if i == 0 else torch.randperm(q.shape[-1], generator=perms)
        out, lse = reference_attention(q[..., perm], k[..., perm], v, True, scale, dtype=torch.float32)
        error = float((out.double() - ref64).abs().max())
        if worst is None or error > worst[0]:
            worst = (error, out, lse)
    return worst[1], worst[2]


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 3.0, 30.0, 300.0, 1e10, 1e20])
def test_any_finite_positive_scale_works_or_says_why_not(kernels, gen, seed, scale):
    """Tiny scales (uniform attention) to huge ones (an argmax). The forward matches float64 at
    any scale. The backward recomputes P from the fp32 LSE, whose rounding grows with |lse|: up
    to 80 (normal logits) it meets the flash-attn rule against plain fp32 attention; beyond, it
    stays within the first-order error bound of that recompute; from |lse| = 2^16 on it is a
    clear error, never NaN or silently wrong gradients."""
    q, k, v = random_inputs(gen, 1, 50, 70, 2, 2, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 50)
    kernels.forward(q, k, v, out, lse, scale, causal=True)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, True, scale)
    same, same_lse = _plain_fp32_worst_order(q, k, v, scale, ref.detach())
    assert_flash_rule(f"out at scale {scale}", out, ref.detach(), same, torch.float32, seed)
    assert_flash_rule(f"lse at scale {scale}", lse, ref_lse.detach(), same_lse, torch.float32, seed)
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    if lse.abs().max() >= checks.MAX_RECOMPUTABLE_LSE:
        with pytest.raises(ValueError, match="log-sum-exp reached .* supports [|]lse[|] < 65536"):
            kernels.backward(dout, q, k, v, out, lse, *grads, scale, causal=True)
        return
    kernels.backward(dout, q, k, v, out, lse, *grads, scale, causal=True)
    if lse.abs().max() <= 80:
        assert_matches_reference(f"scale {scale}", (q, k, v, dout), (out, lse, *grads), True, seed, scale)
        return
    # Beyond: the LSE's own fp32 rounding (half an ulp of |lse|) scales each recomputed row of P,
    # and the gradients' error grows with it. Against PyTorch's SDPA FLASH (the same recompute) the
    # ratio of errors is chance, 1/16 to 16 on single seeds at scale 300; both stay within the
    # first-order bound of that rounding (over 3,000 seeds at scales 3-300: ours <= 0.16 of it,
    # PyTorch's <= 0.21), so that bound is the assertion.
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    bounds = _fp32_recompute_error_bound(q, k, v, dout, scale, lse)
    for name, ours, r, bound in zip(("dq", "dk", "dv"), grads, ref_grads, bounds):
        ulps = 2 * torch.finfo(torch.float32).eps * r.abs().max()  # 4 units of roundoff
        excess = ((ours.double() - r).abs() / (bound + ulps)).max().item()
        assert excess <= 1, (name, scale, excess, seed)


@pytest.mark.parametrize("scale,error,match", [
    (float("nan"), ValueError, "finite number > 0"), (float("inf"), ValueError, "finite number > 0"),
    (0.0, ValueError, "finite number > 0"), (-0.5, ValueError, "finite number > 0"),
    ("0.1", TypeError, "real number"), (True, TypeError, "real number"),
])
def test_bad_scales_are_rejected_at_every_entry_point(kernels, scale, error, match):
    q = torch.randn(1, 8, 1, 32)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 8)
    with pytest.raises(error, match=match):
        kernels.forward(q, q, q, out, lse, scale)
    with pytest.raises(error, match=match):
        kernels.backward(q, q, q, q, out, lse, torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), scale)
    with pytest.raises(error, match=match):
        tvmflash.flash_attn_func(q, q, q, softmax_scale=scale)
    if not isinstance(scale, (str, bool)):  # the custom op's schema types the argument itself
        with pytest.raises(error, match=match):
            torch.ops.tvmflash.flash_attn_forward(q, q, q, None, None, None, scale, -1, -1, 0.0, False, False, None)


# --- 8. clear errors -------------------------------------------------------------------------------
def test_clear_errors_for_unusual_inputs(kernels):
    q = np.random.randn(1, 8, 1, 32).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((1, 1, 8), np.float32)
    readonly = q.copy()
    readonly.setflags(write=False)
    with pytest.raises(ValueError, match="q is a read-only array"):
        kernels.forward(readonly, q, q, out, lse)
    empty = np.empty((1, 0, 1, 32), np.float32)
    with pytest.raises(ValueError, match="q is empty"):
        kernels.forward(empty, q, q, np.empty_like(empty), np.empty((1, 1, 0), np.float32))
    strided_lse = np.empty((1, 8, 2), np.float32)[:, :, :1].transpose(0, 2, 1)
    with pytest.raises(ValueError, match="lse must be contiguous"):
        kernels.forward(q, q, q, out, np.ascontiguousarray(np.empty((1, 1, 16), np.float32))[:, :, ::2])
    assert strided_lse.shape == (1, 1, 8)
    sparse = torch.randn(1, 8, 1, 32).to_sparse()
    with pytest.raises(TypeError, match="to_dense"):
        tvmflash.flash_attn_func(sparse, sparse, sparse)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tvmflash.flash_attn_func(torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32),
                                 causal="False")
    with pytest.raises(TypeError, match="causal must be True or False"):
        tvmflash.compile("llvm", 32, "float32", causal="False")


def test_numpy_integer_head_dim_is_accepted():
    assert tvmflash.compile("llvm", head_dim=np.int64(32), dtype="float32").head_dim == 32
    with pytest.raises(TypeError, match="head_dim must be an integer"):
        tvmflash.compile("llvm", head_dim=32.0, dtype="float32")


# --- 9. aliasing -----------------------------------------------------------------------------------
def test_outputs_that_alias_inputs_or_themselves_are_rejected(kernels):
    q, k, v = (torch.randn(1, 8, 1, 32) for _ in range(3))
    lse = torch.empty(1, 1, 8)
    with pytest.raises(ValueError, match="out overlaps q"):
        kernels.forward(q, k, v, q, lse)
    with pytest.raises(ValueError, match="overlapping elements"):
        kernels.forward(q, k, v, torch.empty(1, 1, 1, 32).expand(1, 8, 1, 32), lse)
    packed = torch.randn(1, 8, 2, 1, 32)
    with pytest.raises(ValueError, match="dq overlaps"):
        kernels.backward(q, q, k, v, q.clone(), lse, packed[:, :, 0], packed[:, :, 1], torch.empty_like(v))


# --- 2, 3, 5. the disk cache -------------------------------------------------------------------------
def _entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    compiler.clear_memory_cache()
    kern = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    return kern, tmp_path / f"{kern.meta['cache_key']}.so"


def _compile_in_fresh_process(tmp_path) -> subprocess.CompletedProcess:
    script = ("import torch, tvmflash; k = tvmflash.compile('llvm', head_dim=32, dtype='float32'); "
              "q = torch.randn(1, 10, 1, 32); o = torch.empty_like(q); l = torch.empty(1, 1, 10); "
              "k.forward(q, q, q, o, l); assert torch.isfinite(o).all(); print('ran')")
    env = {**os.environ, "TVMFLASH_CACHE_DIR": str(tmp_path), "TVMFLASH_QUIET": "0"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong-metadata", "no-metadata"])
def test_broken_cache_entries_are_rebuilt_with_one_warning(tmp_path, monkeypatch, damage):
    kern, so = _entry(tmp_path, monkeypatch)
    meta = so.with_suffix(".json")
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])
    elif damage == "garbage":  # same size, code bytes overwritten: checksum catches it
        data = bytearray(so.read_bytes())
        data[len(data) // 2: len(data) // 2 + 4096] = os.urandom(4096)
        so.write_bytes(bytes(data))
    elif damage == "wrong-metadata":  # e.g. another kernel's library under this key
        entry = json.loads(meta.read_text())
        entry["request"]["spec"]["head_dim"] = 64
        meta.write_text(json.dumps(entry))
    else:
        meta.unlink()
    run = _compile_in_fresh_process(tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ran" in run.stdout and "compiling" in run.stderr and run.stderr.count("rebuilding cache entry") == 1
    again = _compile_in_fresh_process(tmp_path)  # and the rebuilt entry is good
    assert again.returncode == 0 and "compiling" not in again.stderr and "rebuilding" not in again.stderr


def test_cache_entry_with_a_missing_function_is_rebuilt(tmp_path, monkeypatch):
    """A library that loads but lacks a kernel (e.g. another module planted under the key)."""
    import tvm
    from tvm.script import tirx as T

    kern, so = _entry(tmp_path, monkeypatch)

    @T.prim_func(s_tir=True)
    def flash_fwd(a: T.Buffer((4,), "float32")):
        T.func_attr({"global_symbol": "flash_fwd"})
        for i in range(4):
            a[i] = T.float32(0)

    tvm.compile(tvm.IRModule({"flash_fwd": flash_fwd}), target={"kind": "llvm"}).export_library(str(so))
    entry = json.loads(so.with_suffix(".json").read_text())
    entry["sha256"][".so"] = cache._digest(so)  # even with a matching checksum
    so.with_suffix(".json").write_text(json.dumps(entry))
    with pytest.warns(TvmflashWarning, match="does not load"):
        assert cache.load(kern.meta["cache_key"], entry["request"], ("flash_fwd", "flash_bwd")) is None


def test_unsafe_cache_directories_are_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(shared))
    with pytest.raises(cache.UnsafeCacheError, match="writable by group and others.*chmod 700"):
        cache.safe_directory()
    os.chmod(shared, 0o700)
    assert cache.safe_directory() == shared
    if os.getuid() == 0:  # root can give it away: a directory owned by someone else
        os.chown(shared, 12345, 12345)
        with pytest.raises(cache.UnsafeCacheError, match="owned by uid 12345"):
            cache.safe_directory()


def test_new_cache_directories_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "fresh" / "cache"))
    monkeypatch.setattr(os, "umask", os.umask)  # whatever the umask
    old = os.umask(0o022)
    try:
        path = cache.safe_directory()
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o700


def test_planted_entry_in_a_foreign_directory_is_never_loaded(tmp_path, monkeypatch):
    kern, so = _entry(tmp_path, monkeypatch)
    os.chmod(tmp_path, 0o775)  # group-writable: someone else could have planted the .so
    compiler.clear_memory_cache()
    with pytest.raises(cache.UnsafeCacheError):
        tvmflash.compile("llvm", head_dim=32, dtype="float32")


def test_failing_cache_write_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    compiler.clear_memory_cache()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache, "_digest", disk_full)
    with pytest.warns(TvmflashWarning, match="could not write the compile cache.*No space left"):
        kern = tvmflash.compile("llvm", head_dim=32, dtype="float32", config=tvmflash.CPUKernelConfig(
            "forward", 64, 64, 16, tuple((p, tvmflash.RegisterTile(2, 1)) for p in ("scores", "pv"))))
    q = torch.randn(1, 10, 1, 32)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 10)
    kern.forward(q, q, q, out, lse)  # the kernels are used all the same
    assert torch.isfinite(out).all()
    assert not list(tmp_path.glob("*.so"))


# --- 4. prebuilt kernels match the full request and the CPU -------------------------------------------
def test_prebuilt_kernels_for_another_cpu_are_not_used(tmp_path, monkeypatch):
    spr = tvmflash.compile({"kind": "llvm", "mcpu": "sapphirerapids"}, head_dim=32, dtype="float32")
    spr.export_library(tmp_path / "spr.so")
    here = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    here.export_library(tmp_path / "here.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    found = compiler._find_prebuilt("llvm", SPEC32, False, None, True)
    assert found is not None and found.meta["target"] == here.meta["target"]
    from tvmflash.target import missing_isa_features

    if missing_isa_features(spr.meta["isa_features"]):  # this CPU lacks some of them (AMX, AVX512-FP16)
        (tmp_path / "here.so").unlink()
        (tmp_path / "here.so.json").unlink()
        compiler._prebuilt_cache.clear()
        assert compiler._find_prebuilt("llvm", SPEC32, False, None, True) is None
        with pytest.raises(RuntimeError, match="uses instructions this CPU lacks"):
            tvmflash.load(tmp_path / "spr.so")


def test_prebuilt_kernels_respect_explicit_arguments(tmp_path, monkeypatch):
    kern = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    kern.export_library(tmp_path / "k.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    other = tvmflash.CPUKernelConfig("backward", 64, 64, 16, tuple((p, tvmflash.RegisterTile(2, 2))
                                                                   for p in ("scores", "dv", "dprobs", "dk", "dq")))
    assert compiler._find_prebuilt("llvm", SPEC32, False, None, True) is not None
    assert compiler._find_prebuilt("llvm", SPEC32, False, other, True) is None  # config
    assert compiler._find_prebuilt({"kind": "llvm", "mcpu": "znver3"}, SPEC32, False, None,
                                   True) is None or kern.meta["target"]["mcpu"] == "znver3"  # target
    fresh = tvmflash.compile("llvm", head_dim=32, dtype="float32", cache=False)  # cache=False: no prebuilt
    assert fresh._library is None


def test_malformed_prebuilt_metadata_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "broken.so").write_bytes(b"")
    (tmp_path / "broken.so.json").write_text("{not json")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    with pytest.warns(TvmflashWarning, match="broken.so.json"):  # skipped (issue 21: it broke every call)
        assert compiler._find_prebuilt("llvm", SPEC32, False, None, True) is None


# --- bitwise independent of the thread count ---------------------------------------------------------
def test_results_do_not_depend_on_the_thread_count(gen):
    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    q, k, v = random_inputs(gen, 1, 700, 650, 4, 1, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    results = []
    for threads in (1, 2, 3, 7, 64):
        out, lse = torch.empty_like(q), torch.empty(1, 4, 700)
        kernels.forward(q, k, v, out, lse, causal=True, num_threads=threads)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        kernels.backward(dout, q, k, v, out, lse, *grads, causal=True, num_threads=threads)
        results.append([out, lse, *grads])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_thread_count_setting_is_used_and_validated():
    script = ("import os, tvmflash; from tvmflash import settings; "
              "print(settings.num_threads(), os.environ['TVM_NUM_THREADS'])")
    env = {**os.environ, "TVMFLASH_NUM_THREADS": "3"}
    env.pop("TVM_NUM_THREADS", None)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout.split() == ["3", "3"], run.stderr
    env["TVMFLASH_NUM_THREADS"] = "lots"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0 and "TVMFLASH_NUM_THREADS='lots' is not a thread count" in run.stderr


def test_scale_helper_defaults_to_one_over_sqrt_d():
    assert checks.softmax_scale(None, 64) == 1 / math.sqrt(64)
    assert checks.softmax_scale(np.float32(0.5), 64) == 0.5
