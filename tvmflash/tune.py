"""Autotuning with TVM MetaSchedule over the hand-written CPU schedules; records for compile().

    python -m tvmflash.tune --target llvm --head-dim 64 --dtype float32 [--causal] \\
        --seqlen 2048 --batch 1 --heads 8 [--heads-k 2] --trials 64 [--log-dir DIR] \\
        [--records-dir DIR] [--rpc-tracker HOST:PORT --rpc-key KEY] [--verify-only]

How it works:
* The search space is the hand-written schedule itself (``schedules/llvm.py``), run with
  ``SampledKnobs``: each register-tile choice (``<product>.rows``, ``<product>.vectors``)
  becomes ``sch.sample_perfect_tile``. MetaSchedule (``tune_tir`` with a ``ScheduleFn`` space,
  XGBoost cost model, evolutionary search) samples, builds and measures candidates. Tile sizes
  (``block_q`` x ``block_k``) and how the products run (``products``: fp32 FMAs, or bf16 dot
  products for bf16 inputs where the target has AVX512-BF16) shape the kernels' loop nests, so
  each candidate (tile sizes, products) is a separate task of the same run; tasks take turns
  (round robin) and each batch is measured to completion before the next is built (two cores:
  builds would slow the measurements down).
* The kernels are symbolic in sizes and read their sequence layout from int32 tables
  (``plan.py``); MetaSchedule measures concrete ones, so each task is the kernel specialized
  (``analysis.specialize``) to the workload ``--batch --heads --heads-k --seqlen``, the mask
  (causal or none: right window 0 or unlimited), the softmax scale and the thread count. Its
  function attributes (``tvmflash.*``) say what it is, so the database describes itself. The
  runner fills the buffers like a real call (``realistic_arguments``): N(0, 1) tensors, LSE near
  its real value, and the real sequence tables, since random tables would index out of bounds.
* The hand-written config of every task is measured first, as a seed and a baseline. Records
  accumulate in MetaSchedule JSON databases, the tuner's working files, in
  ``<log-dir>/<target key>/<variant>/`` (``variant`` = ``d<head_dim>-<dtype>``); running again
  resumes.
* Then the arbiter: the best record of each kernel for this workload, decoded back to a
  ``CPUKernelConfig`` (block sizes and the trace's ``SamplePerfectTile`` decisions), is timed
  against the hand-written config in the same process, interleaved (``reference.median_times``),
  and the result is written as the compact record ``compile()`` reads (``records.py``):
  ``<records-dir>/<target key>/<variant>.json`` with ``speedup`` and ``verified`` (speedup >=
  ``records.MIN_VERIFIED_SPEEDUP`` and a config other than the hand-written one).
  ``--records-dir`` defaults to ``--log-dir``, whose default is ``$TVMFLASH_TUNE_LOGS`` (or
  ``<cache dir>/tune_logs``), where ``compile()`` looks first.

Every worker process MetaSchedule starts (builder and runner pools) is ended when tuning ends,
fails or is interrupted (Ctrl-C): see ``reaped_workers``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import tvm
from tvm import s_tir, tirx

from . import analysis, plan, product_rates, records, settings
from .kernels import cpu as cpu_kernels
from . import target as targets
from .config import BF16_DOT, FP32_FMA, KERNELS, PRODUCTS, CPUKernelConfig, RegisterTile, default_cpu_config
from .schedules import llvm as llvm_schedules
from .schedules import llvm_bf16
from .spec import UNLIMITED_WINDOW, AttentionSpec

BLOCK_CANDIDATES = ((64, 64), (64, 128), (128, 64))
ATTR = "tvmflash."
POPEN_WORKER = "tvm.exec.popen_worker"


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

    With ``decide_as`` (a CPUKernelConfig) every sample is fixed to that config's value: the
    hand-written schedule as a point of the search space, measured first.
    """

    def __init__(self, decide_as: CPUKernelConfig | None = None):
        self.names: list[str] = []
        self.fixed = llvm_schedules.FixedKnobs(decide_as) if decide_as else None

    def split(self, sch: s_tir.Schedule, loop, kernel: str, name: str, max_inner: int) -> list:
        self.names.append(name)
        decision = None
        if self.fixed is not None:
            inner = self.fixed.split(sch, loop, kernel, name, max_inner)[1]
            decision = [int(sch.get(loop).extent) // inner, inner]
        return list(sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_inner, decision=decision))


