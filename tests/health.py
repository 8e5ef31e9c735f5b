"""The Argo CD health each phase of our kinds must show, shared by the e2e test
that captures real objects in those phases (tests/e2e/test_health_e2e.py) and
the unit test that replays the captured objects (tests/fixtures/health/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "health"

# Case name (the fixture's file name) -> the health Argo CD must show.
EXPECTED: dict[str, str] = {
    "sandbox-starting": "Progressing",
    "sandbox-running": "Healthy",
    "sandbox-paused": "Suspended",
    "sandbox-invalid-spec": "Degraded",
    "sandbox-no-python": "Degraded",
    "sandbox-terminating": "Progressing",
    "execution-running": "Progressing",
    "execution-succeeded": "Healthy",
    "execution-failed": "Degraded",
    "execution-timed-out": "Degraded",
    "execution-cancelled": "Degraded",
    "snapshot-waiting": "Progressing",
    "snapshot-ready": "Healthy",
    "snapshot-failed": "Degraded",
}


def kind_of(case: str) -> str:
    return case.split("-", 1)[0].capitalize()


def trimmed(body: dict[str, Any]) -> dict[str, Any]:
    """An object as a fixture: what the API server returned, minus the field
    managers' bookkeeping (large, and no part of health)."""
    metadata = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**body, "metadata": metadata}


def load(case: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{case}.json").read_text())
    return loaded


def save(case: str, body: dict[str, Any]) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / f"{case}.json").write_text(
        json.dumps(trimmed(body), indent=2, sort_keys=True) + "\n"
    )
