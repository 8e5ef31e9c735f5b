"""Sandbox reconciliation: children from builders, status from observation.

Every entry point (create/update/resume, the periodic timer, pod and claim
events) ends in `reconcile`, which is level-based: it looks at what exists and
converges, so a missed event or an operator restart at any moment costs nothing.
The decisions (what to do with the pod, the workspace, an idle sandbox) are
functions of what was read, kept apart from the calls that carry them out.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import kopf
from pydantic import ValidationError

from sandbox_operator import envvars, metrics
from sandbox_operator.agent_client import AgentError, AgentInfo, environment_hash
from sandbox_operator.api.common import parse_duration, readable
from sandbox_operator.api.sandbox import (
    OnIdle,
    SandboxCondition,
    SandboxPhase,
    SandboxReason,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders import snapshot as snapshot_build
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, find
from sandbox_operator.builders.sandbox_status import Observed
from sandbox_operator.clock import iso, now_utc, parse_time
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.kube import MERGE_PATCH, Refused, status_patch
from sandbox_operator.resources import (
    CLAIMS,
    EVENTS,
    NETWORK_POLICIES,
    POD_SPEC_ANNOTATION,
    PODS,
    RESTORE_ANNOTATION,
    RESUME_ANNOTATION,
    SANDBOXES,
    SECRETS,
    SERVICES,
    SNAPSHOTS,
    STORAGE_CLASSES,
)

JSON = dict[str, Any]
Key = tuple[str, str]
# Kopf indexes of our pods and claims by (namespace, sandbox): read without a request.
ChildIndex = Mapping[Key, Any]

# How long teardown waits for a graceful pod exit before forcing it.
POD_DELETE_PATIENCE = timedelta(seconds=60)
# How long a pod may wait unscheduled on a claim that is bound before it is
# replaced (see sandbox_status.stuck_on_unbound_claim).
UNBOUND_CLAIM_PATIENCE = timedelta(seconds=15)
# How long a claim may be Pending before its Events are read for the reason.
CLAIM_PROBLEM_PATIENCE = timedelta(seconds=10)
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"


class Children(Enum):
    """How much of the Sandbox's children a reconciliation looks after."""

    # Only the pod (timer, pod and claim events): cheapest, the common case.
    POD = "pod"
    # Create missing children, leave existing ones be (creation, operator restart).
    ENSURE = "ensure"
    # Also bring drifted children back to the spec (spec updates).
    CONVERGE = "converge"


def parse_spec(body: JSON, settings: Settings) -> tuple[SandboxSpec | None, str | None]:
    """(spec, None), or (spec or None, why it cannot run)."""
    try:
        spec = SandboxSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return None, readable(exc)
    try:
        build.image_of(spec, settings)
    except ValueError as exc:
        return spec, f"spec.runtime: {exc}"
    return spec, None


def ref_of(body: JSON) -> build.SandboxRef:
    meta = body["metadata"]
    return build.SandboxRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def status_of(body: JSON) -> SandboxStatus:
    return SandboxStatus.model_validate(body.get("status") or {})


async def _create_or_converge(ctx: OperatorContext, path: str, obj: JSON, converge: bool) -> None:
    created = await ctx.kube.create(path, obj)
    if created is None and converge:
        # Exists: bring its spec in line (merge patch replaces lists wholesale,
        # which is what we want for a fully-specified desired object).
        await ctx.kube.patch(f"{path}/{obj['metadata']['name']}", {"spec": obj["spec"]})


# -- the workspace ----------------------------------------------------------------


@dataclass(frozen=True)
class WorkspacePlan:
    """Where the workspace claim comes from, and whether the pod must wait for it."""

    # Make a missing claim from this Snapshot (None: an empty claim).
    source: snapshot_build.RestoreSource | None = None
    # Keep the pod stopped and create no claim: a restore or rollback is under way.
    hold: bool = False
    # The existing claim must go first (rollback); it is this one.
    replace: JSON | None = None
    condition: Cond | None = None
    # Status fields (by model field name).
    fields: JSON = field(default_factory=dict)
    # Worth retrying soon (a snapshot on its way, a pod or claim going).
    busy: bool = False


def _restored(name: str) -> Cond:
    return Cond(
        SandboxCondition.WORKSPACE_RESTORED,
        TRUE,
        SandboxReason.RESTORED,
        f"the workspace was restored from snapshot {name}",
    )


