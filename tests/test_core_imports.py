"""The package's modules import each other one way: the graph of intra-package imports has no cycle.

Every `import`/`from ... import` is counted wherever it stands (module level or inside a
function: a function-local import that closes a loop is still a loop). A name imported from
a package counts as its submodule where one exists (`from ..runtime import context`), and
importing from a package that is not one of the importer's own ancestors also runs that
package's `__init__` (an edge to it as well). The implicit import of an importer's own
ancestors is not counted: every module's package is initialising already when it runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> package name, as pyproject.toml's package-dir maps them
PACKAGES = {"globaltensor": "globaltensor", "globaltensor/runtime": "globaltensor.runtime",
            "globaltensor/raggedtensor": "globaltensor.raggedtensor", "globaltensor/parallel": "globaltensor.parallel",
            "globaltensor/tools": "globaltensor.tools",
            "boxing": "globaltensor.boxing", "ops": "globaltensor.ops", "models": "globaltensor.models"}

# The floors, lowest first: a module imports only from its own floor and those below it. Each floor is a wing
# (a concept: its modules may share private names); `globaltensor/__init__.py` stands on none, handing names on.
FLOORS = [
    ("core", ("globaltensor.sbp", "globaltensor.placement", "globaltensor.layout", "globaltensor.runtime")),
    ("boxing", ("globaltensor.boxing",)),
    ("ops", ("globaltensor.ops",)),
    ("tensor", ("globaltensor.tensor", "globaltensor.chunks")),
    ("ragged", ("globaltensor.raggedtensor",)),
    ("parallel", ("globaltensor.parallel",)),
    ("tools", ("globaltensor.tools",)),
    ("front door", ("globaltensor.api", "globaltensor.factory", "globaltensor.checkpoint", "globaltensor.data",
                    "globaltensor.hf", "globaltensor.planning", "globaltensor.calibrate")),
    ("models", ("globaltensor.models",)),
]


def floor(name: str) -> int | None:
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def source_of(node: ast.ImportFrom, package: str) -> str | None:
    """The dotted module a `from ... import` in `package` reads from; None outside globaltensor."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    if node.module and node.module.split(".")[0] == "globaltensor":
        return node.module
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` (at `path`) imports, anywhere in its source."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `import a.b.c` of a name inside a module: the module
            target = target.rpartition(".")[0]
        # the target and the packages on the way to it, whose __init__ runs first
        for t in _ancestors(target) | {target}:
            if t in known and t != name and t not in _ancestors(name):
                found.add(t)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "globaltensor":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = source_of(node, package)
            if source is None:
                continue
            add(source)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    add(f"{source}.{alias.name}")
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _edge_lines(cycle: list[str]) -> str:
    known = modules()
    lines = []
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"  {a} -> {b}   ({known[a].relative_to(ROOT)})")
    return "\n".join(lines)


def test_graph_covers_every_folder():
    graph = import_graph()
    assert {"globaltensor.sbp", "globaltensor.runtime.comm", "globaltensor.boxing.search",
            "globaltensor.ops.dispatch", "globaltensor.models.gpt"} <= set(graph)
    assert "globaltensor.layout" in graph["globaltensor.boxing.cost"]  # `from ..layout import Layout`
    assert "globaltensor.runtime.context" in graph["globaltensor.api"]  # `from .runtime import context`
    assert "globaltensor.runtime" in graph["globaltensor.boxing.execute"]  # its __init__ runs first


def test_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle:\n" + _edge_lines(cycle)


def test_every_module_stands_on_a_floor():
    unplaced = [name for name in import_graph() if floor(name) is None and name != "globaltensor"]
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"


def test_no_import_points_up_the_floors():
    """core < boxing < ops < tensor < ragged < parallel < tools < front door < models (docs/design.md)."""
    graph = import_graph()
    upward = [(a, b) for a, targets in graph.items() for b in targets
              if floor(a) is not None and floor(b) is not None and floor(b) > floor(a)]
    assert not upward, f"imports that point up the floors: {upward}"


def private_imports() -> list[tuple[str, str]]:
    """(importer, imported name) for each private name (`_x`) a module takes from another floor, by
    `from m import _x` or as `m._x` on a module it imported."""
    known = modules()
    found = []
    for name, path in known.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> module it is
        for node in ast.walk(tree):
            source = source_of(node, package) if isinstance(node, ast.ImportFrom) else None
            if source is None:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:
                    aliases[alias.asname or alias.name] = target
                elif alias.name.startswith("_") and floor(source) != floor(name):
                    found.append((name, target))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                target = aliases[node.value.id]
                if floor(target) != floor(name):
                    found.append((name, f"{target}.{node.attr}"))
    return found


def test_no_private_name_crosses_a_floor():
    crossing = private_imports()
    assert not crossing, f"private names taken from another floor (make them public there, or move): {crossing}"
