"""Autotuning: a tiny MetaSchedule run end to end, compile() using its verified records, remote
measurement through an RPC tracker, and no process left behind (also when interrupted)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("xgboost", reason="tuning needs the [tune] extra")
psutil = pytest.importorskip("psutil", reason="tuning needs the [tune] extra")

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

import tvmflash  # noqa: E402
from conftest import random_inputs, reference_attention  # noqa: E402
from tvmflash import plan, records, reference, tune  # noqa: E402
from tvmflash.config import BF16_DOT, FP32_FMA, CPUKernelConfig  # noqa: E402
from tvmflash.schedules import llvm as llvm_schedules  # noqa: E402
from tvmflash.spec import AttentionSpec  # noqa: E402
from tvmflash.target import key, resolve  # noqa: E402

SPEC = AttentionSpec(32, "float32")
SHAPE = dict(seqlen=256, batch=1, heads=2, heads_k=2)
# One tile shape, not the hand-written one (64 x 64): the tuned configs differ from the defaults.
BLOCKS = ((64, 128),)


def _popen_workers(process: psutil.Process) -> list:
    found = []
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if tune.POPEN_WORKER in " ".join(child.cmdline()):
                found.append(child)
    return found


def _group_members(pgid: int) -> list:
    members = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def _stop_group(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20) -> None:
    """Stop a process started with start_new_session=True and everything it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.time() + timeout
    while _group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _check_correct(kernels, gen):
    q, k, v = random_inputs(gen, 1, 100, 130, 2, 2, 32, "float32")
    dout = torch.randn(q.shape, generator=gen)
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 2, 100), float("nan"))
    kernels.forward(q, k, v, out, lse)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(qd, kd, vd, False)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 1e-5


