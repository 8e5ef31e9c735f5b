"""The chart's Grafana dashboard names only metrics the code exports, and every
metric of ours is on it: a new metric without a panel fails here, before the
chart tier renders the board."""

from __future__ import annotations

import json
import re
from pathlib import Path

import prometheus_client

import sandbox_operator.gateway.metrics
import sandbox_operator.metrics

BOARD = Path(__file__).parents[2] / "charts/sandbox-operator/files/dashboards/sandbox-operator.json"


def exported_metrics() -> set[str]:
    """Every sample name the operator and the gateway can export."""
    # Importing the modules registered their metrics in the default registry.
    assert sandbox_operator.metrics.PHASES is not None
    assert sandbox_operator.gateway.metrics.ROUTES is not None
    names: set[str] = set()
    for family in prometheus_client.REGISTRY.collect():
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
        }.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def _family(sample: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", sample)


def test_the_board_shows_every_metric_and_only_real_ones() -> None:
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {m for expr in exprs for m in re.findall(r"\bsandbox_[a-z_]+\b", expr)}
    assert used
    assert used <= exported_metrics(), used - exported_metrics()
    exported = {m for m in exported_metrics() if m.startswith("sandbox_")}
    missing = {_family(m) for m in exported} - {_family(m) for m in used}
    assert not missing, f"metrics without a panel: {sorted(missing)}"


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    panels = json.loads(BOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]