# ---------------------------------------------------------------------------------------------
# Workloads: a kernel with one tile shape, specialized to one problem


@dataclass(frozen=True)
class Workload:
    kernel: str  # "forward" or "backward"
    spec: AttentionSpec
    config: CPUKernelConfig  # tile shape and lanes; its register tiles are the hand-written seed
    batch: int
    heads: int
    heads_k: int
    seqlen: int
    causal: bool = False
    n_threads: int = 1

    def name(self) -> str:
        products = "" if self.config.products == FP32_FMA else f"_{self.config.products}"
        return f"{self.kernel}_q{self.config.block_q}_k{self.config.block_k}{products}"

    def flops(self) -> float:
        return analysis.model_flops(self.kernel, self.batch, self.heads, self.seqlen, self.seqlen,
                                    self.spec.head_dim, self.causal)

    def tuned_at(self) -> dict:
        """The shape and mask a record of this workload was tuned at (``records``' ``tuned_at``)."""
        return {"batch": self.batch, "heads": self.heads, "heads_k": self.heads_k, "seqlen": self.seqlen,
                "causal": self.causal, "threads": self.n_threads}

    def prim_func(self) -> tirx.PrimFunc:
        """The fused kernel specialized to this workload, labelled with tvmflash.* attributes."""
        cfg = self.config
        func = analysis.specialize(
            cpu_kernels.fused_kernel(self.kernel, self.spec, cfg), batch=self.batch, seqlen_q=self.seqlen,
            seqlen_k=self.seqlen, heads=self.heads, heads_k=self.heads_k, block_q=cfg.block_q, block_k=cfg.block_k,
            n_threads=self.n_threads, softmax_scale=1.0 / math.sqrt(self.spec.head_dim),
            window_left=UNLIMITED_WINDOW, window_right=0 if self.causal else UNLIMITED_WINDOW)
        attrs = {
            "kernel": self.kernel, "head_dim": self.spec.head_dim, "dtype": self.spec.dtype,
            "causal": int(self.causal), "block_q": cfg.block_q, "block_k": cfg.block_k, "lanes": cfg.lanes,
            "products": cfg.products,
            "batch": self.batch, "heads": self.heads, "heads_k": self.heads_k, "seqlen": self.seqlen,
            "n_threads": self.n_threads,
        }
        func = func.with_attr("global_symbol", self.name())
        for key, value in attrs.items():
            func = func.with_attr(ATTR + key, value)
        return func

    @classmethod
    def of(cls, func: tirx.PrimFunc) -> Workload:
        """The workload a tuning task's function was made from (its tvmflash.* attributes), with
        the hand-written register tiles of its ISA (AVX-512: 16 lanes)."""

        def attr(key):
            value = func.attrs[ATTR + key]
            return str(value) if key in ("kernel", "dtype", "products") else int(value)

        kernel = attr("kernel")
        lanes = attr("lanes")
        products = attr("products") if ATTR + "products" in func.attrs else FP32_FMA
        cfg = replace(default_cpu_config(kernel, avx512=lanes >= 16, products=products), block_q=attr("block_q"),
                      block_k=attr("block_k"), lanes=lanes)
        return cls(kernel, AttentionSpec(attr("head_dim"), attr("dtype")), cfg, attr("batch"), attr("heads"),
                   attr("heads_k"), attr("seqlen"), bool(attr("causal")), attr("n_threads"))


def product_choices(target, dtype: str) -> tuple[str, ...]:
    """How the products may run for this target and input dtype (config.py): fp32 FMAs always;
    bf16 dot products for bf16 inputs where the target has AVX512-BF16. Not AMX tiles: their
    product blocks have no knobs, and MetaSchedule's runner processes have no tile permission."""
    bf16_dot = dtype == "bfloat16" and targets.supports_bf16_dot(targets.resolve(target))
    return (FP32_FMA, BF16_DOT) if bf16_dot else (FP32_FMA,)


