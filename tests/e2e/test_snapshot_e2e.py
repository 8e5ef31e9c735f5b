"""Snapshots end to end: the CSI hostpath driver cuts real VolumeSnapshots and
restores real volumes from them; the agent reads the files back."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.integration.harness import wait_for
from tests.kube import api_path, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import VOLUME_SNAPSHOTS, Snapshots

pytestmark = pytest.mark.timeout(1800)


def _restored(sandboxes: Sandboxes, name: str, snapshot: str, timeout: float = 180) -> None:
    """Ready on a workspace restored from `snapshot` (WorkspaceRestored=True)."""

    def done() -> bool:
        cond = sandboxes.condition(name, "WorkspaceRestored") or {}
        status = (sandboxes.get(name) or {}).get("status") or {}
        return cond.get("status") == "True" and status.get("workspaceSnapshot") == snapshot

    wait_for(done, timeout, f"sandbox {name} restored from {snapshot}", interval=0.5)
    sandboxes.wait_ready(name)


def test_rollback_returns_the_workspace_to_the_snapshot(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create("work")
    sandboxes.wait_ready("work")
    agent = Agent.of(e2e.kube, ns, "work")
    agent.write("src/main.py", "print('v1')\n")
    agent.write("notes.txt", "first\n")

    snapshots.create("checkpoint", "work", tag="v1", description="before the refactor")
    body = snapshots.wait_phase("checkpoint", "Ready")
    status = body["status"]
    assert status["readyToUse"] is True
    assert status["sourceSandbox"] == "work"
    assert status["lineage"] == []
    assert status["restoreSize"]
    assert status["creationTime"]
    assert snapshots.volume_snapshot(status["volumeSnapshotName"]) is not None
    columns = e2e.kubectl("get", "-n", ns, "snapshot", "checkpoint").stdout
    for shown in ("work", "v1", "true", status["restoreSize"]):
        assert shown in columns, columns

    agent.write("src/main.py", "print('v2: broken')\n")
    agent.write("scratch.txt", "made after the checkpoint\n")
    agent.run(["rm", "notes.txt"])

    pod_uid = e2e.kube.read(core_path("pods", ns, "work"))["metadata"]["uid"]
    sandboxes.patch("work", {"spec": {"workspace": {"fromSnapshot": "checkpoint"}}})
    _restored(sandboxes, "work", "checkpoint")
    assert e2e.kube.read(core_path("pods", ns, "work"))["metadata"]["uid"] != pod_uid
    agent = Agent.of(e2e.kube, ns, "work")
    assert agent.read("src/main.py") == "print('v1')\n"
    assert agent.read("notes.txt") == "first\n"
    assert agent.run(["test", "-e", "scratch.txt"])["exitCode"] == 1

    # Again to the same snapshot: a new restore request (annotation) rolls back again.
    agent.write("src/main.py", "print('v3')\n")
    claim_uid = e2e.kube.read(core_path("persistentvolumeclaims", ns, "work-workspace"))[
        "metadata"
    ]["uid"]
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    sandboxes.patch(
        "work", {"metadata": {"annotations": {"sandbox.dev/restore-requested-at": stamp}}}
    )
    wait_for(
        lambda: (
            ((sandboxes.get("work") or {}).get("status") or {}).get("workspaceRestoreRequest")
            == stamp
        ),
        180,
        "the second rollback",
    )
    sandboxes.wait_ready("work")
    claim = e2e.kube.read(core_path("persistentvolumeclaims", ns, "work-workspace"))
    assert claim["metadata"]["uid"] != claim_uid
    assert Agent.of(e2e.kube, ns, "work").read("src/main.py") == "print('v1')\n"


def test_forks_are_independent_and_lineage_follows_restore_chains(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create("origin")
    sandboxes.wait_ready("origin")
    Agent.of(e2e.kube, ns, "origin").write("data.txt", "shared start\n")
    snapshots.create("base", "origin", tag="base")
    snapshots.wait_phase("base", "Ready")

    # The source goes: its snapshot stays and stays usable.
    sandboxes.delete("origin")
    sandboxes.wait_gone("origin", 120, "origin deleted")
    assert snapshots.get("base") is not None

    for name in ("left", "right"):
        sandboxes.create(name, {"workspace": {"fromSnapshot": "base"}})
    for name in ("left", "right"):
        _restored(sandboxes, name, "base")
    left, right = Agent.of(e2e.kube, ns, "left"), Agent.of(e2e.kube, ns, "right")
    assert left.read("data.txt") == right.read("data.txt") == "shared start\n"
    left.write("data.txt", "left was here\n")
    right.write("only-right.txt", "right\n")
    assert right.read("data.txt") == "shared start\n"
    assert left.run(["test", "-e", "only-right.txt"])["exitCode"] == 1
    assert (sandboxes.get("left") or {})["status"]["workspaceLineage"] == ["base"]

    # A snapshot of a fork, a sandbox from that, a snapshot of it: base <- mid <- top.
    snapshots.create("mid", "left")
    assert snapshots.wait_phase("mid", "Ready")["status"]["lineage"] == ["base"]
    sandboxes.delete("right")
    sandboxes.create("grandchild", {"workspace": {"fromSnapshot": "mid"}})
    _restored(sandboxes, "grandchild", "mid")
    assert Agent.of(e2e.kube, ns, "grandchild").read("data.txt") == "left was here\n"
    snapshots.create("top", "grandchild")
    assert snapshots.wait_phase("top", "Ready")["status"]["lineage"] == ["mid", "base"]

    # Retain keeps the VolumeSnapshot when the Snapshot goes; Delete (the default) does not.
    snapshots.create("kept", "grandchild", retainPolicy="Retain")
    kept = snapshots.wait_phase("kept", "Ready")["status"]["volumeSnapshotName"]
    top = snapshots.get("top")["status"]["volumeSnapshotName"]  # type: ignore[index]
    snapshots.delete("kept")
    snapshots.delete("top")
    wait_for(lambda: snapshots.get("top") is None, 60, "snapshot top deleted")
    wait_for(lambda: snapshots.volume_snapshot(top) is None, 60, "top's VolumeSnapshot deleted")
    wait_for(lambda: snapshots.get("kept") is None, 60, "snapshot kept deleted")
    assert snapshots.volume_snapshot(kept) is not None
    e2e.kube.delete(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", ns, kept))


def test_idle_snapshot_before_delete_is_restorable(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create(
        "sleepy",
        {"lifecycle": {"idleTimeout": "15s", "onIdle": "Delete", "snapshotOnIdle": True}},
    )
    sandboxes.wait_ready("sleepy")
    Agent.of(e2e.kube, ns, "sleepy").write("work.txt", "unsaved work\n")
    sandboxes.wait_gone("sleepy", 240, "idle deletion of sleepy")
    taken = snapshots.list("sandbox.dev/sandbox=sleepy")
    assert len(taken) == 1, taken
    name = taken[0]["metadata"]["name"]
    assert not taken[0]["metadata"].get("ownerReferences")
    # The idle policy waited for it: it was Ready before the sandbox went.
    assert taken[0]["status"]["phase"] == "Ready", taken[0]["status"]

    sandboxes.create("revived", {"workspace": {"fromSnapshot": name}})
    _restored(sandboxes, "revived", name)
    assert Agent.of(e2e.kube, ns, "revived").read("work.txt") == "unsaved work\n"


def test_paused_timeout_deletes_after_its_snapshot(e2e: E2E) -> None:
    """A sandbox paused past pausedTimeout with snapshotOnIdle goes once a Snapshot
    of its workspace is Ready (not before: a failed one keeps it paused, see the
    integration tier), and that Snapshot outlives it."""
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create("parked", {"lifecycle": {"pausedTimeout": "5s", "snapshotOnIdle": True}})
    sandboxes.wait_ready("parked")
    Agent.of(e2e.kube, ns, "parked").write("notes.txt", "kept\n")
    sandboxes.patch("parked", {"spec": {"paused": True}})
    sandboxes.wait_gone("parked", 240, "deletion after pausedTimeout")
    [taken] = snapshots.list("sandbox.dev/sandbox=parked")
    assert taken["status"]["phase"] == "Ready", taken["status"]

    sandboxes.create("unparked", {"workspace": {"fromSnapshot": taken["metadata"]["name"]}})
    _restored(sandboxes, "unparked", taken["metadata"]["name"])
    assert Agent.of(e2e.kube, ns, "unparked").read("notes.txt") == "kept\n"


WRITER = "i=0; while true; do echo line-$i-end >> log.txt; i=$((i+1)); sleep 0.005; done"


def test_quiesce_pauses_a_running_writer_while_the_snapshot_is_cut(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create("busy")
    sandboxes.wait_ready("busy")
    agent = Agent.of(e2e.kube, ns, "busy")
    writer = agent.start(WRITER)
    wait_for(lambda: agent.run(["test", "-s", "log.txt"])["exitCode"] == 0, 30, "the writer")

    snapshots.create("steady", "busy", quiesce=True)
    status = snapshots.wait_phase("steady", "Ready")["status"]
    assert status["quiescedExecutions"] == 1
    quiesced = snapshots.condition("steady", "Quiesced") or {}
    assert (quiesced.get("status"), quiesced.get("reason")) == ("False", "ExecutionsResumed")
    # Resumed: the writer goes on after the cut.
    size = len(agent.read("log.txt"))
    time.sleep(1)
    assert len(agent.read("log.txt")) > size
    stop = agent._http.post(f"/v1/executions/{writer['id']}/cancel", json={})
    assert stop.status_code == 200, stop.text

    # The restored copy holds only whole lines: the writer was stopped, not torn.
    sandboxes.create("copy", {"workspace": {"fromSnapshot": "steady"}})
    _restored(sandboxes, "copy", "steady")
    lines = Agent.of(e2e.kube, ns, "copy").read("log.txt").splitlines()
    assert lines
    assert all(line.startswith("line-") and line.endswith("-end") for line in lines), lines[-3:]


def test_snapshot_fails_clearly_where_the_storage_cannot_snapshot(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    sandboxes.create("plain")
    sandboxes.create("scratch", {"workspace": {"ephemeral": True}})
    sandboxes.wait_ready("plain")
    sandboxes.wait_ready("scratch")

    snapshots.create("of-scratch", "scratch")
    snapshots.wait_phase("of-scratch", "Failed")
    cond = snapshots.condition("of-scratch") or {}
    assert cond["reason"] == "NoPersistentWorkspace", cond
    assert "ephemeral" in cond["message"]

    # A class for a driver that is not the workspace volume's: that driver cannot
    # take the snapshot, and the Snapshot says exactly that.
    classes = api_path(VOLUME_SNAPSHOTS, "volumesnapshotclasses")
    alien = f"alien-{ns}"
    e2e.kube.create(
        classes,
        {
            "apiVersion": VOLUME_SNAPSHOTS,
            "kind": "VolumeSnapshotClass",
            "metadata": {"name": alien},
            "driver": "no-such-driver.example.com",
            "deletionPolicy": "Delete",
        },
    )
    try:
        snapshots.create("elsewhere", "plain", volumeSnapshotClassName=alien)
        snapshots.wait_phase("elsewhere", "Failed")
        cond = snapshots.condition("elsewhere") or {}
        assert cond["reason"] == "SnapshotsUnsupported", cond
        assert "no-such-driver.example.com" in cond["message"]
        assert "hostpath.csi.k8s.io" in cond["message"]
        assert snapshots.get("elsewhere")["status"].get("volumeSnapshotName") is None  # type: ignore[index]
    finally:
        e2e.kube.delete(f"{classes}/{alien}")

    # A sandbox asked to start from the failed snapshot says so, and makes no claim.
    sandboxes.create("hopeful", {"workspace": {"fromSnapshot": "elsewhere"}})
    wait_for(
        lambda: (
            (sandboxes.condition("hopeful", "WorkspaceRestored") or {}).get("reason")
            == "SnapshotFailed"
        ),
        60,
        "WorkspaceRestored=False SnapshotFailed",
    )
    assert e2e.kube.get(core_path("persistentvolumeclaims", ns, "hopeful-workspace")) is None
    # Nothing else broke: the other sandboxes still serve.
    assert sandboxes.wait_ready("plain", timeout=10)
    assert Agent.of(e2e.kube, ns, "plain").run(["true"])["exitCode"] == 0
