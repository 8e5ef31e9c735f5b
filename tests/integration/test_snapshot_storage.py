"""Snapshot object logic against a control plane with CSI storage and snapshots.

A private control plane of this module runs the CSI hostpath driver, the
external provisioner, snapshotter and snapshot controller (no kubelet: volumes
are provisioned, snapshotted and restored, never mounted). The operator runs
under the chart's RBAC. The sandboxes are paused (no pod, no agent needed), so
the workspace data is read and written in the driver's volume directories.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import build, storage
from devcluster.controlplane import ControlPlaneError
from devcluster.storage import StorageControlPlane
from sandbox_operator.resources import RESTORE_ANNOTATION
from sandbox_sdk import Conflict, NotFound, SandboxClient
from tests.integration.conftest import OPERATOR_ENV, archive_audit_logs, kubectl
from tests.integration.harness import (
    AgentProcess,
    Node,
    OperatorProcess,
    next_pod_ip,
    operator_credentials,
    secret_token,
    wait_for,
)
from tests.kube import JSON, KubeJSON, api_path, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import VOLUME_SNAPSHOTS, Snapshots
from tests.templates import Templates

# The first test is charged with a cold build of the CSI binaries (minutes).
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cluster(audit_archive: Path) -> Iterator[StorageControlPlane]:
    build.etcd_binary()
    build.kubernetes_binaries()
    storage.storage_binaries()
    cluster = StorageControlPlane(f"pytest-snapshots-{os.getpid()}", die_with_parent=True)
    try:
        cluster.start()
    except ControlPlaneError as error:
        pytest.fail(f"storage control plane did not start: {error}", pytrace=False)
    try:
        yield cluster
    finally:
        archive_audit_logs(cluster, audit_archive)
        cluster.stop(remove_state=True)


@pytest.fixture(scope="module")
def skube(cluster: StorageControlPlane) -> Iterator[KubeJSON]:
    with KubeJSON(cluster.kubeconfig) as client:
        yield client


@pytest.fixture(scope="module")
def soperator(
    cluster: StorageControlPlane,
    skube: KubeJSON,
    repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    # The session's `crds` fixture serves the session's control plane, not this one.
    applied = kubectl(cluster, "apply", "-f", str(repo / "crds"))
    assert applied.returncode == 0, applied.stderr
    crds = ("crd", "-l", "app.kubernetes.io/part-of=sandbox-operator")
    waited = kubectl(cluster, "wait", "--for=condition=Established", *crds, "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    kubeconfig = operator_credentials(
        cluster, skube, repo, tmp_path_factory.mktemp("soperator") / "kubeconfig"
    )
    process = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("soperator-logs"), OPERATOR_ENV)
    process.start()
    yield process
    process.stop()
    assert process.errors() == [], f"handler tracebacks in {process.log}"


@pytest.fixture
def sns(skube: KubeJSON, soperator: OperatorProcess) -> Iterator[str]:
    name = f"s-{os.urandom(4).hex()}"
    skube.create(core_path("namespaces"), {"apiVersion": "v1", "metadata": {"name": name}})
    yield name
    if skube.get(core_path("namespaces", name=name)) is not None:  # a test may delete it
        skube.delete(core_path("namespaces", name=name))


def workspace_dir(cluster: StorageControlPlane, kube: KubeJSON, ns: str, sandbox: str) -> Path:
    """The driver's directory of a sandbox's workspace volume, once bound."""

    def bound() -> JSON | None:
        claim = kube.get(core_path("persistentvolumeclaims", ns, f"{sandbox}-workspace"))
        if claim and (claim.get("status") or {}).get("phase") == "Bound":
            return claim
        return None

    claim = wait_for(bound, 60, f"claim of {sandbox} bound")
    pv = kube.read(core_path("persistentvolumes", name=claim["spec"]["volumeName"]))
    path: Path = cluster.storage.data_dir / "volumes" / pv["spec"]["csi"]["volumeHandle"]
    assert path.is_dir(), path
    return path


def test_snapshot_rollback_fork_lineage_and_retention_on_real_volumes(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("paused", {"paused": True, "workspace": {"size": "16Mi"}})
    volume = workspace_dir(cluster, skube, sns, "paused")
    (volume / "state.txt").write_text("original\n")

    snapshots.create("one", "paused", tag="one", quiesce=True)
    status = snapshots.wait_phase("one", "Ready")["status"]
    assert status["readyToUse"] is True
    assert status["volumeSnapshotClassName"] == storage.SNAPSHOT_CLASS
    assert status["lineage"] == []
    quiesced = snapshots.condition("one", "Quiesced") or {}
    assert quiesced.get("reason") == "NoPod", quiesced
    vs = snapshots.volume_snapshot(status["volumeSnapshotName"])
    assert vs is not None
    assert vs["spec"]["source"] == {"persistentVolumeClaimName": "paused-workspace"}

    # Roll back: the claim is replaced by one made from the snapshot.
    (volume / "state.txt").write_text("changed\n")
    old_claim = skube.read(core_path("persistentvolumeclaims", sns, "paused-workspace"))
    sandboxes.patch("paused", {"spec": {"workspace": {"fromSnapshot": "one"}}})
    wait_for(
        lambda: (
            ((sandboxes.get("paused") or {}).get("status") or {}).get("workspaceSnapshot") == "one"
        ),
        90,
        "rollback recorded",
    )
    cond = sandboxes.condition("paused", "WorkspaceRestored") or {}
    assert (cond.get("status"), cond.get("reason")) == ("True", "Restored"), cond
    claim = skube.read(core_path("persistentvolumeclaims", sns, "paused-workspace"))
    assert claim["metadata"]["uid"] != old_claim["metadata"]["uid"]
    assert claim["spec"]["dataSource"]["name"] == status["volumeSnapshotName"]
    restored = workspace_dir(cluster, skube, sns, "paused")
    assert (restored / "state.txt").read_text() == "original\n"

    # A snapshot of the rolled-back sandbox knows where its workspace came from.
    snapshots.create("two", "paused", retainPolicy="Retain")
    two = snapshots.wait_phase("two", "Ready")["status"]
    assert two["lineage"] == ["one"]

    # The source goes; its snapshots stay and still restore.
    sandboxes.delete("paused")
    sandboxes.wait_gone("paused", 60, "sandbox deleted")
    assert snapshots.get("one") is not None
    sandboxes.create("fork", {"paused": True, "workspace": {"fromSnapshot": "two"}})
    fork = workspace_dir(cluster, skube, sns, "fork")
    assert (fork / "state.txt").read_text() == "original\n"
    wait_for(
        lambda: (
            ((sandboxes.get("fork") or {}).get("status") or {}).get("workspaceLineage")
            == ["two", "one"]
        ),
        30,
        "the fork's lineage",
    )

    # Retain keeps the VolumeSnapshot; Delete removes it.
    snapshots.delete("two")
    snapshots.delete("one")
    wait_for(lambda: snapshots.get("one") is None and snapshots.get("two") is None, 60, "deleted")
    assert snapshots.volume_snapshot(two["volumeSnapshotName"]) is not None
    wait_for(
        lambda: snapshots.volume_snapshot(status["volumeSnapshotName"]) is None,
        60,
        "one's VolumeSnapshot deleted",
    )
    skube.delete(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", sns, two["volumeSnapshotName"]))


def test_a_retained_snapshot_keeps_its_data_when_its_namespace_goes(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    """Retain means the VolumeSnapshotContent (and the data behind it) survive the
    Snapshot, its VolumeSnapshot and the whole namespace. Named as long as a
    name may be: the VolumeSnapshot's labels must still fit."""
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("keeper", {"paused": True, "workspace": {"size": "16Mi"}})
    (workspace_dir(cluster, skube, sns, "keeper") / "kept.txt").write_text("precious\n")
    kept, dropped = "k" * 253, "dropped"
    snapshots.create(kept, "keeper", retainPolicy="Retain")
    snapshots.create(dropped, "keeper")
    contents = {}
    for name in (kept, dropped):
        status = snapshots.wait_phase(name, "Ready")["status"]
        contents[name] = status["volumeSnapshotContentName"]
    kept_content = api_path(VOLUME_SNAPSHOTS, "volumesnapshotcontents", name=contents[kept])
    wait_for(
        lambda: skube.read(kept_content)["spec"]["deletionPolicy"] == "Retain",
        30,
        "the retained content's policy",
    )
    handle = skube.read(kept_content)["status"]["snapshotHandle"]
    data = cluster.storage.data_dir / "snapshots" / f"{handle}.tar"
    assert data.is_file(), data

    skube.delete(core_path("namespaces", name=sns))
    wait_for(lambda: skube.get(core_path("namespaces", name=sns)) is None, 120, "namespace gone")
    dropped_content = api_path(VOLUME_SNAPSHOTS, "volumesnapshotcontents", name=contents[dropped])
    wait_for(lambda: skube.get(dropped_content) is None, 60, "the deleted snapshot's content gone")
    assert skube.get(kept_content) is not None, "the retained content went with its namespace"
    assert data.is_file(), "the retained data went with its namespace"
    skube.delete(kept_content)


