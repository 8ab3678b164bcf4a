"""The disk cache: broken, mismatched or planted entries are rebuilt (with one warning) or refused,
never loaded; directories others can write are refused, new ones are private; a failing write is
a warning and the kernels are used all the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tvmflash
from tvmflash import cache, compiler, records
from tvmflash import target as targets
from tvmflash.spec import AttentionSpec
from tvmflash.settings import TvmflashWarning


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


# --- warm starts: a request resolved in an earlier process, loaded without TVM's compiler -------------
_WARM_SCRIPT = """
import sys, torch
if sys.argv[3:] == ["tvm first"]:
    import tvm
import tvmflash
from tvmflash import flash_attn_func, flash_attn_with_kvcache
q, k, v, dout, qd, k_cache, v_cache = torch.load(sys.argv[1])
imported_before = "tvm" in sys.modules
q, k, v = (t.requires_grad_() for t in (q, k, v))
out = flash_attn_func(q, k, v, causal=True)
out.backward(dout)
decoded = flash_attn_with_kvcache(qd, k_cache, v_cache)
# (bf16 flash kernels measure the product rates, which the decode kernel's answer must not depend on)
out16 = flash_attn_func(q.detach().bfloat16(), k.detach().bfloat16(), v.detach().bfloat16())
torch.save({"out": out.detach(), "grads": [t.grad for t in (q, k, v)], "decoded": decoded, "out16": out16,
            "tvm imported": (imported_before, "tvm" in sys.modules)}, sys.argv[2])
