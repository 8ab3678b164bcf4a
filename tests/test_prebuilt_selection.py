"""Which prebuilt kernels ($TVMFLASH_PREBUILT) are used: only those that match the full request
(target, config) and this CPU's instruction set; malformed metadata is an error naming the file."""

from __future__ import annotations

import json
import os
import platform
import re

import pytest

import tvmflash
from tvmflash import compiler
from tvmflash.config import config_from_json
from tvmflash.cache import UnsafeCacheError
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
        # the error names what was skipped, and why (it named only the prebuild call that made it)
        lacking = ", ".join(missing_isa_features(spr.meta["isa_features"]))
        assert f"Skipped for instructions this CPU lacks: spr.so (needs {lacking})" in compiler._nothing_prebuilt(
            "flash", "llvm", SPEC32, False)
        with pytest.raises(RuntimeError, match="uses instructions this CPU lacks"):
            tvmflash.load(tmp_path / "spr.so")


def test_of_several_prebuilt_cpu_models_the_nearest_is_used(tmp_path, monkeypatch):
    """A directory with kernels for the generic x86-64 and for this CPU: this CPU's (the most
    instruction-set extensions it has), whatever the names' order (the first by name was taken:
    6.8x slower here)."""
    here = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    generic_cpu = "x86-64" if platform.machine() in ("x86_64", "AMD64") else "generic"
    generic = tvmflash.compile({"kind": "llvm", "mcpu": generic_cpu}, head_dim=32, dtype="float32")
    assert len(generic.meta["isa_features"]) < len(here.meta["isa_features"])
    generic.export_library(tmp_path / "a-generic.so")
    here.export_library(tmp_path / "b-here.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    assert compiler._find_prebuilt("flash", "llvm", SPEC32).meta["target"] == here.meta["target"]


def test_prebuilt_kernels_of_the_calls_tile_class_are_used(tmp_path, monkeypatch):
    """A call of a short sequence gets the library with its tile class (16- or 32-row tiles, as a
    compiling process would build), a long one the 64-row one; a class the directory lacks falls
    back to the long class's library, as does one exported before libraries recorded a class."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("tile classes follow the length on x86 only")
    long = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    short = tvmflash.compile("llvm", head_dim=32, dtype="float32", seqlen=16)
    assert (long.meta["tile_class"], short.meta["tile_class"]) == ([64, 64], [16, 16])
    assert short.meta["configs"]["forward"]["block_q"] == 16
    # an explicit config's tiles are its class (the length's class, unknown here, was recorded)
    forward = config_from_json(short.meta["configs"]["forward"])
    assert tvmflash.compile("llvm", head_dim=32, dtype="float32", config=forward).meta["tile_class"] == [16, 16]
    short.export_library(tmp_path / "a-short.so")  # (first by name: the search must not take it for long calls)
    long.export_library(tmp_path / "b-long.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()

    def found(seqlen) -> str:
        return compiler._find_prebuilt("flash", "llvm", SPEC32, seqlen=seqlen)._library.name

    assert [found(n) for n in (None, 16, 48, (16, 16), 1000, (16, 1000), 90)] == [
        "b-long.so", "a-short.so", "a-short.so", "a-short.so", "b-long.so", "b-long.so", "b-long.so"]
    _edit_meta(tmp_path / "b-long.so", tile_class=None)  # (as exports before tile classes)
    compiler._prebuilt_cache.clear()
    assert [found(n) for n in (None, 16, (16, 1000))] == ["b-long.so", "a-short.so", "b-long.so"]
    for name in ("b-long.so", "b-long.so.json"):
        (tmp_path / name).unlink()
    compiler._prebuilt_cache.clear()
    assert found(1000) == "a-short.so"  # (every class computes every length: slower, not wrong)


def test_prebuild_compiles_what_the_prebuilt_directory_holds_already(tmp_path, monkeypatch):
    """prebuild builds for its target, whatever $TVMFLASH_PREBUILT holds: it had exported the
    library found there (another CPU model's, or the long class's under each short class's
    name: 64-row tiles where the name promised 16)."""
    generic_cpu = "x86-64" if platform.machine() in ("x86_64", "AMD64") else "generic"
    (tmp_path / "deployed").mkdir(mode=0o755)
    generic = tvmflash.compile({"kind": "llvm", "mcpu": generic_cpu}, head_dim=16, dtype="float32")
    generic.export_library(tmp_path / "deployed" / "generic.so")
    here = tvmflash.compile("llvm", head_dim=16, dtype="float32").meta["target"]
    assert here != generic.meta["target"]
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path / "deployed"))
    compiler._prebuilt_cache.clear()
    assert compiler._find_prebuilt("flash", "llvm", AttentionSpec(16, "float32"), seqlen=16) is not None
    written = tvmflash.prebuild(tmp_path / "new", "llvm", head_dims=(16,), dtypes=("float32",), decode=True)
    for path in written[:-2]:  # (the helpers in C last)
        meta = tvmflash.load(path).meta
        assert meta["target"] == here, path
        if "-tiles" in path.name:
            tiles = [int(edge) for edge in path.name.rsplit("-tiles", 1)[1].removesuffix(".so").split("x")]
            assert meta["tile_class"] == tiles and [meta["configs"]["forward"][f"block_{side}"]
                                                    for side in "qk"] == tiles, path


def _edit_meta(path, **changes) -> None:
    """Change an exported library's metadata (its checksum is of the library: it still holds)."""
    meta_path = path.with_name(path.name + ".json")
    meta = json.loads(meta_path.read_text())
    for name, value in changes.items():
        if value is None:
            meta.pop(name, None)
        else:
            meta[name] = value
    meta_path.write_text(json.dumps(meta))


def test_a_prebuilt_library_that_cannot_serve_is_skipped_and_the_search_goes_on(tmp_path, monkeypatch):
    """A library whose metadata claims another kind, or was written by another tvmflash, is
    skipped with a warning naming it, and a good one after it in the directory is found (a
    load's error ended the search; an old version was loaded)."""
    flash = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    decode = compiler.compile_decode("llvm", SPEC32)
    decode.export_library(tmp_path / "a-decode-claims-flash.so")
    _edit_meta(tmp_path / "a-decode-claims-flash.so", kernel=None)  # (as old exports: no "kernel")
    flash.export_library(tmp_path / "b-flash-claims-decode.so")
    _edit_meta(tmp_path / "b-flash-claims-decode.so", kernel="decode")
    flash.export_library(tmp_path / "c-flash-of-another-version.so")
    _edit_meta(tmp_path / "c-flash-of-another-version.so", versions={**flash.meta["versions"], "tvmflash": "0.0.1"})
    flash.export_library(tmp_path / "d-flash-of-an-unknown-kind.so")
    _edit_meta(tmp_path / "d-flash-of-an-unknown-kind.so", kernel="prefill")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    with pytest.warns(TvmflashWarning) as caught:
        assert compiler._find_prebuilt("flash", "llvm", SPEC32) is None
        assert compiler._find_prebuilt("decode", "llvm", SPEC32) is None
    said = "\n".join(str(w.message) for w in caught)
    for name, why in (("a-decode-claims-flash.so", "configs"), ("b-flash-claims-decode.so", "flash_decode"),
                      ("c-flash-of-another-version.so", "another tvmflash (0.0.1"),
                      ("d-flash-of-an-unknown-kind.so", "prefill")):
        assert re.search(f"{re.escape(name)}.*{re.escape(why)}", said), (name, said)
    flash.export_library(tmp_path / "e-flash.so")
    decode.export_library(tmp_path / "f-decode.so")
    compiler._prebuilt_cache.clear()
    with pytest.warns(TvmflashWarning):
        assert compiler._find_prebuilt("flash", "llvm", SPEC32)._library == tmp_path / "e-flash.so"
        assert compiler._find_prebuilt("decode", "llvm", SPEC32)._library == tmp_path / "f-decode.so"


def test_kernels_follow_a_changed_prebuilt_directory(tmp_path, monkeypatch):
    """$TVMFLASH_PREBUILT read again: kernels found in one directory are not served for another
    (the search was memoized by request alone, the decode kernels by the cache directory)."""
    from tvmflash import kvcache

    (tmp_path / "a").mkdir(mode=0o755)
    (tmp_path / "b").mkdir(mode=0o755)
    compiler.compile_decode("llvm", SPEC32).export_library(tmp_path / "a" / "decode.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path / "a"))
    assert kvcache.decode_kernels(32, "float32")._library == tmp_path / "a" / "decode.so"
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path / "b"))
    assert compiler._find_prebuilt("decode", "llvm", SPEC32) is None
    assert kvcache.decode_kernels(32, "float32")._library != tmp_path / "a" / "decode.so"  # (compiled, cached)
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path / "no-such-directory"))
    with pytest.raises(FileNotFoundError, match="TVMFLASH_PREBUILT=.*no-such-directory is not a directory"):
        compiler._find_prebuilt("decode", "llvm", SPEC32)


