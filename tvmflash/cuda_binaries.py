"""Compiled CUDA binaries for kernels loaded with TVM's runtime alone.

A CUDA library exported on a machine without a GPU holds its kernels' CUDA source, and TVM's
runtime compiles that source when the library loads, through the ``tvm_callback_cuda_compile``
callback. TVM's own callback needs TVM's compiler library (it asks for the current ``Target``),
so with the runtime alone (``TVM_USE_RUNTIME_LIB=1``, or the package without
``libtvm_compiler.so``: the GPU machines of ``benchmarks/gpu_bundle.py``) it fails. There
``runtime.load`` puts this module's callback in its place: it returns the binary that
``tvmflash.prebuild`` compiled next to the library (``<sha256>.fatbin``, nvcc with TVM's own
options, when nvcc was there), so the GPU machine compiles nothing.

A binary is the name of the source and arch it was compiled from (SHA-256), is loaded only
under the prebuilt directory's rules (``cache.prebuilt_file_problem``: owned by this user or root,
writable by nobody else, a regular file) and must hash to the digest in its ``.json``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from . import cache, settings

SUFFIX = ".fatbin"


def binary_name(source: str, arch: str) -> str:
    """The file name of the binary of ``source`` compiled for ``arch`` (e.g. "sm_90")."""
    return hashlib.sha256(f"{arch}\n{source}".encode()).hexdigest() + SUFFIX


def compile_with_nvcc(source: str, arch: str) -> bytes:
    """``source`` compiled as TVM's runtime compiles it at load with TVM_CUDA_COMPILE_MODE=nvcc (a fatbin).

    Needs TVM's compiler library (TVM's nvcc wrapper reads the target) and nvcc on PATH."""
    import tvm
    from tvm.support import nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        return bytes(nvcc.compile_cuda(source, target_format="fatbin", compiler="nvcc"))


def write(directory: Path, source: str, arch: str, binary: bytes) -> Path:
    """Store ``binary`` under its name in ``directory``, with a ``.json`` of its digest."""
    path = Path(directory) / binary_name(source, arch)
    meta = {"arch": arch, "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "sha256": hashlib.sha256(binary).hexdigest()}
    # (renamed into place, private whatever the umask: under umask 002 ``find`` would refuse them)
    cache.replace_with(path, lambda temporary: temporary.write_bytes(binary))
    cache.replace_with(Path(str(path) + ".json"), lambda temporary: temporary.write_text(json.dumps(meta, indent=1)))
    return path


def find(directory: Path, source: str, arch: str) -> bytes:
    """The binary of ``source`` for ``arch`` in ``directory``; RuntimeError naming what is wrong
    if there is none that may be loaded."""
    path = Path(directory) / binary_name(source, arch)
    meta_path = Path(str(path) + ".json")
    for p in (path, meta_path):
        try:
            problem = cache.prebuilt_file_problem(p)
        except FileNotFoundError:
            raise RuntimeError(
                f"TVM's runtime alone cannot compile CUDA source, and {directory} has no binary of these kernels "
                f"for {arch} ({path.name}): run tvmflash.prebuild on a machine with TVM's compiler and nvcc") from None
        if problem:
            raise RuntimeError(f"tvmflash will not load {p}: {problem}")
    binary = path.read_bytes()
    try:
        digest = settings.read_json(meta_path)["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"tvmflash will not load {path}: {meta_path.name} is no binary's metadata ({err!r})") from None
    if hashlib.sha256(binary).hexdigest() != digest:
        raise RuntimeError(f"tvmflash will not load {path}: it does not match the checksum in {meta_path.name}")
    return binary


def serve(directory: Path, arch: str) -> None:
    """Let the callback serve binaries for ``arch`` from ``directory`` (a prebuilt directory whose
    CUDA library is about to load) from now on: TVM may compile a module's source when it loads
    or when its first kernel is fetched."""
    import tvm_ffi

    with _lock:
        if not _served:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", _callback, override=True)
        if (Path(directory), arch) not in _served:
            _served.append((Path(directory), arch))


def _callback(source: str) -> bytes:
    with _lock:
        served = list(_served)
    errors = []
    for directory, arch in served:
        try:
            return find(directory, source, arch)
        except RuntimeError as err:
            errors.append(str(err))
    raise RuntimeError("; ".join(errors) or "TVM's runtime alone cannot compile CUDA source")


_lock = threading.Lock()
_served: list[tuple[Path, str]] = []
