"""The package's layering: imports point downward.

Every import between tvmflash modules (also the ones inside functions) is an edge; the graph must
have no cycle, and no module may import the package facade (``tvmflash/__init__.py``), which sits
on top of everything. A lazy import is fine for cost (``compiler`` loads the code generator only
when it builds), never to hide a cycle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Module name -> file, with pyproject's package-dir mapping (schedules/ is tvmflash.schedules)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    for package in config["packages"]:  # packages without their own package-dir entry
        folder = ROOT / package.replace(".", "/")
        if package not in config["package-dir"] and folder.is_dir():
            for path in folder.glob("*.py"):
                found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names if a.name.split(".")[0] == "tvmflash"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "tvmflash":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return targets - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_module_list_is_complete():
    modules = _modules()
    for expected in ("tvmflash", "tvmflash.kernels", "tvmflash.schedules.llvm", "tvmflash.distributed.ring",
                     "tvmflash.integrations.transformers"):
        assert expected in modules
    # every edge points at a module that exists
    for name, targets in _graph().items():
        assert targets <= set(modules), (name, targets - set(modules))


def test_no_module_imports_the_package_facade():
    offenders = {name: "tvmflash" for name, targets in _graph().items() if name != "tvmflash" and "tvmflash" in targets}
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


def test_the_kernel_layers_do_not_import_torch():
    """The TE/TIR definitions and the code generator work without PyTorch (CUDA builds, tuning)."""
    modules = _modules()
    for name in ("tvmflash.spec", "tvmflash.config", "tvmflash.plan", "tvmflash.attention_te", "tvmflash.kernels.cpu",
                 "tvmflash.kernels.decode",
                 "tvmflash.kernels.cuda", "tvmflash.kernels.common", "tvmflash.score_mods", "tvmflash.build", "tvmflash.schedules.llvm",
                 "tvmflash.schedules.cuda", "tvmflash.cache", "tvmflash.records", "tvmflash.settings"):
        tree = ast.parse(modules[name].read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "torch" for n in names), f"{name} imports torch"
