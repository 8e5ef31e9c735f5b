"""Idleness and lifetime: when the sandbox is paused, snapshotted or deleted by itself."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

import kopf

from sandbox_operator import metrics
from sandbox_operator.agent_client import AgentError, AgentInfo
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import (
    OnIdle,
    SandboxCondition,
    SandboxPhase,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders import snapshot as snapshot_build
from sandbox_operator.builders.conditions import TRUE, Cond, find, merge
from sandbox_operator.clock import iso, parse_time
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.view import SandboxView
from sandbox_operator.resources import (
    RESUME_ANNOTATION,
    SANDBOXES,
    SNAPSHOTS,
)

JSON = dict[str, Any]


class IdleAction(Enum):
    NONE = "none"
    DELETE = "delete"  # max lifetime reached, or the lease with onExpiry: Delete
    EXPIRE_PAUSE = "expire-pause"  # the lease ended and onExpiry says Pause
    SNAPSHOT = "snapshot"  # take the idle snapshot first
    WAIT_SNAPSHOT = "wait-snapshot"  # act once the snapshot is settled
    IDLE = "idle"  # onIdle: Delete or Pause now


@dataclass(frozen=True)
class LifecycleDecision:
    action: IdleAction
    # Status fields (by model field name).
    fields: JSON = field(default_factory=dict)
    last_activity: datetime | None = None


def decide_lifecycle(
    spec: SandboxSpec,
    status: SandboxStatus,
    info: AgentInfo | None,
    resumed_at: datetime | None,
    now: datetime,
    settings: Settings,
) -> LifecycleDecision:
    """Max lifetime and the idle policy, from the agent's report. Pure.

    `info` None means the agent's activity is unknown: never taken for idleness."""
    lease = spec.lifecycle.expires_at
    if status.expires_at and now >= parse_time(status.expires_at):
        # status.expiresAt is the earlier of the lease and the max lifetime: a lease
        # that ended first is what onExpiry decides about.
        if (
            lease
            and spec.lifecycle.on_expiry is OnIdle.PAUSE
            and parse_time(lease) <= parse_time(status.expires_at)
        ):
            return LifecycleDecision(IdleAction.EXPIRE_PAUSE)
        return LifecycleDecision(IdleAction.DELETE)
    # A leased sandbox lives as long as its lease says, used or not: the
    # operator's default idle timeout is for sandboxes nobody said anything about.
    idle_timeout = spec.lifecycle.idle_timeout or (None if lease else settings.default_idle_timeout)
    if idle_timeout and became_ready(status, now):
        # Idleness counts from Ready at the earliest, which is now: nothing the agent
        # could report moves the deadline, so the first Ready is written without asking.
        last = now.replace(microsecond=0)
        fields: JSON = {
            "last_activity": iso(last),
            "idle_deadline": iso(last + parse_duration(idle_timeout)),
            # A pod that just got Ready runs nothing yet (nobody could reach it;
            # a pool member is refused to all but its claimer); one Ready again
            # after an agent blip keeps what was last reported.
            "active_executions": status.active_executions or 0,
        }
        return LifecycleDecision(IdleAction.NONE, fields, last)
    if info is None or not idle_timeout:
        return LifecycleDecision(IdleAction.NONE)
    reported = now if info.active_executions else info.last_activity.replace(microsecond=0)
    last = max(reported, parse_time(status.last_activity)) if status.last_activity else reported
    # Idleness counts from the moment the sandbox became Ready at the earliest:
    # the agent's clock starts with the agent, before anyone could use the sandbox.
    ready = find(status.conditions, SandboxCondition.READY)
    if ready is not None and ready.status == TRUE and ready.last_transition_time:
        last = max(last, parse_time(ready.last_transition_time))
    # A resume request (an Execution waiting for this sandbox) is activity too:
    # without it a fresh pod could be paused again before the work arrives.
    if resumed_at is not None:
        last = max(last, resumed_at.replace(microsecond=0))
    deadline = last + parse_duration(idle_timeout)
    fields = {
        "last_activity": iso(last),
        "idle_deadline": iso(deadline),
        "active_executions": info.active_executions,
    }
    # Once the idle policy has started its snapshot, it goes through with its
    # action: the snapshot's own flush is not the user coming back.
    if now < deadline and not status.idle_snapshot:
        return LifecycleDecision(IdleAction.NONE, fields, last)
    if spec.lifecycle.snapshot_on_idle:
        if not status.idle_snapshot:
            return LifecycleDecision(IdleAction.SNAPSHOT, fields, last)
        # Deleting too waits for the snapshot: a delete cannot be taken back if
        # the snapshot then fails, and the workspace would go with the pod.
        return LifecycleDecision(IdleAction.WAIT_SNAPSHOT, fields, last)
    return LifecycleDecision(IdleAction.IDLE, fields, last)


