"""AMX's tile registers for this process (Linux): the request its first tile instruction needs.

Linux enables AMX's tile data (XTILEDATA, 8 KB of register state) per process, on request:
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; a tile instruction before that faults
(SIGILL). The kernels with AMX products (``config.AMX``; DEVELOPING.md, "AMX tiles") run only
after ``request_tile_permission`` made the request, once per process (threads and forked
children inherit the permission); ``target.amx_features`` tells which AMX extensions a target
compiles for.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading

from . import settings

SYS_ARCH_PRCTL = 158  # x86-64 system call number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

_lock = threading.Lock()
_granted: bool | None = None  # None: not asked yet in this process


def _arch_prctl(code: int, argument: int) -> int:
    """The raw system call: 0, or -1 with errno set."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(argument))


def request_tile_permission() -> bool:
    """Ask Linux for AMX tile data in this process (once; later calls return the first answer).
    False, with one warning, where it is refused or not supported (not Linux on x86-64, a kernel
    before 5.16, a CPU or hypervisor without AMX)."""
    global _granted
    with _lock:
        if _granted is None:
            _granted, why = _request()
            if not _granted:
                settings.warn(f"AMX tiles are not available to this process ({why}): no AMX code can run")
        return _granted


def _request() -> tuple[bool, str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"arch_prctl is Linux's on x86-64, this is {platform.system()} on {platform.machine()}"
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return True, ""
    code = ctypes.get_errno()
    return False, f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: {errno.errorcode.get(code, code)} " \
                  f"({os.strerror(code)})"


def _forget() -> None:
    """Ask again at the next request: for tests (Linux keeps a granted permission for the process)."""
    global _granted
    with _lock:
        _granted = None