"""


def _run_warm_script(tmp_path, inputs, n: int, runtime_only_tvm_first: bool = False) -> tuple[dict, str]:
    results = tmp_path / f"results{n}.pt"
    env = {**os.environ, "TVMFLASH_CACHE_DIR": str(tmp_path / "cache"), "TVMFLASH_QUIET": "0",
           **({"TVM_USE_RUNTIME_LIB": "1"} if runtime_only_tvm_first else {})}
    run = subprocess.run([sys.executable, "-c", _WARM_SCRIPT, str(inputs), str(results),
                          *(["tvm first"] if runtime_only_tvm_first else [])], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(results), run.stderr


def test_a_warm_start_runs_cached_kernels_without_importing_tvm(tmp_path, gen, seed):
    """The second process asks the questions the first answered: it loads the same entries with
    TVM's runtime library alone (``import tvm`` never runs) and computes the same results, which
    meet the flash-attn rule against float64 (fp32 training call, bf16 decode step, bf16 forward:
    the last measures the product rates after the decode kernel's answer was recorded)."""
    from conftest import assert_flash_rule
    from tvmflash.reference import reference_attention

    n, heads, heads_k, d = 37, 4, 2, 32
    q, dout = (torch.randn(2, n, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, n, heads_k, d, generator=gen) for _ in range(2))
    qd = torch.randn(1, 1, heads, d, generator=gen).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 45, heads_k, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    inputs = tmp_path / "inputs.pt"
    torch.save((q, k, v, dout, qd, k_cache, v_cache), inputs)

    cold, cold_log = _run_warm_script(tmp_path, inputs, 1)
    warm, warm_log = _run_warm_script(tmp_path, inputs, 2)
    assert "compiling" in cold_log and cold["tvm imported"] == (False, True)
    assert "compiling" not in warm_log and warm["tvm imported"] == (False, False), warm_log[-2000:]
    assert all(torch.equal(warm[name], cold[name]) for name in ("out", "decoded", "out16"))
    assert all(torch.equal(a, b) for a, b in zip(warm["grads"], cold["grads"]))
    # TVM's runtime alone, imported first: its alias finder, asked while the question's code was
    # hashed, imported its CUDA backend, which failed (ImportError at the first call)
    alone, _ = _run_warm_script(tmp_path, inputs, 3, runtime_only_tvm_first=True)
    assert all(torch.equal(alone[name], cold[name]) for name in ("out", "decoded", "out16"))

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref64, _ = reference_attention(q64, k64, v64, causal=True)
    ref64.backward(dout.double())
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    same, _ = reference_attention(qf, kf, vf, causal=True, dtype=torch.float32)
    same.backward(dout)
    assert_flash_rule("out", warm["out"], ref64, same, torch.float32, seed)
    for name, ours, ref, plain in zip("qkv", warm["grads"], (q64, k64, v64), (qf, kf, vf)):
        assert_flash_rule(f"d{name}", ours, ref.grad, plain.grad, torch.float32, seed)
    dec64, _ = reference_attention(qd, k_cache, v_cache)
    dec16, _ = reference_attention(qd, k_cache, v_cache, dtype=torch.bfloat16)
    assert_flash_rule("decode", warm["decoded"], dec64, dec16, torch.bfloat16, seed)
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    out64, _ = reference_attention(q16, k16, v16)
    plain16, _ = reference_attention(q16, k16, v16, dtype=torch.bfloat16)
    assert_flash_rule("bf16 out", warm["out16"], out64, plain16, torch.bfloat16, seed)


def test_an_answer_holds_while_the_files_it_read_do(tmp_path, monkeypatch):
    """A recorded answer names its entry only while every file the resolution read (tuning
    records, product rates) holds what it held, absent ones included; and only an entry's name."""
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    records, absent, key = tmp_path / "records.json", tmp_path / "absent.json", "0123456789abcdef01234567"
    records.write_text("{}")
    cache.remember_answer("q1", key, [records, absent])
    assert cache.answer("q1") == key and cache.answer("q2") is None
    records.write_text('{"forward": {}}')
    assert cache.answer("q1") is None
    cache.remember_answer("q1", key, [records, absent])
    assert cache.answer("q1") == key
    absent.write_text("{}")
    assert cache.answer("q1") is None
    absent.unlink()
    records.unlink()
    assert cache.answer("q1") is None
    (tmp_path / "cache" / "answers" / "q1.json").write_text("not json")
    assert cache.answer("q1") is None
    cache.remember_answer("q1", "../../elsewhere/library", [])
    assert cache.answer("q1") is None


def test_an_answer_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    cache.remember_answer("q1", "0123456789abcdef01234567", [])
    path = tmp_path / "cache" / "answers" / "q1.json"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    os.chmod(path, 0o666)
    with pytest.raises(cache.UnsafeCacheError, match="will not read"):
        cache.answer("q1")


def test_compiles_take_recorded_answers_and_resolve_again_when_records_change(tmp_path, monkeypatch):
    """In process: a cleared memory cache takes the recorded answer (no resolution, the same
    entry); an answer pointing at an entry of another spec is not taken, also where that entry is
    in memory already (the request is resolved, and the answer rewritten); a tuning-record file
    written since makes it resolve again."""
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TVMFLASH_TUNE_LOGS", str(tmp_path / "logs"))
    compiler.clear_memory_cache()
    resolved = []
    real = compiler._compile_spec
    monkeypatch.setattr(compiler, "_compile_spec", lambda *a, **kw: resolved.append(a) or real(*a, **kw))
    first = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    other = tvmflash.compile("llvm", head_dim=16, dtype="float32")
    assert len(resolved) == 2
    compiler.clear_memory_cache()
    again = tvmflash.compile("llvm", head_dim=32, dtype="float32", causal=True)
    assert len(resolved) == 2 and again.meta == first.meta and again.causal

    answers = {json.loads(path.read_text())["key"]: path for path in (tmp_path / "cache" / "answers").iterdir()}
    first_answer = answers[first.meta["cache_key"]]
    first_answer.write_text(first_answer.read_text().replace(first.meta["cache_key"], other.meta["cache_key"]))
    compiler.clear_memory_cache()
    assert tvmflash.compile("llvm", head_dim=16, dtype="float32").meta == other.meta and len(resolved) == 2
    # (the entry the answer names is in memory now, loaded for its own question: checked all the same)
    assert tvmflash.compile("llvm", head_dim=32, dtype="float32").meta == first.meta and len(resolved) == 3
    assert json.loads(first_answer.read_text())["key"] == first.meta["cache_key"]

    spec = AttentionSpec(32, "float32")
    record = records.record_path(records.user_root(), targets.key(first.meta["target"]), spec)
    record.parent.mkdir(parents=True)
    record.write_text("{}")  # (a record of no kernel: the configs stay, the resolution runs again)
    compiler.clear_memory_cache()
    assert tvmflash.compile("llvm", head_dim=32, dtype="float32").meta == first.meta and len(resolved) == 4


def test_a_question_names_the_code_that_resolves_it():
    """An edit of any module a compile runs (config choice, product rates, tuning records' format,
    as well as the kernels' code) asks a new question: the old answer could name other configs."""
    from tvmflash import import_closure

    closure = set(import_closure.closure(compiler.RESOLVING_MODULES))
    assert {"tvmflash.compiler", "tvmflash.product_rates", "tvmflash.records", "tvmflash.config",
            "tvmflash.target", "tvmflash.kernels.cpu"} <= closure
    spec = AttentionSpec(32, "float32")
    asked = ["llvm", [spec.digest(), [], False, True, None], spec]
    before = compiler._question("flash", *asked)
    real = import_closure.digest
    try:
        import_closure.digest = lambda entries: "edited" if entries == compiler.RESOLVING_MODULES else real(entries)
        assert compiler._question("flash", *asked) != before
    finally:
        import_closure.digest = real
    assert compiler._question("flash", *asked) == before and before is not None


def test_entries_are_private_whatever_the_umask(tmp_path, monkeypatch):
    """With umask 002 (a common default) every file of an entry was group-writable, and the next
    process refused to load it (UnsafeCacheError)."""
    old = os.umask(0o002)
    try:
        kern, so = _entry(tmp_path, monkeypatch)
    finally:
        os.umask(old)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert so in written and not [p for p in written if p.stat().st_mode & 0o022]
    run = _compile_in_fresh_process(tmp_path)
    assert run.returncode == 0 and "compiling" not in run.stderr, run.stderr[-2000:]