def test_prebuild_checks_every_argument_before_it_builds(tmp_path):
    """One value where a tuple of choices is asked is that choice; a bad one anywhere is an error
    before anything is written; so is a directory $TVMFLASH_PREBUILT would refuse."""
    written = tvmflash.prebuild(tmp_path / "one", "llvm", head_dims=32, dtypes="float32", score_mods="none",
                                short_sequences=False)
    assert written[0].name.endswith("-d32-float32.so")
    for bad, error in ((dict(head_dims=(32, 20)), "head_dim 20 is not supported"),
                       (dict(dtypes=("float32", "float64")), "dtype 'float64' is not supported"),
                       (dict(score_mods="tanh"), r"score_mods \['tanh'\] unknown"),
                       (dict(fp32_results=(True,)), "float32 kernels' results are float32 already"),
                       (dict(head_dims=None), "head_dims lists the choices"),
                       (dict(short_sequences="no"), "short_sequences must be True or False")):
        with pytest.raises((ValueError, TypeError), match=error):
            tvmflash.prebuild(tmp_path / "bad", "llvm", **{"head_dims": (32,), "dtypes": ("float32",), **bad})
        assert not (tmp_path / "bad").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(NotADirectoryError, match="a-file is not one"):
        tvmflash.prebuild(tmp_path / "a-file", "llvm", head_dims=(32,), dtypes=("float32",), short_sequences=False)
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o775)
    with pytest.raises(UnsafeCacheError, match="would refuse it"):
        tvmflash.prebuild(tmp_path / "shared", "llvm", head_dims=(32,), dtypes=("float32",), short_sequences=False)
    assert not list((tmp_path / "shared").iterdir())
    loaded = tvmflash.load(written[0])
    loaded.export_library(written[0])  # (over the file it was loaded from: it was SameFileError)
    assert tvmflash.load(written[0]).meta["spec"] == loaded.meta["spec"]


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
    (tmp_path / "nested.so").write_bytes(b"")
    (tmp_path / "nested.so.json").write_text("[" * 100_000)  # (json's parser: RecursionError, which broke every call)
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    with pytest.warns(TvmflashWarning) as caught:  # skipped: a foreign json broke every call
        assert compiler._find_prebuilt("flash", "llvm", SPEC32) is None
    said = "\n".join(str(w.message) for w in caught)
    assert "broken.so.json" in said and "nested.so.json nests its values too deeply" in said, said
