"""Snapshot builders and conditions: pure functions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sandbox_operator import identity
from sandbox_operator.api.sandbox import SandboxPhase, SandboxReason, SandboxSpec
from sandbox_operator.api.snapshot import SnapshotPhase as P
from sandbox_operator.api.snapshot import SnapshotReason as R
from sandbox_operator.api.snapshot import SnapshotStatus
from sandbox_operator.builders import sandbox as sandbox_build
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders import snapshot as build
from sandbox_operator.builders import snapshot_status as sc
from sandbox_operator.builders.conditions import Cond
from sandbox_operator.config import Settings
from sandbox_operator.resources import LABEL_SANDBOX, LABEL_SNAPSHOT_UID, SNAPSHOT_ANNOTATION

REF = build.SnapshotRef(name="snap", namespace="ns", uid="1234-abcd")
NOW = datetime(2026, 1, 1, tzinfo=UTC)
SOURCE = build.RestoreSource(
    snapshot="snap",
    volume_snapshot="sandbox-snapshot-1234-abcd",
    restore_size="2Gi",
    lineage=("snap", "older"),
    request="2026-01-01T00:00:00Z",
)


def test_volume_snapshot_is_named_by_uid_unowned_and_labelled() -> None:
    vs = build.build_volume_snapshot(REF, "box", "box-workspace", "csi-hostpath-snapclass")
    assert vs["metadata"]["name"] == "sandbox-snapshot-1234-abcd"
    assert "ownerReferences" not in vs["metadata"]
    # Labels carry the UID (at most 63 characters), the annotation the name.
    assert vs["metadata"]["labels"][LABEL_SNAPSHOT_UID] == "1234-abcd"
    assert vs["metadata"]["annotations"][SNAPSHOT_ANNOTATION] == "snap"
    assert vs["metadata"]["labels"][LABEL_SANDBOX] == "box"
    assert vs["spec"] == {
        "source": {"persistentVolumeClaimName": "box-workspace"},
        "volumeSnapshotClassName": "csi-hostpath-snapclass",
    }
    unclassed = build.build_volume_snapshot(REF, "box", "box-workspace", None)
    assert "volumeSnapshotClassName" not in unclassed["spec"]


def _class(name: str, driver: str, default: bool = False) -> dict[str, object]:
    annotations = {build.DEFAULT_CLASS_ANNOTATION: "true"} if default else {}
    return {"metadata": {"name": name, "annotations": annotations}, "driver": driver}


def test_snapshot_class_is_the_drivers_default_or_only_one() -> None:
    assert build.pick_snapshot_class([_class("a", "x"), _class("b", "y")], "y") == "b"
    two = [_class("a", "x"), _class("b", "x", default=True)]
    assert build.pick_snapshot_class(two, "x") == "b"
    assert build.pick_snapshot_class([_class("a", "x"), _class("b", "x")], "x") is None
    assert build.pick_snapshot_class([_class("a", "x")], "z") is None
    assert build.pick_snapshot_class([], "x") is None


def test_restored_claim_has_a_data_source_enough_room_and_its_origin() -> None:
    ref = identity.SandboxRef(name="box", namespace="ns", uid="u")
    spec = SandboxSpec.model_validate({"workspace": {"size": "1Gi", "fromSnapshot": "snap"}})
    claim = sandbox_build.build_claim(ref, spec, Settings())
    assert claim is not None
    restored = build.restore_into(claim, SOURCE)
    assert restored["spec"]["dataSource"] == {
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": "sandbox-snapshot-1234-abcd",
    }
    # The snapshot is 2Gi: a 1Gi claim could not hold it.
    assert restored["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"  # input untouched
    assert build.claim_origin(restored) == ("snap", "2026-01-01T00:00:00Z", ["snap", "older"])
    assert build.claim_origin(claim) == (None, "", [])
    assert build.restored_size("5Gi", "2Gi") == "5Gi"
    assert build.restored_size("1Gi", None) == "1Gi"


def test_idle_snapshot_is_named_after_the_deadline_and_not_owned() -> None:
    deadline = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    name = build.idle_snapshot_name("box", deadline)
    assert name == "box-idle-20260304050607"
    body = build.build_idle_snapshot("box", "ns", name)
    assert "ownerReferences" not in body["metadata"]
    assert body["spec"]["sandboxRef"] == {"name": "box"}
    assert body["metadata"]["labels"][LABEL_SANDBOX] == "box"


def _erring(since: datetime) -> dict[str, object]:
    """A VolumeSnapshot whose error the snapshot controller first wrote at `since`."""
    when = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"creationTimestamp": "2025-01-01T00:00:00Z"},
        "status": {"readyToUse": False, "error": {"message": "conflict", "time": when}},
    }


@pytest.mark.parametrize(
    ("observed", "phase", "reason"),
    [
        (sc.Observed(failure=(R.UNSUPPORTED, "no API")), P.FAILED, R.UNSUPPORTED),
        (sc.Observed(waiting=(R.SANDBOX_NOT_FOUND, "x")), P.PENDING, R.SANDBOX_NOT_FOUND),
        # Retrying a flush is not failing: only a Failure ends the snapshot.
        (sc.Observed(waiting=(R.SYNC_FAILED, "agent busy")), P.PENDING, R.SYNC_FAILED),
        (sc.Observed(failure=(R.SYNC_FAILED, "5 attempts")), P.FAILED, R.SYNC_FAILED),
        (sc.Observed(created=True), P.FAILED, R.VOLUME_SNAPSHOT_MISSING),
        (sc.Observed(created=True, volume_snapshot={}), P.IN_PROGRESS, R.CREATING),
        (
            sc.Observed(created=True, volume_snapshot={"status": {"readyToUse": True}}),
            P.READY,
            R.READY,
        ),
        # The snapshot controller retries what it reports: an error is final
        # only once it has stayed CSI_ERROR_GRACE_SECONDS.
        (
            sc.Observed(
                created=True,
                volume_snapshot={"status": {"readyToUse": False, "error": {"message": "boom"}}},
            ),
            P.IN_PROGRESS,
            R.CSI_RETRYING,
        ),
        (
            sc.Observed(created=True, volume_snapshot=_erring(NOW - timedelta(seconds=119))),
            P.IN_PROGRESS,
            R.CSI_RETRYING,
        ),
        (
            sc.Observed(created=True, volume_snapshot=_erring(NOW - timedelta(seconds=120))),
            P.FAILED,
            R.SNAPSHOT_FAILED,
        ),
        (
            # No time on the error: it counts from the VolumeSnapshot's creation.
            sc.Observed(
                created=True,
                volume_snapshot={
                    "metadata": {"creationTimestamp": "2025-12-31T23:00:00Z"},
                    "status": {"error": {"message": "boom"}},
                },
            ),
            P.FAILED,
            R.SNAPSHOT_FAILED,
        ),
    ],
)
def test_snapshot_phase_and_ready_reason(observed: sc.Observed, phase: str, reason: str) -> None:
    status = sc.build_status(SnapshotStatus(), observed, 1, NOW)
    ready = [c for c in status.conditions if c.type == "Ready"]
    assert (status.phase, ready[0].reason) == (phase, reason)
    assert ready[0].status == ("True" if phase == P.READY else "False")


def test_csi_error_message_reaches_the_condition_and_fields_mirror_the_volume_snapshot() -> None:
    vs = {
        "status": {
            "readyToUse": True,
            "restoreSize": "10Mi",
            "creationTime": "2026-01-01T00:00:00Z",
        }
    }
    assert sc.volume_snapshot_fields(vs) == {
        "ready_to_use": True,
        "restore_size": "10Mi",
        "creation_time": "2026-01-01T00:00:00Z",
    }
    assert sc.cut(vs, NOW)
    assert not sc.cut({"status": {}}, NOW)
    ready = sc.ready(
        sc.Observed(created=True, volume_snapshot={"status": {"error": {"message": "disk full"}}}),
        NOW,
    )
    assert "disk full" in ready.message


def test_quiesced_writers_wait_while_the_snapshot_controller_retries() -> None:
    """An error being retried is no cut: quiesced executions stay paused (the
    agent's own bound ends the pause); a final one lets them go."""
    assert not sc.cut(_erring(NOW - timedelta(seconds=5)), NOW)
    assert sc.cut(_erring(NOW - timedelta(seconds=600)), NOW)
    retried = {**_erring(NOW - timedelta(seconds=5)), "status": {"creationTime": "x"}}
    assert sc.cut(retried, NOW)


def test_a_sandbox_held_for_a_rollback_is_restoring_not_ready() -> None:
    restore = Cond("WorkspaceRestored", "False", SandboxReason.ROLLING_BACK, "msg")
    observed = sandbox_status.Observed(
        generation=1,
        paused=False,
        deleting=False,
        ephemeral=False,
        pod=None,
        restore=restore,
        holding=True,
    )
    conds = sandbox_status.compute(observed)
    assert sandbox_status.phase_of(conds) == SandboxPhase.RESTORING
    ready = conds["Ready"]
    assert ready is not None
    assert ready.reason == SandboxReason.RESTORING
    assert conds["WorkspaceRestored"] == restore


def test_naming_a_snapshot_does_not_restart_the_pod_by_itself() -> None:
    """The pod stamp leaves fromSnapshot out: a rollback replaces the pod when
    its snapshot is ready, not when the field is written."""
    ref = identity.SandboxRef(name="box", namespace="ns", uid="u")
    plain = SandboxSpec.model_validate({})
    restored = SandboxSpec.model_validate({"workspace": {"fromSnapshot": "snap"}})
    pod = sandbox_build.desired_pod(ref, plain, Settings())
    assert sandbox_build.changed_fields(pod, restored) == []
