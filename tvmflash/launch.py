"""Repeated kernel calls launched from C: ``launch.c``, compiled once into the cache directory.

A model calls attention once per layer and token with the same shapes; after the first call's
checks, what is left per call is matching the tensors, allocating the outputs and packing the
kernel's arguments. In Python that costs ~5 us while the interpreter's data is in cache, and
30-60 us where a model's products have just evicted it (between a model's layers: where every
attention call runs; DEVELOPING.md, "Repeated calls launched from C"). A ``Launch`` does it in
one C call, reading torch tensors through torch's DLPack C exchange table and calling the kernel
through tvm-ffi's C ABI.

``make(...)`` returns a Launch, or None where the module cannot be built (no C compiler, no
Python headers, a torch or tvm-ffi without the C entry points it needs): the callers then keep
their Python path, which does the same.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import subprocess
import threading

from . import settings, threads

_MODULE_NAME = "tvmflash_launch"  # (PyInit_tvmflash_launch)

_lock = threading.Lock()
_module = None
_failed: str | None = None  # why there is no module (None: not tried yet, or loaded)


def _load():
    from .c_helpers import launch_library

    import tvm_ffi.libinfo
    import torch

    library = launch_library()
    loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(library))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(_MODULE_NAME, loader))
    loader.exec_module(module)
    # tvm-ffi's library is loaded already (tvm_ffi imports it; RTLD_NOLOAD: nothing new is loaded)
    ffi = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    address = [ctypes.cast(getattr(ffi, name), ctypes.c_void_p).value
               for name in ("TVMFFIFunctionCall", "TVMFFIErrorMoveFromRaised", "TVMFFIObjectDecRef")]
    module.init(torch.Tensor, torch.Tensor.__dlpack_c_exchange_api__, torch.is_grad_enabled,
                torch._C.TensorBase.__dict__["requires_grad"], *address)
    return module


def module():
    """The loaded C module, or None (once per process: the first failure is kept, with one warning)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _load()
            except (OSError, ImportError, AttributeError, KeyError, TypeError, RuntimeError,
                    subprocess.SubprocessError) as err:
                _failed = f"{type(err).__name__}: {err}"
                settings.warn(f"repeated calls keep their Python path (the C launcher is not usable: {_failed})")
    return _module


def make(function, template: tuple, inputs: tuple, outputs: tuple, *, team: int, refuse_grad: bool,
         guards: tuple | None):
    """A ``Launch`` (launch.c says what the arguments are), or None without the C module.

    ``team``: the thread limit for a kernel on torch's threads (0: a kernel on TVM's pool, whose
    limit it leaves alone). ``guards``: ((dict, key, value), ...) that must still hold when a
    call runs (``settings.EnvironmentValues.guards``); None: they cannot be read from C (then no
    launch)."""
    found = module()
    if found is None or guards is None:
        return None
    if not hasattr(function, "__chandle__"):  # (a kernel on TVM's pool runs fork_safe's Python wrapper)
        return None
    if team and not threads.use_limit_of(found):
        return None  # (a kernel on torch's threads without the shim: cannot happen; no launch then)
    made = found.Launch(function, template, inputs, outputs, team, refuse_grad)
    made.set_guards(guards)
    return made


def meta_key(*tensors) -> tuple | None:
    """What the checks of a call read from its plain torch tensors but their values (dtype,
    device, shape, strides), as one hashable tuple; None for other tensors (a sparse layout,
    say). The C module's (one call, where Python reads 12 attributes for three tensors: ~30 us
    where the interpreter's data has been evicted), else Python's; chosen at the first call."""
    global meta_key
    found = module()
    meta_key = found.meta_key if found is not None else _python_meta_key
    return meta_key(*tensors)


def _python_meta_key(*tensors) -> tuple | None:
    try:
        return tuple(x for t in tensors for x in (t.dtype, t.device, t.shape, t.stride()))
    except RuntimeError:  # (no strides)
        return None


def eager_state(conditions: tuple, *tensors) -> int:
    """2 unless every ``(callable, args, value)`` of ``conditions`` holds (``callable(*args) ==
    value``: no autocast, mode or transform that must see the call), else 1 if autograd records
    a call of these tensors, else 0. The C module's (one call where Python makes five, ~20 us
    where the interpreter's data has been evicted), else Python's; chosen at the first call."""
    global eager_state
    found = module()
    eager_state = found.eager_state if found is not None else _python_eager_state
    return eager_state(conditions, *tensors)


def _python_eager_state(conditions: tuple, *tensors) -> int:
    import torch

    if any(function(*args) != value for function, args, value in conditions):
        return 2
    return int(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
