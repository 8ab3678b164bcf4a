"""``compile``: kernels for a target and spec, from the caches or built (``build.py``).

Layering: this module decides *what* to build (target, spec, the configs chosen by
``choose_configs``) and where it comes from: the memory cache, prebuilt kernels
(``$TVMFLASH_PREBUILT``), the disk cache (``cache.py``), or a build. Only a build imports the
code generators (``build.py``), so cached and prebuilt kernels load with TVM's runtime alone.

**Warm starts.** Resolving a request (this CPU's target from LLVM, the configs) needs TVM's
compiler, and ``import tvm`` takes ~1.3 s. So each resolution is recorded in the disk cache
under its *question*: the request as asked, and what else decides its answer that can be read
without TVM (versions, the kernel code's digest, this CPU, the steering environment), with the
digests of the files it read (tuning records, product rates). A later process asking the same
question loads the recorded entry with TVM's runtime library alone (``libraries``) after
checking it against the question; ``import tvmflash`` and a call whose kernels are cached never
import ``tvm``.

Every kernel build is keyed by a request: versions of tvmflash, TVM and tvm-ffi, a hash of the
code that generates kernels (every module a build runs, found from the imports), the full target, the spec, the configs (and
for CUDA the mask and determinism it builds in). A change to any of them builds anew.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import tvm_ffi

from . import cache, checks, cuda_binaries, import_closure, product_rates, records, runtime, settings
from . import target as targets
from .config import (AMX, AMX_TILE, BF16_DOT, KERNELS, LONG_TILES, TILE_CLASSES, CPUKernelConfig, CUDAKernelConfig,
                     default_arm_config, default_cpu_config, tile_class)
from .runtime import FlashKernels
from .spec import Alibi, AttentionSpec, Softcap
from .version import __version__

if TYPE_CHECKING:
    import tvm

# The modules that generate kernels: a build runs them and everything they import, and the disk
# cache keys hash exactly that (``import_closure``): a change to any of it builds anew. ``build``
# generates every kernel; a traced mod (``flex_trace``) rides in the spec and emits its own TIR.
CODEGEN_ENTRY_MODULES = ("tvmflash.build", "tvmflash.flex_trace")
# What decides which entry a request resolves to (config choice, product rates, tuning records'
# format) beyond the kernels' code: every module a compile runs. Warm starts' questions hash it.
RESOLVING_MODULES = ("tvmflash.compiler", *CODEGEN_ENTRY_MODULES)
_memory_cache: dict[str, FlashKernels] = {}
# (target, spec, options, steering environment) -> the kernels compile_spec returned: the ops ask
# on every call, and choosing configs and hashing the request takes ~ms.
_request_memo: dict[tuple, FlashKernels] = {}
_STEERING_ENV = ("TVMFLASH_CACHE_DIR", "TVMFLASH_TUNE_LOGS", "TVMFLASH_PREBUILT", product_rates.OVERRIDE_ENV)
_steering_values = settings.EnvironmentValues(*_STEERING_ENV)
_lock = threading.Lock()


def sources_digest() -> str:
    """A hash of the code that generates kernels (once per process; ~10 ms, see import_closure)."""
    return import_closure.digest(CODEGEN_ENTRY_MODULES)


def choose_configs(target: tvm.target.Target, spec: AttentionSpec, *, config=None, tuned: bool = True,
                   seqlen: int | None = None) -> tuple[dict, dict | None]:
    """The config of each kernel, and the tuning records used (None if none).

    The one place this is decided. Per kernel: an explicit ``config`` (a dict kernel -> config,
    or one config applying to its own kernel) wins; else, on CPUs with ``tuned``, the verified
    tuning record for this target and spec (``records.py``; the one tuned at the sequence length
    nearest ``seqlen``) if its tiles are those of the hand-written config; else the hand-written
    default for the target's ISA, the spec's dtype (bf16 inputs: native bf16 dot products where
    the target has AVX512-BF16 and, on this CPU, they multiply faster than fp32 FMAs:
    ``product_rates``) and ``seqlen``: an int, or (queries, keys); sequences that 64-row tiles would pad by more
    than an eighth get 16- or 32-row tiles (``config.tile_edge``), a tuning record made at
    long lengths would compute whole 64-row tiles of padding for them. A config whose products
    the target cannot run is an error (explicit) or skipped (tuning record).
    """
    explicit = _explicit_configs(config)
    is_cuda = target.kind.name == "cuda"
    chosen, used = {}, {}
    bf16_dot = not is_cuda and targets.supports_bf16_dot(target)
    amx = not is_cuda and targets.supports_amx(target)
    runnable = {BF16_DOT: bf16_dot, AMX: amx}  # the bf16 products the target has (fp32 FMAs: every CPU)
    seqlen_q, seqlen_k = seqlen if isinstance(seqlen, tuple) else (seqlen, seqlen)
    for kernel in KERNELS:
        if kernel in explicit:
            chosen[kernel] = explicit[kernel]
            continue
        if is_cuda:
            chosen[kernel] = CUDAKernelConfig(kernel)
            continue
        default = _default_cpu_config(target, kernel,
                                      product_rates.default_products(target, spec.dtype, spec.head_dim), seqlen_q,
                                      seqlen_k)
        found = records.lookup(targets.key(target), spec, kernel, max(seqlen_q or 0, seqlen_k or 0) or None
                               ) if tuned else None
        tiles = (default.block_q, default.block_k)
        if (found is not None and runnable.get(found[0].products, True)
                and (tiles == LONG_TILES or tiles == (found[0].block_q, found[0].block_k))):
            chosen[kernel], used[kernel] = found
        else:
            chosen[kernel] = default
    wanted = CUDAKernelConfig if is_cuda else CPUKernelConfig
    for kernel, cfg in chosen.items():
        if not isinstance(cfg, wanted) or cfg.kernel != kernel:
            raise TypeError(f"config for the {kernel} kernel must be a {wanted.__name__}(kernel={kernel!r}), got {cfg!r}")
        if not is_cuda and cfg.products == BF16_DOT and not (bf16_dot and spec.dtype == "bfloat16"):
            raise ValueError(f"the {kernel} config asks for bf16_dot products, which need bfloat16 inputs (got "
                             f"{spec.dtype}) and a target with AVX512-BF16 or Arm's BF16 ({targets.key(target)}"
                             f"{'' if bf16_dot else ' has none'})")
        if not is_cuda and cfg.products == AMX and not (amx and spec.dtype == "bfloat16"
                                                        and spec.head_dim % AMX_TILE == 0):
            # (LLVM would abort the process on tile instructions for a target without AMX)
            raise ValueError(f"the {kernel} config asks for amx products, which need bfloat16 inputs (got "
                             f"{spec.dtype}), a head dim that is a multiple of {AMX_TILE} (got {spec.head_dim}) and "
                             f"a target with AMX-BF16 ({targets.key(target)}{'' if amx else ' has none'})")
    return chosen, (used or None)


def _default_cpu_config(target: tvm.target.Target, kernel: str, products: str, seqlen_q: int | None,
                        seqlen_k: int | None) -> CPUKernelConfig:
    if targets.is_aarch64(target):  # 64 x 64 tiles at any length: short-sequence tiles are untried there
        return default_arm_config(kernel, products)
    return default_cpu_config(kernel, targets.has_features(target, "avx512f"), products, seqlen_q, seqlen_k)


def _explicit_configs(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, (CPUKernelConfig, CUDAKernelConfig)):
        return {config.kernel: config}
    if isinstance(config, dict):
        for kernel, cfg in config.items():
            if kernel not in KERNELS:
                raise ValueError(f"config names a kernel {kernel!r}; the kernels are {', '.join(KERNELS)}")
            if not isinstance(cfg, (CPUKernelConfig, CUDAKernelConfig)) or cfg.kernel != kernel:
                raise TypeError(f"config[{kernel!r}] must be a CPUKernelConfig/CUDAKernelConfig for the {kernel!r} "
                                f"kernel, got {cfg!r}")
        return dict(config)
    raise TypeError(f"config must be a CPUKernelConfig/CUDAKernelConfig or a dict of them by kernel, got {config!r}")


def _request(target: tvm.target.Target, spec: AttentionSpec, configs: dict, deterministic: bool, record,
             tiles: tuple[int, int] | None = None) -> dict:
    """Everything a build depends on (JSON): the cache key and the metadata of the result.
    ``tiles``: the tile class of the lengths asked for (``_tile_class``): what ``_find_prebuilt``
    chooses an exported library by."""
    kind = target.kind.name
    is_cuda = kind == "cuda"
    meta = {
        "versions": _versions(),
        "target": targets.code_json(target),
        "spec": spec.to_json(),
        "mod_inputs": _mod_inputs(spec),
        "configs": {kernel: cfg.to_json() for kernel, cfg in configs.items()},
        # kernels take the mask per call; an export records its object's default (runtime.py)
        "causal": False,
        "deterministic": bool(deterministic) and is_cuda,
        "tuning_record": record,
    }
    if not is_cuda:
        meta["isa_features"] = targets.isa_features(target)
    if tiles is not None:
        meta["tile_class"] = list(tiles)
    return meta


def _tile_class(target: tvm.target.Target, seqlen, config=None) -> tuple[int, int] | None:
    """The tile class of kernels for ``seqlen`` on this target: that of the length
    (``config.tile_class``; a tuning record's tiles may differ, for the same lengths), or an
    explicit forward ``config``'s tiles; None where the tiles do not follow the length (CUDA,
    aarch64)."""
    if target.kind.name == "cuda" or targets.is_aarch64(target):
        return None
    forward = _explicit_configs(config).get("forward")
    return tile_class(seqlen) if forward is None else (forward.block_q, forward.block_k)


def _mod_inputs(spec: AttentionSpec) -> list:
    return [[i.name, list(i.shape), i.dtype, i.requires_grad] for i in spec.mod_inputs]


def _versions(tvm_version: str | None = None) -> dict:
    """What a request records of the code that builds it (``tvm_version``: TVM's, when already
    known; else ``import tvm`` asks it)."""
    if tvm_version is None:
        import tvm

        tvm_version = tvm.__version__
    return {"tvmflash": __version__, "tvm": tvm_version, "tvm_ffi": tvm_ffi.__version__, "sources": sources_digest()}


def _key(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:24]


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
    ``causal``: the default mask of the returned kernels' calls (they take any mask per call:
    ``causal=``, ``window_size=``).
    ``config``: a ``CPUKernelConfig``/``CUDAKernelConfig`` or a dict of them by kernel; default
    chosen by ``choose_configs`` (``tuned=False``: the hand-written defaults, ignoring tuning
    records; the record used is ``kernels.tuning_record``). ``seqlen``: the sequence length the
    kernels are for (an int, or (queries, keys)): tuning records tuned nearest to it, and tiles
    of 16 or 32 rows for sequences that 64-row tiles pad much (``config.tile_edge``; the kernels still take any
    length). ``cache=False`` skips every cache
    (memory, prebuilt, disk). ``deterministic``: CUDA backward without atomic adds (bitwise
    reproducible); CPU kernels are deterministic, independent of the thread count, always.
    """
    causal = checks.require_bool("causal", causal)
    checks.check_kernel_params(head_dim, dtype)
    spec = AttentionSpec(checks.head_dim_value(head_dim), str(dtype))
    return compile_spec(target, spec, causal=causal, config=config, tuned=checks.require_bool("tuned", tuned),
                        seqlen=checks.sequence_lengths(seqlen), cache=checks.require_bool("cache", cache),
                        deterministic=checks.require_bool("deterministic", deterministic))