def workloads_for(target, spec: AttentionSpec, *, seqlen: int, batch: int, heads: int, heads_k: int | None = None,
                  causal: bool = False, kernels_to_tune=KERNELS, blocks=BLOCK_CANDIDATES,
                  products=None) -> dict[str, Workload]:
    """One task per kernel, tile shape and products (default: every choice of the target and
    dtype), seeded with the hand-written register tiles."""
    target = targets.resolve(target)
    found = {}
    for kernel in kernels_to_tune:
        base = llvm_schedules.default_config(target, kernel)
        for kind in products or product_choices(target, spec.dtype):
            for block_q, block_k in blocks:
                w = Workload(kernel, spec, replace(base, block_q=block_q, block_k=block_k, products=kind), batch,
                             heads, heads_k or heads, seqlen, causal, settings.num_threads())
                found[w.name()] = w
    return found


def space_function(sch: s_tir.Schedule) -> None:
    """The design space: the hand-written schedule with sampled knobs."""
    workload = Workload.of(sch.mod["main"])
    llvm_schedules.SCHEDULES[workload.kernel](sch, workload.config, SampledKnobs())


def decode(record) -> CPUKernelConfig:
    """The CPUKernelConfig a tuning record stands for: its tile shape and sampled register tiles."""
    func = record.workload.mod["main"]
    workload = Workload.of(func)
    knobs = SampledKnobs()
    llvm_schedules.SCHEDULES[workload.kernel](s_tir.Schedule(func), workload.config, knobs)
    trace = record.trace
    samples = [inst for inst in trace.insts if inst.kind.name == "SamplePerfectTile"]
    if len(samples) != len(knobs.names):
        raise ValueError(f"record has {len(samples)} tile decisions, the {workload.kernel} space {len(knobs.names)}")
    values = {name: int(trace.decisions[inst][1]) for name, inst in zip(knobs.names, samples)}
    tiles = tuple((p, RegisterTile(values[f"{p}.rows"], values[f"{p}.vectors"])) for p in PRODUCTS[workload.kernel])
    return replace(workload.config, tiles=tiles)


# ---------------------------------------------------------------------------------------------
# Building and measuring candidates (module-level: the worker processes import them)


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, directory: str) -> str:
    """Build a candidate as ``build.build_module`` builds a kernel (TVM's CSE off: LLVM does it;
    DEVELOPING.md) and export it into ``directory``: the path of the artifact. Runs in a worker."""
    from tvm.support.tar import tar

    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        lib = tvm.compile(mod, target=target)
    artifact = os.path.join(tempfile.mkdtemp(dir=directory), "candidate." + tar.output_format)
    lib.export_library(artifact, fcompile=tar)
    return artifact


