"""Snapshot reconciliation: check, flush (or quiesce), cut a VolumeSnapshot, follow it.

A Snapshot is taken once. Before its VolumeSnapshot exists, everything is
checked and retried (the cluster can snapshot, the sandbox and its claim are
there, the agent flushed); once it exists, the Snapshot only mirrors it. The
VolumeSnapshot's name derives from the Snapshot's UID, so a crash between
creating it and recording it costs nothing: the next pass finds it by name.
"""

from __future__ import annotations

from typing import Any

import kopf
from pydantic import ValidationError

from sandbox_operator import identity, metrics
from sandbox_operator.agent_client import AgentError
from sandbox_operator.api.common import readable
from sandbox_operator.api.sandbox import SandboxPhase
from sandbox_operator.api.snapshot import (
    RetainPolicy,
    SnapshotCondition,
    SnapshotPhase,
    SnapshotReason,
    SnapshotSpec,
    SnapshotStatus,
)
from sandbox_operator.builders import snapshot as build
from sandbox_operator.builders import snapshot_status
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, find
from sandbox_operator.builders.snapshot_status import Observed
from sandbox_operator.clock import now_utc, parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.kube import MERGE_PATCH, Refused, status_patch
from sandbox_operator.resources import (
    CLAIMS,
    SANDBOXES,
    SNAPSHOTS,
    VOLUME_SNAPSHOT_CLASSES,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    VOLUMES,
)

JSON = dict[str, Any]
R = SnapshotReason

# The discovery document of the VolumeSnapshot API group.
SNAPSHOT_API_PATH = f"/apis/{VOLUME_SNAPSHOTS.api_version}"
# A flush (or quiesce) that fails this many times in a row fails the Snapshot:
# a sandbox whose agent never answers should not leave it Pending forever.
SYNC_ATTEMPTS = 5
RETRY_SECONDS = 2.0


class Wait(Exception):
    """Not done yet: (reason, message) go to status; try again in `delay` seconds."""

    def __init__(self, reason: str, message: str, delay: float = RETRY_SECONDS) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.delay = delay


class Failure(Exception):
    """The snapshot can never be taken: (reason, message) go to status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def ref_of(body: JSON) -> build.SnapshotRef:
    meta = body["metadata"]
    return build.SnapshotRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def status_of(body: JSON) -> SnapshotStatus:
    return SnapshotStatus.model_validate(body.get("status") or {})


async def _write(ctx: OperatorContext, body: JSON, observed: Observed, **fields: Any) -> str:
    """Patch status when it changed; an Event when the phase did. Returns the phase."""
    meta = body["metadata"]
    old = status_of(body)
    status = snapshot_status.build_status(
        old, observed, meta.get("generation", 0), now_utc(), **fields
    )
    phase = status.phase or SnapshotPhase.PENDING
    new = status.to_wire()
    patch = status_patch(body.get("status") or {}, new)
    if patch is None:
        return phase
    await ctx.kube.patch(
        SNAPSHOTS.path(meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    body["status"] = new
    if old.phase != phase:
        ready = find(status.conditions, SnapshotCondition.READY)
        if phase == SnapshotPhase.READY:
            metrics.SNAPSHOTS.labels("ready").inc()
            created = parse_time(meta["creationTimestamp"])
            metrics.SNAPSHOT_SECONDS.observe((now_utc() - created).total_seconds())
            ctx.event(body, "info", reason="SnapshotReady", message=f"size {status.restore_size}")
        elif phase == SnapshotPhase.FAILED and ready is not None:
            metrics.SNAPSHOTS.labels("failed").inc()
            ctx.event(body, "warn", reason=ready.reason, message=ready.message)
    return phase


def refused(ctx: OperatorContext, body: JSON) -> Any:
    """The error policy's report when the API server refuses the VolumeSnapshot."""

    async def report(exc: Refused) -> None:
        observed = (
            Observed(failure=(R.SNAPSHOT_FAILED, str(exc)))
            if exc.permanent
            else Observed(waiting=(R.CREATING, str(exc)))
        )
        await _write(ctx, body, observed)

    return report


