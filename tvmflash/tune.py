"""Autotuning with TVM MetaSchedule over the hand-written schedules; tuned configs for compile().

    python -m tvmflash.tune --target llvm --head-dim 64 --dtype float32 [--causal] \\
        --seqlen 2048 --batch 1 --heads 8 --trials 64 [--log-dir DIR] \\
        [--rpc-tracker HOST:PORT --rpc-key KEY]

How it works:
* The search space is the hand-written schedule itself (``schedules/llvm.py``), run with
  ``SampledKnobs``: each register-tile choice becomes ``sch.sample_perfect_tile``. MetaSchedule
  (``tune_tir`` with a ``ScheduleFn`` space, XGBoost cost model, evolutionary search) samples,
  builds and measures candidates. Tile sizes shape the kernels' loop nests, so each candidate
  pair (block_q, block_k) is a separate task of the same tuning run.
* Kernels are symbolic in sizes; MetaSchedule measures concrete ones, so each task is the fused
  kernel specialized to the workload (``--batch --heads --seqlen``). Its function attributes
  (``tvmflash.*``) say what it is, so the database describes itself.
* Records accumulate in a MetaSchedule JSON database under
  ``<log-dir>/<target key>/d<head_dim>-<dtype>[-causal]/``; running again resumes. From the
  best record of each kernel the knob values are read back (the decisions of the trace's
  ``SamplePerfectTile`` instructions, in sampling order) into an ``LLVMConfig``, written to
  ``index.json`` beside the database. ``compile()`` applies these configs to the symbolic
  kernels: the shipped ``tune_logs`` and ``$TVMFLASH_TUNE_LOGS`` (default: the cache dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import tvm
from tvm import s_tir, tirx

from . import analysis, compiler, kernels
from . import target as targets
from .schedules import llvm as llvm_schedules

INDEX = "index.json"
# A tuned config replaces the hand-written one only if it measured at least this much faster:
# these machines' run-to-run noise is a few percent.
MIN_GAIN = 0.03
BLOCK_CANDIDATES = ((64, 64), (64, 128), (128, 64))
ATTR = "tvmflash."


def stub_tensor_intrin() -> None:
    """Skip importing tvm.s_tir.tensor_intrin (~45 s here, in every MetaSchedule worker).

    TuneContext and the builder import it to register tensorize intrinsics; the CPU schedules
    use none. Module-level so that worker processes can run it as their initializer.
    """
    import types

    import tvm.s_tir

    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
        sys.modules[name] = module
        tvm.s_tir.tensor_intrin = module


class SampledKnobs:
    """The knobs of schedules/llvm.py as MetaSchedule random variables (in sampling order).

    With ``decide_as`` (an LLVMConfig) every sample is fixed to that config's value: the
    hand-written schedule as a point of the search space, measured first.
    """

    def __init__(self, decide_as: llvm_schedules.LLVMConfig | None = None):
        self.names: list[str] = []
        self.fixed = llvm_schedules.FixedKnobs(decide_as) if decide_as else None

    def split(self, sch: s_tir.Schedule, loop, kernel: str, name: str, max_inner: int) -> list:
        self.names.append(name)
        decision = None
        if self.fixed is not None:
            inner = self.fixed.split(sch, loop, kernel, name, max_inner)[1]
            decision = [int(sch.get(loop).extent) // inner, inner]
        return list(sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_inner, decision=decision))


@dataclass(frozen=True)
class Workload:
    kernel: str  # "forward" or "backward"
    params: compiler.KernelParams
    blocks: tuple
    batch: int
    heads: int
    heads_k: int
    seqlen: int

    def name(self) -> str:
        return f"{self.kernel}_q{self.blocks[0]}_k{self.blocks[1]}"

    def flops(self) -> float:
        return analysis.model_flops(self.kernel, self.batch, self.heads, self.seqlen, self.seqlen,
                                    self.params.head_dim, self.params.causal)

    def n_split(self) -> int:
        return compiler.backward_splits(self.batch, self.heads_k, self.seqlen, self.blocks[1])

    def prim_func(self) -> tirx.PrimFunc:
        """The fused kernel specialized to this workload, labelled with tvmflash.* attributes."""
        spec = kernels.KernelSpec(self.params.head_dim, self.params.dtype, self.params.causal, *self.blocks)
        func = analysis.specialize(
            kernels.fused_kernel(self.kernel, spec), batch=self.batch, heads=self.heads, heads_k=self.heads_k, seqlen_q=self.seqlen,
            seqlen_k=self.seqlen, n_split=self.n_split(), softmax_scale=1.0 / math.sqrt(self.params.head_dim))
        attrs = {
            "kernel": self.kernel, "head_dim": self.params.head_dim, "dtype": self.params.dtype,
            "causal": int(self.params.causal), "block_q": self.blocks[0], "block_k": self.blocks[1],
            "batch": self.batch, "heads": self.heads, "heads_k": self.heads_k, "seqlen": self.seqlen,
        }
        func = func.with_attr("global_symbol", self.name())
        for key, value in attrs.items():
            func = func.with_attr(ATTR + key, value)
        return func


def _attr(func: tirx.PrimFunc, key: str):
    value = func.attrs[ATTR + key]
    return str(value) if key in ("kernel", "dtype") else int(value)


def space_function(base: llvm_schedules.LLVMConfig):
    """The design space: the hand-written schedule with sampled knobs."""

    def space(sch: s_tir.Schedule) -> None:
        kernel = _attr(sch.mod["main"], "kernel")
        llvm_schedules.SCHEDULES[kernel](sch, base, SampledKnobs())

    return space


def knob_names(kernel: str, base: llvm_schedules.LLVMConfig, params: compiler.KernelParams) -> list[str]:
    """The knob names of a kernel's space, in the order the schedule samples them."""
    knobs = SampledKnobs()
    func = Workload(kernel, params, (64, 64), 1, 1, 1, 64).prim_func()
    llvm_schedules.SCHEDULES[kernel](s_tir.Schedule(func), base, knobs)
    return knobs.names


