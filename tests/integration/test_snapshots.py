"""Snapshot object logic against a real API server that has no VolumeSnapshot API.

This control plane has neither the snapshot CRDs nor a CSI driver: the path a
cluster without snapshot support takes. The CSI side (real VolumeSnapshots,
restores, rollbacks) is exercised end to end in tests/e2e/test_snapshot_e2e.py.
"""

from __future__ import annotations

import pytest

from tests.integration.harness import OperatorProcess, wait_for
from tests.kube import ApiError, KubeJSON, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots


def test_snapshot_waits_for_its_sandbox_then_fails_without_a_snapshot_api(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes
) -> None:
    snapshots = Snapshots(kube, ns)
    snapshots.create("early", "later", tag="t1", description="made before its sandbox")
    wait_for(
        lambda: (snapshots.condition("early") or {}).get("reason") == "SandboxNotFound",
        30,
        "SandboxNotFound",
    )
    assert snapshots.get("early")["status"]["phase"] == "Pending"  # type: ignore[index]

    sandboxes.create("later")
    body = snapshots.wait_phase("early", "Failed", timeout=60)
    cond = snapshots.condition("early") or {}
    assert cond["reason"] == "SnapshotsUnsupported", cond
    assert "no VolumeSnapshot API" in cond["message"]
    assert body["status"]["sourceSandbox"] == "later"
    assert body["status"].get("volumeSnapshotName") is None

    # Nothing else broke: the sandbox has its children and a status of its own.
    wait_for(lambda: kube.get(core_path("pods", ns, "later")), 30, "the sandbox's pod")
    assert kube.get(core_path("persistentvolumeclaims", ns, "later-workspace")) is not None

    # Deleting the Sandbox leaves its Snapshot; deleting the Snapshot completes
    # (its finalizer has no VolumeSnapshot to delete on this cluster).
    sandboxes.delete("later")
    wait_for(lambda: sandboxes.get("later") is None, 60, "sandbox deleted")
    assert snapshots.get("early") is not None
    snapshots.delete("early")
    wait_for(lambda: snapshots.get("early") is None, 30, "snapshot deleted")


def test_ephemeral_workspace_cannot_be_snapshotted(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes
) -> None:
    snapshots = Snapshots(kube, ns)
    sandboxes.create("scratch", {"workspace": {"ephemeral": True}})
    snapshots.create("of-scratch", "scratch")
    snapshots.wait_phase("of-scratch", "Failed", timeout=60)
    cond = snapshots.condition("of-scratch") or {}
    assert cond["reason"] == "NoPersistentWorkspace", cond
    assert "ephemeral" in cond["message"]


def test_restore_waits_for_its_snapshot_and_creates_nothing_meanwhile(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes, running_operator: OperatorProcess
) -> None:
    snapshots = Snapshots(kube, ns)
    sandboxes.create("fork", {"workspace": {"fromSnapshot": "missing"}})
    wait_for(
        lambda: (
            (sandboxes.condition("fork", "WorkspaceRestored") or {}).get("reason")
            == "SnapshotNotReady"
        ),
        30,
        "WorkspaceRestored=False SnapshotNotReady",
    )
    body = sandboxes.wait_phase("fork", "Restoring")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Restoring")
    assert "missing does not exist" in ready["message"]
    # No empty claim in place of the restored one, and no pod on nothing.
    assert kube.get(core_path("persistentvolumeclaims", ns, "fork-workspace")) is None
    assert kube.get(core_path("pods", ns, "fork")) is None

    # The snapshot appears but can never be ready here: the sandbox says so.
    sandboxes.create("source")
    snapshots.create("missing", "source")
    snapshots.wait_phase("missing", "Failed", timeout=60)
    wait_for(
        lambda: (
            (sandboxes.condition("fork", "WorkspaceRestored") or {}).get("reason")
            == "SnapshotFailed"
        ),
        30,
        "WorkspaceRestored=False SnapshotFailed",
    )
    assert kube.get(core_path("persistentvolumeclaims", ns, "fork-workspace")) is None
    assert "sandbox_operator_snapshots_total" in running_operator.metrics()


def test_snapshot_spec_is_validated_by_the_api_server(kube: KubeJSON, ns: str) -> None:
    snapshots = Snapshots(kube, ns)
    snapshots.create("fine", "box", tag="v1.0_rc-1", retainPolicy="Retain")
    with pytest.raises(ApiError) as bad_tag:
        snapshots.create("bad-tag", "box", tag="-starts-with-dash")
    assert bad_tag.value.status == 422
    with pytest.raises(ApiError) as moved:
        kube.patch(snapshots.path("fine"), {"spec": {"sandboxRef": {"name": "other"}}})
    assert moved.value.status == 422
    assert "immutable" in moved.value.message
