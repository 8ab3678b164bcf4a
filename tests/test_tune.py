"""Autotuning: a tiny MetaSchedule run end to end, compile() using its records, remote measurement."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("xgboost", reason="tuning needs the [tune] extra")

import tvmflash  # noqa: E402
from conftest import random_inputs, reference_attention  # noqa: E402
from tvmflash import compiler, tune  # noqa: E402
from tvmflash.schedules import llvm as llvm_schedules  # noqa: E402
from tvmflash.target import resolve  # noqa: E402

PARAMS = compiler.KernelParams(32, "float32", False)
SHAPE = dict(seqlen=256, batch=1, heads=2, heads_k=2)


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


def test_tiny_tuning_is_used_by_compile(tmp_path, monkeypatch, gen):
    monkeypatch.setenv("TVMFLASH_TUNE_LOGS", str(tmp_path))
    start = time.perf_counter()
    directory = tune.tune("llvm", PARAMS, trials=6, log_dir=tmp_path, blocks=((64, 128),), seed=1, **SHAPE)
    assert (directory / "database_tuning_record.json").exists()
    records = [json.loads(line) for line in (directory / "database_tuning_record.json").read_text().splitlines()]
    assert len(records) >= 4  # forward and backward candidates, measured
    index = json.loads((directory / tune.INDEX).read_text())
    assert {e["kernel"] for e in index} == {"forward", "backward"}
    assert all(e["blocks"] == [64, 128] and 0 < e["seconds"] < 1 for e in index)

    kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32", causal=False)
    assert kernels.tuning_record is not None and set(kernels.tuning_record) == {"forward", "backward"}
    assert str(tmp_path) in kernels.tuning_record["forward"]
    best = {e["kernel"]: llvm_schedules.LLVMConfig.from_json(e["config"]) for e in index}
    assert kernels.config.forward_tiles == best["forward"].forward_tiles
    assert kernels.config.backward_tiles == best["backward"].backward_tiles
    assert kernels.config.forward_blocks == (64, 128)
    _check_correct(kernels, gen)

    # The same-run default-vs-tuned check overrules MetaSchedule: a record it found slower is unused.
    verified = {"forward": {"speedup": 0.8, "config": tune._kernel_knobs(best["forward"], "forward")}}
    (directory / tune.VERIFIED).write_text(json.dumps(verified))
    base = llvm_schedules.default_config(resolve("llvm"), 32, "float32", False)
    config, used = tune.tuned_config(resolve("llvm"), PARAMS, base, SHAPE["seqlen"])
    assert set(used) == {"backward"} and config.forward_tiles == base.forward_tiles
    assert config.backward_tiles == best["backward"].backward_tiles

    untuned = tvmflash.compile("llvm", head_dim=32, dtype="float32", causal=False, tuned=False)
    assert untuned.tuning_record is None
    assert untuned.config == llvm_schedules.default_config(resolve("llvm"), 32, "float32", False)
    print(f"tiny tuning + compile: {time.perf_counter() - start:.0f} s")


def test_decoded_knobs_reproduce_the_measured_schedule():
    """A record's knob values, applied by the hand-written schedule, give the record's own program."""
    from tvm.s_tir import meta_schedule as ms

    import tvm

    tune.stub_tensor_intrin()
    base = llvm_schedules.default_config(resolve("llvm"), 32, "float32", False)
    workload = tune.Workload("forward", PARAMS, (64, 64), **SHAPE)
    func = workload.prim_func()
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}), seed=7)
    tune.space_function(base)(sch)
    db = ms.database.MemoryDatabase()
    record = ms.database.TuningRecord(sch.trace, db.commit_workload(tvm.IRModule({"main": func})), [1e-3])
    config = tune.decode(record, base)
    fixed = llvm_schedules.schedule_forward(tvm.s_tir.Schedule(workload.prim_func()), config)
    tvm.ir.assert_structural_equal(fixed.mod["main"], sch.mod["main"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_tracker_and_server():
    """A TVM RPC tracker and one server, both on 127.0.0.1, as a remote GPU box would run them."""
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                "--port", str(port), "--port-end", str(port + 1)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        server_port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1",
                                   "--port", str(server_port), "--port-end", str(server_port + 1),
                                   "--tracker", f"127.0.0.1:{port}", "--custom-addr", "127.0.0.1",
                                   "--key", "tvmflash-test", "--no-fork"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(3)  # server registration
        yield f"127.0.0.1:{port}"
    finally:
        for proc in (server, tracker):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def test_tuning_through_an_rpc_tracker(tmp_path, rpc_tracker_and_server):
    directory = tune.tune("llvm", PARAMS, trials=2, log_dir=tmp_path, kernels_to_tune=("forward",),
                          blocks=((64, 64),), rpc_tracker=rpc_tracker_and_server, rpc_key="tvmflash-test",
                          seed=1, **SHAPE)
    lines = (directory / "database_tuning_record.json").read_text().splitlines()
    assert lines, "no records written"
    run_secs = [json.loads(line)[1][1] for line in lines]
    assert any(secs and max(secs) < 1.0 for secs in run_secs), run_secs  # measured, not failed (1e10)