def decode(record, base: llvm_schedules.LLVMConfig) -> llvm_schedules.LLVMConfig:
    """The LLVMConfig a tuning record stands for: its blocks and its sampled register tiles."""
    func = record.workload.mod["main"]
    kernel = _attr(func, "kernel")
    params = compiler.KernelParams(_attr(func, "head_dim"), _attr(func, "dtype"), bool(_attr(func, "causal")))
    trace = record.trace
    samples = [inst for inst in trace.insts if inst.kind.name == "SamplePerfectTile"]
    names = knob_names(kernel, base, params)
    if len(samples) != len(names):
        raise ValueError(f"record has {len(samples)} tile decisions, the {kernel} space {len(names)}")
    values = {name: int(trace.decisions[inst][1]) for name, inst in zip(names, samples)}
    tiles = {block: llvm_schedules.RegisterTile(values[f"{block}.rows"], values[f"{block}.vectors"])
             for block in llvm_schedules.PRODUCTS[kernel]}
    config = base.with_tiles(kernel, **tiles)
    return replace(config, **{f"{kernel}_blocks": (_attr(func, "block_q"), _attr(func, "block_k"))})


# ---------------------------------------------------------------------------------------------
# Record lookup for compile()


def variant_dir(root: Path, target: tvm.target.Target, params: compiler.KernelParams) -> Path:
    mask = "-causal" if params.causal else ""
    return Path(root) / targets.key(target) / f"d{params.head_dim}-{params.dtype}{mask}"


def shipped_logs() -> Path:
    from . import tune_logs

    return Path(tune_logs.__file__).parent


def user_logs() -> Path:
    return Path(os.environ.get("TVMFLASH_TUNE_LOGS", compiler.cache_dir() / "tune_logs"))


def build_index(directory: Path, base: llvm_schedules.LLVMConfig) -> list[dict]:
    """One entry per workload of a tuning database: its best record, decoded to a config, and the
    time of the hand-written schedule of that workload (measured first by ``tune``)."""
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.JSONDatabase(work_dir=str(directory), allow_missing=False)
    best: dict[str, dict] = {}
    for record in db.get_all_tuning_records():
        if not record.run_secs:
            continue
        seconds = sum(float(s) for s in record.run_secs) / len(record.run_secs)
        if not math.isfinite(seconds) or seconds >= 1e9:  # failed runs are recorded as 1e10
            continue
        func = record.workload.mod["main"]
        kernel = _attr(func, "kernel")
        key = str(func.attrs["global_symbol"]) + f"@{_attr(func, 'seqlen')}"
        config = decode(record, base)
        entry = best.setdefault(key, {
            "kernel": kernel, "seqlen": _attr(func, "seqlen"), "batch": _attr(func, "batch"),
            "heads": _attr(func, "heads"), "blocks": [_attr(func, "block_q"), _attr(func, "block_k")],
            "seconds": math.inf, "hand_written_seconds": None, "config": None,
        })
        if getattr(config, f"{kernel}_tiles") == getattr(base, f"{kernel}_tiles"):
            entry["hand_written_seconds"] = min(seconds, entry["hand_written_seconds"] or math.inf)
        if seconds < entry["seconds"]:
            entry["seconds"], entry["config"] = seconds, config.to_json()
    return sorted(best.values(), key=lambda e: (e["kernel"], e["seqlen"], e["seconds"]))