def request_state() -> tuple:
    """What besides the request decides which kernels a compile returns (the records' generation,
    the steering environment variables): part of every memo of compile results."""
    return records.generation, *_steering_values()


def request_guards() -> tuple | None:
    """``request_state`` as a C launch's guards (``launch.make``), or None where C cannot read it."""
    steering = _steering_values.guards()
    return None if steering is None else ((vars(records), "generation", records.generation), *steering)


def compile_spec(target, spec: AttentionSpec, *, causal: bool = False, config=None, tuned: bool = True,
                 seqlen: int | None = None, cache: bool = True, deterministic: bool = False) -> FlashKernels:
    """``compile`` for any spec (score/mask mods, block sparsity, fp32 results)."""
    memo = None
    if cache and config is None and isinstance(target, (str, dict)):
        memo = (json.dumps(target, sort_keys=True), spec.digest(), spec.mod_inputs, causal, deterministic, tuned,
                seqlen, *request_state())
        with _lock:
            found = _request_memo.get(memo)
        if found is not None:
            return found
    if memo is None:
        return _compile_spec(target, spec, causal=causal, config=config, tuned=tuned, seqlen=seqlen, cache=cache,
                             deterministic=deterministic)
    def resolve() -> FlashKernels:
        return _compile_spec(target, spec, causal=False, config=None, tuned=tuned, seqlen=seqlen, cache=True,
                             deterministic=deterministic)

    kernels_obj = _answered("flash", target, [spec.digest(), _mod_inputs(spec), deterministic, tuned, seqlen], spec,
                            runtime.CPU_FUNCTIONS, FlashKernels, resolve, tuned).with_causal(causal)
    with _lock:
        _request_memo[memo] = kernels_obj
    return kernels_obj


