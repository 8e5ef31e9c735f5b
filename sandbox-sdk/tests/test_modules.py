"""The SDK's modules import one another one way: a handle names its client's
type (or a client its handle's) for the type checker only, never when it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sandbox_sdk

ROOT = Path(sandbox_sdk.__file__).resolve().parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("sandbox_sdk", *parts))] = path
    return found


def imported_when_run(path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports, in functions too, leaving out
    those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(ast.Module(body=node.body, type_ignores=[]))
    }
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            }
    return targets & known


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A path that comes back to where it started, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(edges.get(name, ())):
            found = visit(target, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for start in sorted(edges):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_cycle_finder_can_fail() -> None:
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("flavour", ["_async", "_sync"])
def test_the_clients_modules_import_one_way(flavour: str) -> None:
    known = modules()
    edges = {
        name: imported_when_run(path, set(known)) - {name}
        for name, path in known.items()
        if name.startswith(f"sandbox_sdk.{flavour}.")
    }
    assert {"client", "sandbox", "executions", "files", "terminals"} <= {
        name.rsplit(".", 1)[1] for name in edges
    }
    assert cycle(edges) is None
    # The client makes handles; no handle imports the client to run.
    client = f"sandbox_sdk.{flavour}.client"
    assert not any(client in targets for targets in edges.values())