def test_rollback_interrupted_by_an_operator_crash_converges(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str, soperator: OperatorProcess
) -> None:
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("crashy", {"paused": True, "workspace": {"size": "16Mi"}})
    volume = workspace_dir(cluster, skube, sns, "crashy")
    (volume / "data.txt").write_text("checkpoint\n")
    snapshots.create("cp", "crashy")
    snapshots.wait_phase("cp", "Ready")
    (volume / "data.txt").write_text("later\n")

    # The operator dies; the rollback is asked for while it is down, and the
    # state it finds on restart is the middle of one: old claim already gone.
    soperator.kill()
    try:
        sandboxes.patch("crashy", {"spec": {"workspace": {"fromSnapshot": "cp"}}})
        skube.delete(core_path("persistentvolumeclaims", sns, "crashy-workspace"))
        wait_for(
            lambda: skube.get(core_path("persistentvolumeclaims", sns, "crashy-workspace")) is None,
            60,
            "old claim gone",
        )
    finally:
        soperator.start()
    wait_for(
        lambda: (
            ((sandboxes.get("crashy") or {}).get("status") or {}).get("workspaceSnapshot") == "cp"
        ),
        90,
        "rollback finished after the restart",
    )
    assert (workspace_dir(cluster, skube, sns, "crashy") / "data.txt").read_text() == (
        "checkpoint\n"
    )