def _builder(pool, directory: str):
    """A MetaSchedule builder on the tuner's own worker pool (MetaSchedule's LocalBuilder starts a
    new pool for every batch, seconds of Python and TVM imports each, and leaves it running when
    interrupted); artifacts go to ``directory``."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.support.popen_pool import StatusKind

    @derived_object
    class PoolBuilder(ms.builder.PyBuilder):
        def build(self, build_inputs):
            results = []
            jobs = [(b.mod, b.target, directory) for b in build_inputs]
            for done in pool.map_with_error_catching(lambda job: build_candidate(*job), jobs):
                if done.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(done.value, None))
                else:
                    results.append(ms.builder.BuilderResult(None, f"build failed ({done.status.name}): {done.value}"))
            return results

    return PoolBuilder()


def sequence_tables(args_info) -> list:
    """The int32 sequence tables of a kernel call with these arguments, as ``plan.batched`` makes them.

    The arguments are those of a specialized kernel (``Workload.prim_func``): the forward's
    (q, k, v, out, lse, seq_table, q_tile_seq, k_tile_seq), the backward's (dout, q, k, v, out,
    lse, dq, dk, dv, seq_table, q_tile_seq, k_tile_seq, k_super_seq). Batch, lengths and heads
    come from q and k; the tiles per sequence from the tile maps' lengths (the tables depend on
    tile counts, not on the tile sizes: ``ceil(N / ceil(N / t)) = t`` for every count t a tile
    size gives).
    """
    shapes = [tuple(int(s) for s in shape) for _kind, _dtype, shape in args_info]
    int_args = [i for i, (_kind, dtype, _shape) in enumerate(args_info) if str(dtype) == "int32"]
    backward = len(int_args) == 4
    if len(int_args) not in (3, 4) or len(shapes[int_args[0]]) != 2:
        raise ValueError(f"not the arguments of a tvmflash kernel: {args_info}")
    batch, seqlen_q, _heads, _ = shapes[1 if backward else 0]
    _, seqlen_k, heads_k, _ = shapes[2 if backward else 1]
    query_tiles, key_tiles = shapes[int_args[1]][0], shapes[int_args[2]][0]
    seqs = plan.batched(batch, seqlen_q, seqlen_k, block_q=plan.ceildiv(seqlen_q, query_tiles // batch),
                        block_k=plan.ceildiv(seqlen_k, key_tiles // batch), heads_k=heads_k)
    arrays = list(seqs.arrays()[:len(int_args)])
    for i, array in zip(int_args, arrays):
        if array.shape != shapes[i]:
            raise ValueError(f"sequence table {i} has shape {shapes[i]}, plan.batched made {array.shape}")
    return arrays


def realistic_arguments(device, args_info, alloc_repeat: int) -> list:
    """Measurement inputs of a real call: the sequence tables of the workload (``plan.py``),
    N(0, 1) tensors, LSE = log(seqlen) + 0.5 (about its value for such inputs).

    MetaSchedule's default fill (random values) would give the kernels random int32 tables,
    which they use as indices (out of bounds), and floats uniform in [0, 10), whose scores are
    ~100x too large: P overflows in the backward and the timings measure inf/NaN arithmetic.
    """
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    numpy_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    tables = sequence_tables(args_info)
    repeated = []
    for _ in range(alloc_repeat):
        args, next_table = [], iter(tables).__next__
        for _kind, dtype, shape in args_info:
            if str(dtype) == "int32":
                data = next_table()
            elif len(shape) == 3:  # lse (batch, heads, seqlen)
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


@contextlib.contextmanager
def reaped_workers():
    """End, on the way out (normally, on an error, on Ctrl-C), every MetaSchedule worker started inside.

    The builder starts a pool of ``tvm.exec.popen_worker`` processes per batch and shuts it down
    only when the batch completes; the runner keeps one until garbage collection. An exception
    or KeyboardInterrupt in between left them running (a build can take minutes), and the
    interpreter then waited for their threads at exit. This kills the popen workers that are
    children of this process and were not there before (and their children), so the pools'
    threads see their worker gone and end.
    """
    import psutil

    me = psutil.Process()
    before = {child.pid for child in me.children()}
    try:
        yield
    finally:
        killed = []
        for child in me.children():
            if child.pid in before:
                continue
            try:
                if POPEN_WORKER not in " ".join(child.cmdline()):
                    continue
                family = [*child.children(recursive=True), child]
            except psutil.Error:
                continue
            for proc in family:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
                    killed.append(proc)
        psutil.wait_procs(killed, timeout=10)


def _measure_defaults(workloads: dict[str, Workload], target, builder, runner, database) -> dict[str, float]:
    """Measure the hand-written schedule of each workload and store it as a tuning record;
    returns the seconds of each.

    The evolutionary search starts from the best records in the database, so it refines the
    hand-written choices, and the result can only match or beat them (as measured).
    """
    from tvm.s_tir import meta_schedule as ms

    measured = {}
    for name, workload in workloads.items():
        mod = tvm.IRModule({"main": workload.prim_func()})
        sch = s_tir.Schedule(mod)
        llvm_schedules.SCHEDULES[workload.kernel](sch, workload.config, SampledKnobs(decide_as=workload.config))
        built = builder.build([ms.builder.BuilderInput(sch.mod, target)])[0]
        if built.error_msg:
            raise RuntimeError(f"building the hand-written {name} failed: {built.error_msg}")
        args = ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])
        result = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", args)])[0].result()
        if result.error_msg:
            raise RuntimeError(f"measuring the hand-written {name} failed: {result.error_msg}")
        record = ms.database.TuningRecord(sch.trace, database.commit_workload(mod), result.run_secs, target, args)
        database.commit_tuning_record(record)
        secs = measured[name] = _mean(result.run_secs)
        print(f"  hand-written {name}: {secs * 1e3:.2f} ms ({workload.flops() / secs / 1e9:.1f} GFLOP/s)", flush=True)
    return measured


def _mean(run_secs) -> float:
    return sum(float(s) for s in run_secs) / len(run_secs)


def _progress_callback(workloads: dict[str, Workload], total: int, hand_written: dict[str, float]):
    """A line per measured batch: the task's best time so far, its hand-written seed included."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def __init__(self):
            self.done = 0
            self.best: dict[str, float] = dict(hand_written)
            self.start = time.perf_counter()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            task = task_scheduler.tasks_[task_id].ctx.task_name
            for result in runner_results:
                self.done += 1
                if result.error_msg is None and result.run_secs:
                    self.best[task] = min(self.best.get(task, math.inf), _mean(result.run_secs))
            best = self.best.get(task, math.inf)
            gflops = workloads[task].flops() / best / 1e9 if math.isfinite(best) else 0.0
            elapsed = time.perf_counter() - self.start
            seed = " (the hand-written seed)" if best == hand_written.get(task) else ""
            print(f"  [{self.done}/{total} trials, {elapsed:.0f} s] {task}: best search time {best * 1e3:.2f} ms "
                  f"({gflops:.1f} GFLOP/s){seed}", flush=True)

    return Progress()


