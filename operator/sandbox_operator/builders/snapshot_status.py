"""A Snapshot's status from what was observed: one function per condition, the
phase derived from the Ready condition. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandbox_operator.api.snapshot import (
    SnapshotCondition,
    SnapshotPhase,
    SnapshotReason,
    SnapshotStatus,
)
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, merge, progress
from sandbox_operator.clock import iso, parse_time

JSON = dict[str, Any]
C = SnapshotCondition
R = SnapshotReason

# How long a VolumeSnapshot may report an error before its Snapshot fails. The
# snapshot controller writes `status.error` for failures it goes on retrying
# (its update of the source claim conflicting with another writer's, say) and
# clears it once the snapshot is ready: an error is a verdict only when it
# stays. Its `time` is when that error was first written (the same message is
# not written again), so the grace runs from the error, not from each retry.
CSI_ERROR_GRACE_SECONDS = 120.0


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
    # Quiesced, when spec.quiesce asked for it (None: it does not apply).
    quiesce: Cond | None = None


def volume_snapshot_fields(volume_snapshot: JSON | None) -> JSON:
    """readyToUse, restoreSize, creationTime and the content's name as the CSI side reports."""
    status = (volume_snapshot or {}).get("status") or {}
    fields: JSON = {"ready_to_use": bool(status.get("readyToUse"))}
    if status.get("restoreSize") is not None:
        fields["restore_size"] = str(status["restoreSize"])
    if status.get("creationTime"):
        fields["creation_time"] = status["creationTime"]
    if status.get("boundVolumeSnapshotContentName"):
        fields["volume_snapshot_content_name"] = status["boundVolumeSnapshotContentName"]
    return fields


def csi_error(volume_snapshot: JSON | None, now: datetime) -> tuple[str, bool] | None:
    """The VolumeSnapshot's error message, and whether it is final (reported for
    `CSI_ERROR_GRACE_SECONDS`); None without one. An error without a time counts
    from the VolumeSnapshot's creation."""
    vs = volume_snapshot or {}
    error = (vs.get("status") or {}).get("error") or {}
    message = error.get("message")
    if not message:
        return None
    since = error.get("time") or (vs.get("metadata") or {}).get("creationTimestamp")
    final = since is not None and (now - parse_time(since)).total_seconds() >= (
        CSI_ERROR_GRACE_SECONDS
    )
    return str(message), final


def cut(volume_snapshot: JSON | None, now: datetime) -> bool:
    """The point-in-time copy exists, or failed for good: quiesced writers may go
    on. While the snapshot controller retries they stay paused (the agent ends
    a pause by itself after its bound)."""
    status = (volume_snapshot or {}).get("status") or {}
    if status.get("creationTime") or status.get("readyToUse"):
        return True
    error = csi_error(volume_snapshot, now)
    return error is not None and error[1]


def ready(o: Observed, now: datetime) -> Cond:
    if o.failure:
        reason, message = o.failure
        return Cond(C.READY, FALSE, reason, message)
    if o.created and o.volume_snapshot is None:
        message = "the VolumeSnapshot of this Snapshot was deleted; take a new Snapshot"
        return Cond(C.READY, FALSE, R.VOLUME_SNAPSHOT_MISSING, message)
    if o.volume_snapshot is not None:
        status = o.volume_snapshot.get("status") or {}
        if status.get("readyToUse"):
            return Cond(C.READY, TRUE, R.READY, "restorable")
        error = csi_error(o.volume_snapshot, now)
        if error is not None:
            message, final = error
            if final:
                return Cond(C.READY, FALSE, R.SNAPSHOT_FAILED, f"CSI snapshot: {message}")
            retrying = f"CSI snapshot: {message} (the snapshot controller retries)"
            return Cond(C.READY, FALSE, R.CSI_RETRYING, retrying)
        message = (
            "cut; waiting for the CSI driver to make it ready"
            if status.get("creationTime")
            else "waiting for the CSI driver to cut the snapshot"
        )
        return Cond(C.READY, FALSE, R.CREATING, message)
    reason, message = o.waiting or (R.CREATING, "starting")
    return Cond(C.READY, FALSE, reason, message)


def compute(o: Observed, now: datetime) -> dict[str, Cond | None]:
    cond = ready(o, now)
    return {C.QUIESCED: o.quiesce, C.READY: cond, **progress(cond, stalled=failed(o, cond))}


def failed(o: Observed, ready: Cond) -> bool:
    """For good: the controller gave up, or the CSI side failed or lost the copy."""
    return bool(o.failure) or ready.reason in (R.SNAPSHOT_FAILED, R.VOLUME_SNAPSHOT_MISSING)


def phase_of(o: Observed, conds: dict[str, Cond | None]) -> SnapshotPhase:
    """From the Ready condition; a reason such as SyncFailed is final only when the
    controller gave up (`failure`), and a passing state while it retries."""
    cond = conds[C.READY]
    assert cond is not None
    if cond.status == TRUE:
        return SnapshotPhase.READY
    if failed(o, cond):
        return SnapshotPhase.FAILED
    return SnapshotPhase.IN_PROGRESS if o.volume_snapshot is not None else SnapshotPhase.PENDING


TERMINAL = (SnapshotPhase.READY, SnapshotPhase.FAILED)


def build_status(
    old: SnapshotStatus, o: Observed, generation: int, now: datetime, **fields: Any
) -> SnapshotStatus:
    conds = compute(o, now)
    return old.evolve(
        **{
            **fields,
            "phase": phase_of(o, conds),
            "observed_generation": generation,
            "conditions": merge(old.conditions, conds, generation, iso(now)),
        }
    )
