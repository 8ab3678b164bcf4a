"""Compilation, caching and the kernel objects users call.

``compile(target, head_dim, dtype, causal)`` builds the fused forward and backward kernels of
``kernels.py`` with the target's schedule from ``schedules/`` into one TVM module and returns a
``FlashKernels`` object. Built modules are cached twice: in this process, and on disk
(``$TVMFLASH_CACHE_DIR``, default ``~/.cache/tvmflash``) under a key made of the versions of
tvmflash, TVM and tvm-ffi, a hash of the kernel and schedule sources, the full target, the
kernel parameters and the schedule config. A second process therefore starts without compiling,
and any change to the code, the target or the knobs builds anew.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir

from . import __version__, attention_te, kernels, kernels_cuda
from . import target as targets
from .checks import (
    check_backward_args,
    check_cuda_grid,
    check_cuda_layout,
    check_cuda_params,
    check_forward_args,
    check_kernel_params,
)
from .schedules import cuda as cuda_schedules
from .schedules import llvm as llvm_schedules

# The code that decides what gets compiled, per target kind: a change to any of it invalidates
# the disk cache of that kind (editing the CUDA kernels does not rebuild the CPU ones).
_SHARED_SOURCES = (Path(__file__), Path(kernels.__file__), Path(attention_te.__file__), Path(targets.__file__))
_CODEGEN_SOURCES = {
    "llvm": (*_SHARED_SOURCES, Path(llvm_schedules.__file__)),
    "cuda": (*_SHARED_SOURCES, Path(kernels_cuda.__file__), Path(cuda_schedules.__file__)),
}
_memory_cache: dict[tuple, FlashKernels] = {}
_lock = threading.Lock()


def _progress(message: str) -> None:
    """Long work (compiling) says what it does on stderr; TVMFLASH_QUIET=1 silences it."""
    if os.environ.get("TVMFLASH_QUIET", "0") in ("", "0"):
        print(f"tvmflash: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    root = os.environ.get("TVMFLASH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvmflash"


@functools.lru_cache(maxsize=None)
def _sources_digest(kind: str) -> str:
    h = hashlib.sha256()
    for p in _CODEGEN_SOURCES[kind]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class KernelParams:
    head_dim: int
    dtype: str
    causal: bool
    # CUDA only: dQ without atomics, bitwise reproducible (the CPU kernels always are)
    deterministic: bool = False


def _cache_key(target: tvm.target.Target, params: KernelParams, config_json: dict) -> str:
    blob = json.dumps(
        {
            "tvmflash": __version__,
            "tvm": tvm.__version__,
            "tvm_ffi": tvm_ffi.__version__,
            "sources": _sources_digest(target.kind.name),
            "target": str(target),
            "params": params.__dict__,
            "config": config_json,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class FlashKernels:
    """Compiled fused forward and backward kernels for one target, head dim, dtype and mask.

    ``forward`` and ``backward`` take any DLPack tensors (torch, numpy, tvm) in the flash-attn
    layout ``(batch, seqlen, heads, head_dim)`` and write their outputs in place; ``lse`` is
    ``(batch, heads, seqlen_q)`` float32. Sizes are free (any batch, lengths, heads with
    ``heads % heads_k == 0``); only the head dim must be contiguous.
    """

    def __init__(self, module, meta: dict, source_text: str | None = None, library: Path | None = None):
        self._module = module
        self._library = library  # the shared library this module was loaded from, if any
        self.meta = meta
        self.target = tvm.target.Target(meta["target"])
        self.head_dim = meta["head_dim"]
        self.dtype = meta["dtype"]
        self.causal = meta["causal"]
        self.deterministic = meta.get("deterministic", False)
        self.is_cuda = self.target.kind.name == "cuda"
        config_type = cuda_schedules.CUDAConfig if self.is_cuda else llvm_schedules.LLVMConfig
        self.config = config_type.from_json(meta["config"])
        self.tuning_record = meta.get("tuning_record")
        self._source = source_text
        self._fwd = module["flash_fwd"]
        self._bwd = module["flash_bwd"]

    def __repr__(self):
        mask = "causal" if self.causal else "full"
        extra = ", deterministic" if self.deterministic else ""
        return f"FlashKernels({targets.key(self.target)}, head_dim={self.head_dim}, {self.dtype}, {mask}{extra})"

    def forward(self, q, k, v, out, lse, softmax_scale: float | None = None) -> None:
        batch, _, heads, _ = check_forward_args(self, q, k, v, out, lse)
        if self.is_cuda:
            check_cuda_layout(q=q, k=k, v=v)
            check_cuda_grid(batch * heads)
        self._fwd(q, k, v, out, lse, _scale(softmax_scale, self.head_dim))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float | None = None) -> None:
        batch, seqlen_q, heads, heads_k = check_backward_args(self, dout, q, k, v, out, lse, dq, dk, dv)
        scale = _scale(softmax_scale, self.head_dim)
        if not self.is_cuda:
            splits = backward_splits(batch, heads_k, k.shape[1], self.config.backward_blocks[1])
            self._bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, splits)
            return
        check_cuda_layout(dout=dout, q=q, k=k, v=v)
        check_cuda_grid(batch * heads_k)
        # FlashAttention-2's three launches (kernels_cuda.py): row statistics + zeroed fp32 dQ
        # accumulator, the fused backward, the dQ conversion. Workspace: O(N) fp32.
        key_tiles = -(-k.shape[1] // kernels_cuda.WARPS // kernels_cuda.ROWS_PER_WARP)
        if self.deterministic:
            splits = partials = deterministic_splits(batch, heads_k, key_tiles)
        else:
            splits, partials = key_tiles, 1
        stats = _workspace(dq, (batch, heads, 3, kernels_cuda.stats_rows(seqlen_q)))
        dq_acc = _workspace(dq, (partials, batch, seqlen_q, heads, self.head_dim))
        self._module["flash_bwd_prep"](dout, out, lse, stats, dq_acc)
        self._bwd(dout, q, k, v, stats, dq_acc, dk, dv, scale, splits)
        self._module["flash_bwd_dq"](dq_acc, dq, scale)

    def export_library(self, path: str | os.PathLike) -> None:
        """Write the compiled module (a shared library) and its metadata (``path + '.json'``)."""
        path = Path(path)
        if not _can_run(self.target):
            raise RuntimeError("CUDA kernels built on a machine without a GPU driver (libcuda) are CUDA source "
                               "only: source() has the code; export them on a machine with a GPU")
        if self._library is not None:  # loaded from a library: its code is that file
            shutil.copyfile(self._library, path)
        else:
            self._module.export_library(str(path))
        Path(str(path) + ".json").write_text(json.dumps(self.meta, indent=1))

    def source(self) -> str:
        """The generated code: LLVM IR for CPU targets, CUDA C for CUDA targets."""
        if self._source is None:
            raise RuntimeError("this module was loaded from a library without its source; "
                               "compile it with tvmflash.compile(...) to see the generated code")
        return self._source


def _scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def deterministic_splits(batch: int, heads_k: int, key_tiles: int) -> int:
    """Thread blocks per (batch, kv head) of the deterministic CUDA backward.

    Each owns an fp32 dQ partial (workspace = splits x dQ in fp32), so they are capped at 8:
    enough blocks for a GPU's ~132 SMs at typical batch x heads, bounded memory at any length.
    """
    return max(1, min(key_tiles, 8, -(-256 // (batch * heads_k))))


def _workspace(like, shape: tuple):
    """An fp32 scratch tensor on the device of ``like`` (torch's allocator for torch tensors)."""
    if type(like).__module__.startswith("torch"):
        return like.new_empty(shape, dtype=sys.modules["torch"].float32)
    device = (like if isinstance(like, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(like)).device
    return tvm.runtime.empty(shape, "float32", device)


def _num_threads() -> int:
    return int(tvm_ffi.get_global_func("runtime.NumThreads")())


def backward_splits(batch: int, heads_k: int, seqlen_k: int, block_k: int) -> int:
    """Key-tile splits of the backward: enough parallel tasks for every thread (>= 2 each)."""
    tasks = batch * heads_k
    wanted = -(-2 * _num_threads() // tasks)
    return max(1, min(wanted, -(-seqlen_k // block_k)))


def load(path: str | os.PathLike) -> FlashKernels:
    """Load kernels written by ``FlashKernels.export_library``."""
    path = Path(path)
    meta_path = Path(str(path) + ".json")
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} (written by export_library next to the library) is missing")
    meta = json.loads(meta_path.read_text())
    return FlashKernels(tvm.runtime.load_module(str(path)), meta, library=path)


def kernel_spec(params: KernelParams, config, kernel: str, **variant) -> kernels.KernelSpec:
    return kernels.KernelSpec(params.head_dim, params.dtype, params.causal, *config.blocks(kernel), **variant)


def scheduled_kernel(params: KernelParams, config, kernel: str, **variant) -> tvm.tirx.PrimFunc:
    """One fused CPU kernel ("forward" or "backward") with the hand-written schedule applied."""
    build = kernels.fused_forward if kernel == "forward" else kernels.fused_backward
    sch = s_tir.Schedule(build(kernel_spec(params, config, kernel, **variant)))
    return llvm_schedules.SCHEDULES[kernel](sch, config).mod["main"]


def build_module(target: tvm.target.Target, params: KernelParams, config, **variant) -> tvm.runtime.Module:
    """Schedule and compile both fused kernels into one module (no caching).

    ``variant``: the experiment knobs of ``kernels.KernelSpec`` (lse_dtype, recompute,
    grad_acc_dtype); empty for the real kernels.
    """
    if target.kind.name == "cuda":
        return build_cuda_module(target, params, config)
    mod = tvm.IRModule({
        "flash_fwd": scheduled_kernel(params, config, "forward", **variant),
        "flash_bwd": scheduled_kernel(params, config, "backward", **variant),
    })
    return tvm.compile(mod, target=target)


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


def cuda_kernels(params: KernelParams, config) -> tvm.IRModule:
    """The four CUDA kernels (forward; backward pre-pass, main, dQ conversion), scheduled."""
    spec = kernels.KernelSpec(params.head_dim, params.dtype, params.causal, kernels_cuda.WARPS * 16,
                              config.block_k, exp2="intrinsic")
    mod = tvm.IRModule({
        "flash_fwd": kernels_cuda.cuda_forward(spec),
        "flash_bwd_prep": kernels_cuda.cuda_backward_prep(params.head_dim, params.dtype),
        "flash_bwd": kernels_cuda.cuda_backward(spec, atomic_dq=not params.deterministic),
        "flash_bwd_dq": kernels_cuda.cuda_backward_dq(params.head_dim, params.dtype),
    })
    sch = s_tir.Schedule(mod, enable_check=False)  # the tensorized fragments defeat TVM's checks
    for name, apply in (("flash_fwd", lambda: cuda_schedules.schedule_forward(sch, config, params.dtype,
                                                                              kernels_cuda.WARPS)),
                        ("flash_bwd", lambda: cuda_schedules.schedule_backward(sch, config, params.dtype,
                                                                               kernels_cuda.WARPS)),
                        ("flash_bwd_prep", lambda: cuda_schedules.schedule_backward_prep(sch)),
                        ("flash_bwd_dq", lambda: cuda_schedules.schedule_backward_dq(sch))):
        sch.work_on(name)
        apply()
    return sch.mod


def build_cuda_module(target: tvm.target.Target, params: KernelParams, config) -> tvm.runtime.Module:
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.PIPELINE_MAP.setdefault(_CUDA_PIPELINE, _cuda_pipeline)
    with tvm.transform.PassContext(config=_CUDA_PASS_CONFIG):
        return tvm.compile(cuda_kernels(params, config), target=target, tir_pipeline=_CUDA_PIPELINE)


def _module_source(target: tvm.target.Target, lib: tvm.runtime.Module) -> str:
    if target.kind.name == "cuda":
        return lib.mod.imports[0].inspect_source()
    return lib.mod.inspect_source("ll")


def _can_run(target: tvm.target.Target) -> bool:
    """CUDA modules are only real (exportable, runnable) where a GPU driver is present."""
    return target.kind.name != "cuda" or tvm.cuda(0).exist


def compile_variant(head_dim: int = 64, dtype: str = "float32", causal: bool = False, **variant) -> FlashKernels:
    """Kernels that break one of the three rules on purpose, for the experiments in benchmarks/.

    Built for this CPU with the default schedule, in this process only (never cached on disk).
    """
    target = targets.host_target()
    params = KernelParams(head_dim, dtype, causal)
    config = llvm_schedules.default_config(target, head_dim, dtype, causal)
    meta = {"target": json.loads(str(target)), **params.__dict__, "config": config.to_json(),
            "tuning_record": None, "variant": variant}
    _progress(f"compiling an experiment variant {variant} ...")
    lib = build_module(target, params, config, **variant)
    return FlashKernels(lib, meta, lib.mod.inspect_source("ll"))


def compile(  # noqa: A001 - the public name the API promises
    target="llvm",
    head_dim: int = 64,
    dtype: str = "float32",
    causal: bool = False,
    *,
    config=None,
    tuned: bool = True,
    seqlen: int | None = None,
    cache: bool = True,
    deterministic: bool = False,
) -> FlashKernels:
    """Compile (or fetch from the caches) the fused forward and backward kernels.

    ``target``: "llvm" (this machine's CPU), "cuda" (sm_90), a target dict such as
    ``{"kind": "cuda", "arch": "sm_80"}`` or a ``tvm.target.Target``. CUDA kernels compile
    without a GPU (``source()`` shows the CUDA C); they need float16/bfloat16 and a head dim that
    is a multiple of 16 up to 128.
    ``config``: schedule knobs (``schedules.llvm.LLVMConfig`` / ``schedules.cuda.CUDAConfig``).
    CPU default: the best tuning record for this target and kernel (``tvmflash.tune``; shipped
    ``tune_logs`` and ``$TVMFLASH_TUNE_LOGS``), from the tuned sequence length nearest to
    ``seqlen`` (default 2048), else the hand-written defaults. ``tuned=False`` always uses the
    defaults; the record used is ``kernels.tuning_record``. ``cache=False`` skips both caches.
    ``deterministic``: CUDA backward without atomic adds (bitwise reproducible dQ, somewhat
    slower); the CPU kernels are always deterministic, so it changes nothing there.
    """
    target = targets.resolve(target)
    check_kernel_params(head_dim, dtype)
    is_cuda = target.kind.name == "cuda"
    if is_cuda:
        check_cuda_params(head_dim, dtype)
    params = KernelParams(int(head_dim), str(dtype), bool(causal), bool(deterministic) and is_cuda)
    record = None
    if config is None and is_cuda:
        config = cuda_schedules.default_config()
    elif config is None:
        config = llvm_schedules.default_config(target, params.head_dim, params.dtype, params.causal)
        if tuned:
            from . import tune

            found = tune.tuned_config(target, params, config, seqlen or 2048)
            if found is not None:
                config, record = found
    key = _cache_key(target, params, config.to_json())
    meta = {
        "target": json.loads(str(target)),
        **params.__dict__,
        "config": config.to_json(),
        "tuning_record": record,
        "cache_key": key,
    }
    if not cache:
        return _build(target, params, config, meta)
    if not _can_run(target):  # a CUDA source module (no GPU here): cannot be exported, memo only
        with _lock:
            found = _memory_cache.get((key, None))
        if found is None:
            found = _build(target, params, config, meta)
            with _lock:
                _memory_cache[(key, None)] = found
        return found
    memo_key = (key, json.dumps(record, sort_keys=True))
    with _lock:
        if memo_key in _memory_cache:
            return _memory_cache[memo_key]
    kernels_obj = _load_from_disk(key, meta)
    if kernels_obj is None:
        kernels_obj = _compile_and_store(target, params, config, meta, key)
    with _lock:
        _memory_cache[memo_key] = kernels_obj
    return kernels_obj


def _build(target, params: KernelParams, config, meta: dict) -> FlashKernels:
    desc = f"{targets.key(target)}, head_dim={params.head_dim}, {params.dtype}" + (
        ", causal" if params.causal else "") + (", deterministic" if params.deterministic else "")
    _progress(f"compiling flash attention forward+backward ({desc}) ...")
    start = time.perf_counter()
    lib = build_module(target, params, config)
    source_text = _module_source(target, lib)
    _progress(f"compiled in {time.perf_counter() - start:.1f} s")
    return FlashKernels(lib, meta, source_text)


def _load_from_disk(key: str, meta: dict) -> FlashKernels | None:
    so = cache_dir() / f"{key}.so"
    if not so.exists():
        return None
    try:
        src = cache_dir() / f"{key}.src"
        return FlashKernels(tvm.runtime.load_module(str(so)), meta,
                            src.read_text() if src.exists() else None, library=so)
    except (OSError, ValueError, RuntimeError) as err:  # a broken entry is rebuilt (TVM errors are RuntimeErrors)
        _progress(f"ignoring unreadable cache entry {so} ({err})")
        return None


def _compile_and_store(target, params, config, meta, key: str) -> FlashKernels:
    kernels_obj = _build(target, params, config, meta)
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Write under temporary names, then rename: concurrent processes never see half a file.
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            tmp_so = Path(tmp) / "kernels.so"
            kernels_obj._module.export_library(str(tmp_so))
            (Path(tmp) / "kernels.src").write_text(kernels_obj.source())
            (Path(tmp) / "kernels.json").write_text(json.dumps(meta, indent=1))
            os.replace(Path(tmp) / "kernels.src", directory / f"{key}.src")
            os.replace(Path(tmp) / "kernels.json", directory / f"{key}.json")  # for people reading the cache
            os.replace(tmp_so, directory / f"{key}.so")  # last: its presence marks a complete entry
    except OSError as err:
        _progress(f"could not write the compile cache in {directory} ({err}); continuing without it")
    return kernels_obj


class StandardAttention:
    """The unfused TE definitions compiled as they are: "standard attention", O(N^2) memory.

    Same call signatures as ``FlashKernels`` (minus the backward's split count); used as an
    independent second implementation in tests and as the baseline of the memory experiments.
    """

    def __init__(self, module, head_dim: int, dtype: str, causal: bool):
        self._module = module
        self.head_dim, self.dtype, self.causal = head_dim, dtype, causal

    def forward(self, q, k, v, out, lse, softmax_scale: float | None = None) -> None:
        check_forward_args(self, q, k, v, out, lse)
        self._module["standard_fwd"](q, k, v, out, lse, _scale(softmax_scale, self.head_dim))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float | None = None) -> None:
        check_backward_args(self, dout, q, k, v, out, lse, dq, dk, dv)
        self._module["standard_bwd"](dout, q, k, v, out, lse, dq, dk, dv, _scale(softmax_scale, self.head_dim))

    @property
    def target(self):
        return targets.host_target()


_standard_cache: dict[tuple, StandardAttention] = {}


def compile_standard(head_dim: int = 64, dtype: str = "float32", causal: bool = False) -> StandardAttention:
    """Compile the unfused TE forward and backward for this CPU (cached in this process)."""
    check_kernel_params(head_dim, dtype)
    key = (int(head_dim), str(dtype), bool(causal))
    if key not in _standard_cache:
        fwd = attention_te.standard_forward(*key)
        bwd = attention_te.standard_backward(*key)
        mod = tvm.IRModule({
            "standard_fwd": llvm_schedules.schedule_standard(s_tir.Schedule(fwd)).mod["main"],
            "standard_bwd": llvm_schedules.schedule_standard(s_tir.Schedule(bwd)).mod["main"],
        })
        _standard_cache[key] = StandardAttention(tvm.compile(mod, target=targets.host_target()), *key)
    return _standard_cache[key]
