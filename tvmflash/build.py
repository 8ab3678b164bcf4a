"""Code generation: the kernels of ``kernels/cpu.py`` / ``kernels/cuda.py`` with the schedules of
``schedules/`` lowered into TVM modules. The only part of tvmflash that needs TVM's compiler
(TVMScript, TE, schedules, LLVM, CUDA codegen); ``compiler.py`` imports it on a cache miss, so
cached, exported or prebuilt kernels load with TVM's runtime alone.
"""

from __future__ import annotations

import contextlib
import re
import threading

import tvm
import tvm_ffi
from tvm import s_tir

from . import attention_te
from .kernels import cpu as cpu_tir
from .kernels import cuda as cuda_tir
from .kernels.uniform_rows import uniform_kernels
from . import target as targets
from .config import CUDA_BLOCK_Q, CPUKernelConfig, KERNELS
from .schedules import cuda as cuda_schedules
from .schedules import llvm as llvm_schedules
from .spec import AttentionSpec


def scheduled_kernel(kernel: str, spec: AttentionSpec, cfg: CPUKernelConfig) -> tvm.tirx.PrimFunc:
    """One fused CPU kernel ("forward" or "backward") with the hand-written schedule applied."""
    sch = s_tir.Schedule(cpu_tir.fused_kernel(kernel, spec, cfg))
    return llvm_schedules.SCHEDULES[kernel](sch, cfg).mod["main"]


def build_module(target: tvm.target.Target, spec: AttentionSpec, configs: dict, *, deterministic: bool = False,
                 transform=None) -> tvm.runtime.Module:
    """Schedule and compile the kernels into one module (no caching).

    CPU: ``flash_fwd`` and ``flash_bwd``, and ``uniform_means`` / ``uniform_grads`` (eager's rows
    whose keys the mask all hides, ``kernels/uniform_rows.py``). CUDA: forward, backward pre-pass, backward and dQ
    conversion, with ``deterministic`` built in. Masks (causal, windows) are runtime arguments.
    ``transform(kernel, prim_func)``: a rewrite applied to each scheduled CPU kernel (the
    experiment variants in benchmarks/variants.py); None for the real kernels.
    """
    if target.kind.name == "cuda":
        return build_cuda_module(target, spec, configs, deterministic)
    funcs = {kernel: scheduled_kernel(kernel, spec, configs[kernel]) for kernel in KERNELS}
    if transform is not None:
        funcs = {kernel: transform(kernel, func) for kernel, func in funcs.items()}
    # TVM's common-subexpression pass wraps the kernels' index arithmetic in let expressions
    # that its LLVM codegen then re-simplifies for minutes; LLVM eliminates the same
    # subexpressions itself (DEVELOPING.md).
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        return tvm.compile(tvm.IRModule({"flash_fwd": funcs["forward"], "flash_bwd": funcs["backward"],
                                         **uniform_kernels(spec)}), target=target)


# --- CUDA ---------------------------------------------------------------------------------
@tvm.transform.module_pass(opt_level=0, name="tvmflash.LowerAllWarpMemory")
def _lower_all_warp_memory(mod, _ctx):
    """TVM 0.27's LowerWarpMemory lowers only the first warp buffer of each statement list
    (DEVELOPING.md); the fragments of our kernels are many. Repeat it to a fixed point."""
    for _ in range(256):
        lowered = tvm.tirx.transform.LowerWarpMemory()(mod)
        if tvm_ffi.structural_equal(lowered, mod):
            return lowered
        mod = lowered
    raise RuntimeError("LowerWarpMemory did not reach a fixed point")


def _cuda_pipeline():
    """TVM's default s_tir pipeline with the repeated warp-memory lowering on the device side."""
    from tvm.s_tir import pipeline as s_tir_pipeline

    main, host, _ = s_tir_pipeline.default_s_tir_pipeline()

    def device():
        return tvm.ir.transform.Sequential([
            _lower_all_warp_memory, tvm.tirx.transform.StmtSimplify(), tvm.tirx.transform.LowerIntrin()])

    return main, host, device


_CUDA_PIPELINE = "tvmflash_cuda"
# CSE would hoist parts of the fragment index arithmetic into lets, and TVM's explicit unrolling
# leaves index expressions (truncdiv with constant offsets) that LowerWarpMemory cannot map to a
# lane; "#pragma unroll" loops keep both intact, and nvcc unrolls them all the same.
_CUDA_PASS_CONFIG = {"tirx.disable_cse_tir": True, "tirx.UnrollLoop": {"explicit_unroll": False}}