def clear_memory_cache() -> None:
    """Forget every compiled kernel held in this process (the disk cache stays)."""
    with _lock:
        _memory_cache.clear()
        _request_memo.clear()


def can_compile() -> bool:
    """Whether TVM's compiler is here (not its runtime alone, which loads prebuilt kernels only)."""
    import tvm

    return not tvm.base._RUNTIME_ONLY


def _compile_spec(target, spec: AttentionSpec, *, causal: bool, config, tuned: bool, seqlen: int | None,
                  cache: bool, deterministic: bool, prebuilt: bool = True) -> FlashKernels:
    """``compile_spec`` without its memo, from ``$TVMFLASH_PREBUILT`` first unless not ``prebuilt``."""
    if cache and prebuilt:
        found = _find_prebuilt("flash", target, spec, deterministic=deterministic, config=config, tuned=tuned,
                               seqlen=seqlen)
        if found is not None:
            return found.with_causal(causal)
    if not can_compile():
        raise RuntimeError(_nothing_prebuilt("flash", target, spec, deterministic))
    target = targets.resolve(target)
    is_cuda = target.kind.name == "cuda"
    if is_cuda:
        checks.check_cuda_params(spec.head_dim, spec.dtype, target.attrs.get("arch", "sm_90"))
        checks.check_cuda_spec(spec, deterministic)
    configs, record = choose_configs(target, spec, config=config, tuned=tuned, seqlen=seqlen)
    request = _request(target, spec, configs, deterministic, record, _tile_class(target, seqlen, config))
    key = _key(request)
    meta = {**request, "cache_key": key}
    if not cache:
        lib, source = _build(target, spec, configs, meta)
        return FlashKernels(lib, meta, source, causal=causal)

    def load_or_build() -> FlashKernels:
        found = _load_from_disk(key, request, meta) if _can_load(target) else None
        if found is None:
            lib, source = _build(target, spec, configs, meta)
            if not _can_load(target):
                return FlashKernels(lib, meta, source)
            # (a CUDA library would compile its source again when loaded: it keeps the module built)
            found = _stored(FlashKernels, key, request, meta, lib, source, reload=not is_cuda)
        return found

    return _once(_memory_cache, key, load_or_build).with_causal(causal)


_making: dict[object, threading.Lock] = {}  # (memo, key) -> the lock of the thread making it


def _once(memo: dict, key, make):
    """``memo[key]``, made by ``make()`` if missing, once: a thread that finds another making it
    waits for that one's result. (Two threads that missed together loaded the same library twice,
    and loading a library again points its parallel-launch functions back at TVM's pool, under a
    kernel of it that runs on torch's threads: a segfault in its barrier.)"""
    with _lock:
        found = memo.get(key)
        if found is not None:
            return found
        making = _making.setdefault((id(memo), key), threading.Lock())
    with making:
        with _lock:
            found = memo.get(key)
        if found is None:
            found = make()
            with _lock:
                if found is not None:  # (None: nothing found, e.g. no prebuilt library: looked for again)
                    memo[key] = found
                _making.pop((id(memo), key), None)
    return found


# --- warm starts: requests answered in an earlier process (module docstring) ---------------------
def _answered(kind: str, target, asked: list, spec: AttentionSpec, functions: tuple[str, ...], kernels_class,
              resolve, tuned: bool = False):
    """``kernels_class`` for a request: the entry an earlier process resolved the same question to,
    loaded without TVM's compiler; else ``resolve()`` (the kernels, from the disk cache or built),
    whose answer is recorded with the files the resolution read (flash kernels: ``_configs_read``)."""
    question = _question(kind, target, asked, spec)
    if question is not None:
        key = cache.answer(question)
        if key is not None:
            found = _once(_memory_cache, key, lambda: _load_answer(key, kind, spec, functions, kernels_class))
            # (checked here too: an entry already in memory, loaded for another question, was not)
            if found is not None and _answers(found.meta, kind, spec):
                return found
    kernels = resolve()
    key = None if kernels is None else kernels.meta.get("cache_key")
    if question is not None and key is not None:
        cache.remember_answer(question, key, _configs_read(kernels.meta, spec, tuned) if kind == "flash" else [])
    return kernels