def became_ready(status: SandboxStatus, now: datetime) -> bool:
    """`status` (computed at `now`) is Ready, since this very pass. Pure."""
    ready = find(status.conditions, SandboxCondition.READY)
    return ready is not None and ready.status == TRUE and ready.last_transition_time == iso(now)


def paused_fields(old: SandboxStatus, spec: SandboxSpec, paused: bool, now: datetime) -> JSON:
    """When the current pause began and when lifecycle.pausedTimeout ends it. Pure."""
    if not paused:
        return {"paused_since": None, "paused_deadline": None}
    since = old.paused_since or old.idle_paused_at or iso(now)
    timeout = spec.lifecycle.paused_timeout
    deadline = iso(parse_time(since) + parse_duration(timeout)) if timeout else None
    return {"paused_since": since, "paused_deadline": deadline}


async def _paused_too_long(
    ctx: OperatorContext, body: JSON, spec: SandboxSpec, status: SandboxStatus, now: datetime
) -> JSON | None:
    """Delete a sandbox paused past its pausedTimeout (None: deleted). With
    snapshotOnIdle, only once a Snapshot of its workspace is Ready: the idle
    policy's, if it took one when it paused the sandbox (nothing has written to
    it since), or one taken now. Until then, the status fields to write; a
    snapshot that fails keeps the sandbox paused, workspace and all."""
    meta = body["metadata"]
    if spec.lifecycle.snapshot_on_idle:
        waiting = await _snapshot_before_delete(ctx, body, spec, status, now)
        if waiting is not None:
            return waiting
    ctx.event(
        body,
        "info",
        reason="PausedTimeout",
        message=f"paused since {status.paused_since}, longer than"
        f" {spec.lifecycle.paused_timeout}: deleting",
    )
    metrics.TEARDOWNS.labels("paused_timeout").inc()
    await ctx.kube.delete(SANDBOXES.path(meta["namespace"], meta["name"]), uid=meta["uid"])
    return None


async def _snapshot_before_delete(
    ctx: OperatorContext, body: JSON, spec: SandboxSpec, status: SandboxStatus, now: datetime
) -> JSON | None:
    """None once a Snapshot of the paused sandbox's workspace is Ready; until then
    the status fields that take or wait for one."""
    meta = body["metadata"]
    # Named after the deadline, which a restarted operator reads again from status.
    deadline = parse_time(status.paused_deadline or iso(now))
    own = snapshot_build.idle_snapshot_name(meta["name"], deadline)
    name = status.idle_snapshot
    if name:
        settled, why = await idle_snapshot_outcome(
            ctx, body, spec, name, status.idle_snapshot_started_at, now
        )
        if settled is Settled.READY:
            return None
        if settled is Settled.WAITING:
            return {}
        if name == own:
            ctx.event_once(
                body,
                "warn",
                "IdleSnapshotFailed",
                f"snapshot {name}: {why}; kept paused instead of deleted after"
                f" pausedTimeout {spec.lifecycle.paused_timeout}, workspace and all:"
                " delete the Sandbox to let it go",
                key=name,
            )
            return {}
        # The idle policy's own failed: this deletion takes one of its own.
    return await _take_idle_snapshot(ctx, body, own, now, " before deleting")


async def _take_idle_snapshot(
    ctx: OperatorContext, body: JSON, name: str, now: datetime, why: str = ""
) -> JSON:
    """Create the Snapshot `name` of the sandbox's workspace; the status fields
    that record it (what the idle policy and the finalizer wait on)."""
    meta = body["metadata"]
    await ctx.kube.create(
        SNAPSHOTS.path(meta["namespace"]),
        snapshot_build.build_idle_snapshot(meta["name"], meta["namespace"], name),
    )
    ctx.event(body, "info", reason="IdleSnapshot", message=f"taking snapshot {name}{why}")
    return {"idle_snapshot": name, "idle_snapshot_started_at": iso(now)}


