"""The disk cache of compiled kernels: safe to share a machine with, safe against broken files.

An entry is three files under the cache directory: ``<key>.so`` (the compiled module),
``<key>.json`` (what it is: the request it was built for, plus the SHA-256 of the other files) and
``<key>.src`` (generated source, for ``FlashKernels.source()``). The key is a hash of the
request (versions, sources, target, spec, configs), so a change to any of them builds anew.

Loading a shared library runs its code, so nothing is loaded unless:

* the directory is owned by this user and not writable by group or others (created 0700; an
  unsafe directory is an error that says how to fix it, never silently used);
* the entry's files are owned by this user and not group/world-writable;
* the metadata parses and describes exactly the request (else the entry is rebuilt);
* every other file of the entry (``.so``, ``.src``) is a regular file that hashes to its digest
  in the metadata (a truncated, altered or replaced file is rebuilt, with one warning), and the
  loaded module has every function the kernels call.

Writes go to a temporary directory inside the cache and are renamed into place (the ``.so``
last), so concurrent processes never see half an entry; TMPDIR is not used (``export``). A
failure to write (a full or read-only disk) is a warning: the kernels that were just built are
used all the same.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from .libraries import load_library
from .settings import cache_dir, read_json, warn


class UnsafeCacheError(PermissionError):
    """A cache directory or entry that another user could have written."""


def _unsafe_reason(path: Path, st: os.stat_result, root_too: bool = False) -> str | None:
    """Why another user could have written ``path``, or None. ``root_too``: root may own it too
    (a system-wide install of prebuilt kernels)."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid() and not (root_too and st.st_uid == 0):
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()}){' or root' if root_too else ''}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by {'group and others' if st.st_mode & stat.S_IWOTH else 'group'} (mode {stat.filemode(st.st_mode)})"
    return None


def check_own_file(path: Path) -> None:
    """Raise UnsafeCacheError unless ``path`` (about to be loaded: its code runs) is this user's
    and writable by no one else."""
    reason = _unsafe_reason(path, path.stat())
    if reason:
        raise UnsafeCacheError(f"tvmflash will not load {path}: {reason}. Delete it and it will be rebuilt.")


def only_mine(path: Path) -> None:
    """Clear the group and others' write bits the umask left on a file this process wrote (with
    umask 002, Debian's and Ubuntu's default for users with their own group, every entry was
    group-writable, which the next process refused to load)."""
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def safe_directory(path: Path | None = None, create: bool = True) -> Path | None:
    """The cache directory, created 0700 if missing; raises UnsafeCacheError if another user
    could plant files in it. None if it does not exist and ``create`` is False."""
    path = Path(path or cache_dir())
    if not path.exists():
        if not create:
            return None
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    reason = _unsafe_reason(path, path.stat())
    if reason:
        raise UnsafeCacheError(
            f"tvmflash will not load compiled code from {path}: {reason}. Use a directory only you can "
            f"write: `chmod 700 {path}` if it is yours, or set TVMFLASH_CACHE_DIR to another path.")
    return path


def c_compiler() -> str | None:
    """The C compiler the helpers in C are built with: $CC, else gcc, else cc (None: none found)."""
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def built_from_c(source: Path, name: str, args: list[str], inputs: bytes = b"") -> Path:
    """``source`` compiled with ``args`` (``-o`` added) into ``<name>-<digest>`` in the cache
    directory, once per source, arguments and ``inputs`` (what else decides the binary: included
    headers, the Python it is built for). Without a C compiler, the same file from
    ``$TVMFLASH_PREBUILT`` (``prebuild`` puts the kernels' helpers there: ``export_helper``).
    Checked as this user's own (or, prebuilt, the prebuilt directory's rules): the caller runs or
    loads it. OSError (or subprocess's errors) where it cannot be built or found.

    The key leaves out the compiler and the include paths: the headers' bytes are among the
    ``inputs``, and a deployment without a compiler must name the file its builder made."""
    key = "\0".join(arg for arg in args if not arg.startswith("-I")).encode()
    digest = hashlib.sha256(source.read_bytes() + inputs + key).hexdigest()[:16]
    directory = safe_directory()
    stem, dot, suffix = name.partition(".")
    built_path = directory / f"{stem}-{digest}{dot}{suffix}"
    if built_path.exists():
        check_own_file(built_path)
        return built_path
    compiler = c_compiler()
    if compiler is None:
        prebuilt = prebuilt_helper(built_path.name)
        if prebuilt is not None:
            return prebuilt
        raise OSError("no C compiler (gcc or $CC) found" + (f", and $TVMFLASH_PREBUILT holds no usable "
                                                            f"{built_path.name}"
                                                            if os.environ.get("TVMFLASH_PREBUILT") else ""))
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / name
        subprocess.run([compiler, *args, "-o", str(built), str(source)], check=True, capture_output=True,
                       timeout=120)
        only_mine(built)
        os.replace(built, built_path)
    check_own_file(built_path)
    return built_path


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_digest = file_digest


