"""The architecture, declared once (``LAYERS``) and checked against the code and the README.

``LAYERS`` lists the layers top to bottom. Each names modules by prefix of their dotted names:
``"tvmflash.kernels"`` covers ``kernels.py``, ``kernels_cuda.py`` and a ``kernels/`` package alike,
so moving a module inside its layer needs no edit here; the longest matching prefix wins
(``tvmflash.flex_trace`` is not ``tvmflash.flex``), and the facade ``tvmflash`` (``__init__.py``)
matches only itself. ``schedules/`` is ``tvmflash.schedules`` (pyproject's package-dir); the
scripts in ``benchmarks/`` are ``benchmarks.<name>`` (they import each other as top-level
modules, with ``benchmarks/`` on ``sys.path``).

Checked: every import (also the ones inside functions) points into the same or a lower layer;
no import cycle anywhere (a lazy import is fine for cost, never to hide a cycle); nothing
imports the facade; the layers that say so import no torch; README's layer table names the same
layers in the same order, and files that belong to them; the disk-cache key hashes exactly the
import closure of the code-generation modules, and an edit of any file of it (only of it)
changes the key.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FACADE = "tvmflash"


@dataclass(frozen=True)
class Layer:
    name: str
    modules: frozenset[str]  # prefixes of dotted module names
    torch: bool  # may import PyTorch


LAYERS = (
    Layer("benchmarks", frozenset({"benchmarks"}), torch=True),
    Layer("package facade", frozenset({FACADE}), torch=True),
    Layer("tools", frozenset({"tvmflash.tune", "tvmflash.bench", "tvmflash.memory", "tvmflash.analysis",
                              "tvmflash.reference", "tvmflash.demo", "tvmflash.distributed.demo"}), torch=True),
    Layer("user API", frozenset({"tvmflash.torch_op", "tvmflash.flex", "tvmflash.kvcache", "tvmflash.uniform_rows",
                                 "tvmflash.documents", "tvmflash.padded", "tvmflash.sinks", "tvmflash.tensor_memo",
                                 "tvmflash.launch", "tvmflash.integrations", "tvmflash.distributed"}), torch=True),
    Layer("mod tracing", frozenset({"tvmflash.flex_trace"}), torch=True),
    Layer("compile API", frozenset({"tvmflash.compiler", "tvmflash.records", "tvmflash.tune_logs"}), torch=False),
    Layer("code generation", frozenset({"tvmflash.build", "tvmflash.kernels", "tvmflash.pair_words",
                                        "tvmflash.score_mods", "tvmflash.attention_te", "tvmflash.schedules"}),
          torch=False),
    Layer("runtime", frozenset({"tvmflash.runtime", "tvmflash.threads", "tvmflash.cache", "tvmflash.cuda_binaries",
                                "tvmflash.product_rates", "tvmflash.libraries", "tvmflash.c_helpers"}),
          torch=False),
    Layer("base", frozenset({"tvmflash.spec", "tvmflash.config", "tvmflash.plan", "tvmflash.checks", "tvmflash.target",
                             "tvmflash.settings", "tvmflash.import_closure", "tvmflash.version", "tvmflash.amx"}),
          torch=False),
)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the layer that declares ``module`` (the longest matching prefix)."""
    matches = [(len(entry), index) for index, layer in enumerate(LAYERS) for entry in layer.modules
               if module == entry or (entry != FACADE and module.startswith(entry))]
    return max(matches)[1] if matches else None


def _folders() -> dict[str, Path]:
    """Package or script root -> its folder: pyproject's package-dir mapping, and benchmarks/."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {**{package: ROOT / folder for package, folder in config["package-dir"].items()},
            "benchmarks": ROOT / "benchmarks"}


def _modules() -> dict[str, Path]:
    """Module name -> file, for everything under the package folders and benchmarks/."""
    folders = _folders()
    found = {}
    for root, folder in folders.items():
        for path in folder.rglob("*.py"):
            name = ".".join((root, *path.relative_to(folder).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _edges(name: str, path: Path, modules: dict) -> dict[str, int]:
    """Module -> line of each import of a module of ours in ``name`` (lazy ones included)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    script = name.startswith("benchmarks.")
    scripts = {m.split(".")[1] for m in modules if m.startswith("benchmarks.")}
    targets = {}

    def ours(dotted: str) -> str | None:
        if script and dotted.split(".")[0] in scripts:
            return f"benchmarks.{dotted}"  # the scripts import each other with benchmarks/ on sys.path
        return dotted if dotted.split(".")[0] in ("tvmflash", "benchmarks") else None

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := ours(alias.name)) is not None:
                    targets[target] = node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = ours(node.module or "")
            if base is None:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets[submodule if submodule in modules else base] = node.lineno
    targets.pop(name, None)
    return targets


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def test_the_module_list_is_complete():
    modules = _modules()
    for expected in ("tvmflash", "tvmflash.compiler", "tvmflash.schedules.llvm", "tvmflash.distributed.ring",
                     "tvmflash.integrations.transformers", "benchmarks.gpu_check", "benchmarks.gpucheck.stage"):
        assert expected in modules
    # every edge points at a module that exists
    for name, targets in _graph().items():
        assert set(targets) <= set(modules), (name, set(targets) - set(modules))
    # and the wheel ships every package folder (an editable install would find it anyway)
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in modules.items() if path.stem == "__init__" and not name.startswith("benchmarks")}
    assert folders <= packages, f"package folders missing from pyproject's packages: {sorted(folders - packages)}"


