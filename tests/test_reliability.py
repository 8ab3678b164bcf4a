"""Issue 21's defects (reliability, third pass), each with a regression test that failed before the
fix: kernels in forked children and DataLoader workers (1), a full TMPDIR (5), broken cache entries
(6), kernels compiled for another CPU (7), tensor arguments on other devices (9), $TVMFLASH_PREBUILT
under the cache's rules (10), one options check for every entry point (11), numpy/torch scalars and
bool windows (14), cache keys independent of the CPU affinity (15)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import tvmflash
from tvmflash import cache, compiler, torch_op
from tvmflash.settings import TvmflashWarning
from tvmflash.spec import AttentionSpec


def _run_isolated(script: str, tmp_path, *args, env=None, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python in a session of its own; on a hang the whole session (the
    script and every process it forked) is killed, so nothing is left behind."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=tmp_path, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{path.name} {' '.join(args)} hung for {timeout} s (killed)\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers the script may have left
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# --- 1. fork: TVM's thread pool does not survive it -------------------------------------------------
_FORK_SCRIPT = """
    import os, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import tvmflash

    def inputs():
        g = torch.Generator().manual_seed(int(os.environ["SEED"]))
        q, k, v = (torch.randn(2, 77, 4, 32, generator=g) for _ in range(3))
        return q, k, v, torch.randn(q.shape, generator=g)

    def attention():
        q, k, v, dout = inputs()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = tvmflash.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        k_cache, v_cache = (t.detach()[:, :70].clone() for t in (k, v))
        decoded = tvmflash.flash_attn_with_kvcache(q.detach()[:, :1], k_cache, v_cache,
                                                   cache_seqlens=torch.tensor([50, 70], dtype=torch.int32))
        return torch.stack([out.detach(), q.grad, k.grad, v.grad]), decoded

    class Attention(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return attention()

    if __name__ == "__main__":
        mode = sys.argv[1]
        expected = attention()  # TVM's pool is running in this process now
        if mode == "fork":
            pid = os.fork()
            if pid == 0:
                got = attention()
                os._exit(0 if all(torch.equal(a, b) for a, b in zip(got, expected)) else 3)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    sys.exit(f"child exit status {os.waitstatus_to_exitcode(status)}" if status else 0)
                time.sleep(0.05)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            sys.exit("the forked child hung")
        loader = DataLoader(Attention(), batch_size=None, num_workers=2,
                            multiprocessing_context=mode.removeprefix("dataloader-"),
                            timeout=240)
        results = list(loader)
        assert len(results) == 4
        for got in results:
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), "a worker computed other values"
        print("ok")
"""


@pytest.mark.parametrize("mode", ["fork", "dataloader-fork", "spawn", "forkserver"])
def test_kernels_run_in_forked_and_spawned_workers(tmp_path, seed, mode):
    """Before: after a kernel ran in a process, the same call in a fork()ed child (a DataLoader
    worker) hung forever. Now every start method computes bitwise what the parent computes:
    flash_attn_func's forward and backward and flash_attn_with_kvcache."""
    run = _run_isolated(_FORK_SCRIPT, tmp_path, mode, env={"SEED": str(seed)})
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


# --- 6. every file of a cache entry is checksummed ---------------------------------------------------
@pytest.fixture(scope="module")
def stored_kernels():
    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32", cache=False)  # built here: has its source
    assert kernels._source
    return kernels


def _damage(path, how: str) -> None:
    if how == "garbage-byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] = 0xFF  # never valid in UTF-8
        path.write_bytes(bytes(data))
    elif how == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("file,how", [(".src", "garbage-byte"), (".src", "directory"), (".src", "missing"),
                                      (".so", "directory"), (".json", "directory")])
