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
from tvmflash import cache, compiler
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
