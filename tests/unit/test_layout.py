"""The operator's module graph: no cycles, and no controller built on another.

Imports inside functions count as much as those at the top. Shared code lives
in modules that are not controllers (context, resources, builders, ...), so a
maintainer changes one controller without reading the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sandbox_operator
from tests.importgraph import cycle

ROOT = Path(sandbox_operator.__file__).resolve().parent
PACKAGE = "sandbox_operator"


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from a.b import c` imports a.b, or the module a.b.c when it is one.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names
                ]
            edges[name] |= {t for t in targets if t in known and t != name}
    return edges


def test_the_cycle_finder_can_fail() -> None:
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    # The package's __init__ imports nothing, so it counts as no edge.
    assert cycle(graph()) is None


def controller_of(module: str) -> str | None:
    """The controller a module belongs to: handlers.<name>, a module or a package."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "handlers" else None


def test_no_controller_imports_another() -> None:
    controllers = {controller_of(name) for name in modules()} - {None}
    assert controllers == {"sandbox", "execution", "snapshot", "quota", "template", "pool"}, (
        controllers
    )
    for name, targets in graph().items():
        mine = controller_of(name)
        if mine is None:
            continue
        others = {t for t in targets if controller_of(t) not in (None, mine)}
        assert not others, f"{name} imports {sorted(others)}"


def test_pure_layers_do_no_io() -> None:
    """api/ and builders/ compute; they import neither the clients nor Kopf."""
    impure = {f"{PACKAGE}.kube", f"{PACKAGE}.agent_client", f"{PACKAGE}.context"}
    for name, path in modules().items():
        if name.startswith((f"{PACKAGE}.api", f"{PACKAGE}.builders")):
            assert not graph()[name] & impure, name
            assert "import kopf" not in path.read_text(), name