def test_every_module_has_a_layer_and_every_declared_name_a_module():
    modules = _modules()
    undeclared = [m for m in modules if layer_of(m) is None]
    assert not undeclared, f"modules that no layer of LAYERS declares: {undeclared}"
    stale = [entry for layer in LAYERS for entry in layer.modules
             if not any(m == entry or (entry != FACADE and m.startswith(entry)) for m in modules)]
    assert not stale, f"LAYERS names modules that do not exist (moved? renamed?): {stale}"


def test_imports_point_to_the_same_or_a_lower_layer():
    upward = [f"{name}:{line} imports {target} ({LAYERS[layer_of(name)].name} -> {LAYERS[layer_of(target)].name})"
              for name, targets in sorted(_graph().items()) for target, line in sorted(targets.items())
              if layer_of(target) < layer_of(name)]
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_no_module_imports_the_package_facade():
    offenders = {name for name, targets in _graph().items()
                 if name != FACADE and not name.startswith("benchmarks.") and FACADE in targets}
    assert not offenders, f"modules importing the facade tvmflash/__init__.py (import the defining module): {offenders}"


def test_imports_have_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(name):
        state[name] = 1
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_torch_free_layers_do_not_import_torch():
    """The compile API, the code generators and what they use work without PyTorch (CUDA builds, tuning)."""
    offenders = []
    for name, path in sorted(_modules().items()):
        if LAYERS[layer_of(name)].torch:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "torch" for n in names):
                offenders.append(f"{name}:{node.lineno} ({LAYERS[layer_of(name)].name})")
    assert not offenders, f"torch imported in a torch-free layer: {offenders}"