def database_dir(log_dir: Path, target, spec: AttentionSpec) -> Path:
    """Where the MetaSchedule databases of a target and spec live (the tuner's working files)."""
    return Path(log_dir) / targets.key(targets.resolve(target)) / records.variant_name(spec)


# The optional ``tune`` extra: MetaSchedule's XGBoost cost model, its process pools (psutil,
# cloudpickle) and RPC (tornado). Without them MetaSchedule fails deep inside, naming none of this.
TUNE_EXTRA_MODULES = ("psutil", "xgboost", "cloudpickle", "tornado")


def require_tune_extra() -> None:
    """Raise ImportError naming the extra to install if a module the tuner needs is missing."""
    missing = [name for name in TUNE_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"tuning needs {', '.join(missing)}, not installed: "
                          "pip install 'tvmflash[tune]' (in this repository: .venv/bin/pip install -e '.[tune]')")


def tune(target, spec: AttentionSpec, *, seqlen: int, batch: int, heads: int, heads_k: int | None = None,
         causal: bool = False, trials: int, log_dir: Path, kernels_to_tune=KERNELS, blocks=BLOCK_CANDIDATES,
         products=None, rpc_tracker: str | None = None, rpc_key: str | None = None, seed: int | None = None,
         verbose: bool = False) -> Path:
    """Run MetaSchedule over the schedule spaces; returns the database directory.

    Ends every worker process it started, also on errors and Ctrl-C (``reaped_workers``).
    """
    require_tune_extra()
    import logging

    from tvm.s_tir import meta_schedule as ms
    from tvm.support.popen_pool import PopenPoolExecutor

    if spec.mod_inputs or spec.block_sparse or spec.out_dtype != spec.dtype:
        raise NotImplementedError("the tuner measures plain attention specs (no score/mask mods, block masks, "
                                  "fp32 results)")
    target = targets.resolve(target)
    if target.kind.name != "llvm":
        raise NotImplementedError("tuning the CUDA kernels is not supported yet")
    stub_tensor_intrin()
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    # MetaSchedule attaches its handlers on every run and fails on the unnamed ones of the last run.
    for handler in list(ms_logger.handlers):
        ms_logger.removeHandler(handler)
    # Our progress lines instead of MetaSchedule's task tables and XGBoost logs.
    ms_logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    workloads = workloads_for(target, spec, seqlen=seqlen, batch=batch, heads=heads, heads_k=heads_k, causal=causal,
                              kernels_to_tune=kernels_to_tune, blocks=blocks, products=products)
    mod = tvm.IRModule({name: w.prim_func() for name, w in workloads.items()})
    directory = database_dir(log_dir, target, spec)
    directory.mkdir(parents=True, exist_ok=True)
    artifacts = tempfile.mkdtemp(prefix="tvmflash-tune-")
    pools = []
    try:
        with reaped_workers():
            build_pool = PopenPoolExecutor(max_workers=targets.usable_cpus(), timeout=600,
                                           initializer=stub_tensor_intrin, maximum_process_uses=64)
            pools.append(build_pool)
            builder = _builder(build_pool, artifacts)
            evaluator = ms.runner.EvaluatorConfig(number=3, repeat=3, min_repeat_ms=100, enable_cpu_cache_flush=False)
            if rpc_tracker:
                host, port = rpc_tracker.rsplit(":", 1)
                rpc = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=rpc_key,
                                          session_timeout_sec=600)
                inner = ms.runner.RPCRunner(rpc, evaluator_config=evaluator, initializer=stub_tensor_intrin,
                                            f_alloc_argument=realistic_arguments_rpc)
            else:
                inner = ms.runner.LocalRunner(timeout_sec=600, evaluator_config=evaluator,
                                              initializer=stub_tensor_intrin, f_alloc_argument=realistic_arguments)
            pools.append(inner.pool)
            runner = _synchronous(inner)
            space = ms.space_generator.ScheduleFn(space_function, sch_rules=[], postprocs=[],
                                                  mutator_probs={ms.mutator.MutateTileSize(): 1.0})
            # Round robin, one batch per task per round: every tile shape gets trials even on small budgets.
            per_round = max(1, min(16, trials // len(workloads)))
            database = _database(directory)
            print(f"measuring the hand-written configs ({len(workloads)} tasks) ...\n"
                  f"  (search times, here and below: MetaSchedule's runner, each task's kernel specialized to "
                  f"this shape, mean of 3 x 3 runs in a worker process; a task is one kernel with one tile shape, "
                  f"so 'best' is per task. Compare them with each other; the same-run table at the end, which "
                  f"times the kernels compile() builds, decides)", flush=True)
            hand_written = _measure_defaults(workloads, target, builder, runner, database)
            callbacks = [*ms.measure_callback.MeasureCallback.create("default"),
                         _progress_callback(workloads, trials, hand_written)]
            # The spaces are small (a few hundred tile shapes per kernel): a small population keeps
            # the evolutionary search's own time per round low (each member replays the schedule).
            strategy = ms.search_strategy.EvolutionarySearch(population_size=min(96, max(16, 8 * per_round)),
                                                             init_min_unmeasured=min(16, 4 * per_round))
            ms.tir_integration.tune_tir(
                mod, target, work_dir=str(directory), max_trials_global=trials, num_trials_per_iter=per_round,
                builder=builder, runner=runner, database=database, space=space, strategy=strategy,
                measure_callbacks=callbacks, task_scheduler="round-robin", num_tuning_cores=targets.usable_cpus(),
                seed=seed)
    finally:
        for pool in pools:
            pool.shutdown()
        shutil.rmtree(artifacts, ignore_errors=True)
    return directory


# ---------------------------------------------------------------------------------------------
# Reading the databases back, and the same-run verification that writes compile()'s records


def _database(directory: Path, **kwargs):
    """The MetaSchedule JSON database in ``directory``. Loading replays each record's trace on its
    workload, and the traces of bf16 dot products name our tensor intrinsics: registered first."""
    from tvm.s_tir import meta_schedule as ms

    llvm_bf16.register_all()
    return ms.database.JSONDatabase(work_dir=str(directory), **kwargs)


def best_configs(directory: Path, workload: Workload) -> dict[str, tuple[CPUKernelConfig, float]]:
    """Per kernel: the fastest measured config in a database for this workload's problem (shape,
    mask, threads; any tile shape) and its mean time, in seconds."""
    from tvm.s_tir import meta_schedule as ms

    db_files = [directory / "database_tuning_record.json", directory / "database_workload.json"]
    if not all(p.exists() for p in db_files):
        return {}
    stub_tensor_intrin()
    db = _database(directory, allow_missing=False)
    best: dict[str, tuple] = {}
    for record in db.get_all_tuning_records():
        if not record.run_secs:
            continue
        seconds = _mean(record.run_secs)
        if not math.isfinite(seconds) or seconds >= 1e9:  # failed runs are recorded as 1e10
            continue
        func = record.workload.mod["main"]
        if ATTR + "kernel" not in func.attrs:
            continue
        found = Workload.of(func)
        if (found.spec, found.tuned_at()) != (workload.spec, workload.tuned_at()):
            continue
        if seconds < best.get(found.kernel, (None, math.inf))[1]:
            best[found.kernel] = (decode(record), seconds)
    return best


def verify(target, spec: AttentionSpec, *, seqlen: int, batch: int, heads: int, heads_k: int | None = None,
           causal: bool = False, log_dir: Path, records_dir: Path | None = None, kernels_to_tune=KERNELS,
           rounds: int = 7) -> dict[str, dict]:
    """Time the best tuned config of each kernel against the hand-written one, same process,
    interleaved; write the compact records ``compile()`` reads; return them by kernel.

    MetaSchedule measures each candidate once, in its own process, and on a noisy machine a
    lucky measurement can win: this comparison is the arbiter. A record is ``verified`` (used
    by ``compile()``) where the tuned config differs from the hand-written one and ran at least
    ``records.MIN_VERIFIED_SPEEDUP`` times as fast here.
    """
    import torch

    from . import compiler, reference

    target = targets.resolve(target)
    heads_k = heads_k or heads
    directory = database_dir(log_dir, target, spec)
    probe = Workload("forward", spec, llvm_schedules.default_config(target, "forward", product_rates.default_products(target, spec.dtype, spec.head_dim)), batch, heads,
                     heads_k, seqlen, causal, settings.num_threads())
    best = {k: v for k, v in best_configs(directory, probe).items() if k in kernels_to_tune}
    if not best:
        return {}
    defaults = {kernel: llvm_schedules.default_config(target, kernel, product_rates.default_products(target, spec.dtype, spec.head_dim)) for kernel in KERNELS}
    tuned = {**defaults, **{kernel: cfg for kernel, (cfg, _) in best.items()}}
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, heads, spec.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, seqlen, heads_k, spec.head_dim, generator=gen).to(dtype) for _ in range(2))
    dout, out = torch.randn(q.shape, generator=gen).to(dtype), torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    calls = {}
    for label, configs in (("default", defaults), ("tuned", tuned)):
        kern = compiler.compile_spec(target, spec, causal=causal, config=configs, tuned=False)
        kern.forward(q, k, v, out, lse)  # the backward's out and lse
        calls[f"{label}/forward"] = lambda kern=kern: kern.forward(q, k, v, out, lse)
        calls[f"{label}/backward"] = lambda kern=kern: kern.backward(dout, q, k, v, out, lse, *grads)
    calls = {name: fn for name, fn in calls.items() if name.split("/")[1] in best}
    times = reference.median_times(calls, rounds)
    root = Path(records_dir or log_dir)
    written = {}
    for kernel, (cfg, ms_seconds) in best.items():
        d, t = times[f"default/{kernel}"], times[f"tuned/{kernel}"]
        speedup = d / t
        entry = {
            "config": cfg.to_json(),
            "tuned_at": probe.tuned_at(),
            "speedup": round(speedup, 4),
            "verified": bool(cfg != defaults[kernel] and speedup >= records.MIN_VERIFIED_SPEEDUP),
            "same_run_ms": {"default": round(d * 1e3, 4), "tuned": round(t * 1e3, 4)},
            "metaschedule_ms": round(ms_seconds * 1e3, 4),
        }
        records.write(root, targets.key(target), spec, kernel, entry)
        written[kernel] = entry
    return written