def cuda_kernels(spec: AttentionSpec, configs: dict, deterministic: bool) -> tvm.IRModule:
    """The four CUDA kernels (forward; backward pre-pass, main, dQ conversion), scheduled."""
    fwd_cfg, bwd_cfg = configs["forward"], configs["backward"]
    if bwd_cfg.block_k != CUDA_BLOCK_Q:
        raise ValueError(f"the CUDA backward needs block_k = {CUDA_BLOCK_Q}, got {bwd_cfg.block_k}")
    mod = tvm.IRModule({
        "flash_fwd": cuda_tir.cuda_forward(spec, fwd_cfg),
        "flash_bwd_prep": cuda_tir.cuda_backward_prep(spec.head_dim, spec.dtype),
        "flash_bwd": cuda_tir.cuda_backward(spec, bwd_cfg, atomic_dq=not deterministic),
        "flash_bwd_dq": cuda_tir.cuda_backward_dq(spec.head_dim, spec.dtype),
    })
    sch = s_tir.Schedule(mod, enable_check=False)  # the tensorized fragments defeat TVM's checks
    for name, apply in (("flash_fwd", lambda: cuda_schedules.schedule_forward(sch, fwd_cfg, spec, cuda_tir.WARPS)),
                        ("flash_bwd", lambda: cuda_schedules.schedule_backward(sch, bwd_cfg, spec, cuda_tir.WARPS)),
                        ("flash_bwd_prep", lambda: cuda_schedules.schedule_backward_prep(sch)),
                        ("flash_bwd_dq", lambda: cuda_schedules.schedule_backward_dq(sch))):
        sch.work_on(name)
        apply()
    return sch.mod


# ptxas, at the --register-usage-level=10 TVM passes when it compiles the module on the GPU
# machine, otherwise trades registers for occupancy on its own: with __launch_bounds__(128)
# alone it capped the D=64 forward at 128 registers and spilled. The main kernels are built for
# one or two blocks per SM (64 x 64 tiles, 128 threads); saying so (minBlocksPerSM = 1) lets
# ptxas keep everything in registers. TVM 0.27's CUDA codegen has no attribute for it in this
# pipeline, only the source post-processing hook.
_MAIN_KERNELS = re.compile(r"__launch_bounds__\((\d+)\) (flash_fwd_kernel|flash_bwd_kernel)\(")
_POSTPROC = "tvm_callback_cuda_postproc"
_postproc_lock = threading.Lock()


def _one_block_per_sm_suffices(code: str, _target=None) -> str:
    return _MAIN_KERNELS.sub(r"__launch_bounds__(\1, 1) \2(", code)


@contextlib.contextmanager
def _cuda_source_postproc(fn):
    """Register TVM's CUDA source hook for the duration of one build (restoring any other)."""
    with _postproc_lock:
        previous = tvm_ffi.get_global_func(_POSTPROC, allow_missing=True)
        tvm_ffi.register_global_func(_POSTPROC, fn, override=True)
        try:
            yield
        finally:
            if previous is None:
                tvm_ffi.remove_global_func(_POSTPROC)
            else:
                tvm_ffi.register_global_func(_POSTPROC, previous, override=True)


def build_cuda_module(target: tvm.target.Target, spec: AttentionSpec, configs: dict,
                      deterministic: bool) -> tvm.runtime.Module:
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.PIPELINE_MAP.setdefault(_CUDA_PIPELINE, _cuda_pipeline)
    with tvm.transform.PassContext(config=_CUDA_PASS_CONFIG), _cuda_source_postproc(_one_block_per_sm_suffices):
        return tvm.compile(cuda_kernels(spec, configs, deterministic), target=target,
                           tir_pipeline=_CUDA_PIPELINE)


def module_source(target: tvm.target.Target, lib: tvm.runtime.Module) -> str:
    if target.kind.name == "cuda":
        return lib.mod.imports[0].inspect_source()
    return lib.mod.inspect_source("ll")


def build_standard(head_dim: int, dtype: str, causal: bool) -> tvm.runtime.Module:
    """The unfused TE forward and backward, compiled as they are for this CPU."""
    fwd = attention_te.standard_forward(head_dim, dtype, causal)
    bwd = attention_te.standard_backward(head_dim, dtype, causal)
    mod = tvm.IRModule({
        "standard_fwd": llvm_schedules.schedule_standard(s_tir.Schedule(fwd)).mod["main"],
        "standard_bwd": llvm_schedules.schedule_standard(s_tir.Schedule(bwd)).mod["main"],
    })
    return tvm.compile(mod, target=targets.host_target())


# --- decoding against a KV cache (kernels/decode.py, kvcache.py) ------------------------------
def build_decode_module(target: tvm.target.Target, spec: AttentionSpec, cfg) -> tvm.runtime.Module:
    """The ``flash_decode`` kernel scheduled for this CPU and compiled (no caching)."""
    from .kernels import decode as decode_kernels
    from .schedules import llvm_decode

    sch = s_tir.Schedule(decode_kernels.decode_kernel(spec, cfg))
    func = llvm_decode.schedule_decode(sch, cfg, spec.head_dim).mod["main"]
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        return tvm.compile(tvm.IRModule({"flash_decode": func}), target=target)


# --- attention sinks (kernels/sinks.py, sinks.py) ---------------------------------------------------
def build_sink_module(target: tvm.target.Target, spec: AttentionSpec) -> tvm.runtime.Module:
    """The attention sinks' ``sink_rescale`` and ``sink_gradient`` (``kernels/sinks.py``) compiled
    (no caching; loops that need no schedule)."""
    from .kernels.sinks import sink_kernels

    return tvm.compile(tvm.IRModule(sink_kernels(spec)), target=target)