def _question(kind: str, target, asked: list, spec: AttentionSpec) -> str | None:
    """The digest that names a request for CPU kernels as asked, with everything besides it that
    decides its answer and is known without TVM (versions, the code of every module a compile
    runs, this CPU, the steering environment); None where no warm start applies (CUDA, a
    ``tvm.target.Target``, prebuilt kernels, a TVM install that names no version)."""
    if target not in ("llvm", "cpu") and not (isinstance(target, dict) and target.get("kind") == "llvm"):
        return None
    if os.environ.get("TVMFLASH_PREBUILT") or _installed_tvm_version() is None:
        return None
    try:
        text = json.dumps([kind, target, asked, _versions(_installed_tvm_version()),
                           import_closure.digest(RESOLVING_MODULES), product_rates.machine_key(),
                           [os.environ.get(name) for name in _STEERING_ENV]], sort_keys=True)
    except TypeError:  # (a target dict with values JSON cannot write)
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=None)
def _installed_tvm_version() -> str | None:
    """TVM's version without importing it (its distribution's metadata), or None if unknown."""
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_answer(key: str, kind: str, spec: AttentionSpec, functions: tuple[str, ...], kernels_class):
    """The recorded entry, if it holds what the question asks: this request kind and spec, the
    code of these versions, for instructions this CPU has."""
    entry = cache.load(key, lambda request: _answers(request, kind, spec), functions)
    if entry is None:
        return None
    return kernels_class(entry.module, {**entry.request, "cache_key": key}, entry.source, library=entry.library)


def _answers(request: dict, kind: str, spec: AttentionSpec) -> bool:
    """Whether kernels built for ``request`` (an entry's, or a kernel object's meta) are what a
    question of this kind and spec asks: the code of these versions, for instructions this CPU has."""
    return (request.get("kernel", "flash") == kind and request["spec"] == spec.to_json()
            and request.get("mod_inputs", _mod_inputs(spec)) == _mod_inputs(spec)  # (flash requests list them)
            and request["versions"] == _versions(_installed_tvm_version())
            and request["target"]["kind"] == "llvm"
            and not targets.missing_isa_features(request.get("isa_features", ())))


def _configs_read(meta: dict, spec: AttentionSpec, tuned: bool) -> list[Path]:
    """The files ``choose_configs`` read for flash kernels of this target and spec: the tuning
    records (``tuned``), and for bf16 the measured product rates."""
    target_key = targets.key(meta["target"])
    roots = (records.user_root(), records.shipped_root()) if tuned else ()
    return ([records.record_path(root, target_key, spec) for root in roots]
            + ([product_rates.stored_file()] if spec.dtype == "bfloat16" else []))


def _load_from_disk(key: str, request: dict, meta: dict) -> FlashKernels | None:
    entry = cache.load(key, request, runtime.functions_of(meta))
    return None if entry is None else FlashKernels(entry.module, meta, entry.source, library=entry.library)


def _stored(kernels_class, key: str, request: dict, meta: dict, lib, source: str | None, reload: bool = True):
    """``kernels_class`` (FlashKernels, DecodeKernels) of a module just built, written to the disk
    cache first: with ``reload``, CPU kernels run from the stored library (threads.py routes a
    library's parallel launches), and the module in memory is never asked for its functions (TVM
    would compile its LLVM code again, ~0.6 s a forward+backward set); else, or where the cache
    cannot be written, from the module in memory."""
    if not reload:  # (the store's answer is then the entry's path alone, or None)
        return kernels_class(lib, meta, source, library=_cache.store(key, request, lib, source))
    library, loaded, name = _cache.store(key, request, lib, source, reload=True)
    if loaded is not None:
        return kernels_class(loaded, meta, source, library=library, loaded_as=name)
    return kernels_class(lib, meta, source, library=library)


def _can_load(target: tvm.target.Target) -> bool:
    """CUDA modules load back only where a GPU driver is present (elsewhere TVM builds a module
    that holds the CUDA source: it exports, for a GPU machine to compile at load, but the disk
    cache could not load it here)."""
    import tvm

    return target.kind.name != "cuda" or tvm.cuda(0).exist


# Kernel sets compiled (not loaded from a cache) in this process: the demo says which it did.
builds = 0


def _build(target: tvm.target.Target, spec: AttentionSpec, configs: dict, meta: dict, transform=None) -> tuple:
    """The built module and its source text (``build.module_source``)."""
    global builds
    builds += 1
    desc = f"{targets.key(target)}, {spec.describe()}" + (", deterministic" if meta["deterministic"] else "")
    forward = configs.get("forward")
    if isinstance(forward, CPUKernelConfig) and (forward.block_q, forward.block_k) != LONG_TILES:
        desc += f", {forward.block_q} x {forward.block_k} tiles for short sequences"
    settings.progress(f"compiling flash attention forward+backward ({desc}) ...")
    start = time.perf_counter()
    from . import build

    lib = build.build_module(target, spec, configs, deterministic=meta["deterministic"], transform=transform)
    source_text = build.module_source(target, lib)
    settings.progress(f"compiled in {time.perf_counter() - start:.1f} s")
    return lib, source_text


def build_transformed(spec: AttentionSpec, transform, description: str, target="llvm") -> FlashKernels:
    """Kernels with ``transform(kernel, scheduled_prim_func)`` applied before code generation,
    with the hand-written configs and never cached: the experiment variants of benchmarks/."""
    target = targets.resolve(target)
    configs, _ = choose_configs(target, spec, tuned=False)
    meta = {**_request(target, spec, configs, False, None), "variant": description}
    lib, source = _build(target, spec, configs, meta, transform=transform)
    return FlashKernels(lib, meta, source)