async def lifecycle(
    ctx: OperatorContext,
    view: SandboxView,
    status: SandboxStatus,
    now: datetime,
    logger: kopf.Logger,
) -> JSON | None:
    """Idle timeout, paused timeout and max lifetime, for `status` (what the pass
    arrived at so far). Returns status fields to set, or None when it deleted
    the sandbox: whatever it had to say is written, and a write after the
    delete would race the finalizer's own patch."""
    body, spec = view.body, view.valid_spec
    meta = body["metadata"]
    if status.paused_deadline and now >= parse_time(status.paused_deadline):
        return await _paused_too_long(ctx, body, spec, status, now)
    info = None if became_ready(status, now) else await _agent_info(ctx, body, status, logger)
    full = _workspace_full(ctx, body, status, info, now)
    full.update(_limits(ctx, body, spec, status.evolve(**full), info, now))
    resumed = (meta.get("annotations") or {}).get(RESUME_ANNOTATION)
    resumed_at = None
    with suppress(ValueError):
        resumed_at = parse_time(resumed) if resumed else None
    decision = decide_lifecycle(spec, status, info, resumed_at, now, ctx.settings)
    fields = {**full, **decision.fields}
    sandbox_path = SANDBOXES.path(meta["namespace"], meta["name"])
    if decision.action is IdleAction.DELETE:
        by_lease = spec.lifecycle.expires_at == status.expires_at
        logger.info("%s reached; deleting", "lease end" if by_lease else "max lifetime")
        ctx.event(
            body,
            "info",
            reason="LeaseExpired" if by_lease else "MaxLifetimeReached",
            message=f"expired at {status.expires_at}",
        )
        metrics.TEARDOWNS.labels("lease" if by_lease else "max_lifetime").inc()
        await ctx.kube.delete(sandbox_path, uid=meta["uid"])
        return None
    if decision.action is IdleAction.EXPIRE_PAUSE:
        if status.idle_paused_at:
            return fields  # paused at its lease end already
        logger.info("lease ended at %s; pausing", spec.lifecycle.expires_at)
        ctx.event(
            body,
            "info",
            reason="LeaseExpired",
            message=f"the lease ended at {spec.lifecycle.expires_at}: Pause",
        )
        metrics.TEARDOWNS.labels("lease_pause").inc()
        fields["idle_paused_at"] = iso(now)
        return fields
    if decision.action is IdleAction.NONE:
        return fields
    assert decision.last_activity is not None
    if decision.action is IdleAction.SNAPSHOT:
        deadline = parse_time(fields["idle_deadline"])
        name = snapshot_build.idle_snapshot_name(meta["name"], deadline)
        fields.update(await _take_idle_snapshot(ctx, body, name, now))
        return fields  # acted on once the snapshot is done (or failed, or late)
    action = spec.lifecycle.on_idle
    if decision.action is IdleAction.WAIT_SNAPSHOT:
        name = status.idle_snapshot or ""
        started = status.idle_snapshot_started_at
        settled, why = await idle_snapshot_outcome(ctx, body, spec, name, started, now)
        if settled is Settled.WAITING:
            return fields
        if settled is Settled.FAILED:
            # Without its snapshot, a sandbox due for deletion is paused instead:
            # the workspace (its PVC) stays until someone deletes the Sandbox.
            kept = ""
            if action is OnIdle.DELETE:
                kept = " instead of deleting it: the workspace is kept"
            ctx.event(
                body,
                "warn",
                reason="IdleSnapshotFailed",
                message=f"snapshot {name}: {why}; pausing the sandbox{kept}",
            )
            action = OnIdle.PAUSE
    last = iso(decision.last_activity)
    logger.info("idle since %s; %s", last, action.value)
    metrics.TEARDOWNS.labels(f"idle_{action.value.lower()}").inc()
    ctx.event(body, "info", reason="IdleTimeout", message=f"idle since {last}: {action.value}")
    if action is OnIdle.DELETE:
        await ctx.kube.delete(sandbox_path, uid=meta["uid"])
        return None
    fields["idle_paused_at"] = iso(now)
    return fields


def _workspace_full(
    ctx: OperatorContext, body: JSON, status: SandboxStatus, info: AgentInfo | None, now: datetime
) -> JSON:
    """The WorkspaceFull condition from the agent's report, with an Event when it
    comes or goes; no fields when the agent did not report its workspace."""
    if info is None or info.workspace is None:
        return {}
    was = find(status.conditions, SandboxCondition.WORKSPACE_FULL)
    usage = info.workspace
    cond = sandbox_status.workspace_full(
        usage.total_bytes, usage.available_bytes, was_full=was is not None
    )
    if (cond is None) == (was is None):
        return {}
    if cond is not None:
        metrics.WORKSPACE_FULL.inc()
        ctx.event(body, "warn", reason="WorkspaceFull", message=cond.message)
    else:
        free = usage.available_bytes / sandbox_status.MIB
        ctx.event(body, "info", reason="WorkspaceSpaceFreed", message=f"{free:.0f} MiB free")
    generation = body["metadata"].get("generation", 0)
    current = {SandboxCondition.WORKSPACE_FULL.value: cond}
    return {"conditions": merge(status.conditions, current, generation, iso(now))}


# The shortest time between the two looks that PidLimitReached and CpuThrottled
# compare: a third of the periodic pass's default interval.
LIMITS_MIN_INTERVAL_SECONDS = 10.0


