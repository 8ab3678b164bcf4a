"""Targets: turn what users pass ("llvm", "cuda", dicts, Targets) into full TVM targets.

TVM 0.27 rejects ``mcpu=native`` on this LLVM triple, and a generic x86 target would compile
for SSE2 only, so the host CPU name is asked from LLVM and written into the target. The target's
JSON is part of every cache key: kernels built for AVX-512 are never loaded on an AVX2 machine.
"""

from __future__ import annotations

import functools
import os

import tvm
import tvm_ffi


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    return str(tvm_ffi.get_global_func("target.llvm_get_system_cpu")())


def host_target() -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": usable_cpus()})


def resolve(target) -> tvm.target.Target:
    """Accepts "llvm", "cuda", a target dict or a ``tvm.target.Target``."""
    if isinstance(target, tvm.target.Target):
        config = dict(target.export())
    elif isinstance(target, str):
        if target not in ("llvm", "cpu", "cuda"):
            raise ValueError(
                f"unknown target {target!r}: use 'llvm', 'cuda', a dict such as "
                "{'kind': 'cuda', 'arch': 'sm_90'} or a tvm.target.Target"
            )
        config = {"kind": "llvm" if target == "cpu" else target}
    elif isinstance(target, dict):
        config = dict(target)
    else:
        raise TypeError(f"target must be a str, dict or tvm.target.Target, not {type(target).__name__}")
    kind = config.get("kind")
    if kind == "llvm":
        config.setdefault("mcpu", host_cpu())
        config.setdefault("num-cores", usable_cpus())
        return tvm.target.Target(config)
    if kind == "cuda":
        config.setdefault("arch", "sm_90")
        config.pop("host", None)
        return tvm.target.Target(config, host=host_target())
    raise ValueError(f"unsupported target kind {kind!r}: tvmflash compiles for 'llvm' and 'cuda'")


def key(target) -> str:
    """Short, file-name-safe name of a target (a Target or its JSON dict): 'llvm-emeraldrapids',
    'cuda-sm_90'."""
    kind, attrs = (target["kind"], target) if isinstance(target, dict) else (target.kind.name, target.attrs)
    if kind == "llvm":
        return f"llvm-{attrs.get('mcpu', 'generic')}"
    return f"{kind}-{attrs.get('arch', 'unknown')}"
