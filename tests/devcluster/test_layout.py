"""devcluster's module graph stays acyclic.

Imports inside functions count as much as those at the top: the old
`cluster` <-> `controlplane` cycle hid in a function-level import. A cycle
makes import order matter and hides which module builds on which; the
registry of clusters (`devcluster.registry`) sits above both instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import devcluster
from tests.importgraph import cycle

PACKAGE = Path(devcluster.__file__).resolve().parent


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """devcluster modules that `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "devcluster":
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("devcluster."):
            found.add((node.module or "").split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("devcluster.")
            }
    return found - {path.stem}


def test_cycle_finder_finds_the_old_cycle() -> None:
    # The checker must be able to fail: the graph of before the registry moved out.
    old = {"cluster": {"controlplane"}, "controlplane": {"cluster", "pki"}, "pki": set()}
    assert cycle(old) == ["cluster", "controlplane", "cluster"]


def test_devcluster_modules_import_no_cycle() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph = {path.stem: imports_of(path, modules) for path in PACKAGE.glob("*.py")}
    assert "registry" in graph
    assert {"cluster", "controlplane"} <= graph["registry"]
    assert cycle(graph) is None, cycle(graph)
