"""Snapshot object logic against a real API server that has no VolumeSnapshot API.

This control plane has neither the snapshot CRDs nor a CSI driver: the path a
cluster without snapshot support takes. Real VolumeSnapshots, restores and
rollbacks are in test_snapshot_storage.py (a control plane with CSI storage)
and tests/e2e/test_snapshot_e2e.py (a real node).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import (
    AgentProcess,
    Node,
    OperatorProcess,
    secret_token,
    wait_for,
)
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
    sandboxes.wait_gone("later", 60, "sandbox deleted")
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
    assert 'sandbox_operator_snapshots_total{result="failed"}' in running_operator.metrics()


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


@pytest.fixture
def own_agent(tmp_path: Path) -> Iterator[Callable[[str], AgentProcess]]:
    """A real agent + runner on a loopback address of its own: not the shared
    counter's next one, which another test session on this machine may hold."""
    started: list[AgentProcess] = []

    def start(token: str) -> AgentProcess:
        for _ in range(50):
            ip = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}.{random.randint(2, 250)}"
            with socket.socket() as probe:
                try:
                    probe.bind((ip, 8080))
                except OSError:
                    continue
            agent = AgentProcess(tmp_path / f"agent-{len(started)}", ip, 8080, token)
            started.append(agent)
            agent.start()
            return agent
        raise AssertionError("no free loopback address for an agent")

    yield start
    for agent in started:
        agent.stop()


def _events(kube: KubeJSON, ns: str, reason: str) -> list[str]:
    events = kube.list(core_path("events", ns))
    return [e.get("message", "") for e in events if e.get("reason") == reason]


def _idle_sandbox(
    kube: KubeJSON,
    sandboxes: Sandboxes,
    node: Node,
    own_agent: Callable[[str], AgentProcess],
    name: str,
    on_idle: str,
) -> None:
    """A running sandbox (real agent, pod status played) that snapshots when idle."""
    ns = sandboxes.namespace
    lifecycle = {"idleTimeout": "2s", "onIdle": on_idle, "snapshotOnIdle": True}
    sandboxes.create(name, {"lifecycle": lifecycle})
    wait_for(lambda: kube.get(core_path("pods", ns, name)), 20, f"pod {name}")
    agent = own_agent(secret_token(kube, ns, name))
    node.run_pod(ns, name, agent.ip)


def test_idle_snapshot_that_fails_is_reported_and_the_pause_goes_ahead(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    node: Node,
    own_agent: Callable[[str], AgentProcess],
) -> None:
    snapshots = Snapshots(kube, ns)
    _idle_sandbox(kube, sandboxes, node, own_agent, "dozy", "Pause")
    body = sandboxes.wait_phase("dozy", "Paused", timeout=60)
    name = body["status"]["idleSnapshot"]
    assert name.startswith("dozy-idle-")
    taken = snapshots.get(name)
    assert taken is not None
    assert not taken["metadata"].get("ownerReferences")
    assert taken["status"]["phase"] == "Failed"
    assert (snapshots.condition(name) or {})["reason"] == "SnapshotsUnsupported"
    wait_for(lambda: _events(kube, ns, "IdleSnapshotFailed"), 30, "an IdleSnapshotFailed Event")
    assert name in _events(kube, ns, "IdleSnapshotFailed")[0]


def test_an_idle_delete_whose_snapshot_fails_pauses_instead_and_keeps_the_workspace(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    node: Node,
    own_agent: Callable[[str], AgentProcess],
) -> None:
    """onIdle Delete with snapshotOnIdle deletes only once its snapshot is Ready:
    this tier has no snapshots, so the sandbox is paused instead, its
    workspace claim kept, and it says why; deleting it then is not held up."""
    snapshots = Snapshots(kube, ns)
    _idle_sandbox(kube, sandboxes, node, own_agent, "kept", "Delete")
    body = sandboxes.wait_phase("kept", "Paused", timeout=60)
    taken = snapshots.list("sandbox.dev/sandbox=kept")
    assert [s["metadata"]["name"] for s in taken] == [body["status"]["idleSnapshot"]], taken
    assert taken[0]["status"]["phase"] == "Failed"
    wait_for(lambda: _events(kube, ns, "IdleSnapshotFailed"), 30, "an IdleSnapshotFailed Event")
    [message] = _events(kube, ns, "IdleSnapshotFailed")
    assert "instead of deleting it: the workspace is kept" in message, message
    assert kube.get(core_path("persistentvolumeclaims", ns, "kept-workspace")) is not None
    sandboxes.delete("kept")
    sandboxes.wait_gone("kept", 30, "deletion by its user")
