"""What one pass of the Sandbox controller knows of its Sandbox, read once.

`reconcile` reads the view as soon as the pass knows which object it works
on (its pool outcome decided, its template recorded); the steps after it take
the view instead of deriving refs, spec, pause and status from the body
again. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sandbox_operator import identity
from sandbox_operator.api.common import readable
from sandbox_operator.api.sandbox import SandboxSpec, SandboxStatus
from sandbox_operator.builders import sandbox as build
from sandbox_operator.config import Settings
from sandbox_operator.effective import effectively_paused, sandbox_spec

JSON = dict[str, Any]


def parse_spec(body: JSON, settings: Settings) -> tuple[SandboxSpec | None, str | None]:
    """(spec, None), or (spec or None, why it cannot run). Pure."""
    try:
        spec = sandbox_spec(body)
    except ValidationError as exc:
        return None, readable(exc)
    return spec, build.settings_problem(spec, settings)


@dataclass(frozen=True)
class SandboxView:
    """A Sandbox as one pass reads it."""

    # The object the pass works on. The pass's own status writes land in its
    # status (`write_status`), so it ends holding the status it arrived at;
    # `old` is the status as read.
    body: JSON
    # The Sandbox itself, and the one whose children serve it (a claimed pool
    # member, or itself: `identity.children_ref`).
    ref: identity.SandboxRef
    served_by: identity.SandboxRef
    # The spec it runs with (its template's defaults filled in), or None when it
    # does not parse; `invalid` says why it cannot run (None: it can).
    spec: SandboxSpec | None
    invalid: str | None
    old: SandboxStatus
    # Paused by the user or by the idle policy, and not resumed since.
    paused: bool
    deleting: bool
    generation: int
    # The pod and the workspace claim as the indexes (or this process) know them.
    pod: JSON | None
    claim: JSON | None

    @property
    def valid_spec(self) -> SandboxSpec:
        """The spec, for the steps that run once the pass found it valid."""
        assert self.invalid is None, self.invalid
        assert self.spec is not None
        return self.spec


def read(body: JSON, settings: Settings, *, pod: JSON | None, claim: JSON | None) -> SandboxView:
    """The view of `body` with the pod and claim found for it. Pure."""
    spec, invalid = parse_spec(body, settings)
    return SandboxView(
        body=body,
        ref=identity.ref_of(body),
        served_by=identity.children_ref(body),
        spec=spec,
        invalid=invalid,
        old=SandboxStatus.model_validate(body.get("status") or {}),
        paused=spec is not None and effectively_paused(body, spec),
        deleting=bool(body["metadata"].get("deletionTimestamp")),
        generation=body["metadata"].get("generation", 0),
        pod=pod,
        claim=claim,
    )