def report(written: dict[str, dict], spec: AttentionSpec, path: Path, same_as_hand_written=()) -> list[str]:
    """The default-vs-tuned table of ``verify``'s records, saying how its times differ from the search's.
    ``same_as_hand_written``: kernels whose best config is the hand-written one (their ratio is noise)."""
    lines = ["Same run: the kernels compile() builds (sizes read at run time), hand-written and tuned interleaved "
             "in this process, medians; these decide. Search ms: the tuned config's time during the search "
             "(specialized kernel, worker process, measured once at its own moment): not comparable with the "
             "same-run columns.",
             "| kernel | tuned config (blocks; register tiles rows x vectors) | hand-written ms (same run) "
             "| tuned ms (same run) | speedup | tuned ms (search) | used by compile() |",
             "|---|---|---|---|---|---|---|"]
    for kernel, entry in written.items():
        cfg = entry["config"]
        tiles = ", ".join(f"{name} {r}x{v}" for name, (r, v) in cfg["tiles"].items())
        ms_ = entry["same_run_ms"]
        same = kernel in same_as_hand_written
        lines.append(f"| {kernel} | {cfg['block_q']}x{cfg['block_k']}; {tiles}{' (the hand-written config)' * same} | "
                     f"{ms_['default']:.2f} | {ms_['tuned']:.2f} | {entry['speedup']:.2f}x"
                     f"{' (same config: the difference is noise)' * same} | {entry['metaschedule_ms']:.2f} | "
                     f"{'yes' if entry['verified'] else 'no'} |")
    lines.append(f"(written to {path}: compile() uses a tuned config only if it differs from the hand-written one "
                 f"and ran >= {records.MIN_VERIFIED_SPEEDUP:.2f}x as fast here)")
    return lines