# --- prebuilt kernels: built on one machine, loaded on another with TVM's runtime alone ---------
PREBUILD_MODS = {"none": (), "softcap": (Softcap(),), "alibi": (Alibi(),), "softcap+alibi": (Softcap(), Alibi())}


def prebuild(directory, target="cuda", head_dims=(64, 128), dtypes=("float16", "bfloat16"),
             deterministic=(False,), score_mods=("none",), fp32_results=(False,), decode: bool = False,
             sinks: bool = False, short_sequences: bool = True) -> list[Path]:
    """Compile and export every combination into ``directory`` (``<target>-d<D>-<dtype>...so``).

    Point ``$TVMFLASH_PREBUILT`` at the directory and ``compile()`` (hence the torch op) loads
    matching kernels from it before trying to compile: a machine without TVM's compiler library
    (``TVM_USE_RUNTIME_LIB=1``, or a runtime-only TVM) can then run them. Kernels take the mask per
    call (causal, windows, varlen), so one library serves every mask. ``score_mods``: which of
    flash-attn's built-in mods, keys of ``PREBUILD_MODS`` ("none", "softcap", "alibi",
    "softcap+alibi"). ``fp32_results``: (True,) or (False, True) for 16-bit dtypes' kernels whose
    out and gradients are float32 (``-fp32-results``: ring attention's, and attention sinks'
    forward, which scales out before rounding it once). CPU targets only: ``decode`` adds, for each
    of these, the decode kernel of ``flash_attn_with_kvcache`` (``-decode``: a model's
    ``generate()`` steps); ``sinks``, for each head dim and dtype, the attention sinks' rescale and
    gradient kernels (``-sinks``; without them a runtime-only process runs those two steps as torch
    ops); ``short_sequences`` (x86), for each flash library, the eight more with 16- and 32-row
    tiles that a compiling process builds for calls of up to ~200 queries or keys
    (``-tiles<Q>x<K>``, ``config.tile_class``; 2-3 s each to build; without them such calls run on
    64-row tiles: a 16-token forward 3-4x as long). Not covered: flex_attention's traced mods and
    block masks. CUDA kernels built on a machine without a GPU hold their CUDA source, which TVM
    with its compiler compiles when they load; for TVM's runtime alone, which cannot, each is also
    compiled here with nvcc into a binary beside it (``cuda_binaries``; returned with the
    libraries).
    """
    # (every argument is checked before anything is built: no half-written directory)
    head_dims, dtypes, deterministic, score_mods, fp32_results = (
        _several(name, value) for name, value in (("head_dims", head_dims), ("dtypes", dtypes),
                                                  ("deterministic", deterministic), ("score_mods", score_mods),
                                                  ("fp32_results", fp32_results)))
    unknown = [m for m in score_mods if m not in PREBUILD_MODS]
    if unknown:
        raise ValueError(f"score_mods {unknown} unknown: choose from {list(PREBUILD_MODS)}")
    for head_dim in head_dims:
        for dtype in dtypes:
            checks.check_kernel_params(head_dim, dtype)
    decode, sinks = checks.require_bool("decode", decode), checks.require_bool("sinks", sinks)
    short_sequences = checks.require_bool("short_sequences", short_sequences)
    if not can_compile():
        raise RuntimeError("prebuild compiles kernels, which TVM's runtime alone cannot: run it where TVM's compiler "
                           "is installed")
    resolved = targets.resolve(target)
    is_cuda = resolved.kind.name == "cuda"
    # (the long class first: the library named by the stem alone, which serves every length)
    tile_classes = [None] + ([t for t in TILE_CLASSES if t != LONG_TILES]
                             if short_sequences and _tile_class(resolved, None) is not None else [])
    if is_cuda and (decode or sinks):
        raise ValueError("the decode and sink kernels run on CPUs only: prebuild them for an llvm target "
                         "(decode=False, sinks=False for CUDA)")
    variants = [(mods, det, fp32) for mods in score_mods for det in (deterministic if is_cuda else (False,))
                for fp32 in dict.fromkeys(checks.require_bool("fp32_results", f) for f in fp32_results)]
    builds = [(head_dim, dtype, variant) for head_dim in head_dims for dtype in dtypes for variant in variants
              if not (variant[2] and str(dtype) == "float32")]  # (float32 kernels' results are float32)
    if not builds:
        raise ValueError(f"nothing to prebuild for head_dims={head_dims}, dtypes={dtypes}, score_mods={score_mods}, "
                         f"fp32_results={fp32_results}" + (": float32 kernels' results are float32 already "
                                                           "(fp32_results=True is for 16-bit dtypes)"
                                                           if head_dims and dtypes and variants else ""))
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"prebuild writes its libraries into a directory; {directory} is not one")
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # a directory only its owner writes
    unsafe = cache.prebuilt_directory_problem(directory)
    if unsafe:  # (an existing one: $TVMFLASH_PREBUILT would refuse it where it is deployed)
        raise cache.UnsafeCacheError(f"prebuild will not write into {directory}: {unsafe}. $TVMFLASH_PREBUILT "
                                     f"would refuse it; use a directory only you can write: `chmod go-w {directory}`.")
    written = []
    cuda_source = is_cuda and not _can_load(resolved)  # (no GPU here: the libraries hold source)

    def export(kernels, name: str) -> None:
        kernels.export_library(directory / name)
        written.append(directory / name)

    for head_dim, dtype, (mods, det, fp32) in builds:
        spec = AttentionSpec(checks.head_dim_value(head_dim), str(dtype), "float32" if fp32 else str(dtype),
                             score_mods=PREBUILD_MODS[mods])
        for tiles in tile_classes:  # (never what $TVMFLASH_PREBUILT holds: kernels built for this target)
            kern = _compile_spec(target, spec, causal=False, config=None, tuned=True, seqlen=tiles, cache=True,
                                 deterministic=det, prebuilt=False)
            stem = (f"{targets.key(kern.meta['target'])}-d{head_dim}-{dtype}" + ("" if mods == "none" else f"-{mods}")
                    + ("-deterministic" if kern.deterministic else "") + ("-fp32-results" if fp32 else ""))
            export(kern, f"{stem}{'' if tiles is None else '-tiles%dx%d' % tiles}.so")
            if cuda_source:
                written += _prebuild_cuda_binary(directory, kern)
        if decode:
            export(_built_decode(target, spec), f"{stem}-decode.so")
    for head_dim in head_dims if sinks else ():
        for dtype in dtypes:
            sink_kernels = _built_sinks(target, AttentionSpec(checks.head_dim_value(head_dim), str(dtype)))
            export(sink_kernels, f"{targets.key(sink_kernels.meta['target'])}-d{head_dim}-{dtype}-sinks.so")
    if written and not is_cuda and not targets.other_architecture(targets.code_json(resolved)):
        written += _prebuild_c_helpers(directory)
    return written


