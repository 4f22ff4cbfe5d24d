"""The import rules between klrl's packages (docs/layout.md), checked on the source with `ast`.

Arrows: cluster -> {actors, learner, rewards, kl}; learner -> kl; actors -> rewards; kl and
rewards import none of the others. Inside cluster/, between its subpackages: cli -> any of
them; launchers -> {config, train, slurm}; bench -> {config, train, tiny}; sweeps ->
{config, train, launchers, analysis}; analysis -> {config, train}; publish -> {config,
train, tiny, analysis}; slurm -> {config, train}; train -> {config, tiny}; config and tiny ->
none. The lab wing's arrows run one way: running sweeps may import the analysis (to write the
report at the end), publishing imports the analysis, and the analysis imports neither. Every
import counts for the arrows: module level, function-local and `if TYPE_CHECKING:` alike (a
function-local import still couples the packages; it only delays the coupling), and so does
`importlib.import_module("<constant>")`.

Cycles: inside one package (subpackages included) the graph of imports must be acyclic, and
every import counts there too: module level, function-local and `if TYPE_CHECKING:` alike. A
deferred or type-only import hides a cycle from the interpreter, not from the reader: the two
modules still need each other, and the rule should hold without anyone having to remember
which imports were deferred to keep it. (Deferring an import stays the way to keep import time
cheap; it no longer makes a circle allowed.) Importing `a.b.c` also runs the `__init__` of `a`
and `a.b`: those count as edges too, except for the importer's own enclosing packages (already
imported before it).

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
# cluster/'s subpackages and the subpackages each may import (docs/layout.md).
SUBPACKAGES: dict[str, set[str]] = {
    "cluster.cli": {"cluster.config", "cluster.train", "cluster.sweeps", "cluster.analysis",
                    "cluster.publish", "cluster.bench", "cluster.tiny", "cluster.slurm",
                    "cluster.launchers"},
    "cluster.launchers": {"cluster.config", "cluster.train", "cluster.slurm"},
    "cluster.slurm": {"cluster.config", "cluster.train"},
    "cluster.bench": {"cluster.config", "cluster.train", "cluster.tiny"},
    "cluster.sweeps": {"cluster.config", "cluster.train", "cluster.launchers", "cluster.analysis"},
    "cluster.analysis": {"cluster.config", "cluster.train"},
    "cluster.publish": {"cluster.config", "cluster.train", "cluster.tiny", "cluster.analysis"},
    "cluster.train": {"cluster.config", "cluster.tiny"},
    "cluster.config": set(),
    "cluster.tiny": set(),
}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    source: str      # importing module, dotted ("cluster.train.controller"; a package is its name)
    target: str      # imported module, dotted and resolved (relative imports made absolute)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, root: Path) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import in `path`, wherever it is (module, class or function body, under
    `if TYPE_CHECKING:` or not)."""
    source = module_name(path, root)
    # The package a relative import of level 1 starts from: a package's __init__ is its own.
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found: list[Import] = []

    def add(node: ast.AST, target: str) -> None:
        found.append(Import(path, node.lineno, source, target))

    def resolve_from(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".") if package else []
        base = parts[: len(parts) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    for child in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(child, ast.Import):
            for alias in child.names:
                add(child, alias.name)
        elif isinstance(child, ast.ImportFrom):
            base = resolve_from(child)
            for alias in child.names:  # `from pkg import mod` imports the module pkg.mod
                full = f"{base}.{alias.name}" if base else alias.name
                add(child, full if _is_module(full, root) else base)
        elif (isinstance(child, ast.Call) and _is_dynamic_import(child.func)
              and child.args and isinstance(child.args[0], ast.Constant)
              and isinstance(child.args[0].value, str)):
            add(child, child.args[0].value)
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def package_files(root: Path) -> dict[str, list[Path]]:
    return {p: sorted((root / p).rglob("*.py")) for p in PACKAGES if (root / p).is_dir()}


def subpackage(module: str) -> str | None:
    """The cluster subpackage `module` belongs to ("cluster.train.run" -> "cluster.train")."""
    parts = module.split(".")
    name = ".".join(parts[:2])
    return name if len(parts) >= 2 and name in SUBPACKAGES else None


def arrow_violations(root: Path) -> list[str]:
    out = []
    for package, files in package_files(root).items():
        for path in files:
            for imp in imports_of(path, root):
                where = f"{imp.path.relative_to(root)}:{imp.line}"
                dest = imp.target.split(".")[0]
                if dest in ALLOWED and dest != package and dest not in ALLOWED[package]:
                    allowed = ", ".join(sorted(ALLOWED[package])) or "none of the others"
                    out.append(f"{where}: {package} -> {dest} "
                               f"(imports {imp.target}); {package} may import {allowed}")
                src, dst = subpackage(imp.source), subpackage(imp.target)
                if src and dst and src != dst and dst not in SUBPACKAGES[src]:
                    allowed = ", ".join(sorted(SUBPACKAGES[src])) or "none of the others"
                    out.append(f"{where}: {src} -> {dst} (imports {imp.target}); {src} may "
                               f"import {allowed}")
    return out


def runs_on_import(imp: Import) -> list[str]:
    """The modules importing `imp.target` runs: the target and its enclosing packages (their
    `__init__`), less the importer's own enclosing packages, which ran before it."""
    own = imp.source.split(".")[:-1] if imp.path.name != "__init__.py" else imp.source.split(".")
    own_packages = {".".join(own[:i]) for i in range(1, len(own) + 1)}
    parts = imp.target.split(".")
    parents = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [p for p in parents if p not in own_packages] + [imp.target]


def import_cycles(root: Path) -> list[str]:
    """Cycles among each package's modules through any of their imports (module level,
    function-local or type-only; each edge shown with file:line)."""
    out = []
    for files in package_files(root).values():
        modules = {module_name(p, root) for p in files}
        edges: dict[str, dict[str, str]] = {m: {} for m in modules}  # module -> target -> where
        for path in files:
            for imp in imports_of(path, root):
                for target in runs_on_import(imp):
                    if target in modules and target != imp.source:
                        where = f"{imp.path.relative_to(root)}:{imp.line}"
                        edges[imp.source].setdefault(target, where)
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


def test_every_cluster_module_is_in_a_subpackage_with_its_arrows():
    """A new file directly in cluster/, or a new subpackage, must first be given its place
    (and its arrows) here and in docs/layout.md."""
    subdirs = {p.parent for p in (ROOT / "cluster").rglob("*.py")}
    for d in subdirs:  # every folder is a package, so `cluster.x.y` names one module
        assert (d / "__init__.py").is_file(), d
    found = {module_name(p, ROOT) for p in (ROOT / "cluster").rglob("*.py")}
    outside = sorted(m for m in found if m != "cluster" and subpackage(m) is None)
    assert not outside, f"cluster modules outside the subpackages of SUBPACKAGES: {outside}"
    assert {".".join(m.split(".")[:2]) for m in found if m != "cluster"} == set(SUBPACKAGES)


def test_imports_follow_the_layout_arrows():
    violations = arrow_violations(ROOT)
    assert not violations, "imports outside the layout rules (docs/layout.md):\n" + "\n".join(
        violations)


def test_no_import_cycles_inside_a_package():
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles (deferred and type-only imports count):\n" + "\n".join(
        cycles)