async def _snapshot_class(ctx: OperatorContext, spec: SnapshotSpec, driver: str) -> str:
    """The VolumeSnapshotClass to use; raises Failure when there is none for `driver`."""
    name = spec.volume_snapshot_class_name or ctx.settings.volume_snapshot_class
    if name:
        vsc = await ctx.kube.get(VOLUME_SNAPSHOT_CLASSES.path(name=name))
        if vsc is None:
            raise Failure(R.CLASS_NOT_FOUND, f"VolumeSnapshotClass {name!r} does not exist")
        if vsc.get("driver") != driver:
            raise Failure(
                R.UNSUPPORTED,
                f"VolumeSnapshotClass {name!r} is for CSI driver {vsc.get('driver')!r}, but the"
                f" workspace volume belongs to driver {driver!r}, which cannot take this snapshot",
            )
        return name
    listed = await ctx.kube.get(VOLUME_SNAPSHOT_CLASSES.path())
    chosen = build.pick_snapshot_class((listed or {}).get("items") or [], driver)
    if chosen is None:
        raise Failure(
            R.UNSUPPORTED,
            f"no (single default) VolumeSnapshotClass for CSI driver {driver!r}: the workspace's"
            " storage cannot take snapshots in this cluster",
        )
    return chosen


async def _prepare(
    ctx: OperatorContext, body: JSON, spec: SnapshotSpec, retry: int, logger: kopf.Logger
) -> tuple[str, str, JSON, Cond | None, int | None]:
    """Everything before the cut. Returns (claim, class, sandbox, quiesce condition,
    executions stopped); raises Failure (never) or Wait (not yet)."""
    namespace = body["metadata"]["namespace"]
    source = spec.sandbox_ref.name
    sandbox = await ctx.kube.get(SANDBOXES.path(namespace, source))
    if sandbox is None:
        raise Wait(R.SANDBOX_NOT_FOUND, f"sandbox {source!r} does not exist", delay=5)
    if ((sandbox.get("spec") or {}).get("workspace") or {}).get("ephemeral"):
        raise Failure(
            R.NO_PERSISTENT_WORKSPACE,
            f"sandbox {source!r} has an ephemeral (emptyDir) workspace: snapshots need a"
            " persistent one (a PersistentVolumeClaim of a CSI driver that can snapshot)",
        )
    # One read of the API group's discovery document: without the CRDs there is
    # nothing to create, and the error should say so rather than "404".
    if await ctx.kube.get(SNAPSHOT_API_PATH) is None:
        raise Failure(
            R.UNSUPPORTED,
            f"this cluster has no VolumeSnapshot API ({VOLUME_SNAPSHOTS.api_version}): install"
            " the CSI external-snapshotter CRDs and snapshot controller to take snapshots",
        )
    claim_name = identity.names(identity.children_ref(sandbox).name)["claim"]
    claim = await ctx.kube.get(CLAIMS.path(namespace, claim_name))
    if claim is None or (claim.get("status") or {}).get("phase") != "Bound":
        raise Wait(R.WORKSPACE_PENDING, f"claim {claim_name} is not bound yet")
    volume = claim["spec"].get("volumeName")
    pv = await ctx.kube.get(VOLUMES.path(name=volume))
    csi = ((pv or {}).get("spec") or {}).get("csi")
    if not csi:
        raise Failure(
            R.UNSUPPORTED,
            f"the workspace volume {volume} is not a CSI volume: its storage cannot take snapshots",
        )
    class_name = await _snapshot_class(ctx, spec, csi["driver"])

    status = sandbox.get("status") or {}
    endpoint = status.get("agentEndpoint")
    phase = status.get("phase")
    quiesce: Cond | None = None
    stopped: int | None = None
    if phase == SandboxPhase.PAUSED and not status.get("podName"):
        # No pod: nothing can be writing, nothing is cached in a page cache that
        # the volume lacks. Nothing to flush or pause.
        if spec.quiesce:
            quiesce = Cond(SnapshotCondition.QUIESCED, TRUE, R.NO_POD, "the sandbox is paused")
        return claim_name, class_name, sandbox, quiesce, None
    if not endpoint or phase not in (SandboxPhase.RUNNING, SandboxPhase.TERMINATING):
        raise Wait(R.SANDBOX_NOT_READY, f"sandbox {source!r} is {phase}, not Running")
    token = await ctx.agent_token(sandbox)
    try:
        if token is None:
            raise AgentError("the sandbox's agent token Secret is missing")
        if spec.quiesce:
            stopped = await ctx.agents.quiesce(
                endpoint, token, ctx.settings.snapshot_quiesce_seconds
            )
            quiesce = Cond(
                SnapshotCondition.QUIESCED,
                TRUE,
                R.QUIESCED,
                f"{stopped} running execution(s) paused while the snapshot is cut",
            )
        else:
            await ctx.agents.sync(endpoint, token)
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        # Retried like a flush: an agent busy past the timeout once (a loaded
        # node) is no reason to fail the Snapshot. Nothing is cut until it
        # answers, and a pause it did make ends by itself (snapshot_quiesce_seconds).
        reason = R.QUIESCE_FAILED if spec.quiesce else R.SYNC_FAILED
        if retry + 1 >= SYNC_ATTEMPTS:
            if spec.quiesce:
                raise Failure(
                    reason,
                    "could not pause the sandbox's running executions, so no snapshot was"
                    f" taken ({SYNC_ATTEMPTS} attempts): {exc}",
                ) from exc
            raise Failure(
                reason,
                f"the agent could not flush the workspace ({SYNC_ATTEMPTS} attempts): {exc}",
            ) from exc
        logger.warning("workspace %s failed: %s", "quiesce" if spec.quiesce else "sync", exc)
        raise Wait(reason, str(exc)) from exc
    return claim_name, class_name, sandbox, quiesce, stopped