def export(module, path: Path, source: str | None) -> None:
    """``module.export_library(path)`` with its object files in a temporary directory next to
    ``path`` (not in TMPDIR), once there is room for them: LLVM ends the whole process when it
    cannot write an object file ("LLVM ERROR: IO failure on output stream: No space left on
    device"). Raises OSError (ENOSPC) instead; the temporary files are removed either way.
    ``source``: the module's generated code, whose size bounds the objects' (~1/4 of it)."""
    path = Path(path)
    needed = 2 * len(source) + (1 << 20) if source else 64 << 20
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tvmflash-export-") as work:
        free = shutil.disk_usage(work).free
        if free < needed:
            raise OSError(errno.ENOSPC, f"No space left on device: {free >> 10} KB free in {path.parent}, exporting "
                                        f"the kernels needs about {needed >> 10} KB")
        module.export_library(str(path), workspace_dir=work)


class _BrokenEntry(Exception):
    """Why an entry cannot be used (it is rebuilt)."""


def _check_file(path: Path, digest: str) -> None:
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise _BrokenEntry(f"{path.name} is not a regular file")
    if _digest(path) != digest:
        raise _BrokenEntry(f"{path.name} does not match its recorded checksum (truncated or modified)")


class Entry(NamedTuple):
    module: object
    source: str | None
    library: Path  # the entry's .so
    request: dict  # what it was built for (its cache key's input)