def _claim_uid(kube: KubeJSON, ns: str, sandbox: str) -> str:
    uid: str = kube.read(core_path("persistentvolumeclaims", ns, f"{sandbox}-workspace"))[
        "metadata"
    ]["uid"]
    return uid


def test_a_restore_to_a_missing_snapshot_is_refused_and_never_armed(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str, soperator: OperatorProcess
) -> None:
    """A rollback to a snapshot that is not there changes nothing, says so at once,
    and stays dropped: a snapshot made later under that name does not roll back a
    workspace that went on being used."""
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("keep", {"paused": True, "workspace": {"size": "16Mi"}})
    sandboxes.create("other", {"paused": True, "workspace": {"size": "16Mi"}})
    volume = workspace_dir(cluster, skube, sns, "keep")
    (volume / "work.txt").write_text("before\n")
    (workspace_dir(cluster, skube, sns, "other") / "work.txt").write_text("other\n")
    claim = _claim_uid(skube, sns, "keep")

    with SandboxClient(sns, kubeconfig=str(cluster.kubeconfig)) as client:
        # The SDK refuses before touching the spec.
        started = time.monotonic()
        with pytest.raises(NotFound, match="snapshot nope does not exist"):
            client.connect("keep").restore("nope", timeout=120)
        assert time.monotonic() - started < 30
        assert "fromSnapshot" not in sandboxes.read("keep")["spec"].get("workspace", {})

        # Asked for directly (kubectl, GitOps): the operator drops the request.
        sandboxes.patch(
            "keep",
            {
                "metadata": {"annotations": {RESTORE_ANNOTATION: "r1"}},
                "spec": {"workspace": {"fromSnapshot": "nope"}},
            },
        )

        def refused() -> JSON | None:
            status = (sandboxes.get("keep") or {}).get("status") or {}
            return status.get("workspaceRestoreRefused")

        refusal = wait_for(refused, 30, "the restore refused")
        assert (refusal["snapshot"], refusal["request"]) == ("nope", "r1"), refusal
        assert "does not exist" in refusal["message"]
        cond = sandboxes.condition("keep", "WorkspaceRestored") or {}
        assert (cond.get("status"), cond.get("reason")) == ("False", "RestoreRefused"), cond
        wait_for(
            lambda: any(
                e.get("reason") == "RestoreRefused" and e["involvedObject"]["name"] == "keep"
                for e in skube.list(core_path("events", sns))
            ),
            30,
            "a RestoreRefused Event",
        )

        # The workspace goes on being used; a namesake appears; the Sandbox is
        # reconciled again (a spec change): nothing is rolled back.
        (volume / "work.txt").write_text("edited\n")
        snapshots.create("nope", "other")
        snapshots.wait_phase("nope", "Ready")
        body = skube.patch(sandboxes.path("keep"), {"spec": {"lifecycle": {"idleTimeout": "7m"}}})
        wait_for(
            lambda: (
                ((sandboxes.get("keep") or {}).get("status") or {}).get("observedGeneration")
                == body["metadata"]["generation"]
            ),
            30,
            "the spec change observed",
        )
        assert _claim_uid(skube, sns, "keep") == claim
        assert (volume / "work.txt").read_text() == "edited\n"
        assert (sandboxes.condition("keep", "WorkspaceRestored") or {}).get("reason") == (
            "RestoreRefused"
        )

        # Asked again, now that it exists: it applies.
        client.connect("keep").restore("nope", wait=False)
        wait_for(
            lambda: (
                ((sandboxes.get("keep") or {}).get("status") or {}).get("workspaceSnapshot")
                == "nope"
            ),
            90,
            "the second request restored",
        )
        assert _claim_uid(skube, sns, "keep") != claim
        assert (workspace_dir(cluster, skube, sns, "keep") / "work.txt").read_text() == "other\n"

        # A snapshot deleted between the request and the operator's turn: the SDK's
        # wait ends with the refusal, not a timeout.
        snapshots.create("fleeting", "other")
        snapshots.wait_phase("fleeting", "Ready")
        soperator.kill()
        answer: list[BaseException | None] = []

        def restore() -> None:
            try:
                client.connect("keep").restore("fleeting", timeout=120)
                answer.append(None)
            except BaseException as exc:  # handed to the test thread
                answer.append(exc)

        waiter = threading.Thread(target=restore)
        try:
            waiter.start()
            wait_for(
                lambda: (
                    (sandboxes.read("keep")["spec"]["workspace"] or {}).get("fromSnapshot")
                    == "fleeting"
                ),
                30,
                "the request in the spec",
            )
            snapshots.delete("fleeting")
        finally:
            soperator.start()
        waiter.join(120)
        assert len(answer) == 1, "the SDK's wait did not end"
        assert isinstance(answer[0], Conflict), answer
        assert answer[0].code == "RestoreRefused"
        assert "fleeting" in answer[0].message
        assert (workspace_dir(cluster, skube, sns, "keep") / "work.txt").read_text() == "other\n"


