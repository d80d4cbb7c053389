"""The house stays as built: imports run one way down the folder tree, no module imports
another in a circle, and project modules are imported at the top of a file.

Rooms and their floors (a module may import its own room, or any room on a lower floor):

    4  api_client.cli                     the commands sit on top and may import anything
    3  workers, api_client               two processes' code that never import each other
    2  scheduler.placement, scheduler.local
    1  scheduler.gguf, scheduler.store
    0  scheduler (its top-level modules: protocol, cluster, errors, settings, units, ...)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("scheduler", "workers", "api_client")
FLOORS = {
    "api_client.cli": 4,
    "workers": 3,
    "api_client": 3,
    "scheduler.placement": 2,
    "scheduler.local": 2,
    "scheduler.gguf": 1,
    "scheduler.store": 1,
    "scheduler": 0,
}
# function-level imports allowed only to keep a heavy dependency out of start-up:
# (importing module, imported module) → why
LAZY_ALLOWED = {
    ("api_client.cli.ops", "workers.main"): "llama.cpp loads only for `ggufq worker`",
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def room(module: str) -> str:
    return max((r for r in FLOORS if module == r or module.startswith(r + ".")), key=len)


def imports(path: Path, known: set[str]) -> Iterator[tuple[str, bool]]:
    """(imported project module, imported inside a function?) for every import in a file."""
    tree = ast.parse(path.read_text())
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            nested |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            target = _known_prefix(name, known)
            if target is not None:
                yield target, id(node) in nested
                break


def _known_prefix(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def graph() -> dict[str, set[tuple[str, bool]]]:
    found = modules()
    return {m: set(imports(p, set(found))) - {(m, False)} for m, p in found.items()}


def test_no_module_imports_a_room_above_or_beside_it() -> None:
    wrong = []
    for module, targets in graph().items():
        for target, _nested in targets:
            src, dst = room(module), room(target)
            if src != dst and FLOORS[dst] >= FLOORS[src]:
                wrong.append(f"{module} ({src}, floor {FLOORS[src]}) imports {target} ({dst})")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle() -> None:
    edges = {m: {t for t, _ in targets} for m, targets in graph().items()}
    cycles = []
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_project_modules_are_imported_at_the_top() -> None:
    lazy = sorted(
        f"{module} imports {target} inside a function"
        for module, targets in graph().items()
        for target, nested in targets
        if nested and (module, target) not in LAZY_ALLOWED
    )
    assert not lazy, "\n".join(lazy)


def test_the_guard_sees_what_it_guards() -> None:
    """The checks above are only as good as the graph: it must find real imports."""
    edges = graph()
    assert ("scheduler.errors", False) in edges["scheduler.protocol"]
    assert room("scheduler.placement.decision") == "scheduler.placement"
    assert room("scheduler.units") == "scheduler"
    assert room("api_client.cli.ops") == "api_client.cli"