async def plan_workspace(ctx: OperatorContext, body: JSON, spec: SandboxSpec) -> WorkspacePlan:
    """Decide from what exists whether the workspace must be (re)made from a Snapshot.

    Restart-safe: the claim records the Snapshot and request it was made from,
    so a rollback interrupted anywhere resumes from what it finds. Nothing is
    deleted before the Snapshot is ready to restore."""
    wanted = spec.workspace.from_snapshot
    if not wanted or spec.workspace.ephemeral:
        return WorkspacePlan()
    meta = body["metadata"]
    status = body.get("status") or {}
    request = (meta.get("annotations") or {}).get(RESTORE_ANNOTATION, "")
    if (status.get("workspaceSnapshot"), status.get("workspaceRestoreRequest") or "") == (
        wanted,
        request,
    ):
        return WorkspacePlan(condition=_restored(wanted))  # the steady state: no reads
    claim_name = build.names(meta["name"])["claim"]
    claim = await ctx.kube.get(CLAIMS.path(meta["namespace"], claim_name))
    going = claim is not None and bool(claim["metadata"].get("deletionTimestamp"))
    if claim is not None and not going:
        origin, origin_request, lineage = snapshot_build.claim_origin(claim)
        if (origin, origin_request) == (wanted, request):
            fields = {
                "workspace_snapshot": wanted,
                "workspace_lineage": lineage,
                "workspace_restore_request": request,
            }
            return WorkspacePlan(condition=_restored(wanted), fields=fields)
    snap = await ctx.kube.get(SNAPSHOTS.path(meta["namespace"], wanted))
    snap_status = (snap or {}).get("status") or {}
    if snap is None or snap_status.get("phase") != "Ready":
        if snap is None:
            why = "does not exist"
        else:
            ready: JSON = next(
                (c for c in snap_status.get("conditions") or [] if c.get("type") == "Ready"), {}
            )
            why = f"is {snap_status.get('phase') or 'Pending'}: {ready.get('message', '')}"
        failed = snap_status.get("phase") == "Failed"
        cond = Cond(
            SandboxCondition.WORKSPACE_RESTORED,
            FALSE,
            SandboxReason.SNAPSHOT_FAILED if failed else SandboxReason.SNAPSHOT_NOT_READY,
            f"snapshot {wanted} {why}".strip(),
        )
        # An existing workspace keeps serving until the snapshot can replace it;
        # without one, no empty claim is made in place of the restored one.
        hold = claim is None or going
        return WorkspacePlan(condition=cond, hold=hold, busy=not failed)
    source = snapshot_build.RestoreSource(
        snapshot=wanted,
        volume_snapshot=snap_status.get("volumeSnapshotName", ""),
        restore_size=snap_status.get("restoreSize"),
        lineage=(wanted, *snap_status.get("lineage", [])),
        request=request,
    )
    if claim is None:
        cond = Cond(
            SandboxCondition.WORKSPACE_RESTORED,
            FALSE,
            SandboxReason.RESTORING,
            f"creating the workspace from snapshot {wanted}",
        )
        return WorkspacePlan(source=source, condition=cond, busy=True)
    cond = Cond(
        SandboxCondition.WORKSPACE_RESTORED,
        FALSE,
        SandboxReason.ROLLING_BACK,
        f"rolling the workspace back to snapshot {wanted}: stopping the pod, replacing the claim",
    )
    return WorkspacePlan(source=source, hold=True, replace=claim, condition=cond, busy=True)


async def roll_back(
    ctx: OperatorContext, body: JSON, plan: WorkspacePlan, pod: JSON | None
) -> None:
    """One step of a rollback: the pod goes first (no writes in flight), then the
    old claim; the next pass makes the new claim from the snapshot."""
    if plan.replace is None or pod is not None:
        return  # ensure_pod stops the pod (plan.hold); the claim waits for that
    claim = plan.replace
    if claim["metadata"].get("deletionTimestamp"):
        return
    await ctx.kube.delete(
        CLAIMS.path(claim["metadata"]["namespace"], claim["metadata"]["name"]),
        uid=claim["metadata"]["uid"],
    )
    metrics.RESTORES.labels("rollback").inc()
    snapshot = plan.source.snapshot if plan.source else ""
    ctx.event(body, "info", reason="RollingBack", message=f"replacing the claim from {snapshot}")