def _several(name: str, value) -> tuple:
    """A prebuild argument that lists choices, as a tuple (one value alone: a tuple of it)."""
    if isinstance(value, (str, int, bool)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{name} lists the choices to build (a tuple), got {value!r}") from None


def _prebuild_c_helpers(directory: Path) -> list[Path]:
    """The kernels' helpers in C (``c_helpers``: torch's threads for their parallel loops, the C
    launch of repeated calls) for a machine without a C compiler; none, with a warning, where they
    cannot be built here."""
    from . import c_helpers

    try:
        return c_helpers.export(directory)
    except (OSError, subprocess.SubprocessError) as err:
        settings.warn(f"the helpers in C are not prebuilt ({type(err).__name__}: {err}): a machine without a C "
                      "compiler will run the kernels on TVM's thread pool, and repeated calls from Python")
        return []


def _prebuild_cuda_binary(directory: Path, kern: FlashKernels) -> list[Path]:
    """The binary of CUDA kernels exported as source (no GPU here), for a GPU machine with TVM's
    runtime alone, which cannot compile it (``cuda_binaries``); none without nvcc, with a warning."""
    if shutil.which("nvcc") is None:
        settings.warn("nvcc is not on PATH: the CUDA kernels are exported as source, which a GPU machine with "
                      "TVM's compiler compiles when it loads them, but TVM's runtime alone cannot")
        return []
    arch = kern.meta["target"]["arch"]
    source = kern.source()
    return [cuda_binaries.write(directory, source, arch, cuda_binaries.compile_with_nvcc(source, arch))]


def _nothing_prebuilt(kind: str, target, spec: AttentionSpec, deterministic: bool) -> str:
    """What to prebuild, for a runtime-only TVM that was asked for kernels (``kind``: "flash",
    "decode") it cannot build."""
    wish = _target_wish(target)
    where = os.environ.get("TVMFLASH_PREBUILT")
    found = f"no kernel in $TVMFLASH_PREBUILT={where} matches" if where else "$TVMFLASH_PREBUILT is not set for"
    asked = (f"{wish} {spec.describe()}" + (", deterministic" if deterministic else "")
             + (" (the decode kernel of flash_attn_with_kvcache)" if kind == "decode" else ""))
    mods = next((name for name, m in PREBUILD_MODS.items() if m == spec.score_mods), None)
    if mods is None or spec.mask_mod is not None or spec.block_sparse:
        how = ("prebuild() covers flash-attn's functions only (with softcap and ALiBi), not flex_attention's mods or "
               "block masks: run this on a machine with TVM's compiler")
    else:
        how = (f"on a machine with TVM's compiler run tvmflash.prebuild(DIR, {wish!r}, head_dims=({spec.head_dim},), "
               f"dtypes=({spec.dtype!r},){', deterministic=(True,)' if deterministic else ''}"
               f"{'' if mods == 'none' else f', score_mods=({mods!r},)'}"
               f"{', fp32_results=(True,)' if spec.out_dtype != spec.dtype else ''}"
               f"{', decode=True' if kind == 'decode' else ''}) and point $TVMFLASH_PREBUILT at DIR")
    lacking = _prebuilt_lacking.get((kind, json.dumps(spec.to_json(), sort_keys=True)))
    if where and lacking:
        how += (f". Skipped for instructions this CPU lacks: {'; '.join(lacking)}: prebuild for this CPU's model, or "
                "for an older one whose instructions it has (\"mcpu\" in the target)")
    return f"TVM's runtime alone cannot compile kernels, and {found} {asked}; {how}"


_prebuilt_cache: dict[str, object] = {}  # (FlashKernels, DecodeKernels, SinkKernels)


def _target_wish(target) -> dict:
    """What a ``target`` argument asks for, without TVM's compiler: kind, and the arch (CUDA) or
    CPU name (LLVM) if given. The host CPU ("llvm") is any CPU model whose instructions run here."""
    if isinstance(target, str):
        return {"kind": "llvm" if target == "cpu" else target}
    if isinstance(target, dict):
        return {k: v for k, v in target.items() if k in ("kind", "arch", "mcpu")}
    attrs = target.attrs
    return {"kind": target.kind.name, **{k: str(attrs[k]) for k in ("arch", "mcpu") if k in attrs}}


def _find_prebuilt(kind: str, target, spec: AttentionSpec, *, deterministic: bool = False, config=None,
                   tuned: bool = True, seqlen=None):
    """Kernels of ``kind`` ("flash", "decode", "sinks") from ``$TVMFLASH_PREBUILT`` that are
    exactly what the call asks for, or None.

    A library matches if it holds kernels of this kind, its target has the requested kind and,
    where the call names them, the same CUDA arch or CPU model; its spec equals the request's;
    CUDA: the same determinism; an explicit ``config`` (flash: per kernel; decode: a
    ``DecodeConfig``) equals its own; ``tuned=False`` wants it built without tuning records. It
    must come from this tvmflash (version and kernel code) and tvm-ffi (skipped with a warning
    otherwise). CPU libraries are only used where every instruction-set extension they were
    compiled for is present on this CPU; of several that match, the one compiled for the most of
    them (the CPU model nearest this one's), then (flash kernels on CPUs) the one whose tile class
    is ``seqlen``'s (``config.tile_class``: 16- or 32-row tiles for short sequences), else one for
    long sequences (64-row tiles, or a library exported without a tile class), then the first by
    name. Every tile class computes every length: the class decides speed only.
    """
    directory = os.environ.get("TVMFLASH_PREBUILT")
    if not directory:
        return None
    wish = _target_wish(target)
    if kind == "flash":
        explicit = {k: c.to_json() for k, c in _explicit_configs(config).items()}
    else:
        explicit = None if config is None else config.to_json() if hasattr(config, "to_json") else repr(config)
    tiles = list(tile_class(seqlen)) if kind == "flash" and wish["kind"] != "cuda" else None
    wanted = json.dumps([directory, kind, wish, spec.to_json(), deterministic, explicit, tuned, tiles],
                        sort_keys=True)

    def rank(match) -> tuple[int, int]:
        meta = match[1]
        have = meta.get("tile_class", list(LONG_TILES))
        return -len(meta.get("isa_features", [])), 0 if have == tiles else 1 if have == list(LONG_TILES) else 2

    def find():
        matches, lacking = [], []
        for so, meta in cache.prebuilt_libraries(Path(directory)):  # safe, unmodified libraries only
            try:
                mismatch = _prebuilt_mismatch(meta, kind, wish, spec, deterministic, explicit, tuned)
            except (KeyError, TypeError, AttributeError) as err:
                settings.warn(f"skipping prebuilt kernels {so} (metadata without, or with a wrong, {err})")
                continue
            if mismatch is None:
                matches.append((so, meta))
            elif mismatch[0] == "versions":
                settings.warn(f"skipping prebuilt kernels {so}: built by another {mismatch[1]}; prebuild them again")
            elif mismatch[0] == "instructions":
                lacking.append(f"{so.name} (needs {mismatch[1]})")
        _prebuilt_lacking[(kind, json.dumps(spec.to_json(), sort_keys=True))] = lacking
        for so, meta in sorted(matches, key=rank):  # (a stable sort: among equals, name order)
            try:
                return runtime.load(so)
            except (ValueError, RuntimeError, OSError) as err:
                settings.warn(f"skipping prebuilt kernels {so} ({err})")
        return None

    return _once(_prebuilt_cache, wanted, find)


# Prebuilt libraries of the last search for a kind and spec that need instructions this CPU
# lacks (the error says why they were not used).
_prebuilt_lacking: dict[tuple[str, str], list[str]] = {}


def _prebuilt_mismatch(meta: dict, kind: str, wish: dict, spec: AttentionSpec, deterministic: bool, explicit,
                       tuned: bool) -> tuple[str, str] | None:
    """None where a prebuilt library's metadata is what the request asks for; else why not:
    ("request", ""), ("versions", what differs) or ("instructions", the extensions this CPU
    lacks). KeyError, TypeError or AttributeError where the metadata does not say."""
    have_kind = runtime.kernel_kind(meta)
    if have_kind not in runtime.KERNEL_KINDS:
        raise KeyError(f"kernel kind {have_kind!r}")
    if have_kind != kind:
        return ("request", "")
    have_target = meta["target"]
    is_cuda = have_target["kind"] == "cuda"
    if kind == "flash":
        configs = meta["configs"]  # (read whether or not the call names configs: flash metadata has them)
        configs_match = all(configs.get(kernel) == cfg for kernel, cfg in explicit.items())
    else:  # (an explicit config of a wrong type is its repr: it matches none)
        configs_match = explicit is None or meta["config"] == explicit
    if not (all(have_target.get(field) == value for field, value in wish.items())
            and meta["spec"] == spec.to_json()
            and not (is_cuda and meta.get("deterministic", False) != deterministic)
            and configs_match
            and not (not tuned and meta.get("tuning_record"))):
        return ("request", "")
    versions = meta["versions"]
    # (all but TVM's own: the kernels' code and the tables' layout are tvmflash's, their calls tvm-ffi's)
    here = {name: value for name, value in _versions(_installed_tvm_version() or "").items() if name != "tvm"}
    differs = [f"{name} ({versions.get(name)}; here {value})" for name, value in here.items()
               if versions.get(name) != value]
    if differs:
        return ("versions", ", ".join(differs))
    features = meta.get("isa_features", [])
    if not isinstance(features, list):
        raise TypeError(f"isa_features {features!r}")
    missing = [] if is_cuda else targets.missing_isa_features(features)
    return ("instructions", ", ".join(missing)) if missing else None


# --- the unfused baseline -------------------------------------------------------------------------
class StandardAttention:
    """The unfused TE definitions compiled as they are: "standard attention", O(N^2) memory.

    The call signatures of ``FlashKernels``; used as an independent second implementation in
    tests and as the baseline of the memory experiments.
    """

    target_kind = "llvm"

    def __init__(self, module, head_dim: int, dtype: str, causal: bool):
        self._module = module
        self.head_dim, self.dtype, self.out_dtype, self.causal = head_dim, dtype, dtype, causal

    def forward(self, q, k, v, out, lse, softmax_scale: float | None = None) -> None:
        checks.check_forward_args(self, q, k, v, out, lse)
        scale = checks.softmax_scale(softmax_scale, self.head_dim)
        runtime.fork_safe(self._module["standard_fwd"])(q, k, v, out, lse, scale)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float | None = None) -> None:
        checks.check_backward_args(self, dout, q, k, v, out, lse, dq, dk, dv)
        scale = checks.softmax_scale(softmax_scale, self.head_dim)
        runtime.fork_safe(self._module["standard_bwd"])(dout, q, k, v, out, lse, dq, dk, dv, scale)


