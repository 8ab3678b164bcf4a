"""Process-wide settings read from the environment (pure Python, imported first).

* ``TVMFLASH_NUM_THREADS``: the thread count tvmflash plans its work for and runs with (default:
  ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS`` if set, else the CPUs this process may use).
  TVM sizes its thread pool once, at first use, from ``TVM_NUM_THREADS``; tvmflash sets that
  variable at import unless it is set already, because TVM's own default on x86 is half the
  hardware threads ("ignore hyper-threading"): one thread on a 2-vCPU machine.
* ``TVMFLASH_CACHE_DIR``: compiled kernels (default ``$XDG_CACHE_HOME/tvmflash`` or
  ``~/.cache/tvmflash``).
* ``TVMFLASH_QUIET=1``: no progress lines on stderr.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path


class TvmflashWarning(UserWarning):
    """Something tvmflash worked around (a cache it could not use or write, ...)."""


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text in (None, ""):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={text!r} is not a thread count: use a positive integer")
    return value


@functools.lru_cache(maxsize=None)
def num_threads() -> int:
    """The thread count kernels are planned for (read once: TVM's pool is fixed at first use)."""
    for name in ("TVMFLASH_NUM_THREADS", "TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        value = _positive_int(name)
        if value is not None:
            return value
    return usable_cpus()


def configure_tvm_threads() -> None:
    if "TVM_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(num_threads())


def cache_dir() -> Path:
    root = os.environ.get("TVMFLASH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvmflash"


class EnvironmentValues:
    """Reads the raw values of some environment variables (None where unset), for memo keys that
    per-call fast paths compare: from os.environ's own dict (~0.1 us a name) rather than through
    ``os.environ.get`` (~2 us a name: a decode step or a small forward made four such reads).
    The values are what ``os.environ`` holds, as bytes on POSIX: compare them, do not parse them."""

    def __init__(self, *names: str):
        self.names = names
        self._keys = tuple(map(os.environ.encodekey, names)) if isinstance(os.environ, os._Environ) else None

    def __call__(self) -> tuple:
        data = self._data()
        if data is None:  # not CPython's os.environ (replaced): the public way
            return tuple(os.environ.get(name) for name in self.names)
        return tuple(map(data.get, self._keys))

    def guards(self) -> tuple | None:
        """The values now as (dict, key, value) guards for a C launch (``launch.c``), which reads
        them per call as ``__call__`` does; None where os.environ is not CPython's."""
        data = self._data()
        return None if data is None else tuple((data, key, data.get(key)) for key in self._keys)

    def _data(self) -> dict | None:
        """os.environ's own dict (keys encoded as ``_keys``), or None where it is not CPython's."""
        data = getattr(os.environ, "_data", None) if self._keys is not None else None
        return data if type(data) is dict else None


def progress(message: str) -> None:
    """Long work (compiling) says what it does on stderr; TVMFLASH_QUIET=1 silences it."""
    if os.environ.get("TVMFLASH_QUIET", "0") in ("", "0"):
        print(f"tvmflash: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    warnings.warn(message, TvmflashWarning, stacklevel=3)


def read_json(path: Path):
    """A JSON file's contents; ValueError for any text json cannot read, nesting too deep for its
    parser included (json raises RecursionError there, which callers that catch ValueError missed)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path} nests its values too deeply to read") from None
