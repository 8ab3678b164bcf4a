"""Targets: turn what users pass ("llvm", "cuda", dicts, Targets) into full TVM targets.

TVM 0.27 rejects ``mcpu=native`` on this LLVM triple, and a generic x86 target would compile
for SSE2 only, so the host CPU name is asked from LLVM and written into the target. The target's
JSON is part of every cache key: kernels built for AVX-512 are never loaded on an AVX2 machine.

**Target from features.** The CPU model name LLVM reports can disagree with the CPU: a hypervisor
reported an Emerald Rapids (AVX512-BF16, AMX) as model 167, which LLVM calls ``rocketlake``
(neither), and may hide extensions a model has. The host target therefore keeps ``mcpu`` (the
scheduling model) and carries in ``mattr`` the difference between the model's extensions and this
CPU's ``/proc/cpuinfo`` flags: ``-feature`` for what the model implies and the CPU lacks,
``+feature`` for what it has and the model lacks (``cpu_target``). Where they agree there is no
``mattr`` and the target is what it was before.

**aarch64** (issue 20): the same design with Arm's names. The CPU's ``Features`` line in
/proc/cpuinfo (``asimd``, ``sve``, ``sve2``, ``bf16``, ``i8mm``, ...; read on aarch64 Linux) is
compared with LLVM's model (``mcpu``, from the "CPU implementer / part" lines) over the extensions
in ``_ARM_ISA``. Vectors are NEON's 128 bits (4 fp32 lanes, 32 registers) on every Arm CPU: TVM's
fixed-width vectors are what LLVM lowers to NEON; SVE's scalable vectors are not used.
``is_aarch64`` tells a target's architecture (its ``mtriple``, else this machine's).

``resolve`` needs TVM's compiler library (each function that asks LLVM imports ``tvm``);
``host_isa_features``, ``missing_isa_features`` and ``key`` of a JSON dict do not (they read the
CPU's flags), so cached and prebuilt kernels can be checked against the CPU without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from typing import TYPE_CHECKING

import tvm_ffi

from .settings import usable_cpus

if TYPE_CHECKING:
    import tvm


def _llvm(name: str):
    """One of LLVM's functions that TVM's compiler library registers (``import tvm`` loads it)."""
    import tvm  # noqa: F401

    return tvm_ffi.get_global_func(name)


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    return str(_llvm("target.llvm_get_system_cpu")())


def host_target() -> tvm.target.Target:
    return resolve("llvm")


def cpu_target(mcpu: str, cpu_flags) -> dict:
    """The LLVM target (a dict) for a CPU that LLVM models as ``mcpu`` and whose extensions are
    ``cpu_flags`` (/proc/cpuinfo's names, normalized as ``host_isa_features`` returns them; None:
    unknown, the model's features are kept)."""
    config = {"kind": "llvm", "mcpu": mcpu}
    mattr = feature_differences(mcpu, None if cpu_flags is None else frozenset(cpu_flags))
    mattr += full_width_vectors(mcpu, mattr)
    if mattr:
        config["mattr"] = list(mattr)
    return config


@functools.lru_cache(maxsize=64)
def full_width_vectors(mcpu: str, mattr: tuple[str, ...]) -> tuple[str, ...]:
    """``("-prefer-256-bit",)`` where LLVM's model of an AVX-512 CPU prefers 256-bit vectors
    (every Intel model from Skylake-AVX512 to Granite Rapids: a tuning flag for the clock drop of
    early AVX-512 cores). With it LLVM splits the kernels' 16-lane vectors into ymm halves:
    twice the instructions. Without it, on a Sapphire Rapids-class Xeon (DEVELOPING.md), B1 N2048
    H8 D64 causal: fp32 forward 21.9 -> 20.4 ms, AMX bf16 forward 10.5 -> 9.0 ms."""
    import tvm

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, **({"mattr": list(mattr)} if mattr else {})})
    return ("-prefer-256-bit",) if has_features(target, "avx512f", "prefer-256-bit") else ()


