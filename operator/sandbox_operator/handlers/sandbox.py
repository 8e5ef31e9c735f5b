"""Sandbox reconciliation: children from builders, status from observation.

Every entry point (create/update/resume, the periodic timer, pod events) ends
in `reconcile`, which is level-based: it looks at what exists and converges,
so a missed event or an operator restart at any moment costs nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, cast

import kopf
from pydantic import ValidationError

from sandbox_operator import conditions, metrics
from sandbox_operator.agent_client import AgentClient, AgentError, parse_time
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import OnIdle, SandboxSpec
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders import snapshot as snapshot_build
from sandbox_operator.config import Settings
from sandbox_operator.kube import MERGE_PATCH, Kube, KubeError, resource_path, status_patch

JSON = dict[str, Any]

RESUME_ANNOTATION = "sandbox.dev/resume-requested-at"
# A new value rolls the workspace back to `spec.workspace.fromSnapshot` again.
RESTORE_ANNOTATION = "sandbox.dev/restore-requested-at"
SNAPSHOTS = ("sandbox.dev/v1alpha1", "snapshots")
POD_HASH_ANNOTATION = "sandbox.dev/pod-spec-hash"
SANDBOXES = ("sandbox.dev/v1alpha1", "sandboxes")
# How long teardown waits for a graceful pod exit before forcing it.
POD_DELETE_PATIENCE = timedelta(seconds=60)
CREATE_RETRY_SECONDS = 3
# How long a pod may wait unscheduled on a claim that is not bound before it is
# replaced (see conditions.stuck_on_unbound_claim).
UNBOUND_CLAIM_PATIENCE = timedelta(seconds=15)


class Children(Enum):
    """How much of the Sandbox's children a reconciliation looks after."""

    # Only the pod (timer, pod events): cheapest, the common case.
    POD = "pod"
    # Create missing children, leave existing ones be (creation, operator restart).
    ENSURE = "ensure"
    # Also bring drifted children back to the spec (spec updates).
    CONVERGE = "converge"


@dataclass
class Runtime:
    """Process-wide collaborators, created once at startup and kept in Kopf's memo."""

    settings: Settings
    kube: Kube
    agents: AgentClient
    # One reconciliation per Sandbox at a time: create/update handlers, the timer
    # and pod events all converge the same object and must not interleave.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # The status this process last wrote per Sandbox. The operator is the only
    # writer of status, so this is fresher than a body Kopf received earlier.
    statuses: dict[tuple[str, str], JSON] = field(default_factory=dict)
    # Agent tokens by (namespace, sandbox UID): a sandbox's token never changes,
    # and a namesake created later has another UID.
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        self.locks.pop((namespace, name), None)
        self.statuses.pop((namespace, name), None)
        if uid is not None:
            self.tokens.pop((namespace, uid), None)


