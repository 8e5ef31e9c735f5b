"""Snapshot phase and conditions computed from observed state. Pure functions.

Reasons are part of the API (stable CamelCase words); messages carry the detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandbox_operator.conditions import FALSE, TRUE, Cond

JSON = dict[str, Any]

# Phases.
PENDING = "Pending"
IN_PROGRESS = "InProgress"
READY = "Ready"
FAILED = "Failed"
TERMINAL = (READY, FAILED)

# Reasons.
REASON_READY = "SnapshotReady"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_SANDBOX_NOT_FOUND = "SandboxNotFound"
REASON_WORKSPACE_PENDING = "WorkspacePending"
REASON_SANDBOX_NOT_READY = "SandboxNotReady"
REASON_UNSUPPORTED = "SnapshotsUnsupported"
REASON_NO_PERSISTENT_WORKSPACE = "NoPersistentWorkspace"
REASON_CLASS_NOT_FOUND = "VolumeSnapshotClassNotFound"
REASON_QUIESCE_FAILED = "QuiesceFailed"
REASON_SYNC_FAILED = "SyncFailed"
REASON_CREATING = "Creating"
REASON_SNAPSHOT_FAILED = "SnapshotFailed"
REASON_VOLUME_SNAPSHOT_MISSING = "VolumeSnapshotMissing"
REASON_QUIESCED = "ExecutionsPaused"
REASON_RESUMED = "ExecutionsResumed"


@dataclass(frozen=True)
class Observed:
    """What a Snapshot's status is computed from."""

    # Why the snapshot can never be taken: (reason, message). Terminal.
    failure: tuple[str, str] | None = None
    # Why it is not taken yet: (reason, message).
    waiting: tuple[str, str] | None = None
    # The VolumeSnapshot was created (its name is in status).
    created: bool = False
    volume_snapshot: JSON | None = None
    quiesce: Cond | None = None


def volume_snapshot_fields(volume_snapshot: JSON | None) -> JSON:
    """readyToUse, restoreSize and creationTime as the CSI side reports them."""
    status = (volume_snapshot or {}).get("status") or {}
    fields: JSON = {"readyToUse": bool(status.get("readyToUse"))}
    if status.get("restoreSize") is not None:
        fields["restoreSize"] = str(status["restoreSize"])
    if status.get("creationTime"):
        fields["creationTime"] = status["creationTime"]
    return fields


def cut(volume_snapshot: JSON | None) -> bool:
    """The point-in-time copy exists (or failed): quiesced writers may go on."""
    status = (volume_snapshot or {}).get("status") or {}
    return bool(status.get("creationTime") or status.get("readyToUse") or status.get("error"))


def compute(observed: Observed) -> tuple[str, list[Cond]]:
    conds = [observed.quiesce] if observed.quiesce else []
    if observed.failure:
        reason, message = observed.failure
        return FAILED, [*conds, Cond("Ready", FALSE, reason, message)]
    if observed.created and observed.volume_snapshot is None:
        message = "the VolumeSnapshot of this Snapshot was deleted; take a new Snapshot"
        return FAILED, [*conds, Cond("Ready", FALSE, REASON_VOLUME_SNAPSHOT_MISSING, message)]
    if observed.volume_snapshot is not None:
        status = observed.volume_snapshot.get("status") or {}
        if status.get("readyToUse"):
            return READY, [*conds, Cond("Ready", TRUE, REASON_READY, "restorable")]
        error = status.get("error") or {}
        if error.get("message"):
            return FAILED, [
                *conds,
                Cond("Ready", FALSE, REASON_SNAPSHOT_FAILED, f"CSI snapshot: {error['message']}"),
            ]
        message = (
            "cut; waiting for the CSI driver to make it ready"
            if status.get("creationTime")
            else "waiting for the CSI driver to cut the snapshot"
        )
        return IN_PROGRESS, [*conds, Cond("Ready", FALSE, REASON_CREATING, message)]
    reason, message = observed.waiting or (REASON_CREATING, "starting")
    return PENDING, [*conds, Cond("Ready", FALSE, reason, message)]
