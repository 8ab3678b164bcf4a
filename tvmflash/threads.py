"""One thread pool: the CPU kernels' parallel loops run on torch's OpenMP threads.

TVM's LLVM code starts each ``T.parallel`` region through a function pointer that every
generated library holds (``__TVMBackendParallelLaunch``), which TVM's library loader points at
its own thread pool. In a model, torch's ops run on torch's OpenMP workers right before and after
attention, and both pools' workers spin after a region on the same cores (DEVELOPING.md,
"Threads"). When torch is imported and runs on GNU OpenMP, ``route`` points that pointer at a
small C function (``threads.c``, compiled once into the cache directory) that runs the tasks as a
parallel region of torch's libgomp: the same workers as torch's intra-op pool, as many as
``torch.get_num_threads()``. Without torch (the compile API alone), or where the shim cannot be
built, kernels keep TVM's pool.

After ``fork`` GNU libgomp's pool is unusable in the child (a parallel region waits for the
parent's workers forever, torch's own ops included); the shim then runs the tasks on the calling
thread, and if our kernels had started libgomp's pool in the parent, the child's torch runs on one
thread too (``torch.set_num_threads(1)``, what torch's DataLoader does in its workers), so that a
forked child's torch ops do not hang where they would not have without tvmflash.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

from . import settings

_LAUNCH_SLOT = "__TVMBackendParallelLaunch"
_BARRIER_SLOT = "__TVMBackendParallelBarrier"

_lock = threading.Lock()
_shim: ctypes.CDLL | None = None
_shim_failed: str | None = None  # why torch's threads are not used (None: not tried yet, or working)


def torch_openmp() -> ctypes.CDLL | None:
    """libtorch_cpu, if torch is imported and its intra-op pool is GNU OpenMP (libgomp)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.backends.openmp.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        # dlsym on this handle searches libtorch_cpu's own dependencies: its libgomp
        handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        handle.GOMP_parallel  # GNU OpenMP (not Intel's or LLVM's runtime under that name)
    except (OSError, AttributeError):
        return None
    return handle


def _build_shim() -> ctypes.CDLL:
    """threads.c compiled into the cache directory (once per source), or prebuilt; loaded."""
    from .c_helpers import threads_library

    return ctypes.CDLL(str(threads_library()))


def _single_threaded_torch_after_fork() -> None:
    if _shim is not None and _shim.tvmflash_threads_started_region():
        sys.modules["torch"].set_num_threads(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_single_threaded_torch_after_fork)


def _shim_for(gomp: ctypes.CDLL) -> ctypes.CDLL | None:
    global _shim, _shim_failed
    with _lock:
        if _shim is None and _shim_failed is None:
            try:
                shim = _build_shim()
                address = [ctypes.cast(getattr(gomp, name), ctypes.c_void_p) for name in
                           ("GOMP_parallel", "GOMP_barrier", "omp_get_thread_num", "omp_get_num_threads",
                            "omp_get_max_threads", "omp_in_parallel")]
                shim.tvmflash_threads_init(*address)
                shim.tvmflash_threads_limit.argtypes = [ctypes.c_int]
                shim.tvmflash_threads_limit.restype = None
                _shim = shim
            except (OSError, AttributeError, subprocess.SubprocessError) as err:
                _shim_failed = str(err)
                settings.warn(f"the kernels keep TVM's thread pool (torch's OpenMP threads are not usable: {err}); "
                              "torch's and TVM's workers will compete for the cores")
        return _shim


def route(library: Path | str | None) -> bool:
    """Point the parallel launch of the loaded kernel ``library`` at torch's OpenMP threads.

    ``library``: the name the library was loaded by (``dlopen`` finds it by that name; another
    path to the same file would become a second name of it: see ``cache.store``). Returns whether
    it did: False without torch, without GNU OpenMP, for an in-memory module (``library`` None),
    or where the shim cannot be built (then with one warning). TVM's barrier between a region's
    stages is pointed at the shim's too.
    """
    if library is None:
        return False
    gomp = torch_openmp()
    if gomp is None:
        return False
    try:  # the library TVM loaded (RTLD_NOLOAD: this never loads anything new)
        handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        slot = ctypes.c_void_p.in_dll(handle, _LAUNCH_SLOT)
    except (OSError, ValueError):
        return False
    try:  # (kernels whose region has stages: a barrier between them)
        barrier = ctypes.c_void_p.in_dll(handle, _BARRIER_SLOT)
    except ValueError:
        barrier = None
    shim = _shim_for(gomp)
    if shim is None:
        return False
    if barrier is not None:
        barrier.value = ctypes.cast(shim.tvmflash_parallel_barrier, ctypes.c_void_p).value
    slot.value = ctypes.cast(shim.tvmflash_parallel_launch, ctypes.c_void_p).value
    return True


_limit_set = threading.local()  # the limit this thread last gave the shim (the shim's is per thread too)


def limit(count: int) -> None:
    """At most ``count`` threads for the routed launches this thread makes next (every routed
    call sets it: a call with fewer tasks than threads wakes no idle worker)."""
    if _c_limit is not None:  # (C launches set it too: no memo may stand between)
        _c_limit(count)
    elif getattr(_limit_set, "count", None) != count:  # (a ctypes call costs ~1-2 us; a decode step makes one)
        _shim.tvmflash_threads_limit(count)
        _limit_set.count = count


_c_limit = None  # launch.c's limit, once C launches set the limit


def use_limit_of(launcher) -> bool:
    """Let ``launcher`` (the C launch module) set the shim's limit, and set it through the
    launcher from now on; False where there is no shim."""
    global _c_limit
    if _shim is None:
        return False
    if _c_limit is None:
        with _lock:
            launcher.bind_limit(ctypes.cast(_shim.tvmflash_threads_limit, ctypes.c_void_p).value)
            _c_limit = launcher.limit
    return True


def torch_threads() -> int:
    """torch's intra-op thread count (what a routed kernel's region gets)."""
    return sys.modules["torch"].get_num_threads()


def last_launch() -> tuple[int, list[int], int]:
    """(team size, OS thread id of each task, launches so far) of the shim's last launch: for tests."""
    if _shim is None:
        return 0, [], 0
    tids = (ctypes.c_long * 256)()
    count = ctypes.c_long()
    team = _shim.tvmflash_threads_last(tids, 256, ctypes.byref(count))
    return team, list(tids[:team]), count.value