@functools.lru_cache(maxsize=64)
def feature_differences(mcpu: str, cpu_flags) -> tuple[str, ...]:
    """``mattr`` entries that make LLVM's ``mcpu`` compile for exactly the extensions in
    ``cpu_flags``: "-f" for each of the model's extensions the flags lack, "+f" for each extension
    LLVM knows (on any x86 model) that the flags have and the model lacks; sorted."""
    if cpu_flags is None:
        return ()
    import tvm

    model = set(isa_features(tvm.target.Target({"kind": "llvm", "mcpu": mcpu})))
    lacking = {name for name in model if not _present(name, cpu_flags)}
    known = set(_ARM_ISA) if platform.machine() in _ARM_MACHINES else _known_isa_features()
    extra = {name for name in known - model if _normal(name) in cpu_flags}
    return tuple(sorted([f"-{name}" for name in lacking] + [f"+{name}" for name in extra], key=lambda f: (f[1:], f[0])))


def _present(name: str, cpu_flags) -> bool:
    return _normal(name) in cpu_flags or _normal(name) in _LLVM_ONLY


@functools.lru_cache(maxsize=None)
def _known_isa_features() -> frozenset[str]:
    """Every instruction-set extension of LLVM's x86 CPU models (~30 ms once)."""
    import tvm

    archlist = _llvm("target.llvm_get_cpu_archlist")
    names = {str(name) for name in archlist(tvm.target.Target({"kind": "llvm"}))}
    return frozenset(f for name in names for f in isa_features(tvm.target.Target({"kind": "llvm", "mcpu": name})))


_X86_MACHINES = ("x86_64", "AMD64")
_ARM_MACHINES = ("aarch64", "arm64")


def other_architecture(target: dict) -> bool:
    """Whether an LLVM target's JSON dict compiles for another architecture than this machine's
    (x86 vs aarch64; an aarch64 ``mtriple`` on x86 and the reverse)."""
    if target.get("kind") != "llvm":
        return False
    here_arm = platform.machine() in _ARM_MACHINES
    triple = str(target.get("mtriple", ""))
    return bool(triple) and is_aarch64(target) != here_arm


def _host_flags():
    """This CPU's flags where they describe the target's CPU (x86 or aarch64 Linux), else None."""
    return host_isa_features() if platform.machine() in _X86_MACHINES + _ARM_MACHINES else None


def is_aarch64(target) -> bool:
    """Whether an LLVM target (a Target or its JSON dict) compiles for aarch64: its ``mtriple``,
    else (TVM's default triple) this machine's architecture."""
    if isinstance(target, dict):
        if target.get("kind") != "llvm":
            return False
        triple = str(target.get("mtriple", ""))
    else:
        if target.kind.name != "llvm":
            return False
        triple = str(target.attrs.get("mtriple", ""))
    if triple:
        return triple.startswith(("aarch64", "arm64"))
    return platform.machine() in _ARM_MACHINES


def resolve(target) -> tvm.target.Target:
    """Accepts "llvm", "cuda", a target dict or a ``tvm.target.Target``."""
    import tvm

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
        mcpu, triple = config.get("mcpu"), str(config.get("mtriple") or tvm.target.codegen.llvm_get_system_triple())
        if mcpu is not None and not tvm.target.codegen.llvm_is_valid_cpu(str(mcpu), triple):
            # (LLVM would only print an error and compile for a generic CPU)
            raise ValueError(f"LLVM knows no CPU {mcpu!r} for {triple}: name one LLVM models "
                             f"(tvm.target.codegen.llvm_get_cpu_archlist), or leave mcpu out for this machine's")
        if config.get("mcpu", host_cpu()) == host_cpu() and "mattr" not in config:
            # this CPU: its model for scheduling, its own extensions for the code
            config.update(cpu_target(host_cpu(), _host_flags()))
        config.setdefault("num-cores", usable_cpus())
        return tvm.target.Target(config)
    if kind == "cuda":
        config.setdefault("arch", "sm_90")
        config.pop("host", None)
        return tvm.target.Target(config, host=host_target())
    raise ValueError(f"unsupported target kind {kind!r}: tvmflash compiles for 'llvm' and 'cuda'")