_standard_cache: dict[tuple, StandardAttention] = {}


def compile_standard(head_dim: int = 64, dtype: str = "float32", causal: bool = False) -> StandardAttention:
    """Compile the unfused TE forward and backward for this CPU (cached in this process)."""
    checks.check_kernel_params(head_dim, dtype)
    key = (checks.head_dim_value(head_dim), str(dtype), checks.require_bool("causal", causal))
    if key not in _standard_cache:
        from . import build

        _standard_cache[key] = StandardAttention(build.build_standard(*key), *key)
    return _standard_cache[key]


# --- decoding against a KV cache (kvcache.py) ---------------------------------------------------
_cache = cache  # the module (compile_decode's ``cache`` argument is a flag)


def choose_decode_config(target: tvm.target.Target, spec: AttentionSpec, config=None):
    """The decode kernel's config: an explicit ``DecodeConfig`` or the default for the ISA."""
    from .config import DecodeConfig, default_decode_config

    if config is None:
        return default_decode_config(targets.has_features(target, "avx512f"), spec.dtype)
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"config for the decode kernel must be a DecodeConfig, got {config!r}")
    return config


def _module_request(kind: str, target: tvm.target.Target, spec: AttentionSpec, config: dict | None) -> dict:
    """Everything a one-kernel module's build depends on (JSON): its cache key and metadata."""
    return {
        "kernel": kind,
        "versions": _versions(),
        "target": targets.code_json(target),
        "isa_features": targets.isa_features(target),
        "spec": spec.to_json(),
        "config": config,
    }


