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

from . import __version__
from . import schedules as _schedules_package
from . import target as targets
from .checks import check_backward_args, check_cuda_params, check_forward_args, check_kernel_params

# The code that decides what gets compiled, per target kind: a change to any of it invalidates
# the disk cache of that kind (editing the CUDA kernels does not rebuild the CPU ones). Paths, not
# imports: the code generators are only imported on a cache miss (build.py).
_PACKAGE = Path(__file__).parent
_SCHEDULES = Path(_schedules_package.__file__).parent
_SHARED_SOURCES = tuple(_PACKAGE / name for name in ("compiler.py", "build.py", "kernels.py", "attention_te.py",
                                                      "target.py"))
_CODEGEN_SOURCES = {
    "llvm": (*_SHARED_SOURCES, _SCHEDULES / "llvm.py"),
    "cuda": (*_SHARED_SOURCES, _PACKAGE / "kernels_cuda.py", _SCHEDULES / "cuda.py"),
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
        self.target_kind = meta["target"]["kind"]
        self.head_dim = meta["head_dim"]
        self.dtype = meta["dtype"]
        self.causal = meta["causal"]
        self.deterministic = meta.get("deterministic", False)
        self.is_cuda = self.target_kind == "cuda"
        self.tuning_record = meta.get("tuning_record")
        self._source = source_text
        self._fwd = module["flash_fwd"]
        self._bwd = module["flash_bwd"]

    # target and config are parsed on demand: both need TVM's compiler library (or the schedule
    # modules), and loading prebuilt kernels must work with TVM's runtime alone.
    @property
    def target(self) -> tvm.target.Target:
        return tvm.target.Target(self.meta["target"])

    @property
    def config(self):
        if self.is_cuda:
            from .schedules.cuda import CUDAConfig as config_type
        else:
            from .schedules.llvm import LLVMConfig as config_type
        return config_type.from_json(self.meta["config"])

    def __repr__(self):
        mask = "causal" if self.causal else "full"
        extra = ", deterministic" if self.deterministic else ""
        return f"FlashKernels({targets.key(self.meta['target'])}, head_dim={self.head_dim}, {self.dtype}, {mask}{extra})"

    def forward(self, q, k, v, out, lse, softmax_scale: float | None = None) -> None:
        check_forward_args(self, q, k, v, out, lse)
        self._fwd(q, k, v, out, lse, _scale(softmax_scale, self.head_dim))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float | None = None) -> None:
        batch, seqlen_q, heads, heads_k = check_backward_args(self, dout, q, k, v, out, lse, dq, dk, dv)
        scale = _scale(softmax_scale, self.head_dim)
        if not self.is_cuda:
            splits = backward_splits(batch, heads_k, k.shape[1], self.meta["config"]["backward_blocks"][1])
            self._bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, splits)
            return
        # FlashAttention-2's three launches (kernels_cuda.py): row statistics + zeroed fp32 dQ
        # accumulator, the fused backward, the dQ conversion. Workspace: O(N) fp32.
        key_tiles = -(-k.shape[1] // CUDA_TILE)
        if self.deterministic:
            splits = partials = deterministic_splits(batch, heads_k, key_tiles)
        else:
            splits, partials = key_tiles, 1
        stats = _workspace(dq, (batch, heads, 3, cuda_stats_rows(seqlen_q)))
        dq_acc = _workspace(dq, (partials, batch, seqlen_q, heads, self.head_dim))
        self._module["flash_bwd_prep"](dout, out, lse, stats, dq_acc)
        self._bwd(dout, q, k, v, stats, dq_acc, dk, dv, scale, splits)
        self._module["flash_bwd_dq"](dq_acc, dq, scale)

    def export_library(self, path: str | os.PathLike) -> None:
        """Write the compiled module (a shared library) and its metadata (``path + '.json'``)."""
        path = Path(path)
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


# Query and key rows per thread block of the CUDA kernels (kernels_cuda: WARPS x ROWS_PER_WARP;
# build.py checks that they agree).
CUDA_TILE = 64


def cuda_stats_rows(seqlen_q: int) -> int:
    """Rows of the CUDA backward's row-statistics workspace: padded to whole query tiles."""
    return -(-seqlen_q // CUDA_TILE) * CUDA_TILE


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
    if meta["target"]["kind"] == "cuda":
        _load_cuda_runtime()
    return FlashKernels(tvm.runtime.load_module(str(path)), meta, library=path)


def _load_cuda_runtime() -> None:
    """TVM loads its CUDA runtime library while registering its CUDA backend, which in runtime-only
    mode can fail before it gets there; loading a CUDA module needs the library's loader."""
    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    import ctypes

    library = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise RuntimeError(f"cannot load TVM's CUDA runtime ({library}): {err}; a GPU driver (libcuda) and "
                           "libcudart.so.13 must be loadable") from err


def _can_run(target: tvm.target.Target) -> bool:
    """CUDA modules load back only where a GPU driver is present (elsewhere TVM builds a module
    that holds the CUDA source: it exports, for a GPU machine to compile at load, but the disk
    cache could not load it here)."""
    return target.kind.name != "cuda" or tvm.cuda(0).exist


def compile_variant(head_dim: int = 64, dtype: str = "float32", causal: bool = False, **variant) -> FlashKernels:
    """Kernels that break one of the three rules on purpose, for the experiments in benchmarks/.

    Built for this CPU with the default schedule, in this process only (never cached on disk).
    """
    from . import build

    target = targets.host_target()
    params = KernelParams(head_dim, dtype, causal)
    config = build.default_config(target, params)
    meta = {"target": json.loads(str(target)), **params.__dict__, "config": config.to_json(),
            "tuning_record": None, "variant": variant}
    _progress(f"compiling an experiment variant {variant} ...")
    lib = build.build_module(target, params, config, **variant)
    return FlashKernels(lib, meta, build.module_source(target, lib))


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
    prebuilt = _find_prebuilt(target, head_dim, dtype, causal, deterministic)
    if prebuilt is not None:
        return prebuilt
    target = targets.resolve(target)
    check_kernel_params(head_dim, dtype)
    is_cuda = target.kind.name == "cuda"
    if is_cuda:
        check_cuda_params(head_dim, dtype, target.attrs.get("arch", "sm_90"))
    params = KernelParams(int(head_dim), str(dtype), bool(causal), bool(deterministic) and is_cuda)
    record = None
    if config is None:
        from . import build

        config = build.default_config(target, params)
        if tuned and not is_cuda:
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
    memo_key = (key, json.dumps(record, sort_keys=True))
    with _lock:
        if memo_key in _memory_cache:
            return _memory_cache[memo_key]
    if _can_run(target):
        kernels_obj = _load_from_disk(key, meta) or _compile_and_store(target, params, config, meta, key)
    else:  # a CUDA source module (no GPU here) cannot be loaded back: memory cache only
        kernels_obj = _build(target, params, config, meta)
    with _lock:
        _memory_cache[memo_key] = kernels_obj
    return kernels_obj


# --- prebuilt kernels: built on one machine, loaded on another with TVM's runtime alone ---------
def prebuild(directory, target="cuda", head_dims=(64, 128), dtypes=("float16", "bfloat16"),
             causal=(False, True), deterministic=(False,)) -> list[Path]:
    """Compile and export every combination into ``directory`` (``<target>-d<D>-<dtype>...so``).

    Point ``$TVMFLASH_PREBUILT`` at the directory and ``compile()`` (hence the torch op) loads
    matching kernels from it before trying to compile: a machine without TVM's compiler library
    (``TVM_USE_RUNTIME_LIB=1``, or a runtime-only TVM) can then run them. CUDA kernels built on a
    machine without a GPU hold their CUDA source; TVM compiles it (NVRTC or nvcc) when they load.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for head_dim in head_dims:
        for dtype in dtypes:
            for mask in causal:
                for det in deterministic:
                    kern = compile(target, head_dim=head_dim, dtype=dtype, causal=mask, deterministic=det)
                    name = (f"{targets.key(kern.meta['target'])}-d{head_dim}-{dtype}" + ("-causal" if mask else "")
                            + ("-deterministic" if kern.deterministic else "") + ".so")
                    kern.export_library(directory / name)
                    written.append(directory / name)
    return written


_prebuilt_cache: dict[tuple, FlashKernels] = {}


def _find_prebuilt(target, head_dim, dtype, causal, deterministic) -> FlashKernels | None:
    """Kernels from ``$TVMFLASH_PREBUILT`` matching the target kind (and CUDA arch, if given)."""
    directory = os.environ.get("TVMFLASH_PREBUILT")
    if not directory:
        return None
    if isinstance(target, str):
        kind, arch = ("llvm" if target == "cpu" else target), None
    elif isinstance(target, dict):
        kind, arch = target.get("kind"), target.get("arch")
    else:
        kind, arch = target.kind.name, target.attrs.get("arch")
    wanted = (kind, arch, int(head_dim), str(dtype), bool(causal), bool(deterministic) and kind == "cuda")
    with _lock:
        if wanted in _prebuilt_cache:
            return _prebuilt_cache[wanted]
    for meta_path in sorted(Path(directory).glob("*.so.json")):
        meta = json.loads(meta_path.read_text())
        have = (meta["target"]["kind"], arch and meta["target"].get("arch"), meta["head_dim"], meta["dtype"],
                meta["causal"], meta.get("deterministic", False))
        if have == wanted:
            found = load(meta_path.with_suffix(""))
            with _lock:
                _prebuilt_cache[wanted] = found
            return found
    return None


def _build(target, params: KernelParams, config, meta: dict) -> FlashKernels:
    desc = f"{targets.key(target)}, head_dim={params.head_dim}, {params.dtype}" + (
        ", causal" if params.causal else "") + (", deterministic" if params.deterministic else "")
    _progress(f"compiling flash attention forward+backward ({desc}) ...")
    start = time.perf_counter()
    from . import build

    lib = build.build_module(target, params, config)
    source_text = build.module_source(target, lib)
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

    target_kind = "llvm"


_standard_cache: dict[tuple, StandardAttention] = {}


def compile_standard(head_dim: int = 64, dtype: str = "float32", causal: bool = False) -> StandardAttention:
    """Compile the unfused TE forward and backward for this CPU (cached in this process)."""
    check_kernel_params(head_dim, dtype)
    key = (int(head_dim), str(dtype), bool(causal))
    if key not in _standard_cache:
        from . import build

        _standard_cache[key] = StandardAttention(build.build_standard(*key), *key)
    return _standard_cache[key]
