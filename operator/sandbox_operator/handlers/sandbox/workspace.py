"""The workspace: its claim (from a Snapshot, rolled back), whether the pod waits
for it to bind, and the Sandbox's other children."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sandbox_operator import identity, metrics
from sandbox_operator.api.sandbox import (
    RestoreRefusal,
    SandboxCondition,
    SandboxReason,
    SandboxSpec,
)
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders import snapshot as snapshot_build
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond
from sandbox_operator.clock import parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.status import Blocked
from sandbox_operator.kube import KubeError, Refused, newest_warning
from sandbox_operator.resources import (
    CLAIMS,
    NETWORK_POLICIES,
    RESTORE_ANNOTATION,
    SECRETS,
    SERVICES,
    SNAPSHOTS,
    STORAGE_CLASSES,
)

JSON = dict[str, Any]


# Claims Pending longer than this have their Events read for the reason.
CLAIM_PROBLEM_PATIENCE = timedelta(seconds=10)
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"


# The garbage collector removes an earlier namesake's children within seconds.
PREDECESSOR_RETRY_SECONDS = 2.0


class PredecessorDeleting(Blocked):
    """A child's name is held by the object of an earlier Sandbox of the same name,
    which the garbage collector is removing (see identity.left_by_namesake)."""

    def __init__(self, kind: str, name: str, sandbox: str) -> None:
        super().__init__(
            SandboxReason.PREDECESSOR_DELETING.value,
            f"{kind} {name} of an earlier Sandbox named {sandbox} is still being deleted;"
            " this Sandbox starts when it is gone",
            retry=PREDECESSOR_RETRY_SECONDS,
        )


def ours_or_refuse(kind: str, obj: JSON, ref: identity.SandboxRef) -> None:
    """Never use, adopt or delete a child this Sandbox does not control: someone's
    object that only has the name (or copied labels) would receive the sandbox's
    commands, files and agent token. Reported like a refused create (CreateFailed)
    and retried, so removing the namesake lets the sandbox start. The leftover
    of an earlier Sandbox of this name is waited for instead."""
    if identity.controlled_by(obj, ref):
        return
    name = obj["metadata"]["name"]
    if identity.left_by_namesake(obj, ref):
        raise PredecessorDeleting(kind, name, ref.name)
    why = (
        f"a {kind} named {name} exists that this Sandbox does not control"
        " (no controller reference to its UID); delete or rename it"
    )
    raise Refused(KubeError(409, "AlreadyExists", why), kind, name)


async def create_child(
    ctx: OperatorContext, ref: identity.SandboxRef, path: str, obj: JSON
) -> JSON | None:
    """Create one child; None when this Sandbox's own exists already (idempotent).
    An object of that name that is not its own is refused or waited for (see
    ours_or_refuse), never taken."""
    created = await ctx.kube.create(path, obj)
    if created is not None:
        return created
    name = obj["metadata"]["name"]
    existing = await ctx.kube.get(f"{path}/{name}")
    if existing is None:
        # Deleted between the two calls: the earlier namesake's, just collected.
        raise PredecessorDeleting(obj["kind"], name, ref.name)
    ours_or_refuse(obj["kind"], existing, ref)
    return None


async def _create_or_converge(
    ctx: OperatorContext, ref: identity.SandboxRef, path: str, obj: JSON, converge: bool
) -> None:
    created = await create_child(ctx, ref, path, obj)
    if created is None and converge:
        # Exists: bring its spec in line (merge patch replaces lists wholesale,
        # which is what we want for a fully-specified desired object).
        await ctx.kube.patch(f"{path}/{obj['metadata']['name']}", {"spec": obj["spec"]})


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
    # A rollback request was dropped by this pass (an Event says so, once).
    refused: bool = False


def _restored(name: str) -> Cond:
    return Cond(
        SandboxCondition.WORKSPACE_RESTORED,
        TRUE,
        SandboxReason.RESTORED,
        f"the workspace was restored from snapshot {name}",
    )


def _refused(snapshot: str, request: str, message: str, *, fresh: bool = False) -> WorkspacePlan:
    """The workspace stays as it is; status remembers the dropped request."""
    cond = Cond(SandboxCondition.WORKSPACE_RESTORED, FALSE, SandboxReason.RESTORE_REFUSED, message)
    refusal = RestoreRefusal(snapshot=snapshot, request=request, message=message)
    return WorkspacePlan(
        condition=cond, fields={"workspace_restore_refused": refusal}, refused=fresh
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
    refused = status.get("workspaceRestoreRefused") or {}
    if (refused.get("snapshot"), refused.get("request") or "") == (wanted, request):
        # Dropped earlier: a snapshot made later under that name must not roll back
        # a workspace that went on being used meanwhile.
        return _refused(wanted, request, str(refused.get("message") or ""))
    claim_name = identity.names(identity.children_ref(body).name)["claim"]
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
    snap_going = snap is not None and bool(snap["metadata"].get("deletionTimestamp"))
    if snap is None or snap_going or snap_status.get("phase") != "Ready":
        if snap is None:
            why = "does not exist"
        elif snap_going:
            why = "is being deleted"
        else:
            ready: JSON = next(
                (c for c in snap_status.get("conditions") or [] if c.get("type") == "Ready"), {}
            )
            why = f"is {snap_status.get('phase') or 'Pending'}: {ready.get('message', '')}"
        failed = snap_status.get("phase") == "Failed"
        if claim is not None and not going and (snap is None or snap_going or failed):
            # A rollback of a live workspace to nothing that can be restored: drop the
            # request now instead of arming it for whatever appears under that name.
            why = f"snapshot {wanted} {why}".strip()
            return _refused(wanted, request, f"{why}; the restore was dropped", fresh=True)
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


async def _claim_problem(ctx: OperatorContext, namespace: str, claim: JSON) -> str | None:
    """Why a claim is not bound, as the cluster recorded it (a provisioning error)."""
    selector = (
        f"involvedObject.kind=PersistentVolumeClaim,involvedObject.name={claim['metadata']['name']}"
    )
    found = await newest_warning(ctx.kube, namespace, selector)
    if found is None:
        return None
    return f"{found.get('reason', '')}: {found.get('message', '')}".strip(": ")


async def ensure_children(
    ctx: OperatorContext,
    ref: identity.SandboxRef,
    spec: SandboxSpec,
    converge: bool,
    workspace: WorkspacePlan | None = None,
) -> JSON | None:
    """Create what is missing; with `converge`, also update what drifted. Idempotent.
    Returns the workspace claim when this call created it (None when it existed)."""
    kube, settings = ctx.kube, ctx.settings
    child = identity.names(ref.name)
    workspace = workspace or WorkspacePlan()
    # The token is random, so only ever created, never replaced (409 = keep the old one).
    await create_child(
        ctx, ref, SECRETS.path(ref.namespace), build.build_secret(ref, secrets.token_urlsafe(32))
    )
    claim = None if workspace.hold else build.build_claim(ref, spec, settings)
    created = None
    if claim is not None:
        if workspace.source is not None:
            claim = snapshot_build.restore_into(claim, workspace.source)
        created = await create_child(ctx, ref, CLAIMS.path(ref.namespace), claim)
        if created is not None and workspace.source is not None:
            metrics.RESTORES.labels("restore").inc()
    await _create_or_converge(
        ctx,
        ref,
        NETWORK_POLICIES.path(ref.namespace),
        build.build_network_policy(ref, spec, settings),
        converge,
    )
    service = build.build_service(ref, spec)
    if service is not None:
        await _create_or_converge(ctx, ref, SERVICES.path(ref.namespace), service, converge)
    elif converge:
        await kube.delete(SERVICES.path(ref.namespace, child["service"]))
    return created