async def take(ctx: OperatorContext, body: JSON, logger: kopf.Logger, retry: int = 0) -> str:
    """Create-side reconciliation: take the snapshot once, then follow it.
    Returns the phase; raises kopf.TemporaryError while there is more to do."""
    status = status_of(body)
    if status.volume_snapshot_name:
        return await _follow(ctx, body, logger, wait=True)
    if status.phase == SnapshotPhase.FAILED:
        # Failed before the cut: terminal. Taking it later would capture a
        # later state than the one asked for; a new Snapshot says so honestly.
        return SnapshotPhase.FAILED
    try:
        spec = SnapshotSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        await _write(ctx, body, Observed(failure=(R.INVALID_SPEC, readable(exc))))
        raise kopf.PermanentError(readable(exc)) from exc
    ref = ref_of(body)
    source = spec.sandbox_ref.name
    try:
        claim, class_name, sandbox, quiesce, stopped = await _prepare(
            ctx, body, spec, retry, logger
        )
    except Failure as failure:
        observed = Observed(failure=(failure.reason, failure.message))
        return await _write(ctx, body, observed, source_sandbox=source)
    except Wait as waiting:
        observed = Observed(waiting=(waiting.reason, waiting.message))
        await _write(ctx, body, observed, source_sandbox=source)
        raise kopf.TemporaryError(str(waiting), delay=waiting.delay) from waiting

    vs = build.build_volume_snapshot(ref, source, claim, class_name)
    await ctx.kube.create(VOLUME_SNAPSHOTS.path(ref.namespace), vs)
    await _write(
        ctx,
        body,
        Observed(created=True, volume_snapshot=vs, quiesce=quiesce),
        volume_snapshot_name=vs["metadata"]["name"],
        volume_snapshot_class_name=class_name,
        source_sandbox=source,
        # The restore chain of the source's workspace at this moment: it stays
        # with the Snapshot even after the source and its ancestors are gone.
        lineage=list((sandbox.get("status") or {}).get("workspaceLineage") or []),
        quiesced_executions=stopped,
    )
    logger.info("VolumeSnapshot %s created from %s", vs["metadata"]["name"], claim)
    return await _follow(ctx, body, logger, wait=True)