@contextlib.contextmanager
def _noting_interrupts():
    """While inside: SIGINT is noted (in the yielded list) and raises KeyboardInterrupt, as usual."""
    import signal
    import threading

    noted: list = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return

    def on_sigint(signum, frame):
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def command_line() -> argparse.ArgumentParser:
    """The command line of ``python -m tvmflash.tune``."""
    parser = argparse.ArgumentParser(prog="python -m tvmflash.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--causal", action="store_true", help="tune and verify with the causal mask")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-k", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--trials", type=int, default=64, help="measured candidates, all kernels together")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--blocks", nargs="+", default=[f"{q}x{k}" for q, k in BLOCK_CANDIDATES],
                        help="tile sizes to try, QxK (query rows x key rows)")
    parser.add_argument("--products", nargs="+", default=None, choices=[FP32_FMA, BF16_DOT],
                        help="how the products may run (default: every choice of the target and dtype)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="MetaSchedule databases (working files) and, by default, the records; "
                             "default: $TVMFLASH_TUNE_LOGS or <cache dir>/tune_logs")
    parser.add_argument("--records-dir", type=Path, default=None,
                        help="where the records compile() reads are written (default: --log-dir)")
    parser.add_argument("--rpc-tracker", default=None, help="HOST:PORT of a TVM RPC tracker")
    parser.add_argument("--rpc-key", default=None, help="device key registered at the tracker")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the same-run comparison")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="MetaSchedule's own logs too")
    parser.add_argument("--verify-only", action="store_true",
                        help="no tuning: only the same-run default-vs-tuned comparison (writes the records)")
    return parser