# Target attributes that do not change the generated code: kept out of cache keys, so each CPU
# affinity (taskset, container quotas) does not compile anew. "num-cores" is read by MetaSchedule
# only (its parallelism limits while tuning), never by TVM's LLVM codegen.
_NOT_IN_CODE = ("num-cores",)


def code_json(target: tvm.target.Target) -> dict:
    """The target as JSON (its host's too) without attributes that do not change the code."""
    config = json.loads(str(target))
    for attrs in (config, config.get("host") if isinstance(config.get("host"), dict) else {}):
        for name in _NOT_IN_CODE:
            attrs.pop(name, None)
    return config


def has_features(target: tvm.target.Target, *features: str) -> bool:
    """Whether LLVM compiles for all these features (LLVM names: "avx512f", "avx512bf16") on an
    LLVM target (needs TVM's compiler)."""
    has = _llvm("target.llvm_cpu_has_feature")
    return all(bool(has(name, target)) for name in features)


# vdpbf16ps on zmm and (head dims of 8 * odd) ymm registers
BF16_DOT_FEATURES = ("avx512f", "avx512vl", "avx512bf16")
# aarch64: BFDOT on 128-bit NEON registers (FEAT_BF16: Neoverse V1 / V2 / N2, Graviton 3 / 4, Grace)
ARM_BF16_DOT_FEATURES = ("neon", "bf16")


def bf16_dot_features(target) -> tuple[str, ...]:
    """The LLVM features the bf16 dot products of kernels for ``target`` (a Target or its JSON
    dict) need: AVX512-BF16's, or on aarch64 NEON's BFDOT."""
    return ARM_BF16_DOT_FEATURES if is_aarch64(target) else BF16_DOT_FEATURES


def supports_bf16_dot(target: tvm.target.Target) -> bool:
    """bf16 dot products for this target: AVX512-BF16 (x86) or FEAT_BF16 (aarch64), LLVM's
    view: its model and ``mattr``, which ``resolve`` fills from this CPU's flags for this CPU.
    LLVM aborts the process when it meets the instruction for a target without the feature, so
    this gates every use."""
    return target.kind.name == "llvm" and has_features(target, *bf16_dot_features(target))


# AMX (Sapphire Rapids and later): tiles, and their bf16 / fp16 products (LLVM names). Linux
# enables the tile registers per process on request (``amx.request_tile_permission``).
AMX_FEATURES = ("amx-tile", "amx-bf16", "amx-fp16")
# what the kernels' AMX products (config products="amx": tdpbf16ps) need, with AVX-512 for the rest
AMX_BF16_FEATURES = ("amx-tile", "amx-bf16", *BF16_DOT_FEATURES)


def supports_amx(target: tvm.target.Target) -> bool:
    """Whether an LLVM target compiles AMX-BF16's tile products (x86 with AMX-BF16 and AVX-512)."""
    return (target.kind.name == "llvm" and not is_aarch64(target)
            and has_features(target, *AMX_BF16_FEATURES))


def amx_features(target: tvm.target.Target) -> tuple[str, ...]:
    """Those of AMX_FEATURES an LLVM target compiles for (for this CPU: those it has)."""
    if target.kind.name != "llvm":
        return ()
    return tuple(name for name in AMX_FEATURES if has_features(target, name))


def key(target) -> str:
    """Short, file-name-safe name of a target (a Target or its JSON dict), of what changes its
    code: 'llvm-znver4', 'cuda-sm_90'; with ``mattr`` (extensions beyond or short of the model,
    ``cpu_target``) those follow: 'llvm-rocketlake+amx-bf16+amx-tile+avx512bf16'. Tuning records
    are filed under it, so a config tuned on a CPU of the same model with other extensions (one
    it may not run, or that compiles differently) is not applied; a CPU whose flags equal its
    model keeps the key records had before ``mattr`` existed."""
    kind, attrs = (target["kind"], target) if isinstance(target, dict) else (target.kind.name, target.attrs)
    if kind == "llvm":
        name = f"llvm-{attrs.get('mcpu', 'generic')}"
        mattr = "".join(sorted(str(f) for f in attrs.get("mattr", None) or ()))
        if len(mattr) > 120:  # a long list (a VM hiding AVX-512): keep the name within file-name limits
            mattr = "+mattr-" + hashlib.sha256(mattr.encode()).hexdigest()[:16]
        return name + mattr
    return f"{kind}-{attrs.get('arch', 'unknown')}"