def _fake_timing(speedups: dict):
    """A stand-in for reference.median_times: the tuned kernels ran ``speedups[kernel]`` x as fast."""

    def median_times(calls, rounds, **_):
        return {name: 1e-3 / (speedups[name.split("/")[1]] if name.startswith("tuned/") else 1.0) for name in calls}

    return median_times


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tiny tuning run of both kernels (shared by the tests below): its log dir and databases."""
    log_dir = tmp_path_factory.mktemp("tune_logs")
    start = time.perf_counter()
    directory = tune.tune("llvm", SPEC, trials=2, log_dir=log_dir, blocks=BLOCKS, seed=1, **SHAPE)
    print(f"tiny tuning: {time.perf_counter() - start:.0f} s")
    assert not _popen_workers(psutil.Process()), "tune() left MetaSchedule workers running"
    return log_dir, directory


def test_tiny_tuning_writes_verified_records_that_compile_uses(tuned, monkeypatch, gen):
    log_dir, directory = tuned
    assert directory == log_dir / key(resolve("llvm")) / "d32-float32"
    lines = (directory / "database_tuning_record.json").read_text().splitlines()
    assert len(lines) >= 4  # the hand-written seeds and searched candidates of both kernels
    run_secs = [json.loads(line)[1][1] for line in lines]
    assert all(secs and max(secs) < 1.0 for secs in run_secs), run_secs  # measured, not failed (1e10)

    # The same-run comparison writes the compact record compile() reads (beside the databases).
    written = tune.verify("llvm", SPEC, log_dir=log_dir, rounds=3, **SHAPE)
    assert set(written) == {"forward", "backward"}
    path = records.record_path(log_dir, key(resolve("llvm")), SPEC)
    data = json.loads(path.read_text())
    assert data["version"] == records.VERSION and set(data) == {"version", "forward", "backward"}
    for kernel, entry in written.items():
        assert data[kernel] == entry
        assert (entry["config"]["block_q"], entry["config"]["block_k"]) == BLOCKS[0]
        assert entry["tuned_at"] == {**SHAPE, "causal": False, "threads": tvmflash.settings.num_threads()}
        assert math.isfinite(entry["speedup"]) and entry["speedup"] > 0
        assert entry["verified"] == (entry["speedup"] >= records.MIN_VERIFIED_SPEEDUP)

    # Verified (here: the timing says 1.25x): compile() uses both records; tuned=False ignores them.
    monkeypatch.setattr(reference, "median_times", _fake_timing({"forward": 1.25, "backward": 1.25}))
    written = tune.verify("llvm", SPEC, log_dir=log_dir, **SHAPE)
    assert all(entry["verified"] and entry["speedup"] == 1.25 for entry in written.values())
    table = tune.report(written, SPEC, path)  # same-run and search times side by side, each named
    assert "not comparable" in table[0] and "(same run)" in table[1] and "(search)" in table[1]
    for kernel, entry in written.items():
        row = next(line for line in table if line.startswith(f"| {kernel} |"))
        assert f"| 1.25x | {entry['metaschedule_ms']:.2f} | yes |" in row
    flagged = tune.report(written, SPEC, path, same_as_hand_written={"forward"})
    assert "(same config: the difference is noise)" in next(line for line in flagged if line.startswith("| forward |"))
    monkeypatch.setenv("TVMFLASH_TUNE_LOGS", str(log_dir))
    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    assert kernels.tuning_record is not None and set(kernels.tuning_record) == {"forward", "backward"}
    assert all(str(path) in r for r in kernels.tuning_record.values())
    for kernel, entry in written.items():
        assert kernels.configs[kernel] == CPUKernelConfig.from_json(entry["config"])
    _check_correct(kernels, gen)

    untuned = tvmflash.compile("llvm", head_dim=32, dtype="float32", tuned=False)
    assert untuned.tuning_record is None
    assert untuned.configs == {k: llvm_schedules.default_config(resolve("llvm"), k) for k in ("forward", "backward")}


def test_a_record_the_verification_found_slower_is_not_used(tuned, monkeypatch):
    log_dir, _ = tuned
    monkeypatch.setattr(reference, "median_times", _fake_timing({"forward": 1.25, "backward": 0.8}))
    written = tune.verify("llvm", SPEC, log_dir=log_dir, **SHAPE)
    assert written["forward"]["verified"] and not written["backward"]["verified"]
    monkeypatch.setenv("TVMFLASH_TUNE_LOGS", str(log_dir))
    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32")
    assert str(log_dir) in kernels.tuning_record["forward"]
    assert str(log_dir) not in kernels.tuning_record.get("backward", "")
    assert kernels.configs["forward"] == CPUKernelConfig.from_json(written["forward"]["config"])
    assert kernels.configs["backward"] != CPUKernelConfig.from_json(written["backward"]["config"])


# bf16 dot products are scheduled for an explicit AVX512-BF16 target: checkable on any CPU
BF16_TARGET = {"kind": "llvm", "mcpu": "znver4"}


@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("products", [FP32_FMA, BF16_DOT])
def test_decoded_knobs_reproduce_the_measured_schedule(kernel, products):
    """A record's knob values, applied by the hand-written schedule, give the record's own program;
    sampling the space leaves the task's module as it was (MetaSchedule replays every candidate on it),
    and replaying the record's trace gives the same program (bf16 dot products: with the tensorize)."""
    from tvm.s_tir import meta_schedule as ms

    tune.stub_tensor_intrin()
    spec, target = (SPEC, "llvm") if products == FP32_FMA else (AttentionSpec(32, "bfloat16"), BF16_TARGET)
    name = f"{kernel}_q64_k64" + ("" if products == FP32_FMA else f"_{products}")
    workload = tune.workloads_for(target, spec, kernels_to_tune=(kernel,), **SHAPE)[name]
    assert workload.config.products == products
    mod = tvm.IRModule({"main": workload.prim_func()})
    before = tvm_ffi.structural_hash(mod)
    sch = tvm.s_tir.Schedule(mod, seed=7)
    tune.space_function(sch)
    assert tvm_ffi.structural_hash(mod) == before
    db = ms.database.MemoryDatabase()
    record = ms.database.TuningRecord(sch.trace, db.commit_workload(mod), [1e-3])
    config = tune.decode(record)
    assert (config.block_q, config.block_k, config.lanes, config.products) == (64, 64, workload.config.lanes,
                                                                               products)
    fixed = llvm_schedules.SCHEDULES[kernel](tvm.s_tir.Schedule(workload.prim_func()), config)
    tvm.ir.assert_structural_equal(fixed.mod["main"], sch.mod["main"])
    replayed = tvm.s_tir.Schedule(workload.prim_func())
    sch.trace.apply_to_schedule(replayed, remove_postproc=True)
    tvm.ir.assert_structural_equal(replayed.mod["main"], sch.mod["main"])


