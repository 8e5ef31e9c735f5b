"""The module layout keeps its promises: no import cycles, HTTP only at the edge,
and a route table whose declarations are usable as they stand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sandbox_agent
from sandbox_agent.routes import OPS

PACKAGE = Path(sandbox_agent.__file__).parent
MODULES = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
# Below the HTTP edge: they raise domain errors and never learn about requests.
DOMAIN = (
    "archive",
    "config",
    "environment",
    "errors",
    "executions",
    "files",
    "inotify",
    "journal",
    "models",
    "patch",
    "paths",
    "quiesce",
    "runner",
    "runner_client",
    "runtime",
    "watch",
    "watchpoll",
)


def _imports(name: str) -> set[str]:
    """Sibling modules ``name`` imports, at any depth (function-level imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sandbox_agent."):
            found.add((node.module or "").split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("sandbox_agent.")
            )
    return found & set(MODULES)


def test_no_import_cycles() -> None:
    graph = {name: _imports(name) for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("name", [n for n in DOMAIN if n in MODULES])
def test_domain_modules_know_nothing_of_http(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            mods += [a.name for a in node.names]
            assert not any(m.split(".")[0] == "starlette" for m in mods), name
    assert not _imports(name) & {"app", "web", "routes", "routing", "state", "auth"}, name
    assert "status_code" not in MODULES[name].read_text(), name


def test_route_table_is_consistent() -> None:
    seen = set()
    for op in OPS:
        assert (op.method, op.path) not in seen, (op.method, op.path)
        seen.add((op.method, op.path))
        assert op.summary, f"{op.handler.__name__} needs a docstring (its summary)"
        assert op.handler.__module__.startswith("sandbox_agent.api_"), op.handler
        for p in op.params:
            if p.location == "path":
                assert "{" + p.name + "}" in op.path, (op.path, p.name)
            if p.default is not None:
                expected = {"string": str, "integer": int, "number": float, "boolean": bool}
                assert type(p.default) is expected[p.type], (op.path, p.name, p.default)
            if isinstance(p.default, int | float):
                lo, hi = p.minimum, p.maximum
                assert lo is None or lo <= p.default, (op.path, p.name)
                assert hi is None or p.default <= hi, (op.path, p.name)