def load(key: str, request, functions: tuple[str, ...]) -> Entry | None:
    """A valid entry built for ``request``, or None (a broken entry with a warning: the caller
    builds it again). ``request`` may instead be a function that says whether the request an
    entry records will do (a warm start: its caller resolves the request on any None, and warns
    there if need be, so this one never warns). CPU libraries load with TVM's runtime alone."""
    quiet = callable(request)
    directory = safe_directory(create=False)
    if directory is None:
        return None
    so, meta_path, src = (directory / f"{key}{ext}" for ext in (".so", ".json", ".src"))
    if not os.path.lexists(so):
        return None
    for path in (so, meta_path, src):
        if path.exists():
            reason = _unsafe_reason(path, path.stat())
            if reason:
                raise UnsafeCacheError(f"tvmflash will not load {path}: {reason}. Delete it (or the cache "
                                       f"directory {directory}) and it will be rebuilt.")
    try:
        try:
            meta = read_json(meta_path)
            stored_request, digests = meta["request"], meta["sha256"]
            digests[".so"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise _BrokenEntry(f"its metadata {meta_path.name} is missing or unreadable") from err
        if not (request(stored_request) if quiet else stored_request == request):
            raise _BrokenEntry("it was built for another request")
        _check_file(so, digests[".so"])
        source = None
        if ".src" in digests:
            _check_file(src, digests[".src"])
            source = src.read_bytes().decode("utf-8", errors="replace")
        try:
            module = load_library(so, stored_request["target"]["kind"])
            for name in functions:
                module[name]
        except (OSError, ValueError, RuntimeError, AttributeError, KeyError, TypeError) as err:
            raise _BrokenEntry(f"it does not load ({err})") from err
    except (OSError, _BrokenEntry) as err:  # (OSError: unreadable files, a directory, EIO, ...)
        if not quiet:
            warn(f"rebuilding cache entry {so.name}: {err}")
        return None
    return Entry(module, source, so, stored_request)


def _replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` (written by this process) to ``path``, over a directory left at ``path`` too
    (a broken entry); writable by this user only, whatever the umask."""
    only_mine(tmp)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(tmp, path)


def store(key: str, request: dict, module, source: str | None, reload: bool = False):
    """Write an entry; returns the .so path, or None (with a warning) if it could not be written.

    ``reload``: returns (path, the library loaded back, the name it was loaded by) instead. It is
    loaded from a temporary file that is then deleted, and the entry gets a copy: the process
    holds no library under the entry's name (``dlopen`` of a name already loaded returns that
    library, even after the file was replaced), and rewriting the entry in place (damage, a
    test) cannot change code this process has mapped. ``threads.route`` uses the loaded name.
    """
    try:
        directory = safe_directory()
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            tmp_so, tmp_src = Path(tmp) / "kernels.so", Path(tmp) / "kernels.src"
            export(module, tmp_so, source)
            digests = {".so": _digest(tmp_so)}
            if source is not None:
                tmp_src.write_bytes(source.encode("utf-8"))
                digests[".src"] = _digest(tmp_src)
            (Path(tmp) / "kernels.json").write_text(json.dumps({"request": request, "sha256": digests}, indent=1),
                                                    encoding="utf-8")
            if source is not None:
                _replace(tmp_src, directory / f"{key}.src")
            _replace(Path(tmp) / "kernels.json", directory / f"{key}.json")
            loaded, entry_so = None, tmp_so
            if reload:  # this process maps its own copy, which nothing can rewrite under it
                loaded = load_library(tmp_so, request["target"]["kind"])
                entry_so = Path(tmp) / "entry.so"
                shutil.copyfile(tmp_so, entry_so)
            _replace(entry_so, directory / f"{key}.so")  # last: its presence marks a complete entry
        return (directory / f"{key}.so", loaded, tmp_so) if reload else directory / f"{key}.so"
    except (OSError, RuntimeError, UnsafeCacheError) as err:  # TVM reports export failures as RuntimeError
        warn(f"could not write the compile cache in {cache_dir()} ({err}); continuing without it")
        return (None, None, None) if reload else None


# --- answers: which entry a request resolved to, for the next process ------------------------------
# ``compiler`` names a request as asked (its ``question``: a digest) and records the entry it
# resolved to, with the digests of the files the resolution read (tuning records, product rates).
# An answer only names an entry: ``load`` still checks the entry itself.
def _answer_path(question: str) -> Path | None:
    directory = safe_directory(create=False)
    return None if directory is None else directory / "answers" / f"{question}.json"


def _read_digest(path: str) -> str | None:
    try:
        return _digest(Path(path))
    except OSError:  # (missing: the resolution saw none)
        return None


def answer(question: str) -> str | None:
    """The entry key recorded for ``question`` if every file its resolution read still has the
    recorded digest, else None."""
    path = _answer_path(question)
    if path is None or not path.exists():
        return None
    reason = _unsafe_reason(path, path.stat())
    if reason:
        raise UnsafeCacheError(f"tvmflash will not read {path}: {reason}. Delete it (or the cache directory) "
                               "and it will be written again.")
    try:
        recorded = read_json(path)
        key, reads = str(recorded["key"]), dict(recorded["reads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # (a damaged answer: resolved again, and rewritten)
    if not re.fullmatch(r"[0-9a-f]{24}", key):  # (an entry's name, never a path)
        return None
    return key if all(_read_digest(file) == digest for file, digest in reads.items()) else None


def remember_answer(question: str, key: str, reads: list[Path]) -> None:
    """Record that ``question`` resolved to entry ``key`` while ``reads`` held what they hold now.
    Nothing is recorded where the cache directory cannot be written (no warning: the entry's own
    store warned)."""
    text = json.dumps({"key": key, "reads": {str(file): _read_digest(str(file)) for file in reads}})
    temporary = None
    try:
        directory = safe_directory() / "answers"
        directory.mkdir(mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as f:
            temporary = Path(f.name)  # (mode 0600: mkstemp)
            f.write(text)
        os.replace(temporary, directory / f"{question}.json")
    except (OSError, UnsafeCacheError):
        if temporary is not None:
            temporary.unlink(missing_ok=True)


# --- prebuilt kernels ($TVMFLASH_PREBUILT): the same rules, for a directory someone filled -------------
def prebuilt_file_problem(path: Path) -> str | None:
    """Why a file of a prebuilt directory may not be loaded (not a regular file, or writable by
    another user than you or root), or None; OSError if it cannot be read (a missing file)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is not a regular file"
    reason = _unsafe_reason(path, st, root_too=True)
    return f"{path.name} could have been written by another user: {reason}" if reason else None


def export_helper(built: Path, directory: Path) -> list[Path]:
    """Copy a helper ``built_from_c`` made into a prebuilt directory, under its name, with its
    checksum in ``<name>.helper.json`` (not ``.so.json``: no kernels' metadata), which
    ``prebuilt_helper`` serves where there is no C compiler."""
    path = Path(directory) / built.name
    replace_with(path, lambda temporary: shutil.copyfile(built, temporary))
    replace_with(_helper_meta(path), lambda temporary: temporary.write_text(json.dumps({"sha256": file_digest(path)})))
    return [path]


def replace_with(path: Path, write) -> None:
    """``write(temporary)`` next to ``path``, then renamed over it, writable by this user only: a
    process that has the old file mapped keeps its pages (writing in place truncated them under
    it: SIGBUS), and no reader sees half a file."""
    # (the suffix kept: TVM's export picks the format by it; "*.so.json" does not match it)
    temporary = path.with_name(f".tmp-{os.getpid()}-{path.stem}.tmp{path.suffix}")
    try:
        write(temporary)
        only_mine(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _helper_meta(path: Path) -> Path:
    return Path(str(path) + ".helper.json")


def prebuilt_helper(name: str) -> Path | None:
    """``$TVMFLASH_PREBUILT``'s copy of the helper ``name`` (``export_helper``), or None where it
    has none; one that may not be loaded (the prebuilt libraries' rules: owned by you or root, not
    group/world-writable, the checksum in its ``.helper.json``) is skipped with a warning."""
    directory = os.environ.get("TVMFLASH_PREBUILT")
    path = Path(directory, name) if directory else None
    if path is None or not path.exists():
        return None
    reason = prebuilt_directory_problem(path.parent)
    try:
        if reason:
            raise _BrokenEntry(f"the directory could have been written by another user: {reason}")
        _checked_prebuilt(path, _helper_meta(path), "a helper's metadata")
    except (OSError, _BrokenEntry) as err:
        warn(f"skipping prebuilt helper {path} ({err})")
        return None
    return path


def prebuilt_directory_problem(directory: Path) -> str | None:
    """Why a prebuilt directory may not be read (another user than you or root could write it), or None."""
    return _unsafe_reason(directory, directory.stat(), root_too=True)


def prebuilt_libraries(directory: Path):
    """(library, metadata) of each library in a ``$TVMFLASH_PREBUILT`` directory that may be
    loaded, in name order. The directory must be owned by this user or root and writable by
    nobody else (else UnsafeCacheError); a library is skipped, with a warning, unless it and its
    ``.json`` are regular files owned likewise and not group/world-writable, the metadata parses,
    and the library hashes to the digest ``export_library`` recorded in it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"TVMFLASH_PREBUILT={directory} is not a directory: point it at the directory "
                                "tvmflash.prebuild() wrote, or unset it")
    reason = prebuilt_directory_problem(directory)
    if reason:
        raise UnsafeCacheError(
            f"tvmflash will not load compiled code from TVMFLASH_PREBUILT={directory}: {reason}. Use a directory "
            f"only you (or root) can write: `chmod go-w {directory}`.")
    for meta_path in sorted(directory.glob("*.so.json")):
        library = meta_path.with_suffix("")
        try:
            meta = _checked_prebuilt(library, meta_path, "the metadata of kernels exported by this version of tvmflash")
        except (OSError, _BrokenEntry) as err:
            warn(f"skipping prebuilt kernels {library} ({err})")
            continue
        yield library, meta


def _checked_prebuilt(file: Path, meta_path: Path, what: str) -> dict:
    """The metadata of a prebuilt ``file`` (a library or helper) that may be loaded: both files
    pass ``prebuilt_file_problem``, the metadata parses and the file hashes to its ``sha256``;
    else _BrokenEntry (or OSError) naming what is wrong. ``what``: what the metadata should be."""
    for path in (meta_path, file):
        problem = prebuilt_file_problem(path)
        if problem:
            raise _BrokenEntry(problem)
    try:
        meta = read_json(meta_path)
        digest = meta["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise _BrokenEntry(f"{meta_path.name} is not {what} ({type(err).__name__}: {err}); re-export them") from err
    if file_digest(file) != digest:
        raise _BrokenEntry(f"{file.name} does not match the checksum in {meta_path.name} (modified after export)")
    return meta
