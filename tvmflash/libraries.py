"""Loading compiled libraries: CPU ones with TVM's runtime library alone, not TVM's Python package.

``import tvm`` takes ~1.3 s (its compiler library, LLVM's, and every IR module's Python) where
running a compiled library needs tvm-ffi and ``libtvm_runtime.so`` (~1 ms): that library fills
the generated code's ``__TVMBackend*`` slots (workspaces, TVM's parallel launch), which stay
NULL under tvm-ffi alone. ``import tvm`` loads the same file first, so either order works.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import tvm_ffi
import tvm_ffi.libinfo

_lock = threading.Lock()
_runtime_loaded = False


def load_library(path, target_kind: str = "llvm") -> tvm_ffi.Module:
    """A compiled library (an exported .so) as a module whose functions can be called: a CPU
    library (``target_kind`` "llvm") with TVM's runtime library alone, others (CUDA: their
    device code) through TVM's own loaders."""
    if target_kind != "llvm":
        import tvm

        return tvm.runtime.load_module(str(path))
    _load_tvm_runtime()
    return tvm_ffi.load_module(str(path))


def _load_tvm_runtime() -> None:
    global _runtime_loaded
    with _lock:
        if _runtime_loaded or "tvm.base" in sys.modules:  # (tvm.base loads it on import)
            _runtime_loaded = True
            return
        # TVM's own search path: tvm/libinfo.py imports nothing of TVM's, so it runs alone
        package = importlib.util.find_spec("tvm")
        if package is None or not package.submodule_search_locations:
            raise RuntimeError("TVM is not installed (pip install apache-tvm)")
        file = Path(next(iter(package.submodule_search_locations))) / "libinfo.py"
        spec = importlib.util.spec_from_file_location("_tvmflash_tvm_libinfo", file)
        libinfo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(libinfo)
        tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL",
                                        extra_lib_paths=libinfo.package_lib_paths())
        _runtime_loaded = True