def _limits(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec,
    status: SandboxStatus,
    info: AgentInfo | None,
    now: datetime,
) -> JSON:
    """PidLimitReached and CpuThrottled from how the sandbox container's cgroup
    counters grew since the last look, with Events; no fields when nothing
    changed or there is nothing to compare with."""
    if info is None or info.limits is None:
        return {}
    meta = body["metadata"]
    key = (meta["namespace"], meta["uid"])
    last, after = ctx.limit_counters.get(key), info.limits
    if last is not None and (now - last[0]).total_seconds() < LIMITS_MIN_INTERVAL_SECONDS:
        # Passes close together (a pod event right after the timer) would compare
        # a second or two of counters: a busy sandbox would look idle and flap.
        return {}
    ctx.limit_counters[key] = (now, after)
    if last is None:
        return {}
    before = last[1]
    current: dict[str, Cond | None] = {}
    refused = sandbox_status.grown(before.pids_refused, after.pids_refused)
    if refused is not None:
        pids = sandbox_status.pid_limit_reached(refused)
        current[SandboxCondition.PID_LIMIT_REACHED.value] = pids
        if pids is not None:
            metrics.LIMIT_REACHED.labels("pids").inc()
            running = f"; {after.pids_current} processes now" if after.pids_current else ""
            ctx.event(
                body,
                "warn",
                reason="PidLimitReached",
                message=f"{refused} process starts refused by the pod's PID limit since the"
                f" last check{running}",
            )
    periods = sandbox_status.grown(before.cpu_periods, after.cpu_periods)
    throttled = sandbox_status.grown(before.cpu_throttled_periods, after.cpu_throttled_periods)
    if periods is not None and throttled is not None:
        was = find(status.conditions, SandboxCondition.CPU_THROTTLED) is not None
        limit = spec.resources.cpu or ctx.settings.default_cpu
        cpu = sandbox_status.cpu_throttled(periods, throttled, limit, was=was)
        current[SandboxCondition.CPU_THROTTLED.value] = cpu
        share = f"{throttled} of {periods} CPU periods"
        if cpu is not None and not was:
            metrics.LIMIT_REACHED.labels("cpu").inc()
            ctx.event(
                body,
                "warn",
                reason="CpuThrottled",
                message=f"throttled in {share} since the last check at its CPU limit {limit}",
            )
        elif cpu is None and was:
            ctx.event(body, "info", reason="CpuThrottleEnded", message=f"throttled in {share}")
    changed = {
        kind: cond
        for kind, cond in current.items()
        if (cond is None) != (find(status.conditions, SandboxCondition(kind)) is None)
    }
    if not changed:
        return {}
    generation = meta.get("generation", 0)
    return {"conditions": merge(status.conditions, changed, generation, iso(now))}


async def _agent_info(
    ctx: OperatorContext,
    body: JSON,
    status: SandboxStatus,
    logger: kopf.Logger,
) -> AgentInfo | None:
    """The agent's report (activity, workspace usage), when the agent answers.
    Asked on every pass of a running sandbox, idle policy or not: a full
    workspace is reported either way."""
    if status.phase != SandboxPhase.RUNNING or not status.agent_endpoint:
        return None
    token = await ctx.agent_token(body)
    if not token:
        return None
    try:
        return await ctx.agents.info(status.agent_endpoint, token)
    except AgentError as exc:
        # Unknown activity is never taken for idleness: no teardown on a blip.
        metrics.AGENT_ERRORS.inc()
        logger.warning("agent info failed: %s", exc)
        ctx.drop_token(body)
        return None


def idle_snapshot_timeout(spec: SandboxSpec | None, settings: Settings) -> float:
    timeout = (spec.lifecycle.snapshot_timeout if spec else None) or settings.idle_snapshot_timeout
    return parse_duration(timeout).total_seconds()


class Settled(Enum):
    """Where the idle policy's Snapshot stands, for what waits on it."""

    WAITING = "waiting"
    READY = "ready"
    FAILED = "failed"  # failed, gone, or not ready within its timeout


async def idle_snapshot_outcome(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec | None,
    name: str,
    started: str | None,
    now: datetime,
) -> tuple[Settled, str]:
    """Is the idle policy's Snapshot Ready, still on its way, or failed (Failed,
    missing, or not Ready within the timeout, which is the user's to set)? With
    why it failed, for the Event its caller posts."""
    namespace = body["metadata"]["namespace"]
    snap = await ctx.kube.get(SNAPSHOTS.path(namespace, name))
    phase = ((snap or {}).get("status") or {}).get("phase")
    if phase == "Ready":
        return Settled.READY, ""
    timeout = idle_snapshot_timeout(spec, ctx.settings)
    late = started is not None and (now - parse_time(started)).total_seconds() > timeout
    if snap is not None and phase != "Failed" and not late:
        return Settled.WAITING, ""
    why = (
        "it does not exist"
        if snap is None
        else "it failed (see the Snapshot's conditions)"
        if phase == "Failed"
        else f"it was not ready within {timeout:g}s"
    )
    return Settled.FAILED, why