def compile_decode(target, spec: AttentionSpec, *, config=None, cache: bool = True) -> runtime.DecodeKernels:
    """The ``flash_decode`` kernel (``kernels/decode.py``) for a CPU target and spec, from the
    memory or disk cache or built. One kernel serves every batch, cache layout (dense or
    paged), length, split and window; the spec fixes head dim, dtype and softcap / ALiBi."""
    def resolve() -> runtime.DecodeKernels:
        prebuilt = _find_prebuilt("decode", target, spec, config=config) if cache else None
        if prebuilt is not None:
            return prebuilt
        if not can_compile():
            raise RuntimeError(_nothing_prebuilt("decode", target, spec, False))
        return _built_decode(target, spec, config, cache)

    if config is not None or not cache:
        return resolve()
    return _answered("decode", target, [spec.digest(), _mod_inputs(spec)], spec, runtime.DecodeKernels.FUNCTIONS,
                     runtime.DecodeKernels, resolve)


def _built_decode(target, spec: AttentionSpec, config=None, cache: bool = True) -> runtime.DecodeKernels:
    """The decode kernel from the memory or disk cache, or built (never prebuilt)."""
    cpu = _cpu_target(target, "flash_attn_with_kvcache")
    cfg = choose_decode_config(cpu, spec, config)
    return _cpu_module("decode", "flash decode", cpu, spec, cfg.to_json(),
                       lambda build: build.build_decode_module(cpu, spec, cfg), runtime.DecodeKernels, cache)


def compile_sinks(target, spec: AttentionSpec) -> runtime.SinkKernels | None:
    """The attention sinks' rescale and gradient kernels (``kernels/sinks.py``) for a CPU target,
    head dim and dtype (of out'), from ``$TVMFLASH_PREBUILT``, the memory or disk cache or built
    (~0.1 s); None where TVM's runtime alone finds none of these (sinks.py keeps its torch ops)."""
    def resolve() -> runtime.SinkKernels | None:
        prebuilt = _find_prebuilt("sinks", target, spec)
        if prebuilt is not None or not can_compile():
            return prebuilt
        return _built_sinks(target, spec)

    return _answered("sinks", target, [spec.digest()], spec, runtime.SinkKernels.FUNCTIONS, runtime.SinkKernels,
                     resolve)


def _built_sinks(target, spec: AttentionSpec) -> runtime.SinkKernels:
    """The sink kernels from the memory or disk cache, or built (never prebuilt)."""
    cpu = _cpu_target(target, "the sink kernels")
    return _cpu_module("sinks", "the sink kernels", cpu, spec, None,
                       lambda build: build.build_sink_module(cpu, spec), runtime.SinkKernels, True)


def _cpu_target(target, what: str) -> tvm.target.Target:
    target = targets.resolve(target)
    if target.kind.name != "llvm":
        raise NotImplementedError(f"{what} run on CPUs only so far")
    return target


def _cpu_module(kind: str, title: str, target: tvm.target.Target, spec: AttentionSpec, config: dict | None,
                build_module, kernels_class, cache: bool):
    """``kernels_class`` of a small CPU module (``kind``: the request's name for it), loaded
    from the memory or disk cache, or ``build_module(build)`` (the code generators' module,
    imported on a miss only; then stored)."""
    request = _module_request(kind, target, spec, config)
    key = _key(request)
    meta = {**request, "cache_key": key}

    def load_or_build():
        if cache:
            entry = _cache.load(key, request, kernels_class.FUNCTIONS)
            if entry is not None:
                return kernels_class(entry.module, meta, entry.source, library=entry.library)
        settings.progress(f"compiling {title} ({targets.key(target)}, {spec.describe()}) ...")
        start = time.perf_counter()
        from . import build

        lib = build_module(build)
        source = build.module_source(target, lib)
        settings.progress(f"compiled in {time.perf_counter() - start:.1f} s")
        if cache:
            return _stored(kernels_class, key, request, meta, lib, source)
        return kernels_class(lib, meta, source)

    return _once(_memory_cache, key, load_or_build) if cache else load_or_build()
