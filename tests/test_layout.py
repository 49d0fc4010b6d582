"""The package's shape: no import cycle, engine classes a reader can hold, no run history in src,
and a controller that holds no branch per method."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "memfit"
#: the engine's folder, whose classes must stay small
ENGINE = ["engine"]
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


class _Imports(ast.NodeVisitor):
    """memfit modules a module imports; ``lazy``: also inside functions; ``typing``: also under TYPE_CHECKING."""

    def __init__(self, mods: dict[str, Path], lazy: bool, typing: bool = False):
        self.mods, self.lazy, self.typing, self.found = mods, lazy, typing, set()

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" and not self.typing:
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.lazy:
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(a.name for a in node.names if a.name in self.mods)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or not node.module.startswith("memfit"):
            return
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in self.mods]
        self.found.update(subs)
        if len(subs) < len(node.names):
            self.found.add(node.module)


def _graph(lazy: bool, typing: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        visitor = _Imports(mods, lazy, typing)
        visitor.visit(ast.parse(path.read_text()))
        # a submodule's import of its own parent package is how packages work, not a cycle
        graph[name] = {d for d in visitor.found if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(lazy: bool, typing: bool = False) -> list[list[str]]:
    graph = _graph(lazy, typing)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


@pytest.mark.parametrize("lazy, typing", [(False, False), (True, False), (True, True)],
                         ids=["module-level", "with-lazy-imports", "with-type-checking-imports"])
def test_no_import_cycle_inside_the_package(lazy, typing):
    assert _cycles(lazy, typing) == []


#: (importer's package, packages it may never import, lazily or under TYPE_CHECKING included): the engine is
#: used by the integrations, the tools and the CLI, never the other way round; inside it, parts < plan < run
LAYERS = [
    ("memfit.engine", ("memfit.integrations", "memfit.cli", "memfit.tools", "memfit.tasks", "memfit.trl")),
    ("memfit.engine.parts", ("memfit.engine.plan", "memfit.engine.run", "memfit.engine.methods")),
    ("memfit.engine.plan", ("memfit.engine.run",)),
    ("memfit.tools", ("memfit.cli",)),
    ("memfit.tasks", ("memfit.cli", "memfit.tools")),
]


def _crossings(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        for owner, banned in LAYERS
        if mod == owner or mod.startswith(owner + ".")
        for dep in deps
        if any(dep == b or dep.startswith(b + ".") for b in banned)
    )


def test_layers_import_only_downwards():
    assert _crossings(_graph(lazy=True, typing=True)) == []


def test_the_layer_check_finds_a_crossing():
    assert _crossings({"memfit.engine.parts.head": {"memfit.integrations.distributed"},
                       "memfit.tools.report": {"memfit.engine.records"}}) == [
        "memfit.engine.parts.head -> memfit.integrations.distributed"]


#: a folder a reader can scan: more modules than this and it wants subpackages by concern
MAX_MODULES_PER_FOLDER = 12


def test_no_folder_holds_more_than_a_dozen_modules():
    crowded = {}
    for folder in [SRC, *(p for p in SRC.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
        if n > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(SRC.parent))] = n
    assert crowded == {}


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    # the check above must be able to fail: two modules importing each other are found
    pkg = tmp_path / "memfit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from memfit import b\n")
    (pkg / "b.py").write_text("def f():\n    from memfit.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    assert _cycles(lazy=False) == [] and _cycles(lazy=True) == [["memfit.a", "memfit.b", "memfit.a"]]


def _engine_files() -> list[Path]:
    files = []
    for entry in ENGINE:
        path = SRC / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_engine_classes_stay_small():
    long = []
    for path in _engine_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_run_history_in_src():
    # NOTEs state rules; which device, date or run found them belongs in docs/devlog.md
    history = re.compile(
        r"\b(H100|H200|V100|A100|20\d\d-\d\d-\d\d"
        r"|(fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|\d+(st|nd|rd|th)) (run|session|call))\b"
    )
    hits = [
        f"{path.relative_to(SRC)}:{i}: {line.strip()}"
        for path in SRC.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert hits == []


def test_the_controller_holds_no_branch_per_method():
    source = (SRC / "engine" / "run" / "controller.py").read_text()
    from memfit.engine.methods import METHODS

    names = {cls.__name__ for cls in METHODS.values()}
    assert not [n for n in names if re.search(rf"\b{n}\b", source)]
    assert not re.search(r"method\.name\s*[!=]=", source)
