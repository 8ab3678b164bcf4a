"""The files some modules run: their static import closure, and a digest of it (cache keys).

A build runs the code-generation modules and everything they import, at import time or later
(an import inside a function counts). The disk cache must notice a change to any of it, so
``compiler`` hashes this closure into its keys instead of a hand-kept list of files, which went
stale the first time a module gained an import.

Files are found the way Python's import system finds them (a source tree; an editable install
with its package-dir mapping, where ``schedules/`` is ``tvmflash.schedules``; a wheel in
site-packages), without importing them: cached kernels must load with TVM's runtime alone.
Only statements that begin a line are read (a regular expression, then ``ast`` on each
statement; parsing whole files took ~20x longer). ``tests/test_architecture.py`` checks the
result against a full parse of every module.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import re
import sys
import textwrap
from pathlib import Path

# ``import a.b`` or ``from .x import (a, b)``, with a parenthesized or backslash-continued tail
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+[.\w]+[ \t]+import[ \t]*(?:\([^)]*\)|(?:[^\n]*\\\n)*[^\n]*)"
                     r"|import[ \t]+(?:[^\n]*\\\n)*[^\n]*)", re.MULTILINE)


@functools.cache
def find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where ``name`` would be imported from, found without importing it or its parents."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        parent_spec = find_spec(parent)
        if parent_spec is None or parent_spec.submodule_search_locations is None:
            return None
        path = list(parent_spec.submodule_search_locations)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(name, path) if find is not None else None
        except ImportError:  # (TVM's alias finder imports what it finds: its CUDA backend fails in runtime-only TVM)
            continue
        if spec is not None:
            return spec
    return None


def imports_of(name: str, source: str, is_package: bool) -> set[str]:
    """The modules (or, for ``from X import attribute``, ``X``) that module ``name`` imports."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for match in _IMPORT.finditer(source):
        try:
            tree = ast.parse(textwrap.dedent(match.group(0)))
        except SyntaxError:  # prose in a docstring that begins with "import"
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if find_spec(submodule) is not None else base)
    return found


def closure(entries: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file of ``entries`` and every module of their packages they import, transitively.

    Imports leaving the entries' top-level packages (tvm, torch, ...) are not followed: the
    versions in the cache key cover those.
    """
    roots = {entry.split(".")[0] for entry in entries}
    found: dict[str, Path] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        spec = find_spec(name)
        if spec is None or spec.origin is None or not Path(spec.origin).is_file():
            if name in entries:
                raise RuntimeError(f"{name!r} names no module with a file (a code-generation entry that moved?)")
            continue
        path = found[name] = Path(spec.origin)
        if path.suffix == ".py":
            imported = imports_of(name, path.read_text(encoding="utf-8"), spec.submodule_search_locations is not None)
            todo += [target for target in imported if target.split(".")[0] in roots and target not in found]
    return found


@functools.cache
def digest(entries: tuple[str, ...]) -> str:
    """A hash of the closure's module names and contents, computed once per process."""
    h = hashlib.sha256()
    for name, path in sorted(closure(entries).items()):
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
