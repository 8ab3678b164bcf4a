"""The kernels' helpers in C, compiled at their first use into the cache directory
(``cache.built_from_c``): ``threads.c``, which runs the kernels' parallel loops on torch's
OpenMP threads (``threads.py``), and ``launch.c``, which launches repeated calls (``launch.py``).
Without a C compiler (a deployment of prebuilt kernels, say) they come from
``$TVMFLASH_PREBUILT``, where ``prebuild`` puts the copies it builds (``export``)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from . import cache

THREADS_SOURCE = Path(__file__).with_name("threads.c")
LAUNCH_SOURCE = Path(__file__).with_name("launch.c")


def threads_library() -> Path:
    """threads.c built (once per source), or prebuilt."""
    return cache.built_from_c(THREADS_SOURCE, "threads.so", ["-O2", "-shared", "-fPIC", "-pthread"])


def launch_library() -> Path:
    """launch.c built as a Python extension (once per source, headers and Python), or prebuilt."""
    flags, inputs = _launch_headers()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache.built_from_c(LAUNCH_SOURCE, "launch" + suffix, ["-O2", "-shared", "-fPIC", *flags], inputs=inputs)


def _launch_headers() -> tuple[list[str], bytes]:
    """launch.c's include flags, and what decides its build besides them (part of its key):
    tvm-ffi's and DLPack's headers, and the Python it is for (its implementation, minor version
    and ABI name, not its headers, which a deployment that loads a prebuilt copy may lack)."""
    import tvm_ffi.libinfo

    python = sysconfig.get_paths()["include"]
    ffi = tvm_ffi.libinfo.find_include_path()
    dlpack = tvm_ffi.libinfo.find_dlpack_include_path()
    headers = b"".join(p.read_bytes() for p in (Path(ffi, "tvm/ffi/c_api.h"), Path(dlpack, "dlpack/dlpack.h")))
    # (an extension's ABI is the minor version's: another build of it, or a patch release, serves)
    abi = f"{sys.implementation.cache_tag}\0{sysconfig.get_config_var('SOABI')}".encode()
    return [f"-I{python}", f"-I{ffi}", f"-I{dlpack}"], headers + abi


def export(directory: Path) -> list[Path]:
    """Both helpers, built here (or found in the cache), copied into a prebuilt directory for
    this architecture and Python; OSError (or subprocess's errors) where one cannot be built."""
    return [copy for build in (threads_library, launch_library) for copy in cache.export_helper(build(), directory)]