async def _follow(ctx: OperatorContext, body: JSON, logger: kopf.Logger, wait: bool) -> str:
    """Mirror the VolumeSnapshot; let quiesced executions go once it is cut; keep the
    content (and the data) when the Snapshot is to be retained."""
    meta = body["metadata"]
    status = status_of(body)
    name = status.volume_snapshot_name or ""
    vs = await ctx.kube.get(VOLUME_SNAPSHOTS.path(meta["namespace"], name))
    quiesce = find(status.conditions, SnapshotCondition.QUIESCED)
    cond: Cond | None = None
    if quiesce is not None:
        cond = Cond(quiesce.type, quiesce.status, quiesce.reason, quiesce.message)
        if quiesce.reason == R.QUIESCED and (vs is None or snapshot_status.cut(vs, now_utc())):
            await _resume(ctx, body, logger)
            cond = Cond(
                SnapshotCondition.QUIESCED, FALSE, R.RESUMED, "the snapshot is cut; writes resumed"
            )
    fields = (
        snapshot_status.volume_snapshot_fields(vs) if vs is not None else {"ready_to_use": False}
    )
    content = fields.get("volume_snapshot_content_name")
    if content:
        await _retain_content(ctx, body, str(content))
    phase = await _write(
        ctx, body, Observed(created=True, volume_snapshot=vs, quiesce=cond), **fields
    )
    if wait and phase not in snapshot_status.TERMINAL:
        raise kopf.TemporaryError("waiting for the VolumeSnapshot to be ready", delay=1)
    return phase


async def _retain_content(ctx: OperatorContext, body: JSON, content: str) -> None:
    """With `retainPolicy: Retain`, the VolumeSnapshotContent outlives its
    VolumeSnapshot: deleting the namespace (or the VolumeSnapshot) keeps the data.
    Its class may say Delete; the content's own policy is what the CSI side obeys."""
    if (body.get("spec") or {}).get("retainPolicy") != RetainPolicy.RETAIN:
        return
    path = VOLUME_SNAPSHOT_CONTENTS.path(name=content)
    current = await ctx.kube.get(path)
    if current is None or current.get("spec", {}).get("deletionPolicy") == "Retain":
        return
    await ctx.kube.patch(path, {"spec": {"deletionPolicy": "Retain"}})
    ctx.event(
        body, "info", reason="Retained", message=f"VolumeSnapshotContent {content} set to Retain"
    )


async def _resume(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    """Best effort: the agent resumes by itself after its bound anyway."""
    namespace = body["metadata"]["namespace"]
    source = status_of(body).source_sandbox or body["spec"]["sandboxRef"]["name"]
    sandbox = await ctx.kube.get(SANDBOXES.path(namespace, source))
    endpoint = ((sandbox or {}).get("status") or {}).get("agentEndpoint")
    token = await ctx.agent_token(sandbox) if sandbox else None
    if not endpoint or not token:
        return
    try:
        await ctx.agents.resume(endpoint, token)
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        logger.warning("resume after quiesce failed (the agent resumes by itself): %s", exc)


async def observe(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    """Periodic: a VolumeSnapshot deleted or repaired behind our back shows in status."""
    if status_of(body).volume_snapshot_name:
        await _follow(ctx, body, logger, wait=False)


async def release(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: the VolumeSnapshot goes with the Snapshot unless retained.

    By its deterministic name, not by status: a crash between creating the
    VolumeSnapshot and recording it must not leave an orphan."""
    ref = ref_of(body)
    status = status_of(body)
    quiesce = find(status.conditions, SnapshotCondition.QUIESCED)
    if quiesce is not None and quiesce.reason == R.QUIESCED:
        await _resume(ctx, body, logger)
    policy = (body.get("spec") or {}).get("retainPolicy", RetainPolicy.DELETE.value)
    name = status.volume_snapshot_name or build.volume_snapshot_name(ref)
    if policy == RetainPolicy.RETAIN.value:
        if status.volume_snapshot_content_name:
            # Once more, in case the content was bound after the last look.
            await _retain_content(ctx, body, status.volume_snapshot_content_name)
        if status.volume_snapshot_name:
            ctx.event(body, "info", reason="Retained", message=f"VolumeSnapshot {name} kept")
        return
    await ctx.kube.delete(VOLUME_SNAPSHOTS.path(ref.namespace, name))