@dataclass(frozen=True)
class ClaimState:
    """The workspace claim as the pod's creation sees it."""

    claim: JSON | None = None
    # Creating the pod now would only leave it unschedulable (see claim_state).
    wait: bool = False
    # Why the claim is not bound, when known.
    problem: str | None = None


async def claim_state(
    ctx: OperatorContext, namespace: str, claim: JSON | None, now: datetime
) -> ClaimState:
    """Should the pod wait for its claim? Only while a claim of an Immediate-binding
    StorageClass is not bound yet: the scheduler would otherwise report the pod
    unschedulable ("unbound immediate PersistentVolumeClaims") until it binds. A
    claim without a class (static volumes) or of a WaitForFirstConsumer class is
    bound because of the pod, so the pod is created at once."""
    if claim is None or sandbox_status.claim_phase(claim) == "Bound":
        return ClaimState(claim)
    class_name = claim.get("spec", {}).get("storageClassName")
    if not class_name:
        return ClaimState(claim)
    mode = ctx.binding_modes.get(class_name)
    if mode is None:
        storage_class = await ctx.kube.get(STORAGE_CLASSES.path(name=class_name))
        if storage_class is None:
            return ClaimState(
                claim, wait=True, problem=f"StorageClass {class_name!r} does not exist"
            )
        mode = str(storage_class.get("volumeBindingMode") or "Immediate")
        ctx.binding_modes[class_name] = mode
    if mode == WAIT_FOR_FIRST_CONSUMER:
        return ClaimState(claim)
    created = claim["metadata"].get("creationTimestamp")
    problem = None
    if created and now - parse_time(created) > CLAIM_PROBLEM_PATIENCE:
        problem = await _claim_problem(ctx, namespace, claim)
    return ClaimState(claim, wait=True, problem=problem)