def test_a_database_of_bf16_records_loads_in_a_fresh_process(tmp_path):
    """A MetaSchedule database replays its records' traces as it loads, and a bf16 dot product's
    trace names our tensor intrinsics: a process that has scheduled nothing yet (the verify step
    of tune_shipped.sh, a resumed tuning run) registers them first, and finds the record."""
    from tvm.s_tir import meta_schedule as ms

    tune.stub_tensor_intrin()
    spec = AttentionSpec(32, "bfloat16")
    workload = tune.workloads_for(BF16_TARGET, spec, kernels_to_tune=("forward",), **SHAPE)["forward_q64_k64_bf16_dot"]
    mod = tvm.IRModule({"main": workload.prim_func()})
    sch = tvm.s_tir.Schedule(mod, seed=3)
    tune.space_function(sch)
    database = ms.database.JSONDatabase(work_dir=str(tmp_path))
    database.commit_tuning_record(ms.database.TuningRecord(sch.trace, database.commit_workload(mod), [1e-3],
                                                           tvm.target.Target(BF16_TARGET), None))
    config = tune.decode(ms.database.TuningRecord(sch.trace, database.commit_workload(mod), [1e-3]))
    script = (f"import json; from pathlib import Path; from tvmflash import tune\n"
              f"from tvmflash.spec import AttentionSpec\n"
              f"w = tune.workloads_for({BF16_TARGET!r}, AttentionSpec(32, 'bfloat16'), kernels_to_tune=('forward',), "
              f"**{SHAPE!r})['forward_q64_k64_bf16_dot']\n"
              f"found = tune.best_configs(Path({str(tmp_path)!r}), w)\n"
              f"print(json.dumps(found['forward'][0].to_json() if 'forward' in found else None))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == json.loads(json.dumps(config.to_json()))


def test_the_search_space_covers_how_the_products_run():
    """bf16 inputs on an AVX512-BF16 target: a task per tile shape with fp32 FMAs and with bf16
    dot products; without AVX512-BF16 (or for fp16) fp32 FMAs only."""
    bf16 = AttentionSpec(64, "bfloat16")
    found = tune.workloads_for(BF16_TARGET, bf16, blocks=((64, 64), (64, 128)), **SHAPE)
    assert {(w.kernel, w.config.block_k, w.config.products) for w in found.values()} == {
        (kernel, block_k, products) for kernel in ("forward", "backward") for block_k in (64, 128)
        for products in (FP32_FMA, BF16_DOT)}
    skylake = {"kind": "llvm", "mcpu": "skylake-avx512"}
    for target, spec in ((skylake, bf16), (BF16_TARGET, AttentionSpec(64, "float16"))):
        assert {w.config.products for w in tune.workloads_for(target, spec, **SHAPE).values()} == {FP32_FMA}
    # a task's function says what it is
    w = found["backward_q64_k128_bf16_dot"]
    assert tune.Workload.of(w.prim_func()) == w


def test_measurement_arguments_are_those_of_a_real_call():
    """The runner's arguments: the sequence tables plan.py makes for the workload (random int32
    tables would index out of bounds), N(0, 1) tensors, LSE near its value."""
    from tvm.s_tir import meta_schedule as ms

    shape = dict(seqlen=200, batch=2, heads=4, heads_k=2)  # ragged tiles, GQA
    for name, w in tune.workloads_for("llvm", SPEC, causal=True, blocks=tune.BLOCK_CANDIDATES, **shape).items():
        args_info = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(w.prim_func())]
        args = [a.numpy() for a in tune.realistic_arguments(tvm.cpu(), args_info, 1)[0]]
        seqs = plan.batched(2, 200, 200, block_q=w.config.block_q, block_k=w.config.block_k, heads_k=2)
        tables = [a for a in args if a.dtype == np.int32]
        expected = seqs.arrays()[:len(tables)]
        assert len(tables) == (4 if w.kernel == "backward" else 3), name
        for got, want in zip(tables, expected):
            assert np.array_equal(got, want), name
        lse = [a for a in args if a.ndim == 3]
        assert len(lse) == 1 and np.allclose(lse[0], math.log(200) + 0.5)
        q = args[1 if w.kernel == "backward" else 0]
        assert q.shape == (2, 200, 4, 32) and 0.9 < q.std() < 1.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_tracker_and_server(log_dir):
    """A TVM RPC tracker and one server on 127.0.0.1, as a remote box would run them; yields the
    tracker address and the process group ids.

    Each runs in a session of its own and is stopped as a whole process group (also when the
    test fails): the tracker and the server each serve from a ``tvm.exec.popen_worker`` child,
    which a SIGTERM to the parent alone left running.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        port = _free_port()
        with open(log_dir / "rpc_tracker.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                 "--port-end", str(port + 1)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or procs[0].poll() is not None:
                    raise RuntimeError("the RPC tracker did not start") from None
                time.sleep(0.5)
        server_port = _free_port()
        with open(log_dir / "rpc_server.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(server_port),
                 "--port-end", str(server_port + 1), "--tracker", f"127.0.0.1:{port}", "--custom-addr", "127.0.0.1",
                 "--key", "tvmflash-test", "--no-fork"], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
        tracker = tvm.rpc.connect_tracker("127.0.0.1", port)
        while "tvmflash-test" not in tracker.text_summary():  # the server registered
            if time.time() > deadline or procs[1].poll() is not None:
                raise RuntimeError("the RPC server did not register")
            time.sleep(0.5)
        tracker.close()
        yield f"127.0.0.1:{port}", [p.pid for p in procs]
    finally:
        for proc in reversed(procs):
            _stop_group(proc)


def test_tuning_through_an_rpc_tracker_leaves_no_process(tmp_path):
    with rpc_tracker_and_server(tmp_path) as (tracker, groups):
        directory = tune.tune("llvm", SPEC, trials=1, log_dir=tmp_path, kernels_to_tune=("forward",),
                              blocks=((64, 64),), rpc_tracker=tracker, rpc_key="tvmflash-test", seed=1, **SHAPE)
        # The case the process groups are for: the servers run in children of their own.
        assert any(_popen_workers(psutil.Process(pgid)) for pgid in groups)
    lines = (directory / "database_tuning_record.json").read_text().splitlines()
    assert lines, "no records written"
    run_secs = [json.loads(line)[1][1] for line in lines]
    assert any(secs and max(secs) < 1.0 for secs in run_secs), run_secs  # measured, not failed (1e10)
    assert not _popen_workers(psutil.Process()), "tune() left MetaSchedule workers running"
    for pgid in groups:
        assert not _group_members(pgid), f"processes of the RPC tracker/server left: {_group_members(pgid)}"


def test_interrupted_tuning_leaves_no_process(tmp_path):
    """Ctrl-C (SIGINT to the tuner alone, while its workers build and measure) ends every worker."""
    cmd = [sys.executable, "-m", "tvmflash.tune", "--head-dim", "32", "--seqlen", "256", "--batch", "1",
           "--heads", "2", "--trials", "16", "--blocks", "64x128", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    # Never hang the test run: past 5 minutes the whole group is killed (and the test fails).
    watchdog = threading.Timer(300, lambda: _stop_group(proc, signal.SIGKILL, timeout=10))
    watchdog.start()
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if line.startswith("measuring the hand-written"):
                break
        assert output and output[-1].startswith("measuring"), "".join(output)
        tuner = psutil.Process(proc.pid)
        deadline = time.time() + 120
        while len(_popen_workers(tuner)) < 2 and time.time() < deadline:  # the runner's and the builder's
            time.sleep(0.2)
        workers = _popen_workers(tuner)
        assert len(workers) >= 2, "".join(output)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, "".join(output) + rest
        assert "interrupted" in rest
        deadline = time.time() + 10
        while _group_members(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _group_members(proc.pid), f"left running: {_group_members(proc.pid)}"
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        watchdog.cancel()
        _stop_group(proc, signal.SIGKILL, timeout=10)