def _readme_table() -> list[tuple[str, list[str]]]:
    """(layer cell, repository paths) of each row of README's layer table."""
    text = (ROOT / "README.md").read_text()
    lines = text[text.index("## How it is built"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start + 2:end]  # after the header and its separator
    roots = {folder.name for folder in _folders().values()}
    table = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        paths, folder = [], ""
        for token in re.findall(r"`([^`]+)`", cells[2]):
            if token.split("/")[0] in roots:
                folder = token.split("/")[0] + "/"
                paths.append(token)
            else:
                paths.append(folder + token)
        table.append((cells[0], paths))
    return table


def _module_of(repository_path: str) -> str:
    folder_to_root = {folder.relative_to(ROOT).as_posix(): root for root, folder in _folders().items()}
    path = Path(repository_path.rstrip("/"))
    assert (ROOT / path).exists(), f"README's layer table names {repository_path}, which does not exist"
    parts = path.with_suffix("").parts if path.suffix == ".py" else path.parts
    return ".".join((folder_to_root[parts[0]], *parts[1:])).removesuffix(".__init__")


def test_readme_layer_table_matches_the_declaration():
    table = _readme_table()
    names = [cell.split(" (")[0] for cell, _ in table]
    assert names == [layer.name for layer in LAYERS], "README's layers or their order"
    for (cell, paths), layer in zip(table, LAYERS):
        name = cell.split(" (")[0]
        assert ("no torch" in cell) == (not layer.torch), f"README's {name!r} row says {cell!r}; torch={layer.torch}"
        named = [_module_of(p) for p in paths]
        misplaced = [p for p, m in zip(paths, named) if LAYERS[layer_of(m)] != layer]
        assert not misplaced, f"README lists {misplaced} under {name!r}; LAYERS puts them elsewhere"
        unnamed = [entry for entry in layer.modules if not any(m.startswith(entry) for m in named)]
        assert not unnamed, f"README's {name!r} row names no file of {unnamed}"


# --- the disk-cache key: the import closure of the code generators ---------------------------------
def _closure_from_graph(entries) -> set[str]:
    graph, found, todo = _graph(), set(), list(entries)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += graph[name]
    return found


def test_the_cache_key_hashes_the_import_closure_of_the_code_generators():
    from tvmflash import compiler, import_closure

    hashed = import_closure.closure(compiler.CODEGEN_ENTRY_MODULES)
    assert set(hashed) == _closure_from_graph(compiler.CODEGEN_ENTRY_MODULES)
    # the modules a hand-kept list once missed, and the layers a build runs
    assert {"tvmflash.plan", "tvmflash.schedules.llvm_bf16", "tvmflash.build"} <= set(hashed)
    assert {LAYERS[layer_of(m)].name for m in hashed} <= {"mod tracing", "code generation", "base"}


# A process that imports tvmflash from a copy laid out as a wheel installs it, prints the files of
# the closure, then the cache keys of a CPU, a CUDA and a decode request each time a line arrives.
_KEY_SERVER = textwrap.dedent("""
    import json, sys
    import tvmflash
    from tvmflash import compiler, import_closure
    from tvmflash.spec import AttentionSpec
    from tvmflash.target import resolve

    files = import_closure.closure(compiler.CODEGEN_ENTRY_MODULES).values()
    print(json.dumps([tvmflash.__file__, *map(str, files)]), flush=True)
    cpu, cuda = resolve("llvm"), resolve({"kind": "cuda", "arch": "sm_90"})
    fp32, fp16 = AttentionSpec(64, "float32"), AttentionSpec(64, "float16")
    cpu_configs, _ = compiler.choose_configs(cpu, fp32, tuned=False)
    cuda_configs, _ = compiler.choose_configs(cuda, fp16)
    for _ in sys.stdin:
        import_closure.digest.cache_clear()
        requests = (compiler._request(cpu, fp32, cpu_configs, False, None),
                    compiler._request(cuda, fp16, cuda_configs, False, None),
                    compiler._module_request("decode", cpu, fp32, compiler.choose_decode_config(cpu, fp32).to_json()),
                    compiler._module_request("sinks", cpu, fp32, None))
        print(*map(compiler._key, requests), flush=True)
""")


def test_an_edit_in_the_closure_changes_the_cache_key_and_one_outside_does_not(tmp_path):
    installed = tmp_path / "site-packages"
    for root, folder in _folders().items():
        if root.split(".")[0] == "tvmflash":
            shutil.copytree(folder, installed / root.replace(".", "/"), ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(installed), "TVMFLASH_QUIET": "1"}
    server = subprocess.Popen([sys.executable, "-c", _KEY_SERVER], cwd=installed, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        files = json.loads(server.stdout.readline())
        assert files and all(Path(f).is_relative_to(installed) for f in files), files
        assert str(installed / "tvmflash" / "schedules" / "llvm_bf16.py") in files

        def key_after(edit=None):
            original = None
            if edit is not None:
                original = (installed / edit).read_text()
                (installed / edit).write_text(original + "\n# edited\n")
            try:
                server.stdin.write("\n")
                server.stdin.flush()
                return server.stdout.readline().split()
            finally:
                if original is not None:
                    (installed / edit).write_text(original)

        base = key_after()  # CPU, CUDA, decode, sinks
        assert len(base) == 4 and all(re.fullmatch(r"[0-9a-f]{24}", key) for key in base), base
        # plan.py (the sequence tables every kernel reads) and llvm_bf16.py (imported by the CPU
        # schedules, also the decode kernel's) were missing from hand-kept lists once
        for deep in ("tvmflash/plan.py", "tvmflash/schedules/llvm_bf16.py"):
            changed = [new != old for new, old in zip(key_after(deep), base)]
            assert all(changed), f"an edit of {deep} left (CPU, CUDA, decode, sinks) keys unchanged: {changed}"
        for outside in ("tvmflash/torch_op.py", "tvmflash/runtime.py"):
            assert key_after(outside) == base, f"an edit of {outside} (no code generator imports it) changed a key"
        assert key_after() == base
    finally:
        server.stdin.close()
        server.kill()
        server.wait()


@pytest.mark.parametrize("source,expected", [
    ("from .a import (b,\n    c)\n", {"p.s.a"}),  # b, c: no modules, so the import is of p.s.a
    ("def f():\n    from ..q import r\n", {"p.q"}),
    ("import x.y, z\nfrom . import \\\n    a\n", {"x.y", "z", "p.s"}),
    ('"""Docs.\n\nimport the defining module\n"""\n', set()),
    ("from tvmflash.schedules import llvm\nfrom tvmflash import compile\n", {"tvmflash.schedules.llvm", "tvmflash"}),
])
def test_the_import_reader_finds_every_form_of_import(source, expected):
    from tvmflash import import_closure

    assert import_closure.imports_of("p.s.m", source, is_package=False) == expected
