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

from sandbox_operator import conditions, metrics
from sandbox_operator import snapshot_conditions as sc
from sandbox_operator.agent_client import AgentError, parse_time
from sandbox_operator.api.snapshot import RetainPolicy, SnapshotSpec
from sandbox_operator.builders import sandbox as sandbox_build
from sandbox_operator.builders import snapshot as build
from sandbox_operator.conditions import FALSE, TRUE, Cond
from sandbox_operator.handlers.sandbox import (
    SANDBOXES,
    Runtime,
    agent_token,
    event,
    iso,
    now_utc,
    readable,
)
from sandbox_operator.kube import MERGE_PATCH, KubeError, resource_path, status_patch

JSON = dict[str, Any]

SNAPSHOTS = ("sandbox.dev/v1alpha1", "snapshots")
SNAPSHOT_API_PATH = f"/apis/{build.SNAPSHOT_API_VERSION}"
# A flush that fails this many times in a row fails the Snapshot: a sandbox
# whose agent never answers should not leave it Pending forever.
SYNC_ATTEMPTS = 5
RETRY_SECONDS = 2.0


class Wait(Exception):
    """Not done yet: (reason, message) go to status; try again in `delay` seconds."""

    def __init__(self, reason: str, message: str, delay: float = RETRY_SECONDS) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.delay = delay


def ref_of(body: JSON) -> build.SnapshotRef:
    meta = body["metadata"]
    return build.SnapshotRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def _vs_path(namespace: str, name: str | None = None) -> str:
    return resource_path(build.SNAPSHOT_API_VERSION, "volumesnapshots", namespace, name)


def _sandbox_path(namespace: str, name: str) -> str:
    return resource_path(SANDBOXES[0], SANDBOXES[1], namespace, name)


def _snapshot_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return resource_path(SNAPSHOTS[0], SNAPSHOTS[1], namespace, name, sub)


