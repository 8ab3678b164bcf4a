"""Which way bf16 kernels multiply on this CPU, chosen by measuring each way once per machine.

A CPU with AVX512-BF16 can run the bf16 kernels' products as ``vdpbf16ps`` (two bf16 products
per fp32 lane) or convert the operands and use fp32 FMAs (``config.py``: ``products``). Which is
faster depends on the core, not on the feature: a Zen 4 issues ``vdpbf16ps`` as fast as
``vfmadd231ps`` (2x the FLOPs), while on an Emerald Rapids Xeon it runs at half the FMA's rate
(the same FLOPs), and the bf16 kernels were slower there (310 vs 224 ms) because of their operand
packing. ``product_probe.c`` times both instructions in registers on one core; it is compiled
with the C compiler into the cache directory and run once per machine, and its rates are kept
there (``product-rates-<machine>.json``, keyed by the CPU's vendor, family, model, name and flags,
not its microcode or clock). bf16 dot products are chosen where they reach at least
``BF16_DOT_MIN_GAIN`` times the FMAs' FLOP rate. On CPUs with AMX-BF16 the probe also times
AMX's ``tdpbf16ps`` (in its own process, after Linux granted it the tiles); AMX tiles are
chosen where they reach ``AMX_MIN_GAIN`` times the faster of the other two (measured 15x on a
Sapphire Rapids-class Xeon) and Linux grants this process the tiles
(``amx.request_tile_permission``), for head dims that are multiples of 16.

``TVMFLASH_BF16_PRODUCTS`` overrides the measurement: ``fp32_fma``, ``bf16_dot`` or ``amx``
(used where the target has the instructions; elsewhere the measured or feature choice among the
ones it has), ``measure`` (default). Kernels for another CPU than this one follow its features
(nothing here to measure).

What is loaded or run comes from this library only: the probe is built from the packaged source
into the user's own cache directory (``cache.safe_directory``) and run only if it is this user's
file and writable by no one else (``cache.check_own_file``); a stored result is trusted on the
same terms and must hold two positive rates, else the probe runs again. The override is a choice
between two names, never a path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import settings
from . import target as targets
from .config import AMX, AMX_TILE, BF16_DOT, FP32_FMA

OVERRIDE_ENV = "TVMFLASH_BF16_PRODUCTS"
MEASURE = "measure"
# The bf16 path packs and rounds its operands (pair words, P and dS to bf16): it must multiply
# clearly faster than the fp32 path to pay for that, not break even.
BF16_DOT_MIN_GAIN = 1.25
# AMX's products leave the per-score work (exp, row statistics, packing) on the vector units, so
# the products must be much faster than the vector path to pay for moving them there.
AMX_MIN_GAIN = 4.0
_SOURCE = Path(__file__).with_name("product_probe.c")
_HEADER = _SOURCE.with_name("product_loops.h")  # the loops, included by the probe

_lock = threading.Lock()
_measured: dict[str, ProductRates | None] = {}  # machine key -> rates (None: could not measure)


@dataclass(frozen=True)
class ProductRates:
    """Register-only throughput of one core, GFLOP/s: fp32 FMAs and bf16 dot products (zmm), and
    AMX tiles (``tdpbf16ps``; 0: not measured, the CPU has no AMX-BF16 or Linux refused it)."""

    fp32_fma: float
    bf16_dot: float
    amx: float = 0.0

    def __post_init__(self):
        for name in ("fp32_fma", "bf16_dot", "amx"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < 0 or (value == 0 and name != "amx")):
                raise ValueError(f"{name} rate must be a positive number of GFLOP/s, got {value!r}")


def faster_products(rates: ProductRates, amx_allowed: bool = False) -> str:
    """The products a CPU with these rates should run bf16 kernels with (AMX only where
    ``amx_allowed``: the target has it and the kernel's shapes fit its tiles)."""
    vector = BF16_DOT if rates.bf16_dot >= BF16_DOT_MIN_GAIN * rates.fp32_fma else FP32_FMA
    if amx_allowed and rates.amx >= AMX_MIN_GAIN * max(rates.fp32_fma, rates.bf16_dot):
        return AMX
    return vector


def override() -> str | None:
    """The product kind ``$TVMFLASH_BF16_PRODUCTS`` asks for, or None (measure)."""
    value = os.environ.get(OVERRIDE_ENV, "").strip()
    if value in ("", MEASURE):
        return None
    if value not in (FP32_FMA, BF16_DOT, AMX):
        raise ValueError(f"{OVERRIDE_ENV}={value!r}: use {FP32_FMA!r}, {BF16_DOT!r}, {AMX!r} or {MEASURE!r}")
    return value


def bf16_products(target, head_dim: int | None = None) -> str:
    """How bf16 kernels for ``target`` (a resolved LLVM target) and ``head_dim`` (None: any)
    multiply by default: fp32 FMAs where the target lacks AVX512-BF16; else the override where
    the target has it, else (this CPU) the fastest path as measured, else (another CPU, or no
    measurement possible) AMX tiles or bf16 dot products as its features allow. AMX needs a
    head dim that is a multiple of 16 and, on this CPU, Linux's permission."""
    if not targets.supports_bf16_dot(target):
        return FP32_FMA
    forced = override()
    if forced in (FP32_FMA, BF16_DOT):
        return forced
    amx_allowed = targets.supports_amx(target) and (head_dim is None or head_dim % AMX_TILE == 0)
    this_cpu = _compiles_for_this_cpu(target) and not targets.is_aarch64(target)
    if amx_allowed and this_cpu:  # (Linux asked once per process, only where AMX could be chosen)
        from .amx import request_tile_permission

        amx_allowed = request_tile_permission()
    if forced == AMX and amx_allowed:
        return AMX
    if not this_cpu:
        # another CPU, or aarch64 (the probe is x86 code; BFDOT vs FMLA rates are not measured there)
        return AMX if amx_allowed else BF16_DOT
    rates = measured_rates()
    if rates is None:
        return AMX if amx_allowed else BF16_DOT
    return faster_products(rates, amx_allowed)


def _compiles_for_this_cpu(target) -> bool:
    """Whether a resolved LLVM target is this CPU's: its model and its extensions (``mattr``, the
    corrections by /proc/cpuinfo) both; the measured rates are this CPU's only."""
    host = targets.host_target()
    return all(str(target.attrs.get(name, "")) == str(host.attrs.get(name, "")) for name in ("mcpu", "mattr"))


def default_products(target, dtype: str, head_dim: int | None = None) -> str:
    """The products of the hand-written configs for this target, input dtype and head dim."""
    return bf16_products(target, head_dim) if dtype == "bfloat16" else FP32_FMA


@functools.lru_cache(maxsize=8)
def machine_key(cpuinfo: str | None = None) -> str:
    """What the rates depend on: the first CPU's vendor, family, model, stepping, name and flags in
    /proc/cpuinfo (not its microcode, clock or numbering), and the probe's source."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    first = cpuinfo.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    wanted = {name: fields.get(name, "") for name in ("vendor_id", "cpu family", "model", "stepping", "model name")}
    wanted["flags"] = " ".join(sorted(fields.get("flags", "").split()))
    text = json.dumps([wanted, hashlib.sha256(_SOURCE.read_bytes() + _HEADER.read_bytes()).hexdigest()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measured_rates() -> ProductRates | None:
    """This machine's rates: from this process's memo, the cache directory, or measured (~0.1 s,
    once per machine). None, with one warning, where they cannot be measured (no C compiler, an
    unusable cache directory, no AVX512-BF16)."""
    key = machine_key()
    with _lock:
        if key not in _measured:
            try:
                _measured[key] = _stored_or_measured(key)
            except (OSError, ValueError, KeyError, subprocess.SubprocessError) as err:
                settings.warn(f"could not measure this CPU's fp32 FMA and bf16 dot product rates ({err}); bf16 "
                              f"kernels use bf16 dot products, as its features allow (set {OVERRIDE_ENV}=fp32_fma "
                              "to use fp32 FMAs)")
                _measured[key] = None
        return _measured[key]


def forget_measurements() -> None:
    """Drop this process's memo (the stored results stay): for tests."""
    with _lock:
        _measured.clear()


def stored_file(key: str | None = None) -> Path:
    """Where this machine's (``key``: another's) measured rates are kept (``cache.safe_directory``)."""
    from .cache import safe_directory

    return safe_directory() / f"product-rates-{key or machine_key()}.json"


def _stored_or_measured(key: str) -> ProductRates:
    from .cache import UnsafeCacheError, check_own_file

    missing = targets.missing_isa_features(targets.BF16_DOT_FEATURES)
    if missing:  # the probe's instructions would fault here
        raise OSError(f"this CPU lacks {', '.join(missing)}")
    stored = stored_file(key)
    directory = stored.parent
    if stored.exists():
        try:
            check_own_file(stored)
            data = settings.read_json(stored)
            return ProductRates(float(data["fp32_fma"]), float(data["bf16_dot"]), float(data.get("amx", 0.0)))
        except UnsafeCacheError as err:
            settings.warn(f"measuring again: {err}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            settings.warn(f"measuring again: {stored} is unreadable ({type(err).__name__}: {err})")
    rates = _run_probe(_build_probe())
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".product-rates-", suffix=".json", delete=False,
                                     encoding="utf-8") as f:  # mode 0600 (mkstemp)
        json.dump({"fp32_fma": rates.fp32_fma, "bf16_dot": rates.bf16_dot, "amx": rates.amx,
                   "unit": "GFLOP/s, one core"}, f)
    os.replace(f.name, stored)
    return rates


def _build_probe() -> Path:
    """product_probe.c compiled into the cache directory (once per source and compiler)."""
    from .cache import built_from_c

    return built_from_c(_SOURCE, "product-probe", ["-O2"], inputs=_HEADER.read_bytes())


def _run_probe(probe: Path) -> ProductRates:
    from .cache import check_own_file

    check_own_file(probe)  # running it runs its code
    done = subprocess.run([str(probe)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise OSError(f"{probe.name} exited with {done.returncode}{' (no AVX512-BF16)' if done.returncode == 2 else ''}")
    found = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
    return ProductRates(float(found["vfmadd231ps"]), float(found["vdpbf16ps"]), float(found.get("tdpbf16ps", 0.0)))