def main(argv=None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)
    if args.target == "cuda":
        parser.error("tuning the CUDA kernels is not supported yet")
    if bool(args.rpc_tracker) != bool(args.rpc_key):
        parser.error("--rpc-tracker and --rpc-key go together")
    if not args.verify_only:
        try:
            require_tune_extra()
        except ImportError as missing:
            parser.exit(2, f"{parser.prog}: {missing}\n")
    try:
        blocks = tuple(tuple(int(x) for x in b.split("x")) for b in args.blocks)
        if any(len(b) != 2 for b in blocks):
            raise ValueError
    except ValueError:
        parser.error(f"--blocks takes QxK pairs such as 64x128, got {args.blocks}")
    spec = AttentionSpec(args.head_dim, args.dtype)
    target = targets.resolve(args.target)
    heads_k = args.heads_k or args.heads
    log_dir = args.log_dir or records.user_root()
    shape = dict(seqlen=args.seqlen, batch=args.batch, heads=args.heads, heads_k=heads_k, causal=args.causal)
    print(f"tuning {', '.join(args.kernels)} for {targets.key(target)}, {spec.describe()}"
          f"{', causal' if args.causal else ''}, B{args.batch} N{args.seqlen} H{args.heads}/{heads_k}, "
          f"{settings.num_threads()} threads: {args.trials} trials, log dir {log_dir}", flush=True)
    with _noting_interrupts() as interrupted:
        try:
            if not args.verify_only:
                directory = tune(target, spec, trials=args.trials, log_dir=log_dir, kernels_to_tune=args.kernels,
                                 blocks=blocks, products=args.products, rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key, seed=args.seed,
                                 verbose=args.verbose, **shape)
                print(f"databases: {directory}", flush=True)
            print(f"same-run comparison ({args.rounds} rounds) ...", flush=True)
            written = verify(target, spec, log_dir=log_dir, records_dir=args.records_dir,
                             kernels_to_tune=args.kernels, rounds=args.rounds, **shape)
        except BaseException:
            # Ctrl-C raises KeyboardInterrupt wherever Python runs; inside MetaSchedule's
            # callbacks TVM's FFI passes it on as another error, so the handler's note decides.
            if not interrupted:
                raise
            print("interrupted", file=sys.stderr, flush=True)
            return 130
    if not written:
        print(f"no tuning records for this workload in {database_dir(log_dir, target, spec)}")
        return 1
    path = records.record_path(args.records_dir or log_dir, targets.key(target), spec)
    same = {kernel for kernel, entry in written.items()
            if CPUKernelConfig.from_json(entry["config"]) == llvm_schedules.default_config(target, kernel, product_rates.default_products(target, spec.dtype, spec.head_dim))}
    print("\n".join(report(written, spec, path, same)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