def load_index(directory: Path, base: llvm_schedules.LLVMConfig) -> list[dict]:
    index = directory / INDEX
    db_files = [directory / "database_tuning_record.json", directory / "database_workload.json"]
    if not all(p.exists() for p in db_files):
        return json.loads(index.read_text()) if index.exists() else []
    if index.exists() and index.stat().st_mtime >= max(p.stat().st_mtime for p in db_files):
        return json.loads(index.read_text())
    entries = build_index(directory, base)
    try:
        index.write_text(json.dumps(entries, indent=1))
    except OSError:
        pass
    return entries


def tuned_config(target: tvm.target.Target, params: compiler.KernelParams,
                 base: llvm_schedules.LLVMConfig, seqlen: int = 2048, verified_only: bool = True):
    """Best tuned config for these kernels (user logs first, then shipped), or None.

    Per kernel: records of the nearest tuned sequence length (log scale), fastest first; with
    ``verified_only``, a record that the same-run comparison found no faster than the
    hand-written schedule is skipped. Returns (config, description of the records used).
    """
    entries = []
    for root in (user_logs(), shipped_logs()):
        directory = variant_dir(root, target, params)
        if directory.is_dir():
            entries += [(e, directory) for e in load_index(directory, base)]
    if not entries:
        return None
    config, used = base, {}
    for kernel in llvm_schedules.PRODUCTS:
        candidates = [(e, d) for e, d in entries if e["kernel"] == kernel]
        if not candidates:
            continue
        nearest = min(abs(math.log(e["seqlen"] / seqlen)) for e, _ in candidates)
        candidates = [(e, d) for e, d in candidates if abs(math.log(e["seqlen"] / seqlen)) == nearest]
        entry, directory = min(candidates, key=lambda ed: ed[0]["seconds"])
        hand_written = [e["hand_written_seconds"] for e, _ in candidates
                        if tuple(e["blocks"]) == base.blocks(kernel) and e.get("hand_written_seconds")]
        if hand_written and entry["seconds"] > (1 - MIN_GAIN) * min(hand_written):
            continue  # not faster than the hand-written schedule beyond noise: keep it
        tuned = llvm_schedules.LLVMConfig.from_json(entry["config"])
        if verified_only and not _confirmed(directory, kernel, tuned):
            continue  # slower or no faster in the same-run check: keep the hand-written one
        config = replace(config, **{f"{kernel}_blocks": tuned.blocks(kernel),
                                    f"{kernel}_tiles": getattr(tuned, f"{kernel}_tiles")})
        used[kernel] = (f"{directory}: {kernel} blocks {entry['blocks'][0]}x{entry['blocks'][1]}, tuned at "
                        f"B{entry['batch']} H{entry['heads']} N{entry['seqlen']}: {entry['seconds'] * 1e3:.2f} ms"
                        + (f" (hand-written: {min(hand_written) * 1e3:.2f} ms)" if hand_written else ""))
    return (config, used) if used else None


# ---------------------------------------------------------------------------------------------
# Tuning


def realistic_arguments(device, args_info, alloc_repeat: int) -> list:
    """Measurement inputs that look like attention: N(0, 1) tensors, LSE = log(seqlen) + 0.5.

    MetaSchedule's default fill (uniform in [0, 10)) makes scores ~100x too large, so P
    overflows in the backward and the timings measure inf/NaN arithmetic instead of attention.
    LSE is the only 3-D argument of both kernels.
    """
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    numpy_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for _kind, dtype, shape in args_info:
            if len(shape) == 3:
                data = np.full(shape, np.log(shape[-1]) + 0.5, dtype=np.float32)
            else:
                data = rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtypes[str(dtype)])
            args.append(tvm.runtime.tensor(data, device))
        repeated.append(args)
    return repeated


def realistic_arguments_rpc(session, device, args_info, alloc_repeat: int) -> list:
    return realistic_arguments(device, args_info, alloc_repeat)