async def _write(rt: Runtime, body: JSON, phase: str, conds: list[Cond], fields: JSON) -> None:
    """Patch status when it changed; an Event when the phase did."""
    meta = body["metadata"]
    old = body.get("status") or {}
    status: JSON = {
        **{k: v for k, v in old.items() if k not in ("phase", "conditions", "observedGeneration")},
        **fields,
        "phase": phase,
        "observedGeneration": meta.get("generation", 0),
        "conditions": conditions.merge(
            old.get("conditions") or [], conds, meta.get("generation", 0), iso(now_utc())
        ),
    }
    status = {k: v for k, v in status.items() if v is not None}
    patch = status_patch(old, status)
    if patch is None:
        return
    await rt.kube.patch(
        _snapshot_path(meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    body["status"] = status
    if old.get("phase") != phase:
        ready = next((c for c in conds if c.type == "Ready"), None)
        if phase == sc.READY:
            metrics.SNAPSHOTS.labels("ready").inc()
            created = parse_time(meta["creationTimestamp"])
            metrics.SNAPSHOT_SECONDS.observe((now_utc() - created).total_seconds())
            event(body, "info", reason="SnapshotReady", message=f"size {status.get('restoreSize')}")
        elif phase == sc.FAILED and ready is not None:
            metrics.SNAPSHOTS.labels("failed").inc()
            event(body, "warn", reason=ready.reason, message=ready.message)


async def _snapshot_class(rt: Runtime, spec: SnapshotSpec, driver: str) -> str:
    """The VolumeSnapshotClass to use; raises Failure when there is none for `driver`."""
    name = spec.volume_snapshot_class_name or rt.settings.volume_snapshot_class
    if name:
        vsc = await rt.kube.get(
            resource_path(build.SNAPSHOT_API_VERSION, "volumesnapshotclasses", None, name)
        )
        if vsc is None:
            raise Failure(sc.REASON_CLASS_NOT_FOUND, f"VolumeSnapshotClass {name!r} does not exist")
        if vsc.get("driver") != driver:
            raise Failure(
                sc.REASON_UNSUPPORTED,
                f"VolumeSnapshotClass {name!r} is for CSI driver {vsc.get('driver')!r}, but the"
                f" workspace volume belongs to driver {driver!r}, which cannot take this snapshot",
            )
        return name
    listed = await rt.kube.get(resource_path(build.SNAPSHOT_API_VERSION, "volumesnapshotclasses"))
    chosen = build.pick_snapshot_class((listed or {}).get("items") or [], driver)
    if chosen is None:
        raise Failure(
            sc.REASON_UNSUPPORTED,
            f"no (single default) VolumeSnapshotClass for CSI driver {driver!r}: the workspace's"
            " storage cannot take snapshots in this cluster",
        )
    return chosen


class Failure(Exception):
    """The snapshot can never be taken: (reason, message) go to status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


async def _prepare(
    rt: Runtime, body: JSON, spec: SnapshotSpec, retry: int, logger: kopf.Logger
) -> tuple[str, str, JSON, Cond | None, int | None]:
    """Everything before the cut. Returns (claim, class, sandbox, quiesce condition,
    executions stopped); raises Failure (never) or Wait (not yet)."""
    namespace = body["metadata"]["namespace"]
    source = spec.sandbox_ref.name
    sandbox = await rt.kube.get(_sandbox_path(namespace, source))
    if sandbox is None:
        raise Wait(sc.REASON_SANDBOX_NOT_FOUND, f"sandbox {source!r} does not exist", delay=5)
    if ((sandbox.get("spec") or {}).get("workspace") or {}).get("ephemeral"):
        raise Failure(
            sc.REASON_NO_PERSISTENT_WORKSPACE,
            f"sandbox {source!r} has an ephemeral (emptyDir) workspace: snapshots need a"
            " persistent one (a PersistentVolumeClaim of a CSI driver that can snapshot)",
        )
    # One read of the API group's discovery document: without the CRDs there is
    # nothing to create, and the error should say so rather than "404".
    if await rt.kube.get(SNAPSHOT_API_PATH) is None:
        raise Failure(
            sc.REASON_UNSUPPORTED,
            f"this cluster has no VolumeSnapshot API ({build.SNAPSHOT_API_VERSION}): install"
            " the CSI external-snapshotter CRDs and snapshot controller to take snapshots",
        )
    claim_name = sandbox_build.names(source)["claim"]
    claim = await rt.kube.get(resource_path("v1", "persistentvolumeclaims", namespace, claim_name))
    if claim is None or (claim.get("status") or {}).get("phase") != "Bound":
        raise Wait(sc.REASON_WORKSPACE_PENDING, f"claim {claim_name} is not bound yet")
    volume = claim["spec"].get("volumeName")
    pv = await rt.kube.get(resource_path("v1", "persistentvolumes", None, volume))
    csi = ((pv or {}).get("spec") or {}).get("csi")
    if not csi:
        raise Failure(
            sc.REASON_UNSUPPORTED,
            f"the workspace volume {volume} is not a CSI volume: its storage cannot take snapshots",
        )
    class_name = await _snapshot_class(rt, spec, csi["driver"])

    status = sandbox.get("status") or {}
    endpoint = status.get("agentEndpoint")
    phase = status.get("phase")
    quiesce: Cond | None = None
    stopped: int | None = None
    if phase == conditions.PAUSED and not status.get("podName"):
        # No pod: nothing can be writing, nothing is cached in a page cache that
        # the volume lacks. Nothing to flush or pause.
        if spec.quiesce:
            quiesce = Cond("Quiesced", TRUE, "NoPod", "the sandbox is paused: nothing runs")
        return claim_name, class_name, sandbox, quiesce, None
    if not endpoint or phase not in (conditions.RUNNING, conditions.TERMINATING):
        raise Wait(sc.REASON_SANDBOX_NOT_READY, f"sandbox {source!r} is {phase}, not Running")
    token = await agent_token(rt, sandbox)
    try:
        if token is None:
            raise AgentError("the sandbox's agent token Secret is missing")
        if spec.quiesce:
            stopped = await rt.agents.quiesce(endpoint, token, rt.settings.snapshot_quiesce_seconds)
            quiesce = Cond(
                "Quiesced",
                TRUE,
                sc.REASON_QUIESCED,
                f"{stopped} running execution(s) paused while the snapshot is cut",
            )
        else:
            await rt.agents.sync(endpoint, token)
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        if spec.quiesce:
            raise Failure(
                sc.REASON_QUIESCE_FAILED,
                f"could not pause the sandbox's running executions, so no snapshot was taken:"
                f" {exc}",
            ) from exc
        if retry + 1 >= SYNC_ATTEMPTS:
            raise Failure(
                sc.REASON_SYNC_FAILED,
                f"the agent could not flush the workspace ({SYNC_ATTEMPTS} attempts): {exc}",
            ) from exc
        logger.warning("workspace sync failed: %s", exc)
        raise Wait(sc.REASON_SYNC_FAILED, str(exc)) from exc
    return claim_name, class_name, sandbox, quiesce, stopped


async def take(rt: Runtime, body: JSON, logger: kopf.Logger, retry: int = 0) -> str:
    """Create-side reconciliation: take the snapshot once, then follow it.
    Returns the phase; raises kopf.TemporaryError while there is more to do."""
    status = body.get("status") or {}
    if status.get("volumeSnapshotName"):
        return await _follow(rt, body, logger, wait=True)
    if status.get("phase") == sc.FAILED:
        # Failed before the cut: terminal. Taking it later would capture a
        # later state than the one asked for; a new Snapshot says so honestly.
        return sc.FAILED
    try:
        spec = SnapshotSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        await _write(
            rt, body, sc.FAILED, [Cond("Ready", FALSE, sc.REASON_INVALID_SPEC, readable(exc))], {}
        )
        raise kopf.PermanentError(readable(exc)) from exc
    ref = ref_of(body)
    try:
        claim, class_name, sandbox, quiesce, stopped = await _prepare(rt, body, spec, retry, logger)
    except Failure as failure:
        observed = sc.Observed(failure=(failure.reason, failure.message))
        phase, conds = sc.compute(observed)
        await _write(rt, body, phase, conds, {"sourceSandbox": spec.sandbox_ref.name})
        return phase
    except Wait as waiting:
        phase, conds = sc.compute(sc.Observed(waiting=(waiting.reason, waiting.message)))
        await _write(rt, body, phase, conds, {"sourceSandbox": spec.sandbox_ref.name})
        raise kopf.TemporaryError(str(waiting), delay=waiting.delay) from waiting

    sandbox_status = sandbox.get("status") or {}
    vs = build.build_volume_snapshot(ref, spec.sandbox_ref.name, claim, class_name)
    await rt.kube.create(_vs_path(ref.namespace), vs)
    fields: JSON = {
        "volumeSnapshotName": vs["metadata"]["name"],
        "volumeSnapshotClassName": class_name,
        "sourceSandbox": spec.sandbox_ref.name,
        # The restore chain of the source's workspace at this moment: it stays
        # with the Snapshot even after the source and its ancestors are gone.
        "lineage": list(sandbox_status.get("workspaceLineage") or []),
        "quiescedExecutions": stopped,
    }
    observed = sc.Observed(created=True, volume_snapshot=vs, quiesce=quiesce)
    phase, conds = sc.compute(observed)
    await _write(rt, body, phase, conds, fields)
    logger.info("VolumeSnapshot %s created from %s", vs["metadata"]["name"], claim)
    return await _follow(rt, body, logger, wait=True)


async def _follow(rt: Runtime, body: JSON, logger: kopf.Logger, wait: bool) -> str:
    """Mirror the VolumeSnapshot; let quiesced executions go once it is cut."""
    meta = body["metadata"]
    status = body.get("status") or {}
    vs = await rt.kube.get(_vs_path(meta["namespace"], status["volumeSnapshotName"]))
    quiesce = conditions.find(status, "Quiesced")
    cond: Cond | None = None
    if quiesce is not None:
        cond = Cond("Quiesced", quiesce["status"], quiesce["reason"], quiesce.get("message", ""))
        if quiesce["reason"] == sc.REASON_QUIESCED and (vs is None or sc.cut(vs)):
            await _resume(rt, body, logger)
            cond = Cond("Quiesced", FALSE, sc.REASON_RESUMED, "the snapshot is cut; writes resumed")
    observed = sc.Observed(created=True, volume_snapshot=vs, quiesce=cond)
    phase, conds = sc.compute(observed)
    fields = sc.volume_snapshot_fields(vs) if vs is not None else {"readyToUse": False}
    await _write(rt, body, phase, conds, fields)
    if wait and phase not in sc.TERMINAL:
        raise kopf.TemporaryError("waiting for the VolumeSnapshot to be ready", delay=1)
    return phase


async def _resume(rt: Runtime, body: JSON, logger: kopf.Logger) -> None:
    """Best effort: the agent resumes by itself after its bound anyway."""
    namespace = body["metadata"]["namespace"]
    source = (body.get("status") or {}).get("sourceSandbox") or body["spec"]["sandboxRef"]["name"]
    sandbox = await rt.kube.get(_sandbox_path(namespace, source))
    endpoint = ((sandbox or {}).get("status") or {}).get("agentEndpoint")
    token = await agent_token(rt, sandbox) if sandbox else None
    if not endpoint or not token:
        return
    try:
        await rt.agents.resume(endpoint, token)
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        logger.warning("resume after quiesce failed (the agent resumes by itself): %s", exc)


async def observe(rt: Runtime, body: JSON, logger: kopf.Logger) -> None:
    """Periodic: a VolumeSnapshot deleted or repaired behind our back shows in status."""
    status = body.get("status") or {}
    if status.get("volumeSnapshotName"):
        await _follow(rt, body, logger, wait=False)


async def release(rt: Runtime, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: the VolumeSnapshot goes with the Snapshot unless retained.

    By its deterministic name, not by status: a crash between creating the
    VolumeSnapshot and recording it must not leave an orphan."""
    ref = ref_of(body)
    status = body.get("status") or {}
    quiesce = conditions.find(status, "Quiesced")
    if quiesce is not None and quiesce["reason"] == sc.REASON_QUIESCED:
        await _resume(rt, body, logger)
    policy = (body.get("spec") or {}).get("retainPolicy", RetainPolicy.DELETE.value)
    name = status.get("volumeSnapshotName") or build.volume_snapshot_name(ref)
    if policy == RetainPolicy.RETAIN.value:
        if status.get("volumeSnapshotName"):
            event(body, "info", reason="Retained", message=f"VolumeSnapshot {name} kept")
        return
    try:
        await rt.kube.delete(_vs_path(ref.namespace, name))
    except KubeError as exc:
        if exc.status >= 500 or exc.status == 429:
            raise kopf.TemporaryError(f"API server: {exc}", delay=RETRY_SECONDS) from exc
        raise
