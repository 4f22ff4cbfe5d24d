"""The import rules between klrl's packages (README, Layout), checked on the source with `ast`.

Arrows: cluster -> {actors, learner, rewards, kl}; learner -> kl; actors -> rewards; kl and
rewards import none of the others. Every import counts for the arrows: module level,
function-local and `if TYPE_CHECKING:` alike (a function-local import still couples the
packages; it only delays the coupling), and so does `importlib.import_module("<constant>")`.

Cycles: inside one package the graph of imports that run when a module is imported (module
level, not under TYPE_CHECKING) must be acyclic, so any module can be imported first.
Function-local imports are left out of that graph on purpose: deferring an import into the
function that needs it is the ordinary way to keep import time cheap or to break a cycle.

Nothing is imported: the files are parsed, so the check is fast and needs no Ray/vLLM.
"""
from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED: dict[str, set[str]] = {
    "cluster": {"actors", "learner", "rewards", "kl"},
    "learner": {"kl"},
    "actors": {"rewards"},
    "kl": set(),
    "rewards": set(),
}
PACKAGES = tuple(ALLOWED)


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    source: str      # importing module, dotted ("cluster.train.controller"; a package is its name)
    target: str      # imported module, dotted and resolved (relative imports made absolute)
    at_import: bool  # runs when `source` is imported: module level and not under TYPE_CHECKING


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, root: Path) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import in `path`, wherever it is (module, class or function body)."""
    source = module_name(path, root)
    # The package a relative import of level 1 starts from: a package's __init__ is its own.
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found: list[Import] = []

    def add(node: ast.AST, target: str, at_import: bool) -> None:
        found.append(Import(path, node.lineno, source, target, at_import))

    def resolve_from(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".") if package else []
        base = parts[: len(parts) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), at_import)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(child, alias.name, at_import)
            elif isinstance(child, ast.ImportFrom):
                base = resolve_from(child)
                for alias in child.names:  # `from pkg import mod` imports the module pkg.mod
                    full = f"{base}.{alias.name}" if base else alias.name
                    add(child, full if _is_module(full, root) else base, at_import)
            elif (isinstance(child, ast.Call) and _is_dynamic_import(child.func)
                  and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)):
                add(child, child.args[0].value, at_import)
            visit(child, at_import)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def package_files(root: Path) -> dict[str, list[Path]]:
    return {p: sorted((root / p).rglob("*.py")) for p in PACKAGES if (root / p).is_dir()}


def arrow_violations(root: Path) -> list[str]:
    out = []
    for package, files in package_files(root).items():
        for path in files:
            for imp in imports_of(path, root):
                dest = imp.target.split(".")[0]
                if dest in ALLOWED and dest != package and dest not in ALLOWED[package]:
                    allowed = ", ".join(sorted(ALLOWED[package])) or "none of the others"
                    out.append(f"{imp.path.relative_to(root)}:{imp.line}: {package} -> {dest} "
                               f"(imports {imp.target}); {package} may import {allowed}")
    return out


def import_cycles(root: Path) -> list[str]:
    """Cycles among each package's modules through imports that run at import time (each
    edge shown with file:line)."""
    out = []
    for files in package_files(root).values():
        modules = {module_name(p, root) for p in files}
        edges: dict[str, dict[str, str]] = {m: {} for m in modules}  # module -> target -> where
        for path in files:
            for imp in imports_of(path, root):
                if imp.at_import and imp.target in modules and imp.target != imp.source:
                    where = f"{imp.path.relative_to(root)}:{imp.line}"
                    edges[imp.source].setdefault(imp.target, where)
        for loop in find_cycles(edges):
            out.append(" -> ".join(f"{a} ({edges[a][b]})" for a, b in itertools.pairwise(loop))
                       + f" -> {loop[-1]}")
    return out


def find_cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Depth-first search; one cycle (first node repeated at the end) per back edge, so an
    acyclic graph gives [] and a cyclic one at least one cycle."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    return cycles


# --------------------------------------------------------------------------- the rules


def test_every_package_is_scanned():
    files = package_files(ROOT)
    assert set(files) == set(PACKAGES)
    for package, paths in files.items():  # an empty scan would pass every rule vacuously
        assert (ROOT / package / "__init__.py") in paths, package
    assert sum(len(imports_of(p, ROOT)) for ps in files.values() for p in ps) > 100


def test_imports_follow_the_layout_arrows():
    violations = arrow_violations(ROOT)
    assert not violations, "imports outside the layout rules (README, Layout):\n" + "\n".join(
        violations)


def test_no_import_cycles_inside_a_package():
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(cycles)


# --------------------------------------------------------------------------- the checker


def _write(root: Path, files: dict[str, str]) -> None:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for rel, text in files.items():
        (root / rel).write_text(text)


def test_checker_catches_every_kind_of_import(tmp_path):
    """The checker on a made-up tree: each forbidden import below must be named by file and
    line, the allowed ones must not."""
    _write(tmp_path, {
        "learner/a.py": "import torch\nimport kl.config\nfrom .b import x\n\n"
                        "def f():\n    from actors import weight_sync\n",
        "learner/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from rewards.records import Problem\nx = 1\n",
        "kl/c.py": "from .. import cluster\n",
        "rewards/d.py": "import importlib\nm = importlib.import_module('learner.a')\n",
        "cluster/e.py": "from actors import x\nfrom learner.a import f\nimport rewards, kl\n",
        "actors/g.py": "class G:\n    import cluster.e as e\n",
    })
    found = sorted(v.split(" (")[0] for v in arrow_violations(tmp_path))
    assert found == ["actors/g.py:2: actors -> cluster", "kl/c.py:1: kl -> cluster",
                     "learner/a.py:6: learner -> actors", "learner/b.py:3: learner -> rewards",
                     "rewards/d.py:2: rewards -> learner"]


@pytest.mark.parametrize("deferred", [False, True])
def test_checker_finds_module_level_cycles_only(tmp_path, deferred):
    back = "def f():\n    from kl import a\n" if deferred else "from . import a\n"
    _write(tmp_path, {"kl/a.py": "from kl.b import y\n", "kl/b.py": "y = 1\n" + back})
    cycles = import_cycles(tmp_path)
    if deferred:  # a function-local import is how a cycle is broken at import time
        assert cycles == []
    else:
        assert cycles == ["kl.a (kl/a.py:1) -> kl.b (kl/b.py:2) -> kl.a"]