def test_a_volume_snapshot_deleted_behind_the_operators_back_shows(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("lone", {"paused": True, "workspace": {"size": "16Mi"}})
    workspace_dir(cluster, skube, sns, "lone")
    snapshots.create("fragile", "lone")
    name = snapshots.wait_phase("fragile", "Ready")["status"]["volumeSnapshotName"]
    skube.delete(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", sns, name))
    wait_for(
        lambda: (snapshots.condition("fragile") or {}).get("reason") == "VolumeSnapshotMissing",
        60,
        "VolumeSnapshotMissing",
    )
    assert snapshots.get("fragile")["status"]["phase"] == "Failed"  # type: ignore[index]


def test_an_error_the_snapshot_controller_retries_is_not_a_failure(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    """The snapshot controller writes errors it goes on retrying into the
    VolumeSnapshot's status and clears them once the snapshot is cut (CI saw
    one: a conflict on the source claim). The Snapshot says so and waits
    (SnapshotRetrying, phase InProgress) and becomes Ready with the retry,
    where it used to fail for good at once. The error here: a
    VolumeSnapshotClass whose credentials Secret does not exist yet."""
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("patient", {"paused": True, "workspace": {"size": "16Mi"}})
    workspace_dir(cluster, skube, sns, "patient")
    # Upstream's optional rule for drivers with credentials: the sidecar reads Secrets.
    reader = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "secret-reader"}
    skube.create(
        api_path("rbac.authorization.k8s.io/v1", "roles", sns),
        {
            "metadata": {"name": "secret-reader"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
        },
    )
    skube.create(
        api_path("rbac.authorization.k8s.io/v1", "rolebindings", sns),
        {
            "metadata": {"name": "secret-reader"},
            "roleRef": reader,
            "subjects": [
                {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "User",
                    "name": storage.user_name(storage.SNAPSHOTTER),
                }
            ],
        },
    )
    classes = api_path(VOLUME_SNAPSHOTS, "volumesnapshotclasses")
    class_name = f"creds-{sns}"
    skube.create(
        classes,
        {
            "apiVersion": VOLUME_SNAPSHOTS,
            "kind": "VolumeSnapshotClass",
            "metadata": {"name": class_name},
            "driver": storage.DRIVER_NAME,
            "deletionPolicy": "Delete",
            "parameters": {
                "csi.storage.k8s.io/snapshotter-secret-name": "snap-creds",
                "csi.storage.k8s.io/snapshotter-secret-namespace": sns,
            },
        },
    )
    try:
        snapshots.create("later", "patient", volumeSnapshotClassName=class_name)
        wait_for(
            lambda: (snapshots.condition("later") or {}).get("reason") == "SnapshotRetrying",
            90,
            "Ready=False SnapshotRetrying",
        )
        cond = snapshots.condition("later") or {}
        assert "credentials" in cond["message"], cond
        assert "retries" in cond["message"], cond
        body = snapshots.get("later") or {}
        assert body["status"]["phase"] == "InProgress", body["status"]
        stalled = snapshots.condition("later", "Stalled") or {}
        assert stalled.get("status") != "True", stalled

        skube.create(
            core_path("secrets", sns),
            {"metadata": {"name": "snap-creds"}, "stringData": {"key": "value"}},
        )
        # The sidecar retries with a backoff of at most 30 s here.
        ready = snapshots.wait_phase("later", "Ready", timeout=120)
        assert ready["status"]["readyToUse"] is True
        cond = snapshots.condition("later") or {}
        assert cond["reason"] == "SnapshotReady", cond
        # Deleted while its credentials exist: the content's deletion needs them too.
        snapshots.delete("later")
        wait_for(lambda: snapshots.get("later") is None, 60, "the Snapshot deleted")
    finally:
        skube.delete(f"{classes}/{class_name}")


def test_quiesce_that_cannot_reach_the_agent_refuses_to_snapshot(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("mute", {"workspace": {"size": "16Mi"}})
    workspace_dir(cluster, skube, sns, "mute")
    wait_for(lambda: skube.get(core_path("pods", sns, "mute")), 30, "pod mute")
    # The pod runs, as far as the API says, but nothing answers at its address.
    Node(skube).run_pod(sns, "mute", "127.254.254.254")
    sandboxes.wait_phase("mute", "Running")
    snapshots.create("held", "mute", quiesce=True)
    body = snapshots.wait_phase("held", "Failed")
    cond = snapshots.condition("held") or {}
    assert cond["reason"] == "QuiesceFailed", cond
    assert "no snapshot was taken" in cond["message"]
    assert body["status"].get("volumeSnapshotName") is None
    listed = skube.list(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", sns))
    assert listed == []


def test_a_driver_without_a_snapshot_class_cannot_snapshot(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str
) -> None:
    sandboxes, snapshots = Sandboxes(skube, sns), Snapshots(skube, sns)
    sandboxes.create("nosnap", {"paused": True, "workspace": {"size": "16Mi"}})
    workspace_dir(cluster, skube, sns, "nosnap")
    path = api_path(VOLUME_SNAPSHOTS, "volumesnapshotclasses", name=storage.SNAPSHOT_CLASS)
    saved = skube.read(path)
    skube.delete(path)
    try:
        snapshots.create("impossible", "nosnap")
        snapshots.wait_phase("impossible", "Failed")
    finally:
        meta = {k: saved["metadata"][k] for k in ("name", "annotations")}
        skube.create(
            api_path(VOLUME_SNAPSHOTS, "volumesnapshotclasses"), {**saved, "metadata": meta}
        )
    cond = snapshots.condition("impossible") or {}
    assert cond["reason"] == "SnapshotsUnsupported", cond
    assert storage.DRIVER_NAME in cond["message"]
    assert "cannot take snapshots" in cond["message"]
    # A class named by the Snapshot that does not exist is named in turn.
    snapshots.create("misnamed", "nosnap", volumeSnapshotClassName="no-such-class")
    snapshots.wait_phase("misnamed", "Failed")
    cond = snapshots.condition("misnamed") or {}
    assert cond["reason"] == "VolumeSnapshotClassNotFound", cond
    assert "'no-such-class' does not exist" in cond["message"]


def _run_build(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str, tmp_path: Path, template: str
) -> str:
    """Play the node for the template's current build, with the agent working in the
    build sandbox's real volume; its new base snapshot's name."""
    templates = Templates(skube, sns)
    build = wait_for(
        lambda: (templates.get(template) or {}).get("status", {}).get("buildSandbox"),
        30,
        "build sandbox",
    )
    wait_for(lambda: skube.get(core_path("pods", sns, build)), 30, f"pod {build}")
    agent = AgentProcess(tmp_path / build, next_pod_ip(), 8080, secret_token(skube, sns, build))
    agent.workspace = workspace_dir(cluster, skube, sns, build)
    agent.start()
    try:
        Node(skube).run_pod(sns, build, agent.ip)
        wait_for(
            lambda: (templates.get(template) or {}).get("status", {}).get("baseSnapshot") == build,
            120,
            f"base snapshot {build}",
        )
    finally:
        agent.stop()
    wait_for(lambda: Sandboxes(skube, sns).get(build) is None, 30, f"{build} removed")
    return str(build)


def test_template_setup_becomes_the_base_every_new_sandbox_starts_from(
    cluster: StorageControlPlane, skube: KubeJSON, sns: str, tmp_path: Path
) -> None:
    templates, sandboxes = Templates(skube, sns), Sandboxes(skube, sns)
    templates.create(
        "py",
        {
            "description": "python with a prepared workspace",
            "sandbox": {"runtime": "python", "workspace": {"size": "16Mi"}},
            "setup": [
                {"name": "deps", "script": "mkdir -p lib && echo 42 > lib/answer"},
                {"name": "marker", "script": "echo installed > installed.txt; echo done"},
            ],
        },
    )
    build = _run_build(cluster, skube, sns, tmp_path, "py")
    ready = templates.wait_ready("py")["status"]
    assert ready["baseSnapshot"] == build, ready
    assert "--- marker (Succeeded) ---\ndone" in ready["buildLog"], ready
    assert Snapshots(skube, sns).read(build)["status"]["readyToUse"] is True

    # A Sandbox of the template starts from the base: its workspace holds the setup's files.
    sandboxes.create("app", {"templateRef": {"name": "py"}, "paused": True})
    volume = workspace_dir(cluster, skube, sns, "app")
    assert (volume / "installed.txt").read_text() == "installed\n"
    assert (volume / "lib" / "answer").read_text() == "42\n"
    used = sandboxes.read("app")["status"]["template"]
    assert used["baseSnapshot"] == build, used


def _setup(marker: str) -> list[JSON]:
    return [{"name": "marker", "script": f"echo {marker} > marker.txt"}]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_setup_change_builds_a_new_base_without_touching_existing_sandboxes(
    cluster: StorageControlPlane,
    skube: KubeJSON,
    sns: str,
    tmp_path: Path,
    soperator: OperatorProcess,
) -> None:
    templates, sandboxes = Templates(skube, sns), Sandboxes(skube, sns)
    snapshots = Snapshots(skube, sns)
    sandbox = {"runtime": "python", "workspace": {"size": "16Mi"}}
    templates.create("tools", {"sandbox": sandbox, "setup": _setup("v1")})
    first = _run_build(cluster, skube, sns, tmp_path, "tools")
    sandboxes.create("old", {"templateRef": {"name": "tools"}, "paused": True})
    assert (workspace_dir(cluster, skube, sns, "old") / "marker.txt").read_text() == "v1\n"
    digest = templates.read("tools")["status"]["setupHash"]

    # New steps: a new build, and a Sandbox created meanwhile waits for it.
    templates.patch("tools", {"spec": {"setup": _setup("v2")}})
    wait_for(
        lambda: templates.read("tools")["status"].get("buildSandbox") not in (None, first),
        30,
        "a second build",
    )
    sandboxes.create("new", {"templateRef": {"name": "tools"}, "paused": True})
    held = wait_for(
        lambda: (
            (c := sandboxes.condition("new", "Ready")) and c["reason"] == "TemplateNotReady" and c
        ),
        20,
        "new held until the base is built",
    )
    assert "SandboxTemplate tools" in held["message"], held
    second = _run_build(cluster, skube, sns, tmp_path, "tools")
    assert second != first
    status = templates.wait_ready("tools")["status"]
    assert status["setupHash"] != digest
    assert (workspace_dir(cluster, skube, sns, "new") / "marker.txt").read_text() == "v2\n"
    assert sandboxes.read("new")["status"]["template"]["baseSnapshot"] == second

    # The Sandbox of the first base keeps its workspace and its record; the first
    # base is kept as the previous one until a third build replaces it.
    assert (workspace_dir(cluster, skube, sns, "old") / "marker.txt").read_text() == "v1\n"
    assert sandboxes.read("old")["status"]["template"]["baseSnapshot"] == first
    assert snapshots.get(first) is not None
    templates.patch("tools", {"spec": {"setup": _setup("v3")}})
    third = _run_build(cluster, skube, sns, tmp_path, "tools")

    def deleted(name: str) -> bool:
        body = snapshots.get(name)
        return body is None or bool(body["metadata"].get("deletionTimestamp"))

    # Deleted: gone, or going once the VolumeSnapshot behind it is released.
    wait_for(lambda: deleted(first), 60, f"the oldest base {first} deleted")
    assert not deleted(second)
    assert third not in (first, second)
    # Three builds here (other tests of the module may have added theirs).
    text = soperator.metrics()
    assert _metric(text, "sandbox_operator_template_build_seconds_count") >= 3, text
    succeeded = 'sandbox_operator_template_builds_total{event="succeeded"}'
    assert _metric(text, succeeded) >= 3, text