def test_every_file_of_a_cache_entry_is_checked_and_rebuilt(tmp_path, monkeypatch, stored_kernels, file, how):
    """Before: a garbage byte in <key>.src raised UnicodeDecodeError at every later call, and a
    .src or .so replaced by a directory raised IsADirectoryError. Now the entry is refused with
    one warning and the rebuilt entry replaces it."""
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    key, request = stored_kernels.meta["cache_key"], {k: v for k, v in stored_kernels.meta.items() if k != "cache_key"}
    functions = ("flash_fwd", "flash_bwd")
    assert cache.store(key, request, stored_kernels._module, stored_kernels._source) is not None
    _damage(tmp_path / "cache" / f"{key}{file}", how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.load(key, request, functions) is None
    assert [str(w.message) for w in caught if issubclass(w.category, TvmflashWarning)] == [
        next(str(w.message) for w in caught if "rebuilding cache entry" in str(w.message))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.store(key, request, stored_kernels._module, stored_kernels._source) is not None
        entry = cache.load(key, request, functions)
    assert entry.source == stored_kernels._source and entry.library.is_file() and entry.request == request


# --- 7. kernels compiled for another CPU refuse to run ------------------------------------------------
_FOREIGN_CPU_SCRIPT = """
    import sys, torch, tvmflash
    from tvmflash import compiler, target
    from tvmflash.spec import AttentionSpec

    mcpu = sys.argv[1]
    kernels = tvmflash.compile({"kind": "llvm", "mcpu": mcpu}, head_dim=32, dtype="float32")
    decode = compiler.compile_decode({"kind": "llvm", "mcpu": mcpu}, AttentionSpec(32, "float32"))
    q = torch.randn(1, 10, 1, 32)
    out, lse = torch.empty_like(q), torch.zeros(1, 1, 10)
    grads = [torch.empty_like(q) for _ in range(3)]
    for name, call in (("forward", lambda: kernels.forward(q, q, q, out, lse)),
                       ("backward", lambda: kernels.backward(q, q, q, q, out, lse, *grads)),
                       ("decode", lambda: decode.decode(q, q, q, out, lse, 1.0, (0, 0), 1, None, None, None))):
        try:
            call()
        except RuntimeError as err:
            assert "instructions this CPU lacks" in str(err), err
            print(name, "refused")
"""


def _foreign_cpu() -> str | None:
    """A CPU model whose instructions this CPU lacks (as the target module tells)."""
    from tvmflash import target

    for mcpu in ("bdver4", "sapphirerapids", "znver5"):
        if target.missing_isa_features(target.isa_features(target.resolve({"kind": "llvm", "mcpu": mcpu}))):
            return mcpu
    return None


def test_kernels_for_another_cpu_refuse_to_run(tmp_path):
    """Before: kernels compiled in-process for another CPU model (bdver4's XOP/FMA4 on Intel or
    Zen, AVX-512 on an AVX2 machine) ran and died with SIGILL; only ``load()`` refused such a
    library. Now each call refuses with a clear error (and the process lives)."""
    mcpu = _foreign_cpu()
    if mcpu is None:
        pytest.skip("this CPU has every extension of the candidate models")
    run = _run_isolated(_FOREIGN_CPU_SCRIPT, tmp_path, mcpu)
    assert run.returncode == 0, f"exit {run.returncode} (-4: SIGILL)\n{run.stderr[-3000:]}"
    assert run.stdout.split("\n")[:3] == ["forward refused", "backward refused", "decode refused"], run.stdout


# --- 9. every tensor argument's device is checked ----------------------------------------------------
def _varlen_inputs(gen):
    q, k, v = (torch.randn(50, 2, 32, generator=gen) for _ in range(3))
    return q, k, v, torch.tensor([0, 20, 50], dtype=torch.int32)


def _call_with_meta(entry: str, gen):
    q, k, v, cu = _varlen_inputs(gen)
    meta = lambda t: t.to("meta")  # noqa: E731
    if entry == "varlen cu_seqlens_q":
        return tvmflash.flash_attn_varlen_func(q, k, v, meta(cu), cu, 30, 30)
    if entry == "varlen cu_seqlens_k":
        return tvmflash.flash_attn_varlen_func(q, k, v, cu, meta(cu), 30, 30)
    if entry == "varlen kvpacked cu_seqlens_k":
        return tvmflash.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, meta(cu), 30, 30)
    if entry == "func alibi_slopes":
        return tvmflash.flash_attn_func(q[None], k[None], v[None], alibi_slopes=meta(torch.ones(2)))
    if entry == "kvcache cache_seqlens":
        return tvmflash.flash_attn_with_kvcache(q[None, :1], k[None], v[None],
                                                cache_seqlens=meta(torch.tensor([40], dtype=torch.int32)))
    if entry == "kvcache block_table":
        pages = torch.randn(1, 64, 2, 32, generator=gen)
        return tvmflash.flash_attn_with_kvcache(q[None, :1], pages, pages.clone(),
                                                block_table=meta(torch.zeros(1, 1, dtype=torch.int32)))
    kernels = torch_op.kernels_for(q[None], softcap=True)
    out, lse = torch.empty_like(q[None]), torch.empty(1, 2, 50)
    if entry == "kernels mod_inputs":
        return kernels.forward(q[None], k[None], v[None], out, lse, mod_inputs=[meta(torch.tensor([30.0]))])
    assert entry == "kernels cu_seqlens_k"
    return kernels.forward(q[None], k[None], v[None], out, lse, cu_seqlens_q=cu, cu_seqlens_k=meta(cu),
                           mod_inputs=[torch.tensor([30.0])])


@pytest.mark.parametrize("entry", ["varlen cu_seqlens_q", "varlen cu_seqlens_k", "varlen kvpacked cu_seqlens_k",
                                   "func alibi_slopes", "kvcache cache_seqlens", "kvcache block_table",
                                   "kernels mod_inputs", "kernels cu_seqlens_k"])
def test_tensor_arguments_on_another_device_are_refused(gen, entry):
    """Before: flash_attn_varlen_func with cu_seqlens on the ``meta`` device returned uninitialised
    memory (torch sent the op to its shape-only implementation), and a meta mod input reached
    DLPack ("Cannot pack tensors on meta"). Now every entry point names the argument and devices."""
    with pytest.raises(ValueError, match=r"is on meta, q on cpu|is on meta: .* CPU tensors"):
        _call_with_meta(entry, gen)


# --- 11. one argument-checking path for every entry point ---------------------------------------------
@pytest.fixture(scope="module")
def single_rank_group():
    """A gloo process group of this process alone (ring attention's checks run on every rank)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


ALL_OPTIONS = {"causal", "deterministic", "return_attn_probs", "softmax_scale", "dropout_p", "window_size", "softcap"}


def _entry_points(group):
    """Each public function's call with options (q, k, v of 1 x 40 x 2 x 32), and the options it
    takes."""
    from tvmflash.distributed import ring_flash_attn_func, zigzag_ring_flash_attn_func

    q, k, v = (torch.randn(1, 40, 2, 32) for _ in range(3))
    cu = torch.tensor([0, 40], dtype=torch.int32)
    ring = ALL_OPTIONS - {"softcap"}
    return {
        "flash_attn_qkvpacked_func": (lambda **o: tvmflash.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **o),
                                      ALL_OPTIONS),
        "flash_attn_varlen_func": (lambda **o: tvmflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 40, 40, **o),
                                   ALL_OPTIONS),
        "flash_attn_with_kvcache": (lambda **o: tvmflash.flash_attn_with_kvcache(q, k.clone(), v.clone(), **o),
                                    {"causal", "softmax_scale", "window_size", "softcap"}),
        "ring_flash_attn_func": (lambda **o: ring_flash_attn_func(q, k, v, group=group, **o), ring),
        "zigzag_ring_flash_attn_func": (lambda **o: zigzag_ring_flash_attn_func(q, k, v, group=group, **o), ring),
    }, (lambda **o: tvmflash.flash_attn_func(q, k, v, **o))


BAD_OPTIONS = [{"causal": "False"}, {"causal": 1}, {"deterministic": "no"}, {"return_attn_probs": "yes"},
               {"softmax_scale": "0.5"}, {"softmax_scale": -1.0}, {"dropout_p": 0.1}, {"window_size": (3,)},
               {"window_size": (-2, 0)}, {"softcap": -1.0}, {"window_size": (True, False)}, {"softcap": "30"},
               {"softcap": torch.tensor([30.0])}]


@pytest.mark.parametrize("option", BAD_OPTIONS, ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items()))
def test_every_entry_point_refuses_bad_options_as_flash_attn_func_does(single_rank_group, option):
    """Before: ring attention accepted causal="False" (and computed causal: a non-empty string is
    truthy), deterministic="no" and softmax_scale="0.5", which flash_attn_func refuses. Now every
    entry point checks its options by the same function, with the same error."""
    calls, flash_attn_func = _entry_points(single_rank_group)
    with pytest.raises((TypeError, ValueError)) as expected:
        flash_attn_func(**option)
    for name, (call, takes) in calls.items():
        if not set(option) <= takes:
            continue
        with pytest.raises(type(expected.value)) as got:
            call(**option)
        assert str(got.value) == str(expected.value), name


# --- 14. numpy and torch scalars are numbers; bools are not window sizes ------------------------------
@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.array, torch.tensor], ids=lambda f: f.__name__)
def test_numpy_and_torch_scalars_are_accepted_as_numbers(gen, scalar):
    """Before: softcap=np.float32(30.) was refused ("softcap must be a finite number >= 0", which
    it is) and softmax_scale=torch.tensor(0.125) too. Now real 0-d scalars of numpy and torch
    give bitwise the results of the Python floats (flash_attn_func, flash_attn_with_kvcache);
    window_size=(True, False) is refused (BAD_OPTIONS above, at every entry point)."""
    q, k, v = (torch.randn(1, 45, 2, 32, generator=gen) for _ in range(3))
    expected = tvmflash.flash_attn_func(q, k, v, softcap=30.0, softmax_scale=0.125, causal=True)
    got = tvmflash.flash_attn_func(q, k, v, softcap=scalar(30.0), softmax_scale=scalar(0.125), causal=True)
    assert torch.equal(got, expected)
    expected = tvmflash.flash_attn_with_kvcache(q[:, :2], k, v, softcap=30.0, softmax_scale=0.125)
    got = tvmflash.flash_attn_with_kvcache(q[:, :2], k, v, softcap=scalar(30.0), softmax_scale=scalar(0.125))
    assert torch.equal(got, expected)


# --- 10. $TVMFLASH_PREBUILT: the cache's rules -------------------------------------------------------------
@pytest.fixture
def prebuilt_dir(tmp_path, monkeypatch, stored_kernels):
    """A private directory with one exported library (k.so), as $TVMFLASH_PREBUILT."""
    directory = tmp_path / "prebuilt"
    directory.mkdir(mode=0o700)
    stored_kernels.export_library(directory / "k.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(directory))
    compiler._prebuilt_cache.clear()
    yield directory
    compiler._prebuilt_cache.clear()


def _find():
    return compiler._find_prebuilt("flash", "llvm", AttentionSpec(32, "float32"))  # stored_kernels' spec


@pytest.mark.parametrize("damage", ["world-writable library", "foreign-owned library", "modified library",
                                    "library replaced by a directory"])
def test_unsafe_or_modified_prebuilt_libraries_are_skipped(prebuilt_dir, stored_kernels, damage):
    """Before: a library in $TVMFLASH_PREBUILT was loaded (its code run) whoever wrote it and
    whatever it held. Now one that another user could have written, or that does not match the
    checksum export_library recorded, is skipped with a warning naming it."""
    assert _find() is not None  # the intact library is used
    compiler._prebuilt_cache.clear()
    library = prebuilt_dir / "k.so"
    if damage == "world-writable library":
        os.chmod(library, 0o666)
    elif damage == "foreign-owned library":
        if os.getuid() != 0:
            pytest.skip("only root can give a file away")
        os.chown(library, 12345, 12345)
    elif damage == "modified library":  # a new file: this process has the intact one mapped
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        (prebuilt_dir / "new").write_bytes(bytes(data))
        os.replace(prebuilt_dir / "new", library)
    else:
        library.unlink()
        library.mkdir()
    with pytest.warns(TvmflashWarning, match="skipping prebuilt kernels .*k.so"):
        assert _find() is None


def test_world_writable_prebuilt_directory_is_refused(prebuilt_dir, stored_kernels):
    """Before: a world-writable $TVMFLASH_PREBUILT (anyone could plant a library) was used."""
    os.chmod(prebuilt_dir, 0o777)
    with pytest.raises(cache.UnsafeCacheError, match="TVMFLASH_PREBUILT.*writable by group and others"):
        _find()


def test_a_foreign_json_that_sorts_first_does_not_break_every_call(prebuilt_dir, stored_kernels):
    """Before: any *.so.json that is not tvmflash's metadata (another tool's, or without its
    library) raised at every call, even with good kernels next to it. Now it is skipped with one
    warning and the good library is used."""
    (prebuilt_dir / "aaa.so.json").write_text(json.dumps({"name": "another tool's file"}))
    (prebuilt_dir / "aaa.so").write_bytes(b"\x7fELF")
    (prebuilt_dir / "aab.so.json").write_text(json.dumps({"target": "llvm", "spec": [], "configs": {},
                                                          "sha256": "0" * 64}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _find()
    assert found is not None and found._library == prebuilt_dir / "k.so"
    skipped = sorted(str(w.message) for w in caught if "skipping prebuilt kernels" in str(w.message))
    assert len(skipped) == 2 and "aaa.so" in skipped[0] and "aab.so" in skipped[1], skipped


# --- 15. the cache key holds what changes the code, not the CPU affinity -----------------------------
def test_cache_key_does_not_depend_on_the_cpu_affinity(monkeypatch):
    """Before: the target's "num-cores" (the CPUs this process may use) was part of the cache key,
    so each affinity (taskset, a container's CPU quota) compiled and stored the kernels anew. It
    changes nothing in the code (TVM's LLVM codegen never reads it: same assembly below), so the
    key leaves it out."""
    from tvmflash import target

    spec = AttentionSpec(16, "float32")
    keys = set()
    for cpus in (1, 3, 64):
        monkeypatch.setattr(target, "usable_cpus", lambda: cpus)
        resolved = target.resolve("llvm")
        assert int(resolved.attrs["num-cores"]) == cpus  # still there for MetaSchedule (tuning)
        configs, record = compiler.choose_configs(resolved, spec, tuned=False)
        keys.add(compiler._key(compiler._request(resolved, spec, configs, False, record)))
    assert len(keys) == 1
    monkeypatch.undo()
    one, many = (tvmflash.compile({"kind": "llvm", "mcpu": target.host_cpu(), "num-cores": n}, head_dim=16,
                                  dtype="float32", cache=False, tuned=False) for n in (1, 7))
    assert one.assembly() == many.assembly()


# --- 5. a full TMPDIR (or cache directory) is an error or a warning, never the end of the process ----------
@pytest.fixture
def full_filesystem(tmp_path):
    """A 64 KB tmpfs: full for any kernel library (mounting needs root; skipped elsewhere)."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a small tmpfs here ({err})")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


_FULL_DISK_SCRIPT = """
    import json, os, sys, warnings
    from pathlib import Path
    import torch, tvmflash
    from tvmflash import cache
    from tvmflash.settings import TvmflashWarning

    full = Path(sys.argv[1])
    kernels = tvmflash.compile("llvm", head_dim=16, dtype="float32")  # TMPDIR is the full filesystem
    q = torch.randn(1, 33, 1, 16)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 33)
    kernels.forward(q, q, q, out, lse)
    assert torch.isfinite(out).all() and kernels._library is not None, "not stored in the cache"
    print("compiled and stored with a full TMPDIR")
    os.environ["TVMFLASH_CACHE_DIR"] = str(full / "cache")  # now the cache directory is full
    request = {k: v for k, v in kernels.meta.items() if k != "cache_key"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = tvmflash.compile("llvm", head_dim=16, dtype="float32", cache=False)
        assert cache.store("k", request, fresh._module, fresh._source) is None
    assert any("No space left" in str(w.message) for w in caught), [str(w.message) for w in caught]
    print("full cache directory: a warning")
    try:
        fresh.export_library(full / "k.so")
    except OSError as err:
        assert "No space left" in str(err), err
        print("full export directory: OSError")
"""


def test_full_tmpdir_or_cache_directory_does_not_end_the_process(tmp_path, full_filesystem):
    """Before: with a full TMPDIR, compiling killed the process ("LLVM ERROR: IO failure on output
    stream: No space left on device", exit 1, no exception) and left temporary directories in
    TMPDIR and the cache. Now the object files go next to their library, after a check that there
    is room: a full TMPDIR is not used, a full cache directory is a warning, a full export
    directory an OSError; no temporary file is left behind."""
    env = {"TMPDIR": str(full_filesystem), "TVMFLASH_CACHE_DIR": str(tmp_path / "cache")}
    run = _run_isolated(_FULL_DISK_SCRIPT, tmp_path, str(full_filesystem), env=env)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.splitlines() == ["compiled and stored with a full TMPDIR", "full cache directory: a warning",
                                       "full export directory: OSError"]
    assert sorted(p.name for p in full_filesystem.rglob("*")) == ["cache"]  # nothing left behind
    stored = tmp_path / "cache"
    assert {p.suffix for p in stored.iterdir() if p.name != "answers"} == {".so", ".json", ".src"}
    assert [p.suffix for p in (stored / "answers").iterdir()] == [".json"]  # (compile's answer)