def door_arrows_out(root: Path) -> list[str]:
    """Imports from cluster/train/door/ of a cluster/train module that itself reaches the door
    (directly or through others): the door must be a room the rest of cluster/train enters,
    never one that calls back up into what enters it."""
    door = "cluster.train.door"
    train = sorted((root / "cluster" / "train").rglob("*.py"))
    targets = {module_name(p, root): {i.target for i in imports_of(p, root)} for p in train}
    reaches = {m for m in targets if m == door or m.startswith(door + ".")}
    grew = True
    while grew:  # the modules that import the door, directly or through another such module
        above = {m for m, ts in targets.items() if m not in reaches and any(
            t in reaches or any(t.startswith(r + ".") for r in reaches) for t in ts)}
        reaches |= above
        grew = bool(above)
    out = []
    for path in train:
        source = module_name(path, root)
        if not (source == door or source.startswith(door + ".")):
            continue
        for imp in imports_of(path, root):
            t = imp.target
            if t.startswith("cluster.train") and not t.startswith(door) and t in reaches:
                out.append(f"{path.relative_to(root)}:{imp.line}: the door imports {t}, "
                           "which imports the door")
    return out


def test_the_door_is_one_room_with_no_arrow_back_out():
    """Every pre-start check lives in cluster/train/door/ (docs/layout.md); it may read the run
    directory's owners (run_log.py, checkpoint.py), never a module that enters the door."""
    assert not door_arrows_out(ROOT), "\n".join(door_arrows_out(ROOT))
    assert not (ROOT / "cluster" / "train" / "preflight.py").exists()