async def _newest_warning(ctx: OperatorContext, namespace: str, selector: str) -> JSON | None:
    """The newest Warning Event matching a field selector (involvedObject.*, reason)."""
    listed = await ctx.kube.get(
        EVENTS.path(namespace), params={"fieldSelector": f"{selector},type=Warning"}
    )
    items = (listed or {}).get("items") or []
    if not items:
        return None
    newest: JSON = max(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return newest


async def _claim_problem(ctx: OperatorContext, namespace: str, claim: JSON) -> str | None:
    """Why a claim is not bound, as the cluster recorded it (a provisioning error)."""
    selector = (
        f"involvedObject.kind=PersistentVolumeClaim,involvedObject.name={claim['metadata']['name']}"
    )
    found = await _newest_warning(ctx, namespace, selector)
    if found is None:
        return None
    return f"{found.get('reason', '')}: {found.get('message', '')}".strip(": ")


async def with_eviction(ctx: OperatorContext, pod: JSON | None) -> JSON | None:
    """`pod`, with the kubelet's eviction reason in its status when it ended evicted.

    The kubelet records an eviction in an Event first; the pod's own status can
    end as Succeeded (its containers exited cleanly when told to stop) before
    the Evicted phase and reason land, and the pod is replaced at once."""
    if pod is None or not sandbox_status.pod_ended(pod):
        return pod
    if sandbox_status.describe_pod_end(pod).startswith("evicted"):
        return pod
    meta = pod["metadata"]
    selector = f"involvedObject.uid={meta['uid']},reason=Evicted"
    found = await _newest_warning(ctx, meta["namespace"], selector)
    if found is None:
        return pod
    status = {**pod["status"], "reason": "Evicted", "message": found.get("message", "")}
    return {**pod, "status": status}


async def ensure_children(
    ctx: OperatorContext,
    ref: build.SandboxRef,
    spec: SandboxSpec,
    converge: bool,
    workspace: WorkspacePlan | None = None,
) -> None:
    """Create what is missing; with `converge`, also update what drifted. Idempotent."""
    kube, settings = ctx.kube, ctx.settings
    child = build.names(ref.name)
    workspace = workspace or WorkspacePlan()
    # The token is random, so only ever created, never replaced (409 = keep the old one).
    await kube.create(
        SECRETS.path(ref.namespace), build.build_secret(ref, secrets.token_urlsafe(32))
    )
    claim = None if workspace.hold else build.build_claim(ref, spec, settings)
    if claim is not None:
        if workspace.source is not None:
            claim = snapshot_build.restore_into(claim, workspace.source)
        created = await kube.create(CLAIMS.path(ref.namespace), claim)
        if created is not None and workspace.source is not None:
            metrics.RESTORES.labels("restore").inc()
    await _create_or_converge(
        ctx,
        NETWORK_POLICIES.path(ref.namespace),
        build.build_network_policy(ref, spec, settings),
        converge,
    )
    service = build.build_service(ref, spec)
    if service is not None:
        await _create_or_converge(ctx, SERVICES.path(ref.namespace), service, converge)
    elif converge:
        await kube.delete(SERVICES.path(ref.namespace, child["service"]))


# -- the pod ------------------------------------------------------------------------


class PodAction(Enum):
    KEEP = "keep"
    CREATE = "create"
    DELETE = "delete"  # stop it (pause, rollback)
    REPLACE = "replace"  # delete it; the next pass creates the new one
    ADOPT = "adopt"  # keep it, and record what it was built from (an older operator's pod)


@dataclass(frozen=True)
class PodDecision:
    action: PodAction
    # Why, in words for the PodReplaced Event (REPLACE only).
    why: str = ""


def decide_pod(
    pod: JSON | None,
    spec: SandboxSpec,
    *,
    paused: bool,
    hold: bool,
    claim: ClaimState,
    status: SandboxStatus,
    now: datetime,
    agent_patience: timedelta,
) -> PodDecision:
    """What to do with the pod, from what was observed. Pure."""
    if paused or hold:
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            return PodDecision(PodAction.DELETE)
        return PodDecision(PodAction.KEEP)
    if pod is None:
        return PodDecision(PodAction.KEEP if claim.wait else PodAction.CREATE)
    if pod["metadata"].get("deletionTimestamp"):
        return PodDecision(PodAction.KEEP)  # going away; recreated once gone
    changed = build.changed_fields(pod, spec)
    if changed is None:
        return PodDecision(
            PodAction.REPLACE, "the sandbox spec changed (a pod of an older operator)"
        )
    if changed:
        fields = ", ".join(f"spec.{name}" for name in changed)
        return PodDecision(PodAction.REPLACE, f"{fields} changed, which needs a new pod")
    if sandbox_status.pod_ended(pod):
        return PodDecision(PodAction.REPLACE, sandbox_status.describe_pod_end(pod))
    if sandbox_status.claim_phase(claim.claim) == "Bound" and sandbox_status.stuck_on_unbound_claim(
        pod, now, UNBOUND_CLAIM_PATIENCE
    ):
        return PodDecision(
            PodAction.REPLACE, "the scheduler did not retry after the workspace claim was bound"
        )
    stalled = agent_stalled(pod, status, now, agent_patience)
    if stalled:
        return PodDecision(PodAction.REPLACE, stalled)
    if POD_SPEC_ANNOTATION not in (pod["metadata"].get("annotations") or {}):
        return PodDecision(PodAction.ADOPT)
    return PodDecision(PodAction.KEEP)


def agent_stalled(
    pod: JSON, status: SandboxStatus, now: datetime, patience: timedelta
) -> str | None:
    """Why a pod that was serving must be replaced: its agent has not been ready for
    longer than `patience` while the runtime container runs (a wedged agent or
    runner that the kubelet's probes did not cure). Only for a pod that was
    Ready before, so a pod that never gets ready is not replaced in a loop."""
    if status.ready_pod_uid != pod["metadata"].get("uid"):
        return None
    agent = sandbox_status.container_status(pod, build.AGENT_CONTAINER) or {}
    runtime = sandbox_status.container_status(pod, build.SANDBOX_CONTAINER) or {}
    if agent.get("ready") or "running" not in (runtime.get("state") or {}):
        return None
    cond = find(status.conditions, SandboxCondition.AGENT_READY)
    if cond is None or cond.status != FALSE or not cond.last_transition_time:
        return None
    stalled = now - parse_time(cond.last_transition_time)
    if stalled <= patience:
        return None
    return (
        f"the agent has not been ready for {int(stalled.total_seconds())}s"
        " (commands cannot be run or stopped); the workspace is kept"
    )


async def ensure_pod(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec,
    pod: JSON | None,
    decision: PodDecision,
    logger: kopf.Logger,
) -> JSON | None:
    """Carry out `decision`. Returns the pod as it now stands (None if absent)."""
    ref = ref_of(body)
    path = PODS.path(ref.namespace)
    action = decision.action
    if action is PodAction.KEEP:
        return pod
    if action is PodAction.CREATE:
        desired = build.desired_pod(ref, spec, ctx.settings)
        created = await ctx.kube.create(path, desired)
        if created is None:  # a namesake exists that our view has not caught up with
            return await ctx.kube.get(f"{path}/{desired['metadata']['name']}")
        return created
    assert pod is not None
    name = pod["metadata"]["name"]
    if action is PodAction.ADOPT:
        annotations = {POD_SPEC_ANNOTATION: build.stamp_annotation(spec)}
        return await ctx.kube.patch(f"{path}/{name}", {"metadata": {"annotations": annotations}})
    await ctx.kube.delete(f"{path}/{name}", uid=pod["metadata"]["uid"])
    if action is PodAction.DELETE:
        if build.effectively_paused(body, spec):
            ctx.event(body, "info", reason="Paused", message="pod deleted, workspace kept")
        else:
            ctx.event(body, "info", reason="Restoring", message="pod stopped for a rollback")
        return pod
    logger.info("replacing pod: %s", decision.why)
    message = f"replacing the pod: {decision.why}; running commands were stopped"
    ctx.event(body, "warn", reason="PodReplaced", message=message)
    metrics.POD_RECREATIONS.inc()
    return pod


# -- the environment of new commands ---------------------------------------------------


def _pod_env(pod: JSON) -> list[JSON]:
    """The user's variables the pod was started with (not the operator's own)."""
    container: JSON = next(
        (c for c in pod["spec"]["containers"] if c["name"] == build.SANDBOX_CONTAINER), {}
    )
    own = {"HOME", "SANDBOX_RUNNER_SOCKET"}
    return [var for var in container.get("env") or [] if var.get("name") not in own]


async def sync_environment(
    ctx: OperatorContext, body: JSON, spec: SandboxSpec, pod: JSON | None, endpoint: str | None
) -> None:
    """Give commands started from now on the spec's env, without a new pod.

    The pod keeps the env it started with; when the spec's differs, the agent
    gets an overlay (the whole env, and the names to drop) that it applies to
    each new command. What the agent holds is compared by digest."""
    if pod is None or not endpoint:
        return
    uid = pod["metadata"]["uid"]
    wanted = [var.to_wire() for var in spec.env]
    base = _pod_env(pod)
    if wanted == base:
        ctx.environments.pop(uid, None)
        return
    # Secrets are read once per change of the spec's env, like the kubelet reads
    # them once per container start.
    applied = json.dumps(wanted, sort_keys=True)
    if ctx.environments.get(uid) == applied:
        return
    try:
        env = await envvars.resolve(ctx.kube, body["metadata"]["namespace"], spec.env)
    except envvars.MissingSecret as exc:
        ctx.event(body, "warn", reason="EnvironmentPending", message=str(exc))
        return
    unset = sorted({var["name"] for var in base} - env.keys())
    digest = environment_hash(env, unset)
    token = await ctx.agent_token(body)
    if not token:
        return
    try:
        info = await ctx.agents.info(endpoint, token)
        if info.environment_hash != digest:
            await ctx.agents.set_environment(endpoint, token, env, unset)
            ctx.event(
                body,
                "info",
                reason="EnvironmentUpdated",
                message="commands started from now on get the new env (running ones keep theirs)",
            )
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        if exc.status in (401, 403):
            ctx.drop_token(body)
        return  # the next pass tries again
    ctx.environments[uid] = applied


# -- idleness and lifetime ---------------------------------------------------------------


class IdleAction(Enum):
    NONE = "none"
    DELETE = "delete"  # max lifetime reached
    SNAPSHOT = "snapshot"  # take the idle snapshot first
    WAIT_SNAPSHOT = "wait-snapshot"  # pause once the snapshot is settled
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
    if status.expires_at and now >= parse_time(status.expires_at):
        return LifecycleDecision(IdleAction.DELETE)
    idle_timeout = spec.lifecycle.idle_timeout or settings.default_idle_timeout
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
    fields: JSON = {
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
        if spec.lifecycle.on_idle is OnIdle.PAUSE:
            return LifecycleDecision(IdleAction.WAIT_SNAPSHOT, fields, last)
    return LifecycleDecision(IdleAction.IDLE, fields, last)


async def lifecycle(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec,
    status: SandboxStatus,
    now: datetime,
    logger: kopf.Logger,
) -> JSON:
    """Idle timeout and max lifetime. Returns status fields to set."""
    meta = body["metadata"]
    info = await _agent_info(ctx, body, spec, status, logger)
    resumed = (meta.get("annotations") or {}).get(RESUME_ANNOTATION)
    resumed_at = None
    with suppress(ValueError):
        resumed_at = parse_time(resumed) if resumed else None
    decision = decide_lifecycle(spec, status, info, resumed_at, now, ctx.settings)
    fields = dict(decision.fields)
    sandbox_path = SANDBOXES.path(meta["namespace"], meta["name"])
    if decision.action is IdleAction.DELETE:
        logger.info("max lifetime reached; deleting")
        ctx.event(
            body, "info", reason="MaxLifetimeReached", message=f"expired at {status.expires_at}"
        )
        metrics.TEARDOWNS.labels("max_lifetime").inc()
        await ctx.kube.delete(sandbox_path, uid=meta["uid"])
        return fields
    if decision.action is IdleAction.NONE:
        return fields
    assert decision.last_activity is not None
    if decision.action is IdleAction.SNAPSHOT:
        deadline = parse_time(fields["idle_deadline"])
        name = snapshot_build.idle_snapshot_name(meta["name"], deadline)
        await ctx.kube.create(
            SNAPSHOTS.path(meta["namespace"]),
            snapshot_build.build_idle_snapshot(meta["name"], meta["namespace"], name),
        )
        fields.update(idle_snapshot=name, idle_snapshot_started_at=iso(now))
        ctx.event(body, "info", reason="IdleSnapshot", message=f"taking snapshot {name}")
        if spec.lifecycle.on_idle is OnIdle.PAUSE:
            return fields  # paused once the snapshot is done (or timed out)
    if decision.action is IdleAction.WAIT_SNAPSHOT:
        name = status.idle_snapshot or ""
        started = status.idle_snapshot_started_at
        if not await idle_snapshot_settled(ctx, body, spec, name, started, now):
            return fields
    action = spec.lifecycle.on_idle
    last = iso(decision.last_activity)
    logger.info("idle since %s; %s", last, action.value)
    metrics.TEARDOWNS.labels(f"idle_{action.value.lower()}").inc()
    ctx.event(body, "info", reason="IdleTimeout", message=f"idle since {last}: {action.value}")
    if action is OnIdle.DELETE:
        if fields.get("idle_snapshot"):
            # Teardown (the finalizer) waits for the snapshot it finds in status.
            await write_status(ctx, body, status.evolve(**fields))
        await ctx.kube.delete(sandbox_path, uid=meta["uid"])
    else:
        fields["idle_paused_at"] = iso(now)
    return fields


async def _agent_info(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec,
    status: SandboxStatus,
    logger: kopf.Logger,
) -> AgentInfo | None:
    """The agent's activity report, when the idle policy needs one and the agent answers."""
    idle_timeout = spec.lifecycle.idle_timeout or ctx.settings.default_idle_timeout
    if status.phase != SandboxPhase.RUNNING or not status.agent_endpoint or not idle_timeout:
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


async def idle_snapshot_settled(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec | None,
    name: str,
    started: str | None,
    now: datetime,
) -> bool:
    """Is the idle policy's Snapshot Ready or Failed, or has the wait for it run
    out? A failure or timeout is reported (Event) and the teardown goes ahead:
    the bound on the wait is the user's to set, and the Snapshot says why."""
    namespace = body["metadata"]["namespace"]
    snap = await ctx.kube.get(SNAPSHOTS.path(namespace, name))
    phase = ((snap or {}).get("status") or {}).get("phase")
    if phase == "Ready":
        return True
    timeout = idle_snapshot_timeout(spec, ctx.settings)
    late = started is not None and (now - parse_time(started)).total_seconds() > timeout
    if snap is not None and phase != "Failed" and not late:
        return False
    why = (
        "it does not exist"
        if snap is None
        else "it failed (see the Snapshot's conditions)"
        if phase == "Failed"
        else f"it was not ready within {timeout:g}s"
    )
    ctx.event(
        body, "warn", reason="IdleSnapshotFailed", message=f"snapshot {name}: {why}; going ahead"
    )
    return True


# -- status ------------------------------------------------------------------------------


async def write_status(ctx: OperatorContext, body: JSON, status: SandboxStatus) -> None:
    """Patch status only when it changed: every write costs the API server."""
    old = body.get("status") or {}
    new = status.to_wire()
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    metrics.PHASES.set(*key, new.get("phase", ""))
    patch = status_patch(old, new)
    if patch is None:
        ctx.statuses[key] = new
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
        return {"image": None, "workspace_claim": None, "expires_at": None}
    lifetime = spec.lifecycle.max_lifetime or settings.default_max_lifetime
    expires = None
    if lifetime:
        created = parse_time(body["metadata"]["creationTimestamp"])
        expires = iso(created + parse_duration(lifetime))
    claim = None if spec.workspace.ephemeral else build.names(body["metadata"]["name"])["claim"]
    return {
        "image": build.image_of(spec, settings),
        "workspace_claim": claim,
        "expires_at": expires,
    }


async def report_blocked(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxSpec | None,
    *,
    invalid: str = "",
    refused: str = "",
) -> None:
    """Status and an Event for a Sandbox that cannot go on: its spec is invalid, or
    the API server refused one of its children. Nothing of the pod is observed."""
    observed = Observed(
        generation=body["metadata"].get("generation", 0),
        paused=False,
        deleting=False,
        ephemeral=bool(spec and spec.workspace.ephemeral),
        pod=None,
        invalid=invalid or None,
        refused=refused or None,
    )
    current = _current(ctx, body)
    status = sandbox_status.build_status(
        status_of(current),
        observed,
        ctx.settings.agent_port,
        now_utc(),
        **spec_fields(body, None if invalid else spec, ctx.settings),
    )
    await write_status(ctx, current, status)
    reason = "InvalidSpec" if invalid else "CreateFailed"
    ctx.event(body, "warn", reason=reason, message=invalid or refused)


def refused(ctx: OperatorContext, body: JSON) -> Any:
    """The error policy's report for a child the API server refused: a status
    saying so (Ready=False, CreateFailed, with the API server's message)."""

    async def report(exc: Refused) -> None:
        spec, _ = parse_spec(body, ctx.settings)
        await report_blocked(ctx, body, spec, refused=str(exc))

    return report


def _current(ctx: OperatorContext, body: JSON) -> JSON:
    """`body` with the status this process last wrote (fresher than Kopf's copy)."""
    meta = body["metadata"]
    known = ctx.statuses.get((meta["namespace"], meta["name"]))
    return body if known is None else {**body, "status": known}


# -- reconciliation ------------------------------------------------------------------------


async def reconcile(
    ctx: OperatorContext,
    body: JSON,
    logger: kopf.Logger,
    *,
    children: Children,
    pods: ChildIndex,
    claims: ChildIndex,
    pod: JSON | None = None,
    pod_known: bool = False,
) -> None:
    """Converge one Sandbox. `children` says how far beyond the pod to look;
    `pod_known` means `pod` is the pod as it stands (None: there is none);
    otherwise the pod index is asked."""
    meta = body["metadata"]
    async with ctx.lock(meta["namespace"], meta["name"]):
        if not pod_known:
            pod = next(iter(pods.get((meta["namespace"], meta["name"]), [])), None)
        claim = next(iter(claims.get((meta["namespace"], meta["name"]), [])), None)
        await _reconcile(ctx, _current(ctx, body), logger, children=children, pod=pod, claim=claim)


async def _reconcile(
    ctx: OperatorContext,
    body: JSON,
    logger: kopf.Logger,
    *,
    children: Children,
    pod: JSON | None,
    claim: JSON | None,
) -> None:
    meta = body["metadata"]
    spec, invalid = parse_spec(body, ctx.settings)
    now = now_utc()
    old = status_of(body)
    generation = meta.get("generation", 0)
    if invalid is not None:
        await report_blocked(ctx, body, spec, invalid=invalid)
        raise kopf.PermanentError(invalid)
    assert spec is not None
    ref = ref_of(body)
    workspace = await plan_workspace(ctx, body, spec)
    if children is not Children.POD:
        await ensure_children(
            ctx, ref, spec, converge=children is Children.CONVERGE, workspace=workspace
        )
    paused = build.effectively_paused(body, spec)
    if pod is None and children is Children.POD and not paused:
        # The pod is gone (evicted, deleted): its siblings may be too.
        await ensure_children(ctx, ref, spec, converge=False, workspace=workspace)
    await roll_back(ctx, body, workspace, pod)
    claims = ClaimState()
    if not spec.workspace.ephemeral and not workspace.hold:
        if claim is None:
            # Not in the index yet (just created, say): ask, rather than make a pod
            # the scheduler would find waiting on an unbound claim.
            claim = await ctx.kube.get(CLAIMS.path(ref.namespace, build.names(ref.name)["claim"]))
        claims = await claim_state(ctx, ref.namespace, claim, now)
    pod = await with_eviction(ctx, pod)
    decision = decide_pod(
        pod,
        spec,
        paused=paused,
        hold=workspace.hold,
        claim=claims,
        status=old,
        now=now,
        agent_patience=parse_duration(ctx.settings.agent_unready_patience),
    )
    pod = await ensure_pod(ctx, body, spec, pod, decision, logger)

    fields: JSON = {**workspace.fields, **spec_fields(body, spec, ctx.settings)}
    if not paused:
        fields["idle_paused_at"] = None
        if old.idle_paused_at:
            # Resumed: the next idle period takes a snapshot of its own.
            fields.update(idle_snapshot=None, idle_snapshot_started_at=None)
    observed = Observed(
        generation=generation,
        paused=paused,
        deleting=bool(meta.get("deletionTimestamp")),
        ephemeral=spec.workspace.ephemeral,
        pod=pod,
        claim=claims.claim,
        claim_problem=claims.problem,
        restore=workspace.condition,
        holding=workspace.hold,
        awaiting_claim=claims.wait,
    )
    status = sandbox_status.build_status(old, observed, ctx.settings.agent_port, now, **fields)
    if status.phase == SandboxPhase.RUNNING:
        status = status.evolve(ready_pod_uid=status.pod_uid)
        await sync_environment(ctx, body, spec, pod, status.agent_endpoint)
    if old.phase == SandboxPhase.PAUSED and not paused:
        ctx.event(body, "info", reason="Resumed", message="starting the pod on the kept workspace")
    if not observed.deleting:
        changes = await lifecycle(ctx, body, spec, status, now, logger)
        if changes.get("idle_paused_at"):
            # Paused by the idle policy just now: converge again as a paused sandbox.
            body["status"] = status.evolve(**changes).to_wire()
            await _reconcile(ctx, body, logger, children=Children.POD, pod=pod, claim=claim)
            return
        status = status.evolve(**changes)
    await write_status(ctx, body, status)
    if workspace.busy and children is not Children.POD:
        # Change handlers retry; timers and pod events come back by themselves.
        raise kopf.TemporaryError("restoring the workspace from a snapshot", delay=1)


async def teardown(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: wait for the idle policy's snapshot (bounded), stop the pod (no
    writes in flight), then let GC take the rest. Snapshots are not owned by
    the Sandbox: they stay."""
    ref = ref_of(body)
    status = status_of(body)
    if status.idle_snapshot and not status.idle_paused_at:
        spec, _ = parse_spec(body, ctx.settings)
        started = status.idle_snapshot_started_at
        settled = await idle_snapshot_settled(
            ctx, body, spec, status.idle_snapshot, started, now_utc()
        )
        if not settled:
            raise kopf.TemporaryError(f"waiting for snapshot {status.idle_snapshot}", delay=2)
    metrics.PHASES.forget(ref.namespace, ref.name)
    ctx.forget(ref.namespace, ref.name, ref.uid)
    path = PODS.path(ref.namespace, build.names(ref.name)["pod"])
    pod = await ctx.kube.get(path)
    if pod is None:
        return
    deleting_since = pod["metadata"].get("deletionTimestamp")
    if not deleting_since:
        await ctx.kube.delete(path, uid=pod["metadata"]["uid"])
        raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
    if now_utc() - parse_time(deleting_since) > POD_DELETE_PATIENCE:
        logger.warning("pod did not stop in %s; forcing", POD_DELETE_PATIENCE)
        await ctx.kube.delete(path, grace_seconds=0, uid=pod["metadata"]["uid"])
        return
    raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
