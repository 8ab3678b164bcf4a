"""Which prebuilt kernels ($TVMFLASH_PREBUILT) are used: only those that match the full request
(target, config) and this CPU's instruction set; malformed metadata is an error naming the file."""

from __future__ import annotations

import pytest

import tvmflash
from tvmflash import compiler
from tvmflash.settings import TvmflashWarning
from tvmflash.spec import AttentionSpec

SPEC32 = AttentionSpec(32, "float32")


def test_prebuilt_kernels_for_another_cpu_are_not_used(tmp_path, monkeypatch):
    spr = tvmflash.compile({"kind": "llvm", "mcpu": "sapphirerapids"}, head_dim=32, dtype="float32")
    spr.export_library(tmp_path / "spr.so")
    here = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    here.export_library(tmp_path / "here.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    found = compiler._find_prebuilt("flash", "llvm", SPEC32)
    assert found is not None and found.meta["target"] == here.meta["target"]
    from tvmflash.target import missing_isa_features

    if missing_isa_features(spr.meta["isa_features"]):  # this CPU lacks some of them (AMX, AVX512-FP16)
        (tmp_path / "here.so").unlink()
        (tmp_path / "here.so.json").unlink()
        compiler._prebuilt_cache.clear()
        assert compiler._find_prebuilt("flash", "llvm", SPEC32) is None
        with pytest.raises(RuntimeError, match="uses instructions this CPU lacks"):
            tvmflash.load(tmp_path / "spr.so")


def test_prebuilt_kernels_respect_explicit_arguments(tmp_path, monkeypatch):
    kern = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    kern.export_library(tmp_path / "k.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    other = tvmflash.CPUKernelConfig("backward", 64, 64, 16, tuple((p, tvmflash.RegisterTile(2, 2))
                                                                   for p in ("scores", "dv", "dprobs", "dk", "dq")))
    assert compiler._find_prebuilt("flash", "llvm", SPEC32) is not None
    assert compiler._find_prebuilt("flash", "llvm", SPEC32, config=other) is None  # config
    assert compiler._find_prebuilt("flash", {"kind": "llvm", "mcpu": "znver3"},
                                   SPEC32) is None or kern.meta["target"]["mcpu"] == "znver3"  # target
    fresh = tvmflash.compile("llvm", head_dim=32, dtype="float32", cache=False)  # cache=False: no prebuilt
    assert fresh._library is None


def test_malformed_prebuilt_metadata_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "broken.so").write_bytes(b"")
    (tmp_path / "broken.so.json").write_text("{not json")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    with pytest.warns(TvmflashWarning, match="broken.so.json"):  # skipped: a foreign json broke every call
        assert compiler._find_prebuilt("flash", "llvm", SPEC32) is None