def _synchronous(runner):
    """Wrap a MetaSchedule runner so that each batch is measured before anything else runs.

    MetaSchedule's runners return futures and the task scheduler builds the next batch while
    the last one is measured: on a 2-core machine the LLVM builds then halve the measured speed
    (and reorder candidates at random). Measuring to completion first keeps the cores quiet.
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    @derived_object
    class Done(ms.runner.PyRunnerFuture):
        def __init__(self, result):
            super().__init__()
            self._result = result

        def done(self):
            return True

        def result(self):
            return self._result

    @derived_object
    class Synchronous(ms.runner.PyRunner):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def run(self, runner_inputs):
            return [Done(future.result()) for future in self.inner.run(runner_inputs)]

    return Synchronous(runner)


def _measure_defaults(workloads: dict[str, Workload], base, target, builder, runner, database) -> None:
    """Measure the hand-written schedule of each workload and store it as a tuning record.

    The evolutionary search starts from the best records in the database, so it refines the
    hand-written choices, and the result can only match or beat them (as measured).
    """
    from tvm.s_tir import meta_schedule as ms

    for name, workload in workloads.items():
        mod = tvm.IRModule({"main": workload.prim_func()})
        sch = tvm.s_tir.Schedule(mod)
        llvm_schedules.SCHEDULES[workload.kernel](sch, base, SampledKnobs(decide_as=base))
        built = builder.build([ms.builder.BuilderInput(sch.mod, target)])[0]
        if built.error_msg:
            raise RuntimeError(f"building the hand-written {name} failed: {built.error_msg}")
        args = ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])
        result = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", args)])[0].result()
        if result.error_msg:
            raise RuntimeError(f"measuring the hand-written {name} failed: {result.error_msg}")
        record = ms.database.TuningRecord(sch.trace, database.commit_workload(mod), result.run_secs, target, args)
        database.commit_tuning_record(record)
        secs = sum(float(t) for t in result.run_secs) / len(result.run_secs)
        print(f"  hand-written {name}: {secs * 1e3:.2f} ms ({workload.flops() / secs / 1e9:.0f} GFLOP/s)", flush=True)


def _progress_callback(workloads: dict[str, Workload], total: int):
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def __init__(self):
            self.done = 0
            self.best: dict[str, float] = {}
            self.start = time.perf_counter()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            task = task_scheduler.tasks_[task_id].ctx.task_name
            for result in runner_results:
                self.done += 1
                if result.error_msg is None and result.run_secs:
                    secs = sum(float(s) for s in result.run_secs) / len(result.run_secs)
                    self.best[task] = min(self.best.get(task, math.inf), secs)
            best = self.best.get(task, math.inf)
            gflops = workloads[task].flops() / best / 1e9 if math.isfinite(best) else 0.0
            elapsed = time.perf_counter() - self.start
            print(f"  [{self.done}/{total} trials, {elapsed:.0f} s] {task}: best {best * 1e3:.2f} ms "
                  f"({gflops:.0f} GFLOP/s)", flush=True)

    return Progress()


def tune(target, params: compiler.KernelParams, *, seqlen: int, batch: int, heads: int, heads_k: int,
         trials: int, log_dir: Path, kernels_to_tune=("forward", "backward"), blocks=BLOCK_CANDIDATES,
         rpc_tracker: str | None = None, rpc_key: str | None = None, seed: int | None = None,
         verbose: bool = False) -> Path:
    """Run MetaSchedule over the schedule spaces; returns the database directory."""
    import logging

    from tvm.s_tir import meta_schedule as ms

    stub_tensor_intrin()
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    # MetaSchedule attaches its handlers on every run and fails on the unnamed ones of the last run.
    for handler in list(ms_logger.handlers):
        ms_logger.removeHandler(handler)
    # Our progress lines instead of MetaSchedule's task tables and XGBoost logs.
    ms_logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    target = targets.resolve(target)
    base = llvm_schedules.default_config(target, params.head_dim, params.dtype, params.causal)
    workloads = {w.name(): w for w in (Workload(k, params, b, batch, heads, heads_k, seqlen)
                                      for k in kernels_to_tune for b in blocks)}
    mod = tvm.IRModule({name: w.prim_func() for name, w in workloads.items()})
    directory = variant_dir(log_dir, target, params)
    directory.mkdir(parents=True, exist_ok=True)
    builder = ms.builder.LocalBuilder(timeout_sec=600, initializer=stub_tensor_intrin)
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=3, min_repeat_ms=100, enable_cpu_cache_flush=False)
    if rpc_tracker:
        host, port = rpc_tracker.rsplit(":", 1)
        rpc = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=rpc_key,
                                  session_timeout_sec=600)
        runner = ms.runner.RPCRunner(rpc, evaluator_config=evaluator, initializer=stub_tensor_intrin,
                                     f_alloc_argument=realistic_arguments_rpc)
    else:
        runner = ms.runner.LocalRunner(timeout_sec=600, evaluator_config=evaluator, initializer=stub_tensor_intrin,
                                       f_alloc_argument=realistic_arguments)
    runner = _synchronous(runner)
    space = ms.space_generator.ScheduleFn(
        space_function(base), sch_rules=[], postprocs=[],
        mutator_probs={ms.mutator.MutateTileSize(): 1.0})
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), _progress_callback(workloads, trials)]
    # Round robin, one batch per task per round: every tile shape gets trials even on small budgets.
    per_round = max(1, min(16, trials // len(workloads)))
    database = ms.database.JSONDatabase(work_dir=str(directory))
    _measure_defaults(workloads, base, target, builder, runner, database)
    # The spaces are small (a few hundred tile shapes per kernel): a small population keeps the
    # evolutionary search's own time per round low.
    strategy = ms.search_strategy.EvolutionarySearch(population_size=96, init_min_unmeasured=16)
    ms.tir_integration.tune_tir(
        mod, target, work_dir=str(directory), max_trials_global=trials, num_trials_per_iter=per_round,
        builder=builder, runner=runner, database=database, space=space, strategy=strategy,
        measure_callbacks=callbacks, task_scheduler="round-robin", num_tuning_cores=targets.usable_cpus(),
        seed=seed)
    (directory / INDEX).unlink(missing_ok=True)
    load_index(directory, base)
    return directory


VERIFIED = "verified.json"
# ... and, in the same-run check, at least this much: the hand-written config measured against
# itself there came out up to 1.06x on this machine (BENCHMARKS.md), so smaller gains are noise.
VERIFIED_MIN_GAIN = 0.10


def compare_default_and_tuned(target, params, *, seqlen, batch, heads, heads_k, rounds=7,
                              record_in: Path | None = None) -> list[str]:
    """Same-process, interleaved timing of the default and the tuned kernels on the workload.

    MetaSchedule measures each candidate once, in its own process, and on a noisy machine a
    lucky measurement can win. This comparison is the arbiter: with ``record_in`` (a variant
    directory) the speedups are written to ``verified.json`` there, and ``tuned_config`` only
    uses a kernel's record where it was confirmed faster.
    """
    import torch

    from .bench import median_times

    target = targets.resolve(target)
    base = llvm_schedules.default_config(target, params.head_dim, params.dtype, params.causal)
    found = tuned_config(target, params, base, seqlen, verified_only=False)
    if found is None:
        return ["no tuned records found"]
    dtype = getattr(torch, params.dtype)
    q = torch.randn(batch, seqlen, heads, params.head_dim).to(dtype)
    k, v = (torch.randn(batch, seqlen, heads_k, params.head_dim).to(dtype) for _ in range(2))
    dout, out = torch.randn_like(q), torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    calls = {}
    for label, config in (("default", base), ("tuned", found[0])):
        kern = compiler.compile(target, params.head_dim, params.dtype, params.causal, config=config, tuned=False)
        calls[f"{label}/forward"] = lambda kern=kern: kern.forward(q, k, v, out, lse)
        calls[f"{label}/backward"] = lambda kern=kern: kern.backward(dout, q, k, v, out, lse, *grads)
    times = median_times(calls, rounds)
    lines = ["| kernel | default ms (GFLOP/s) | tuned ms (GFLOP/s) | speedup |", "|---|---|---|---|"]
    speedups = {}
    for kernel in ("forward", "backward"):
        flops = Workload(kernel, params, (64, 64), batch, heads, heads_k, seqlen).flops()
        d, t = times[f"default/{kernel}"], times[f"tuned/{kernel}"]
        speedups[kernel] = {"speedup": d / t, "seqlen": seqlen, "batch": batch, "heads": heads,
                            "config": _kernel_knobs(found[0], kernel)}
        lines.append(f"| {kernel} | {d * 1e3:.2f} ({flops / d / 1e9:.0f}) | "
                     f"{t * 1e3:.2f} ({flops / t / 1e9:.0f}) | {d / t:.2f}x |")
    if record_in is not None:
        (record_in / VERIFIED).write_text(json.dumps(speedups, indent=1))
        lines.append(f"(written to {record_in / VERIFIED}: compile() uses a tuned kernel only if >= "
                     f"{1 + VERIFIED_MIN_GAIN:.2f}x here)")
    return lines


def _confirmed(directory: Path, kernel: str, config: llvm_schedules.LLVMConfig) -> bool:
    """Whether the same-run comparison of ``compare_default_and_tuned`` confirmed this config."""
    path = directory / VERIFIED
    if not path.exists():
        return True  # never verified (e.g. a user's fresh records): trust MetaSchedule
    entry = json.loads(path.read_text()).get(kernel)
    if entry is None:
        return True
    same = _kernel_knobs(config, kernel) == entry["config"]
    return not same or entry["speedup"] >= 1 + VERIFIED_MIN_GAIN


def _kernel_knobs(config: llvm_schedules.LLVMConfig, kernel: str) -> dict:
    """One kernel's tile sizes and register tiles, as plain JSON values."""
    knobs = config.to_json()
    return json.loads(json.dumps({f"{kernel}_{k}": knobs[f"{kernel}_{k}"] for k in ("blocks", "tiles")}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmflash.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-k", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--trials", type=int, default=64, help="measured candidates, all kernels together")
    parser.add_argument("--kernels", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    parser.add_argument("--blocks", nargs="+", default=[f"{q}x{k}" for q, k in BLOCK_CANDIDATES],
                        help="tile sizes to try, QxK (query rows x key rows)")
    parser.add_argument("--log-dir", type=Path, default=None, help="default: $TVMFLASH_TUNE_LOGS or the cache dir")
    parser.add_argument("--rpc-tracker", default=None, help="HOST:PORT of a TVM RPC tracker")
    parser.add_argument("--rpc-key", default=None, help="device key registered at the tracker")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="MetaSchedule's own logs too")
    parser.add_argument("--verify-only", action="store_true",
                        help="no tuning: only the same-run default-vs-tuned comparison (writes verified.json)")
    args = parser.parse_args(argv)
    if args.target == "cuda":
        parser.error("tuning the CUDA kernels is not supported yet")
    if bool(args.rpc_tracker) != bool(args.rpc_key):
        parser.error("--rpc-tracker and --rpc-key go together")
    params = compiler.KernelParams(args.head_dim, args.dtype, args.causal)
    heads_k = args.heads_k or args.heads
    log_dir = args.log_dir or user_logs()
    shape = dict(seqlen=args.seqlen, batch=args.batch, heads=args.heads, heads_k=heads_k)
    print(f"tuning {', '.join(args.kernels)} for {targets.key(targets.resolve(args.target))}, "
          f"head_dim={args.head_dim} {args.dtype}{' causal' if args.causal else ''}, "
          f"B{args.batch} N{args.seqlen} H{args.heads}/{heads_k}: {args.trials} trials, log dir {log_dir}", flush=True)
    blocks = tuple(tuple(int(x) for x in b.split("x")) for b in args.blocks)
    if args.verify_only:
        directory = variant_dir(log_dir, targets.resolve(args.target), params)
    else:
        directory = tune(args.target, params, trials=args.trials, log_dir=log_dir, kernels_to_tune=args.kernels,
                         blocks=blocks, rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key, seed=args.seed,
                         verbose=args.verbose, **shape)
    print(f"records: {directory}")
    for entry in load_index(directory, llvm_schedules.default_config(
            targets.resolve(args.target), args.head_dim, args.dtype, args.causal)):
        if entry["seqlen"] == args.seqlen:
            tiles = entry["config"][f"{entry['kernel']}_tiles"]
            hand = entry["hand_written_seconds"]
            print(f"  best {entry['kernel']} with blocks {entry['blocks']}: {entry['seconds'] * 1e3:.2f} ms "
                  f"(hand-written {hand * 1e3 if hand else float('nan'):.2f} ms), register tiles "
                  f"(rows, vectors) {tiles}")
    if log_dir.resolve() not in (user_logs().resolve(), shipped_logs().resolve()):
        os.environ["TVMFLASH_TUNE_LOGS"] = str(log_dir)  # so that the comparison finds them
    print("\n".join(compare_default_and_tuned(args.target, params, record_in=directory, **shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