def event(body: JSON, kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the Sandbox, posted in the background.

    kopf.event, not kopf.info: the latter obeys the posting level, which is set
    to WARNING so that routine handler chatter stays out of Events."""
    kopf.event(
        cast(kopf.Body, body),
        type="Normal" if kind == "info" else "Warning",
        reason=reason,
        message=message,
    )


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _path(plural: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    api_version = {
        "sandboxes": SANDBOXES[0],
        "snapshots": SNAPSHOTS[0],
        "networkpolicies": "networking.k8s.io/v1",
    }.get(plural, "v1")
    return resource_path(api_version, plural, namespace, name, sub)


def readable(error: ValidationError) -> str:
    """One line per problem, with the field path as the user wrote it."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"spec.{where}: {item['msg']}")
    return "; ".join(parts)


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


def _hash(obj: JSON) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def desired_pod(ref: build.SandboxRef, spec: SandboxSpec, settings: Settings) -> JSON:
    """The pod, stamped with a hash of the Sandbox spec it was built from.

    The hash covers the spec, not the built pod: a change of operator settings
    (a new agent image, say) reaches each sandbox at its next pod start instead
    of killing every running sandbox at once. `paused` is left out: pausing
    is handled by deleting the pod, not by replacing it."""
    pod = build.build_pod(ref, spec, settings)
    # fromSnapshot is left out too: a rollback replaces the pod by itself, and
    # naming a snapshot that is not ready yet must not restart the sandbox.
    workspace = spec.workspace.model_copy(update={"from_snapshot": None})
    stamped = spec.model_copy(update={"paused": False, "workspace": workspace}).to_wire()
    pod["metadata"]["annotations"][POD_HASH_ANNOTATION] = _hash(stamped)
    return pod


def effective_paused(body: JSON, spec: SandboxSpec) -> bool:
    """Paused by the user (spec) or by the idle policy (status), unless resumed since."""
    if spec.paused:
        return True
    idle_paused_at = (body.get("status") or {}).get("idlePausedAt")
    if not idle_paused_at:
        return False
    resumed = (body["metadata"].get("annotations") or {}).get(RESUME_ANNOTATION)
    try:
        return not (resumed and parse_time(resumed) > parse_time(idle_paused_at))
    except ValueError:
        return True


async def _create_or_converge(kube: Kube, plural: str, obj: JSON, converge: bool) -> None:
    namespace = obj["metadata"]["namespace"]
    created = await kube.create(_path(plural, namespace), obj)
    if created is None and converge:
        # Exists: bring its spec in line (merge patch replaces lists wholesale,
        # which is what we want for a fully-specified desired object).
        await kube.patch(_path(plural, namespace, obj["metadata"]["name"]), {"spec": obj["spec"]})


@dataclass(frozen=True)
class WorkspacePlan:
    """Where the workspace claim comes from, and whether the pod must wait for it."""

    # Make a missing claim from this Snapshot (None: an empty claim).
    source: snapshot_build.RestoreSource | None = None
    # Keep the pod stopped and create no claim: a restore or rollback is under way.
    hold: bool = False
    # The existing claim must go first (rollback); it is this one.
    replace: JSON | None = None
    condition: conditions.Cond | None = None
    # Status fields (workspaceSnapshot, workspaceLineage, workspaceRestoreRequest).
    fields: JSON = field(default_factory=dict)
    # Worth retrying soon (a snapshot on its way, a pod or claim going).
    busy: bool = False


def _restored(name: str) -> conditions.Cond:
    return conditions.Cond(
        "WorkspaceRestored",
        conditions.TRUE,
        conditions.REASON_RESTORED,
        f"the workspace was restored from snapshot {name}",
    )


async def plan_workspace(rt: Runtime, body: JSON, spec: SandboxSpec) -> WorkspacePlan:
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
    claim = await rt.kube.get(_path("persistentvolumeclaims", meta["namespace"], claim_name))
    going = claim is not None and bool(claim["metadata"].get("deletionTimestamp"))
    if claim is not None and not going:
        origin, origin_request, lineage = snapshot_build.claim_origin(claim)
        if (origin, origin_request) == (wanted, request):
            fields = {
                "workspaceSnapshot": wanted,
                "workspaceLineage": lineage,
                "workspaceRestoreRequest": request,
            }
            return WorkspacePlan(condition=_restored(wanted), fields=fields)
    snap = await rt.kube.get(_path("snapshots", meta["namespace"], wanted))
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
        cond = conditions.Cond(
            "WorkspaceRestored",
            conditions.FALSE,
            conditions.REASON_SNAPSHOT_FAILED if failed else conditions.REASON_SNAPSHOT_NOT_READY,
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
        cond = conditions.Cond(
            "WorkspaceRestored",
            conditions.FALSE,
            conditions.REASON_RESTORING,
            f"creating the workspace from snapshot {wanted}",
        )
        return WorkspacePlan(source=source, condition=cond, busy=True)
    cond = conditions.Cond(
        "WorkspaceRestored",
        conditions.FALSE,
        conditions.REASON_ROLLING_BACK,
        f"rolling the workspace back to snapshot {wanted}: stopping the pod, replacing the claim",
    )
    return WorkspacePlan(source=source, hold=True, replace=claim, condition=cond, busy=True)


async def roll_back(rt: Runtime, body: JSON, plan: WorkspacePlan, pod: JSON | None) -> None:
    """One step of a rollback: the pod goes first (no writes in flight), then the
    old claim; the next pass makes the new claim from the snapshot."""
    if plan.replace is None or pod is not None:
        return  # ensure_pod stops the pod (plan.hold); the claim waits for that
    claim = plan.replace
    if claim["metadata"].get("deletionTimestamp"):
        return
    await rt.kube.delete(
        _path("persistentvolumeclaims", claim["metadata"]["namespace"], claim["metadata"]["name"]),
        uid=claim["metadata"]["uid"],
    )
    metrics.RESTORES.labels("rollback").inc()
    snapshot = plan.source.snapshot if plan.source else ""
    event(body, "info", reason="RollingBack", message=f"replacing the claim from {snapshot}")


async def ensure_children(
    rt: Runtime,
    ref: build.SandboxRef,
    spec: SandboxSpec,
    converge: bool,
    workspace: WorkspacePlan | None = None,
) -> None:
    """Create what is missing; with `converge`, also update what drifted. Idempotent."""
    kube, settings = rt.kube, rt.settings
    child = build.names(ref.name)
    workspace = workspace or WorkspacePlan()
    # The token is random, so only ever created, never replaced (409 = keep the old one).
    await kube.create(
        _path("secrets", ref.namespace), build.build_secret(ref, secrets.token_urlsafe(32))
    )
    claim = None if workspace.hold else build.build_claim(ref, spec, settings)
    if claim is not None:
        if workspace.source is not None:
            claim = snapshot_build.restore_into(claim, workspace.source)
        created = await kube.create(_path("persistentvolumeclaims", ref.namespace), claim)
        if created is not None and workspace.source is not None:
            metrics.RESTORES.labels("restore").inc()
    await _create_or_converge(
        kube, "networkpolicies", build.build_network_policy(ref, spec, settings), converge
    )
    service = build.build_service(ref, spec)
    if service is not None:
        await _create_or_converge(kube, "services", service, converge)
    elif converge:
        await kube.delete(_path("services", ref.namespace, child["service"]))


async def ensure_pod(
    rt: Runtime,
    body: JSON,
    spec: SandboxSpec,
    pod: JSON | None,
    logger: kopf.Logger,
    hold: bool = False,
) -> JSON | None:
    """Converge the pod: create it, replace it when its spec changed or it ended,
    delete it when paused or `hold` (a workspace restore). Returns the pod as it
    now stands (None if absent)."""
    ref = ref_of(body)
    path = _path("pods", ref.namespace)
    paused = effective_paused(body, spec)
    if paused or hold:
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            await rt.kube.delete(f"{path}/{pod['metadata']['name']}", uid=pod["metadata"]["uid"])
            if paused:
                event(body, "info", reason="Paused", message="pod deleted, workspace kept")
            else:
                event(body, "info", reason="Restoring", message="pod stopped for a rollback")
        return pod
    desired = desired_pod(ref, spec, rt.settings)
    if pod is not None:
        if pod["metadata"].get("deletionTimestamp"):
            return pod  # going away; recreated once gone
        phase = pod.get("status", {}).get("phase")
        outdated = (pod["metadata"].get("annotations") or {}).get(POD_HASH_ANNOTATION) != desired[
            "metadata"
        ]["annotations"][POD_HASH_ANNOTATION]
        stuck = conditions.stuck_on_unbound_claim(pod, now_utc(), UNBOUND_CLAIM_PATIENCE)
        if phase in ("Failed", "Succeeded") or outdated or stuck:
            why = (
                "the sandbox spec changed"
                if outdated
                else "the scheduler did not retry after the workspace claim was bound"
                if stuck
                else f"pod {phase}"
            )
            logger.info("replacing pod: %s", why)
            event(body, "info", reason="PodReplaced", message=f"replacing the pod: {why}")
            metrics.POD_RECREATIONS.inc()
            await rt.kube.delete(f"{path}/{pod['metadata']['name']}", uid=pod["metadata"]["uid"])
        return pod
    created = await rt.kube.create(path, desired)
    if created is None:  # a namesake exists that our view has not caught up with
        return await rt.kube.get(f"{path}/{desired['metadata']['name']}")
    return created


def build_status(
    body: JSON,
    spec: SandboxSpec | None,
    observed: conditions.Observed,
    settings: Settings,
    now: datetime,
    extra: JSON,
) -> JSON:
    """The complete status object for this observation (pure)."""
    old = body.get("status") or {}
    phase, conds = conditions.compute(observed)
    pod = observed.pod or {}
    pod_ip = pod.get("status", {}).get("podIP") if observed.pod else None
    status: JSON = {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": conditions.merge(
            old.get("conditions", []), conds, observed.generation, iso(now)
        ),
        "podName": pod.get("metadata", {}).get("name"),
        "podIP": pod_ip,
        "podUID": pod.get("metadata", {}).get("uid"),
        "agentEndpoint": f"http://{pod_ip}:{settings.agent_port}" if pod_ip else None,
    }
    if spec is not None and observed.invalid is None:
        status["image"] = build.image_of(spec, settings)
        if not spec.workspace.ephemeral:
            status["workspaceClaim"] = build.names(body["metadata"]["name"])["claim"]
        lifetime = spec.lifecycle.max_lifetime or settings.default_max_lifetime
        if lifetime:
            created = parse_time(body["metadata"]["creationTimestamp"])
            status["expiresAt"] = iso(created + parse_duration(lifetime))
    for key in (
        "lastActivity",
        "idleDeadline",
        "activeExecutions",
        "idlePausedAt",
        "idleSnapshot",
        "idleSnapshotStartedAt",
        "workspaceSnapshot",
        "workspaceLineage",
        "workspaceRestoreRequest",
    ):
        if key in old:
            status[key] = old[key]
    status.update(extra)
    return {k: v for k, v in status.items() if v is not None}


async def write_status(rt: Runtime, body: JSON, status: JSON) -> None:
    """Patch status only when it changed: every write costs the API server."""
    old = body.get("status") or {}
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    metrics.PHASES.set(*key, status.get("phase", ""))
    patch = status_patch(old, status)
    if patch is None:
        rt.statuses[key] = status
        return
    written = await rt.kube.patch(
        _path("sandboxes", meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    if written is not None:
        rt.statuses[key] = status
    body["status"] = status


async def agent_token(rt: Runtime, sandbox: JSON) -> str | None:
    """The bearer token of a sandbox's agent, read from its Secret once."""
    meta = sandbox["metadata"]
    key = (meta["namespace"], meta["uid"])
    token = rt.tokens.get(key)
    if token:
        return token
    path = _path("secrets", meta["namespace"], build.names(meta["name"])["secret"])
    encoded = ((await rt.kube.get(path)) or {}).get("data", {}).get(build.TOKEN_KEY)
    if not encoded:
        return None
    token = base64.b64decode(encoded).decode()
    rt.tokens[key] = token
    return token


async def lifecycle(
    rt: Runtime,
    body: JSON,
    spec: SandboxSpec,
    status: JSON,
    now: datetime,
    logger: kopf.Logger,
) -> JSON:
    """Idle timeout and max lifetime. Returns status fields to add."""
    extra: JSON = {}
    expires_at = status.get("expiresAt")
    if expires_at and now >= parse_time(expires_at):
        logger.info("max lifetime reached; deleting")
        event(body, "info", reason="MaxLifetimeReached", message=f"expired at {expires_at}")
        metrics.TEARDOWNS.labels("max_lifetime").inc()
        meta = body["metadata"]
        await rt.kube.delete(_path("sandboxes", meta["namespace"], meta["name"]), uid=meta["uid"])
        return extra

    idle_timeout = spec.lifecycle.idle_timeout or rt.settings.default_idle_timeout
    endpoint = status.get("agentEndpoint")
    if status.get("phase") != conditions.RUNNING or not endpoint or not idle_timeout:
        return extra
    token = await agent_token(rt, body)
    if not token:
        return extra
    try:
        info = await rt.agents.info(endpoint, token)
    except AgentError as exc:
        # Unknown activity is never taken for idleness: no teardown on a blip.
        metrics.AGENT_ERRORS.inc()
        logger.warning("agent info failed: %s", exc)
        rt.tokens.pop((body["metadata"]["namespace"], body["metadata"]["uid"]), None)
        return extra
    reported = now if info.active_executions else info.last_activity.replace(microsecond=0)
    previous = status.get("lastActivity")
    last = max(reported, parse_time(previous)) if previous else reported
    # A resume request (an Execution waiting for this sandbox) is activity too:
    # without it a fresh pod could be paused again before the work arrives.
    resumed = (body["metadata"].get("annotations") or {}).get(RESUME_ANNOTATION)
    with suppress(ValueError):
        last = max(last, parse_time(resumed).replace(microsecond=0)) if resumed else last
    deadline = last + parse_duration(idle_timeout)
    extra.update(
        lastActivity=iso(last), idleDeadline=iso(deadline), activeExecutions=info.active_executions
    )
    # Once the idle policy has started its snapshot, it goes through with its
    # action: the snapshot's own flush is not the user coming back.
    snapshotting = status.get("idleSnapshot")
    if now < deadline and not snapshotting:
        return extra
    action = spec.lifecycle.on_idle
    meta = body["metadata"]
    if spec.lifecycle.snapshot_on_idle:
        if not snapshotting:
            name = snapshot_build.idle_snapshot_name(meta["name"], deadline)
            await rt.kube.create(
                _path("snapshots", meta["namespace"]),
                snapshot_build.build_idle_snapshot(meta["name"], meta["namespace"], name),
            )
            extra.update(idleSnapshot=name, idleSnapshotStartedAt=iso(now))
            event(body, "info", reason="IdleSnapshot", message=f"taking snapshot {name}")
        if action is OnIdle.PAUSE:
            name = extra.get("idleSnapshot") or status["idleSnapshot"]
            started = extra.get("idleSnapshotStartedAt") or status.get("idleSnapshotStartedAt")
            if not await idle_snapshot_settled(rt, body, spec, name, started, now):
                return extra  # paused once the snapshot is done (or timed out)
    logger.info("idle since %s; %s", iso(last), action.value)
    metrics.TEARDOWNS.labels(f"idle_{action.value.lower()}").inc()
    event(body, "info", reason="IdleTimeout", message=f"idle since {iso(last)}: {action.value}")
    if action is OnIdle.DELETE:
        if extra.get("idleSnapshot"):
            # Teardown (the finalizer) waits for the snapshot it finds in status.
            await write_status(rt, body, {**status, **extra})
        await rt.kube.delete(_path("sandboxes", meta["namespace"], meta["name"]), uid=meta["uid"])
    else:
        extra["idlePausedAt"] = iso(now)
    return extra


def idle_snapshot_timeout(spec: SandboxSpec | None, settings: Settings) -> float:
    timeout = (spec.lifecycle.snapshot_timeout if spec else None) or settings.idle_snapshot_timeout
    return parse_duration(timeout).total_seconds()


async def idle_snapshot_settled(
    rt: Runtime,
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
    snap = await rt.kube.get(_path("snapshots", namespace, name))
    phase = ((snap or {}).get("status") or {}).get("phase")
    if phase == "Ready":
        return True
    timeout = idle_snapshot_timeout(spec, rt.settings)
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
    event(body, "warn", reason="IdleSnapshotFailed", message=f"snapshot {name}: {why}; going ahead")
    return True


async def reconcile(
    rt: Runtime,
    body: JSON,
    logger: kopf.Logger,
    *,
    children: Children,
    pod: JSON | None = None,
    pod_known: bool = False,
) -> None:
    """Converge one Sandbox. `children` says how far beyond the pod to look;
    `pod_known` means `pod` is the pod as it stands (None: there is none)."""
    meta = body["metadata"]
    async with rt.lock(meta["namespace"], meta["name"]):
        known = rt.statuses.get((meta["namespace"], meta["name"]))
        if known is not None:
            body = {**body, "status": known}
        await _reconcile(rt, body, logger, children=children, pod=pod, pod_known=pod_known)


async def _reconcile(
    rt: Runtime,
    body: JSON,
    logger: kopf.Logger,
    *,
    children: Children,
    pod: JSON | None,
    pod_known: bool,
) -> None:
    meta = body["metadata"]
    spec, invalid = parse_spec(body, rt.settings)
    now = now_utc()
    if invalid is not None:
        observed = conditions.Observed(
            generation=meta.get("generation", 0),
            paused=False,
            deleting=False,
            ephemeral=False,
            pod=None,
            invalid=invalid,
        )
        await write_status(rt, body, build_status(body, None, observed, rt.settings, now, {}))
        event(body, "warn", reason="InvalidSpec", message=invalid)
        raise kopf.PermanentError(invalid)
    assert spec is not None
    ref = ref_of(body)
    try:
        workspace = await plan_workspace(rt, body, spec)
        if children is not Children.POD:
            await ensure_children(
                rt, ref, spec, converge=children is Children.CONVERGE, workspace=workspace
            )
        if not pod_known:
            pod = await rt.kube.get(_path("pods", ref.namespace, build.names(ref.name)["pod"]))
        if pod is None and children is Children.POD and not effective_paused(body, spec):
            # The pod is gone (evicted, deleted): its siblings may be too.
            await ensure_children(rt, ref, spec, converge=False, workspace=workspace)
        await roll_back(rt, body, workspace, pod)
        pod = await ensure_pod(rt, body, spec, pod, logger, hold=workspace.hold)
    except KubeError as exc:
        if exc.status >= 500 or exc.status == 429:
            raise kopf.TemporaryError(f"API server: {exc}", delay=CREATE_RETRY_SECONDS) from exc
        # Refused (quota, admission policy, a namespace still being set up):
        # say so in status and try again; the cause is usually outside our reach.
        observed = conditions.Observed(
            generation=meta.get("generation", 0),
            paused=False,
            deleting=False,
            ephemeral=spec.workspace.ephemeral,
            pod=None,
            create_error=f"{exc.status} {exc.reason}: {exc.message}",
        )
        await write_status(rt, body, build_status(body, spec, observed, rt.settings, now, {}))
        raise kopf.TemporaryError(str(exc), delay=CREATE_RETRY_SECONDS) from exc

    extra: JSON = {**workspace.fields}
    paused = effective_paused(body, spec)
    if not paused:
        extra["idlePausedAt"] = None
        if (body.get("status") or {}).get("idlePausedAt"):
            # Resumed: the next idle period takes a snapshot of its own.
            extra.update(idleSnapshot=None, idleSnapshotStartedAt=None)
    observed = conditions.Observed(
        generation=meta.get("generation", 0),
        paused=paused,
        deleting=bool(meta.get("deletionTimestamp")),
        ephemeral=spec.workspace.ephemeral,
        pod=pod,
        restore=workspace.condition,
        holding=workspace.hold,
    )
    status = build_status(body, spec, observed, rt.settings, now, extra)
    if not observed.deleting:
        changes = await lifecycle(rt, body, spec, status, now, logger)
        if changes.get("idlePausedAt"):
            # Paused by the idle policy just now: converge again as a paused sandbox.
            body["status"] = {**(body.get("status") or {}), **status, **changes}
            await _reconcile(rt, body, logger, children=Children.POD, pod=pod, pod_known=True)
            return
        status.update(changes)
    status = {k: v for k, v in status.items() if v is not None}
    await write_status(rt, body, status)
    if workspace.busy and children is not Children.POD:
        # Change handlers retry; timers and pod events come back by themselves.
        raise kopf.TemporaryError("restoring the workspace from a snapshot", delay=1)


async def teardown(rt: Runtime, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: wait for the idle policy's snapshot (bounded), stop the pod (no
    writes in flight), then let GC take the rest. Snapshots are not owned by
    the Sandbox: they stay."""
    ref = ref_of(body)
    status = body.get("status") or {}
    idle_snapshot = status.get("idleSnapshot")
    if idle_snapshot and not status.get("idlePausedAt"):
        spec, _ = parse_spec(body, rt.settings)
        started = status.get("idleSnapshotStartedAt")
        if not await idle_snapshot_settled(rt, body, spec, idle_snapshot, started, now_utc()):
            raise kopf.TemporaryError(f"waiting for snapshot {idle_snapshot}", delay=2)
    metrics.PHASES.forget(ref.namespace, ref.name)
    rt.forget(ref.namespace, ref.name, ref.uid)
    path = _path("pods", ref.namespace, build.names(ref.name)["pod"])
    pod = await rt.kube.get(path)
    if pod is None:
        return
    deleting_since = pod["metadata"].get("deletionTimestamp")
    if not deleting_since:
        await rt.kube.delete(path, uid=pod["metadata"]["uid"])
        raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
    if now_utc() - parse_time(deleting_since) > POD_DELETE_PATIENCE:
        logger.warning("pod did not stop in %s; forcing", POD_DELETE_PATIENCE)
        await rt.kube.delete(path, grace_seconds=0, uid=pod["metadata"]["uid"])
        return
    raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