# --------------------------------------------------------------------------- the checker


def _write(root: Path, files: dict[str, str]) -> None:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
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


@pytest.mark.parametrize("back", [
    "from . import a\n",                                                   # module level
    "def f():\n    from kl import a\n",                                    # deferred
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kl.a\n",  # type-only
])
def test_checker_finds_cycles_however_the_import_is_written(tmp_path, back):
    _write(tmp_path, {"kl/a.py": "from kl.b import y\n", "kl/b.py": "y = 1\n" + back})
    [cycle] = import_cycles(tmp_path)
    assert cycle.startswith("kl.a (kl/a.py:1) -> kl.b (kl/b.py:") and cycle.endswith(") -> kl.a")


def test_checker_finds_no_cycle_where_the_imports_go_one_way(tmp_path):
    _write(tmp_path, {"kl/a.py": "from kl.b import y\ndef f():\n    from kl import c\n",
                      "kl/b.py": "y = 1\n", "kl/c.py": "from kl.b import y\n"})
    assert import_cycles(tmp_path) == []


def test_checker_follows_the_arrows_between_cluster_subpackages(tmp_path):
    _write(tmp_path, {
        "cluster/config/__init__.py": "", "cluster/train/__init__.py": "",
        "cluster/cli/__init__.py": "",
        "cluster/config/a.py": "def f():\n    from cluster.train import b\n",
        "cluster/train/b.py": "from cluster.config import a\nimport cluster.cli.c\n",
        "cluster/cli/c.py": "from cluster.train.b import x\nfrom cluster.config.a import f\n",
    })
    found = sorted(v.split(" (")[0] for v in arrow_violations(tmp_path))
    assert found == ["cluster/config/a.py:2: cluster.config -> cluster.train",
                     "cluster/train/b.py:2: cluster.train -> cluster.cli"]


def test_checker_finds_cycles_across_cluster_subpackages(tmp_path):
    """sweeps.y imports train.w, which first runs cluster/train/__init__.py; that imports
    train.x, which imports sweeps.y while y is half-initialised: a cycle through an
    `__init__` that no single import line shows."""
    _write(tmp_path, {
        "cluster/train/__init__.py": "from cluster.train.x import g\n",
        "cluster/train/x.py": "from cluster.sweeps.y import f\ng = 1\n",
        "cluster/train/w.py": "",
        "cluster/sweeps/__init__.py": "",
        "cluster/sweeps/y.py": "import cluster.train.w\nf = 1\n",
    })
    assert import_cycles(tmp_path) == [(
        "cluster.sweeps.y (cluster/sweeps/y.py:1) -> cluster.train "
        "(cluster/train/__init__.py:1) -> cluster.train.x (cluster/train/x.py:1) -> "
        "cluster.sweeps.y")]


def test_checker_finds_an_arrow_back_out_of_the_door(tmp_path):
    _write(tmp_path, {
        "cluster/train/__init__.py": "", "cluster/train/door/__init__.py": "",
        "cluster/train/log.py": "x = 1\n",
        "cluster/train/pre.py": "from cluster.train.door.a import f\n",
        "cluster/train/door/a.py": "from cluster.train.log import x\n"
                                   "def f():\n    from cluster.train import pre\n",
    })
    assert door_arrows_out(tmp_path) == [
        "cluster/train/door/a.py:3: the door imports cluster.train.pre, which imports the door"]
