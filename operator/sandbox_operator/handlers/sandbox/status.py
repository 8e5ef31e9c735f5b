"""A Sandbox's status: built through the model, written only when it changed,
and what it says when a pass cannot go on (Blocked)."""

from __future__ import annotations

from typing import Any

import kopf

from sandbox_operator import identity, metrics
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import (
    SandboxCondition,
    SandboxReason,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders.conditions import find
from sandbox_operator.builders.sandbox_status import Observed
from sandbox_operator.clock import iso, now_utc, parse_time
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.kube import MERGE_PATCH, status_patch
from sandbox_operator.resources import (
    SANDBOXES,
)

JSON = dict[str, Any]
R_QUOTA = SandboxReason.QUOTA_EXCEEDED


class Blocked(Exception):
    """A pass that cannot go on, raised where that is found: `reason` and
    `message` are what its Ready condition says. `reconcile` catches it, writes
    the status once (`report`) and ends the pass with Kopf's error for it
    (`error`): tried again in `retry` seconds, never (`permanent`, until the
    spec changes), or, with neither, not by this handler (the status says
    what to do)."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retry: float | None = None,
        permanent: bool = False,
        fields: JSON | None = None,
        retry_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry = retry
        self.permanent = permanent
        # Status fields to set as well (by model field name).
        self.fields = fields
        # What the retry is logged as, when that is not the message.
        self.retry_message = retry_message or message

    def error(self) -> kopf.TemporaryError | kopf.PermanentError | None:
        if self.permanent:
            return kopf.PermanentError(self.message)
        if self.retry is None:
            return None
        return kopf.TemporaryError(self.retry_message, delay=self.retry)


async def report(
    ctx: OperatorContext, body: JSON, spec: SandboxSpec | None, blocked: Blocked
) -> None:
    """`blocked` in the status (and an Event): see `report_blocked`."""
    if blocked.reason == SandboxReason.INVALID_SPEC:
        await report_blocked(ctx, body, spec, invalid=blocked.message, fields=blocked.fields)
    elif blocked.reason == R_QUOTA:
        await report_blocked(ctx, body, spec, quota=blocked.message, fields=blocked.fields)
    else:
        held = (blocked.reason, blocked.message)
        await report_blocked(ctx, body, spec, held=held, fields=blocked.fields)


def status_of(body: JSON) -> SandboxStatus:
    return SandboxStatus.model_validate(body.get("status") or {})


async def write_status(
    ctx: OperatorContext, body: JSON, status: SandboxStatus, into: kopf.Patch | None = None
) -> None:
    """Patch status only when it changed: every write costs the API server.

    With `into` (an event handler's Kopf patch), the status goes into it and
    Kopf writes it when the handler returns, after what the handler wrote
    itself (a claim's order of writes: see `handlers.sandbox.arrival`). This
    process's record of the status stays unset until the index shows it."""
    old = body.get("status") or {}
    new = status.to_wire()
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    metrics.PHASES.set(*key, new.get("phase", ""))
    patch = status_patch(old, new)
    if patch is None:
        # Nothing new: `body` holds it, from an event or from the copy kept since
        # this process's write (kept current; never a new copy of an event's).
        if key in ctx.statuses:
            ctx.statuses[key] = new
        return
    if into is not None:
        into.status.update(patch["status"])
        ctx.statuses.pop(key, None)
        body["status"] = new
        return
    written = await ctx.kube.patch(
        SANDBOXES.path(meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    if written is not None:
        ctx.statuses[key] = new
    body["status"] = new


def spec_fields(body: JSON, spec: SandboxSpec | None, settings: Settings) -> JSON:
    """Status fields that follow from the spec alone (None when it is invalid)."""
    if spec is None:
        return {"image": None, "workspace_claim": None, "expires_at": None, "ports": None}
    lifetime = spec.lifecycle.max_lifetime or settings.default_max_lifetime
    ends = []
    if lifetime:
        created = parse_time(body["metadata"]["creationTimestamp"])
        ends.append(created + parse_duration(lifetime))
    if spec.lifecycle.expires_at:
        ends.append(parse_time(spec.lifecycle.expires_at))
    # Written as the lease was (when it ends first), so the lifecycle can tell which.
    expires = None
    if ends:
        first = min(ends)
        lease = spec.lifecycle.expires_at
        expires = lease if lease and parse_time(lease) == first else iso(first)
    served_by = identity.children_ref(body).name
    claim = None if spec.workspace.ephemeral else identity.names(served_by)["claim"]
    ports = build.port_statuses(identity.ref_of(body), spec, settings)
    return {
        "image": build.image_of(spec, settings),
        "workspace_claim": claim,
        "expires_at": expires,
        "ports": ports or None,
    }


async def report_blocked(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec | None,
    *,
    invalid: str = "",
    refused: str = "",
    quota: str = "",
    held: tuple[str, str] | None = None,
    fields: JSON | None = None,
) -> None:
    """Status and an Event for a Sandbox that cannot go on: its spec is invalid, the
    API server refused one of its children, or a quota has no room for it.
    Nothing of the pod is observed; `fields` are status fields to set as well (by
    model field name). The Event is posted when the reason or the message is
    new, not at every retry."""
    observed = Observed(
        generation=body["metadata"].get("generation", 0),
        paused=False,
        deleting=False,
        ephemeral=bool(spec and spec.workspace.ephemeral),
        pod=None,
        invalid=invalid or None,
        refused=refused or None,
        quota=quota or None,
        held=held,
    )
    fresh = current(ctx, body)
    status = sandbox_status.build_status(
        status_of(fresh),
        observed,
        ctx.settings.agent_port,
        now_utc(),
        **spec_fields(body, None if invalid else spec, ctx.settings),
        **(fields or {}),
    )
    before = find(status_of(fresh).conditions, SandboxCondition.READY)
    await write_status(ctx, fresh, status)
    after = find(status.conditions, SandboxCondition.READY)
    unchanged = before is not None and after is not None and before.message == after.message
    waited = before is not None and before.reason in (R_QUOTA, *(held or ()))
    if (quota or held) and unchanged and waited:
        return
    reason, message = (
        ("InvalidSpec", invalid)
        if invalid
        else (R_QUOTA, quota)
        if quota
        else (held if held else ("CreateFailed", refused))
    )
    ctx.event(body, "warn", reason=reason, message=message)


def current(ctx: OperatorContext, body: JSON) -> JSON:
    """`body` with the status this process last wrote (fresher than Kopf's copy)."""
    return ctx.current(body)