# Instruction-set extensions whose code faults (SIGILL) on a CPU without them. LLVM's target
# features also list tuning flags ("fast-gather", "prefer-256-bit", ...), which are harmless.
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "vaes", "vpclmul", "gfni", "sha", "aes",
                 "adx", "popcnt", "lzcnt", "movbe", "xsave", "fp16", "bf16", "vnni", "xop", "tbm", "lwp")


def _normal(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(".", "")


# aarch64: the extensions the kernels' code can use (LLVM names), checked against cpuinfo
_ARM_ISA = ("fp-armv8", "neon", "fullfp16", "dotprod", "bf16", "i8mm", "sve", "sve2")


def isa_features(target: tvm.target.Target) -> list[str]:
    """The instruction-set extensions an LLVM target compiles for (needs TVM's compiler)."""
    features = _llvm("target.llvm_get_cpu_features")(target)
    if is_aarch64(target):
        return sorted(str(name) for name in features.keys() if str(name) in _ARM_ISA)
    return sorted(str(name) for name in features.keys() if _normal(str(name)).startswith(_ISA_PREFIXES))


@functools.lru_cache(maxsize=None)
def host_isa_features() -> frozenset[str] | None:
    """This CPU's extensions, normalized (no '_', '-', '.'); None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpuinfo_features(f.read(), arm=platform.machine() in _ARM_MACHINES)
    except OSError:
        return None


def cpuinfo_features(cpuinfo: str, arm: bool = False) -> frozenset[str] | None:
    """The extensions a /proc/cpuinfo text lists (x86: its ``flags`` line; aarch64: its
    ``Features`` line), normalized and with LLVM's spellings added; None if it lists none."""
    field = "Features" if arm else "flags"
    flags = next((line.split(":", 1)[1] for line in cpuinfo.splitlines()
                  if line.split(":", 1)[0].strip() == field and ":" in line), None)
    if flags is None:
        return None
    found = {_normal(flag) for flag in flags.split()}
    # cpuinfo spells a few of LLVM's names differently
    if arm:
        aliases = {"fp": "fparmv8", "asimd": "neon", "asimdhp": "fullfp16", "asimddp": "dotprod"}
    else:
        aliases = {"pni": "sse3", "abm": "lzcnt", "bmi1": "bmi", "shani": "sha", "pclmulqdq": "pclmul"}
    found |= {alias for flag, alias in aliases.items() if flag in found}
    return frozenset(found)


def missing_isa_features(features) -> list[str]:
    """Those of ``features`` (LLVM names) this CPU lacks; all of them if its flags are unknown."""
    host = host_isa_features()
    if host is None or platform.machine() not in _X86_MACHINES + _ARM_MACHINES:
        return list(features)
    return [name for name in features if _normal(name) not in host and _normal(name) not in _LLVM_ONLY]


# LLVM features with no /proc/cpuinfo flag of their own (implied by others it lists)
_LLVM_ONLY = {"sse", "sse2", "ssse3", "sse41", "sse42", "avx512vp2intersect", "xsaves", "xsavec", "xsaveopt"}


def missing_for_cpu_kernels(target: dict, features) -> list[str]:
    """Those of ``features`` (the extensions CPU kernels were compiled for) this CPU lacks, for
    kernels of a target JSON dict: their code faults here (SIGILL). Kernels for this CPU's own
    model are no exception where its flags can be read: ``resolve`` compiles them for those flags
    (``mattr``), so only kernels built for the model's features (an explicit ``mattr``, another
    machine's libraries) can need more. Where they cannot (neither x86 nor aarch64 Linux; qemu-user without an Arm cpuinfo) they are trusted, as
    nothing can be checked."""
    if target.get("kind") != "llvm":
        return []
    if _host_flags() is None:
        # TVM's runtime alone cannot name this CPU's model (then nothing is trusted)
        system_cpu = tvm_ffi.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
        if system_cpu is not None and target.get("mcpu") == host_cpu():
            return []
    return missing_isa_features(features)
