"""What the clients read in the custom resources' bodies (JSON, as the API
server sends them): conditions, and whether the status follows the current
spec. Pure, standard library only."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]


def utc_now() -> str:
    """Now, as the request annotations (resume, restore) carry it: to the
    microsecond, so that each request differs from the one before."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def condition(body: JSON | None, kind: str) -> JSON | None:
    for cond in ((body or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            found: JSON = cond
            return found
    return None


def observed(body: JSON | None) -> bool:
    """The status was computed from the current spec."""
    if body is None:
        return False
    status = body.get("status") or {}
    return int(status.get("observedGeneration") or 0) >= int(body["metadata"].get("generation", 0))


def is_ready(body: JSON | None) -> bool:
    cond = condition(body, "Ready")
    return bool(cond and cond.get("status") == "True" and observed(body))
