"""CSI storage of the local cluster against a real control plane: the hostpath
driver, external-provisioner, snapshot-controller and csi-snapshotter as host
processes (devcluster/storage.py). No kubelet here, so data is written to and
read from the driver's volume directories directly; mounting into a pod is
the node tier's test.

The first test builds the storage binaries if they are missing (a cold build
takes several minutes on 2 cores), hence the module's long timeout; every
wait inside the tests has its own bound.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import build, probes, processes, storage
from devcluster.cluster import LocalCluster
from devcluster.controlplane import ControlPlane, ControlPlaneError
from devcluster.pytest_plugin import private_cluster
from devcluster.storage import StorageControlPlane
from tests.devcluster.support import WAIT, kubectl, wait_for
from tests.kube import ApiError, KubeJSON, api_path, core_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

SNAPSHOTS = "snapshot.storage.k8s.io/v1"
MIB = 2**20


def start_cluster(name: str, **kwargs: Any) -> StorageControlPlane:
    cluster = StorageControlPlane(name, die_with_parent=True, **kwargs)
    try:
        cluster.start()
    except ControlPlaneError as error:
        pytest.fail(f"storage cluster {name!r} did not start: {error}", pytrace=False)
    return cluster


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[StorageControlPlane]:
    # Built here rather than inside start() only to report a failed build
    # as such; errors, never skips.
    build.etcd_binary()
    build.kubernetes_binaries()
    storage.storage_binaries()
    # private_cluster keeps the state (the sidecars' logs) when a test failed.
    name = f"pytest-storage-{os.getpid()}"
    with private_cluster(request, StorageControlPlane(name, die_with_parent=True)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kube(cluster: StorageControlPlane) -> Iterator[KubeJSON]:
    with KubeJSON(cluster.kubeconfig) as client:
        yield client


def pvc_body(name: str, size: str, data_source: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # No storageClassName: the default class must be picked up.
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}},
    }
    if data_source:
        spec["dataSource"] = data_source
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": spec,
    }


def create_bound_pvc(
    kube: KubeJSON, namespace: str, name: str, size: str, data_source: dict[str, str] | None = None
) -> tuple[dict[str, Any], float]:
    """Create a PVC and wait until it is Bound; the PV and the seconds it took."""
    began = time.monotonic()
    kube.create(core_path("persistentvolumeclaims", namespace), pvc_body(name, size, data_source))

    def bound() -> bool:
        pvc = kube.read(core_path("persistentvolumeclaims", namespace, name))
        phase: object = pvc.get("status", {}).get("phase")
        return phase == "Bound"

    wait_for(bound, f"PVC {namespace}/{name} to be Bound")
    took = time.monotonic() - began
    pvc = kube.read(core_path("persistentvolumeclaims", namespace, name))
    pv = kube.read(core_path("persistentvolumes", None, pvc["spec"]["volumeName"]))
    return pv, took


def volume_dir(cluster: StorageControlPlane, pv: dict[str, Any]) -> Path:
    assert pv["spec"]["csi"]["driver"] == storage.DRIVER_NAME
    handle: str = pv["spec"]["csi"]["volumeHandle"]
    path = cluster.storage.data_dir / "volumes" / handle
    assert path.is_dir(), f"the driver has no directory for {pv['metadata']['name']}"
    return path


def write_data(directory: Path, size: int) -> str:
    """Random data (incompressible, like real workspaces' binaries) in a few
    files, a subdirectory and a symlink; returns a digest of the tree."""
    (directory / "sub").mkdir()
    chunk = 4 * MIB
    with (directory / "sub" / "big.bin").open("wb") as handle:
        left = size
        while left > 0:
            handle.write(os.urandom(min(chunk, left)))
            left -= chunk
    (directory / "small.txt").write_text("hello\n")
    os.chmod(directory / "small.txt", 0o640)
    os.chown(directory / "small.txt", 1000, 1000)
    (directory / "link").symlink_to("sub/big.bin")
    return tree_digest(directory)


def tree_digest(directory: Path) -> str:
    """Names, modes, owners, symlink targets and contents of a directory tree."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        stat = path.lstat()
        digest.update(
            f"{path.relative_to(directory)} {stat.st_mode:o} {stat.st_uid}:{stat.st_gid}\n".encode()
        )
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            with path.open("rb") as handle:
                while block := handle.read(MIB):
                    digest.update(block)
    return digest.hexdigest()


def snapshot_body(name: str, pvc: str) -> dict[str, Any]:
    # No class: the default VolumeSnapshotClass must be picked up.
    return {
        "apiVersion": SNAPSHOTS,
        "kind": "VolumeSnapshot",
        "metadata": {"name": name},
        "spec": {"source": {"persistentVolumeClaimName": pvc}},
    }


def gone(kube: KubeJSON, path: str) -> Callable[[], bool]:
    return lambda: kube.get(path) is None


def wait_snapshot_ready(
    kube: KubeJSON, cluster: ControlPlane, path: str, timeout: float = WAIT
) -> float:
    """Wait for a VolumeSnapshot to be readyToUse; an error in its status fails
    at once, a timeout fails with what the snapshot chain shows (the
    snapshot's and its content's status, which sidecars run, their last log
    lines): a hang under load must be diagnosable from the CI log alone."""

    def ready() -> bool:
        status = kube.read(path).get("status") or {}
        assert not status.get("error"), status
        return status.get("readyToUse") is True

    try:
        return wait_for(ready, f"{path} to be readyToUse", timeout=timeout)
    except pytest.fail.Exception as failure:
        raise AssertionError(f"{failure}\n{snapshot_diagnosis(kube, cluster, path)}") from None


def snapshot_diagnosis(kube: KubeJSON, cluster: ControlPlane, path: str) -> str:
    status = (kube.get(path) or {}).get("status") or {}
    lines = [f"VolumeSnapshot status: {json.dumps(status)}"]
    content_name = status.get("boundVolumeSnapshotContentName")
    if content_name:
        content = kube.get(api_path(SNAPSHOTS, "volumesnapshotcontents", None, content_name))
        lines.append(f"VolumeSnapshotContent status: {json.dumps((content or {}).get('status'))}")
    lines.append(f"running components: {sorted(cluster.pids())}")
    for name in (storage.SNAPSHOT_CONTROLLER, storage.SNAPSHOTTER, storage.DRIVER):
        log = cluster.logs_dir / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else ["(no log)"]
        lines += [f"--- {log}", *tail]
    return "\n".join(lines)


def test_components_ready_and_objects_installed(
    cluster: StorageControlPlane, kube: KubeJSON
) -> None:
    status = cluster.status()
    names = [component.name for component in status.components]
    assert names[-4:] == [
        storage.DRIVER,
        storage.PROVISIONER,
        storage.SNAPSHOT_CONTROLLER,
        storage.SNAPSHOTTER,
    ]
    assert status.healthy, status
    driver = kube.read(api_path("storage.k8s.io/v1", "csidrivers", None, storage.DRIVER_NAME))
    assert driver["spec"]["attachRequired"] is False
    sc = kube.read(api_path("storage.k8s.io/v1", "storageclasses", None, storage.STORAGE_CLASS))
    assert sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    assert sc["provisioner"] == storage.DRIVER_NAME
    assert sc["volumeBindingMode"] == "Immediate"
    vsc = kube.read(api_path(SNAPSHOTS, "volumesnapshotclasses", None, storage.SNAPSHOT_CLASS))
    assert (
        vsc["metadata"]["annotations"]["snapshot.storage.kubernetes.io/is-default-class"] == "true"
    )
    assert vsc["driver"] == storage.DRIVER_NAME
    assert vsc["deletionPolicy"] == "Delete"


@pytest.mark.parametrize(
    ("user", "verb", "resource", "allowed"),
    [
        ("csi-provisioner", "create", "persistentvolumes", True),
        ("csi-provisioner", "update", "persistentvolumeclaims", True),
        ("csi-provisioner", "get", "secrets", False),
        ("csi-provisioner", "create", "pods", False),
        ("csi-provisioner", "create", "volumesnapshotcontents.snapshot.storage.k8s.io", False),
        ("snapshot-controller", "create", "volumesnapshotcontents.snapshot.storage.k8s.io", True),
        ("snapshot-controller", "create", "persistentvolumes", False),
        (
            "csi-snapshotter",
            "update",
            "volumesnapshotcontents.snapshot.storage.k8s.io/status",
            True,
        ),
        ("csi-snapshotter", "delete", "persistentvolumes", False),
        ("csi-snapshotter", "list", "secrets", False),
    ],
)
def test_sidecars_run_with_least_privilege(
    cluster: StorageControlPlane, user: str, verb: str, resource: str, allowed: bool
) -> None:
    """Each sidecar is its own user, bound only to upstream's ClusterRole for it."""
    subresource = ""
    if "/" in resource:
        resource, subresource = resource.split("/", 1)
    args = ["auth", "can-i", verb, resource, f"--as=devcluster:{user}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    result = kubectl(cluster, *args)
    assert result.stdout.strip() == ("yes" if allowed else "no"), result


@pytest.mark.parametrize("size", [10 * MIB, 1024 * MIB], ids=["10MiB", "1GiB"])
def test_provision_snapshot_restore_delete(
    cluster: StorageControlPlane, kube: KubeJSON, namespace: str, size: int
) -> None:
    timings: dict[str, float] = {}
    pv, timings["provision"] = create_bound_pvc(kube, namespace, "source", "2Gi")
    assert pv["spec"]["storageClassName"] == storage.STORAGE_CLASS
    source = volume_dir(cluster, pv)
    expected = write_data(source, size)

    began = time.monotonic()
    kube.create(api_path(SNAPSHOTS, "volumesnapshots", namespace), snapshot_body("snap", "source"))
    snapshot_path = api_path(SNAPSHOTS, "volumesnapshots", namespace, "snap")

    wait_snapshot_ready(kube, cluster, snapshot_path, timeout=300)
    timings["snapshot_ready"] = time.monotonic() - began
    snapshot = kube.read(snapshot_path)
    # The driver reports the source volume's capacity as the snapshot size.
    assert snapshot["status"]["restoreSize"] == "2Gi"
    content_name = snapshot["status"]["boundVolumeSnapshotContentName"]
    content = kube.read(api_path(SNAPSHOTS, "volumesnapshotcontents", None, content_name))
    handle = content["status"]["snapshotHandle"]
    tar = cluster.storage.data_dir / "snapshots" / f"{handle}.tar"
    assert tar.is_file()
    assert tar.stat().st_size >= size

    # The source changes after the snapshot; the restore must not see that.
    (source / "small.txt").write_text("changed after the snapshot\n")
    restored_pv, timings["restore"] = create_bound_pvc(
        kube,
        namespace,
        "restored",
        "2Gi",
        {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"},
    )
    assert tree_digest(volume_dir(cluster, restored_pv)) == expected

    # Delete policy: deleting the VolumeSnapshot removes its content object
    # and the driver's tar file.
    kube.delete(snapshot_path)
    wait_for(gone(kube, snapshot_path), "the VolumeSnapshot to be deleted")
    wait_for(
        gone(kube, api_path(SNAPSHOTS, "volumesnapshotcontents", None, content_name)),
        "the VolumeSnapshotContent to be deleted",
    )
    wait_for(lambda: not tar.exists(), "the driver to delete the snapshot data")
    # The restored volume does not depend on the snapshot.
    assert tree_digest(volume_dir(cluster, restored_pv)) == expected

    # Reclaim policy Delete: deleting the claims removes PVs and directories.
    restored_dir = volume_dir(cluster, restored_pv)
    for claim, volume in (("source", pv), ("restored", restored_pv)):
        kube.delete(core_path("persistentvolumeclaims", namespace, claim))
        wait_for(
            gone(kube, core_path("persistentvolumes", None, volume["metadata"]["name"])),
            "the PV to be deleted",
        )
    assert not source.exists()
    assert not restored_dir.exists()
    print(
        f"\nstorage timings for {size // MIB} MiB: "
        + json.dumps({k: round(v, 2) for k, v in timings.items()})
    )


def test_clone_from_pvc(cluster: StorageControlPlane, kube: KubeJSON, namespace: str) -> None:
    pv, _ = create_bound_pvc(kube, namespace, "origin", "1Gi")
    expected = write_data(volume_dir(cluster, pv), MIB)
    clone, _ = create_bound_pvc(
        kube, namespace, "clone", "1Gi", {"kind": "PersistentVolumeClaim", "name": "origin"}
    )
    assert tree_digest(volume_dir(cluster, clone)) == expected


def fill(path: Path, limit: int) -> tuple[int, int | None]:
    """Write 1 MiB blocks (synced) until `limit` or an error; bytes written
    and the errno that stopped it (None when the limit did)."""
    written = 0
    block = os.urandom(MIB)
    with path.open("wb", buffering=0) as handle:  # unbuffered: close() has nothing left to fail on
        try:
            while written < limit:
                handle.write(block)
                os.fsync(handle.fileno())
                written += MIB
        except OSError as error:
            return written, error.errno
    return written, None


def test_a_volume_holds_its_size_and_no_more(
    cluster: StorageControlPlane, kube: KubeJSON, namespace: str
) -> None:
    """Each volume is a filesystem of its requested size: writing past it
    fails with ENOSPC (not the node's disk filling up), statfs reports the
    size, freed space can be written again, and the node's disk holds only
    what was written (a sparse image)."""
    pv, _ = create_bound_pvc(kube, namespace, "small", "64Mi")
    directory = volume_dir(cluster, pv)
    assert os.path.ismount(directory)
    assert list(directory.iterdir()) == []  # no lost+found in a new workspace
    fs = os.statvfs(directory)
    assert 48 * MIB <= fs.f_blocks * fs.f_frsize <= 64 * MIB
    assert fs.f_bavail * fs.f_frsize > 40 * MIB

    written, error = fill(directory / "fill.bin", 128 * MIB)
    assert error == errno.ENOSPC, os.strerror(error or 0)
    assert written < 64 * MIB
    image = cluster.storage.data_dir / "volumes" / f"{directory.name}.img"
    assert image.stat().st_size == 64 * MIB
    assert image.stat().st_blocks * 512 < 80 * MIB

    (directory / "fill.bin").unlink()
    (directory / "after.txt").write_bytes(os.urandom(8 * MIB))

    # A volume found unmounted (as after a node reboot) is mounted again,
    # with its data, by the next call that needs it: here a snapshot.
    subprocess.run(["umount", str(directory)], check=True)
    assert not (directory / "after.txt").exists()
    kube.create(
        api_path(SNAPSHOTS, "volumesnapshots", namespace), snapshot_body("of-small", "small")
    )
    path = api_path(SNAPSHOTS, "volumesnapshots", namespace, "of-small")
    wait_snapshot_ready(kube, cluster, path)
    assert (directory / "after.txt").stat().st_size == 8 * MIB

    kube.delete(core_path("persistentvolumeclaims", namespace, "small"))
    wait_for(
        gone(kube, core_path("persistentvolumes", None, pv["metadata"]["name"])),
        "the PV to be deleted",
    )
    assert not directory.exists()
    assert not image.exists()
    assert str(directory) not in Path("/proc/self/mountinfo").read_text()


def test_snapshot_of_missing_claim_reports_error(
    cluster: StorageControlPlane, kube: KubeJSON, namespace: str
) -> None:
    """A snapshot that cannot be taken says so in its status (it does not hang silently)."""
    kube.create(
        api_path(SNAPSHOTS, "volumesnapshots", namespace), snapshot_body("orphan", "no-such-claim")
    )
    path = api_path(SNAPSHOTS, "volumesnapshots", namespace, "orphan")

    def has_error() -> bool:
        status = kube.read(path).get("status") or {}
        return bool(status.get("error", {}).get("message"))

    wait_for(has_error, "an error in the VolumeSnapshot's status")
    assert kube.read(path)["status"].get("readyToUse") is not True


def test_without_snapshot_support_and_stop_removes_everything() -> None:
    """The "no snapshot support" cluster: no VolumeSnapshot API, a driver
    without the capability, no snapshot sidecars; provisioning still works.
    With a kubelet root dir the registrar serves the plugin registration
    socket there (no kubelet here to register with). Then: stop leaves no
    process, socket or data behind."""
    # Short: unix socket paths are limited to 107 bytes.
    kubelet_root = Path(tempfile.mkdtemp(prefix="kubelet-"))
    cluster = start_cluster(
        f"pytest-nosnap-{os.getpid()}", snapshots=False, kubelet_root_dir=kubelet_root
    )
    registration = storage.registration_socket(kubelet_root)
    try:
        names = [component.name for component in cluster.status().components]
        assert names[-3:] == [storage.DRIVER, storage.REGISTRAR, storage.PROVISIONER]
        assert probes.unix_socket_accepts(registration)
        driver_log = (cluster.logs_dir / f"{storage.DRIVER}.log").read_text()
        assert "snapshots false" in driver_log
        with KubeJSON(cluster.kubeconfig) as kube:
            with pytest.raises(ApiError) as raised:
                kube.list(api_path(SNAPSHOTS, "volumesnapshots", "default"))
            assert raised.value.status == 404
            assert kube.get(api_path(SNAPSHOTS, "volumesnapshotclasses")) is None
            pv, _ = create_bound_pvc(kube, "default", "plain", "1Gi")
            data = volume_dir(cluster, pv)
            write_data(data, MIB)
        records = [processes.ProcessRecord.load(path) for path in cluster.run_dir.glob("*.json")]
        assert {storage.DRIVER, storage.REGISTRAR} <= {record.name for record in records}
        assert cluster.storage.socket.exists()
    finally:
        cluster.stop()
        registration_left = registration.exists()
        shutil.rmtree(kubelet_root, ignore_errors=True)
    assert not any(record.is_running() for record in records)
    assert not cluster.storage.root.exists()
    assert not data.exists()
    assert not registration_left
    cluster.stop(remove_state=True)
    assert not cluster.state_dir.exists()


def test_driver_passes_csi_sanity(tmp_path: Path) -> None:
    """Upstream's CSI conformance suite against the in-repo driver, node
    service included (bind mounts into a scratch dir, as root)."""
    binary = storage.storage_binaries()[storage.DRIVER]
    sanity = storage.csi_sanity_binary()
    socket_path = tmp_path / "csi.sock"
    popen, record = processes.launch(
        "sanity-driver",
        [
            str(binary),
            f"--endpoint=unix://{socket_path}",
            "--nodeid=sanity-node",
            f"--datadir={tmp_path / 'data'}",
        ],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        log_path=tmp_path / "driver.log",
        cwd=tmp_path,
        ports=[],
        die_with_parent=True,
    )
    try:
        wait_for(lambda: probes.unix_socket_accepts(socket_path), "the driver's socket", 30)
        result = subprocess.run(
            [
                str(sanity),
                f"--csi.endpoint=unix://{socket_path}",
                f"--csi.mountdir={tmp_path / 'target'}",
                f"--csi.stagingdir={tmp_path / 'staging'}",
                "--ginkgo.no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        processes.terminate(record, grace=5.0, popen=popen)
    summary = [line for line in result.stdout.splitlines() if "Passed" in line or "FAIL" in line]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert any("0 Failed" in line for line in summary), summary
    # Nothing the suite published is left mounted.
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(tmp_path) not in mounts


NODE_IMAGE = "sandbox-runtime-nopython:dev"  # /bin/sh, UID 1000


def run_to_completion(kube: KubeJSON, namespace: str, name: str, timeout: float = WAIT) -> str:
    """Wait for a pod to finish; its phase."""
    path = core_path("pods", namespace, name)
    phase = ""

    def finished() -> bool:
        nonlocal phase
        phase = (kube.read(path).get("status") or {}).get("phase", "")
        return phase in ("Succeeded", "Failed")

    wait_for(finished, f"pod {name} to finish", timeout)
    return phase


def csi_mounts(under: Path) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(str(under)) and "kubernetes.io~csi" in line
    ]


@pytest.mark.e2e
def test_pod_mounts_volume_and_snapshot_restores_into_pod() -> None:
    """On a real node (LocalCluster + StorageAddon): the registrar registers
    the driver with the kubelet, a pod of a non-root user writes to a
    provisioned volume (fsGroup applied), a snapshot of it restores into a
    second pod (read-only mount), unmounts follow pod deletion, and stop
    leaves no mount or state behind."""
    cluster = LocalCluster(
        f"s{os.getpid()}",
        images=[NODE_IMAGE],
        addons=[storage.StorageAddon()],
        die_with_parent=True,
    )
    try:
        cluster.start()
    except ControlPlaneError as error:
        pytest.fail(f"node cluster with storage did not start: {error}", pytrace=False)
    try:
        with KubeJSON(cluster.kubeconfig) as kube:
            csinode = api_path("storage.k8s.io/v1", "csinodes", None, cluster.node_name)

            def registered() -> bool:
                drivers = ((kube.get(csinode) or {}).get("spec") or {}).get("drivers") or []
                return any(driver.get("name") == storage.DRIVER_NAME for driver in drivers)

            wait_for(registered, "the kubelet to register the driver (CSINode)")
            assert storage.StorageLayout.of(cluster).registration_confirmed()

            kube.create(core_path("persistentvolumeclaims", "default"), pvc_body("data", "1Gi"))
            kube.create(
                core_path("pods", "default"),
                pod_body(
                    "writer",
                    "data",
                    "echo written-in-pod > /data/hello.txt && stat -c %g /data && sleep 600",
                    fs_group=2000,
                ),
            )
            path = core_path("pods", "default", "writer")
            wait_for(
                lambda: (kube.read(path).get("status") or {}).get("phase") == "Running",
                "the writer pod to run",
            )
            pv_name = kube.read(core_path("persistentvolumeclaims", "default", "data"))["spec"][
                "volumeName"
            ]
            pv = kube.read(core_path("persistentvolumes", None, pv_name))
            handle: str = pv["spec"]["csi"]["volumeHandle"]
            volume = storage.StorageLayout.of(cluster).data_dir / "volumes" / handle
            wait_for(lambda: (volume / "hello.txt").exists(), "the pod's write in the volume")
            assert (volume / "hello.txt").read_text() == "written-in-pod\n"
            assert volume.stat().st_gid == 2000  # fsGroupPolicy: File
            assert len(csi_mounts(cluster.state_dir)) == 1

            kube.create(
                api_path(SNAPSHOTS, "volumesnapshots", "default"), snapshot_body("snap", "data")
            )
            snapshot = api_path(SNAPSHOTS, "volumesnapshots", "default", "snap")
            wait_snapshot_ready(kube, cluster, snapshot)
            source = {
                "apiGroup": "snapshot.storage.k8s.io",
                "kind": "VolumeSnapshot",
                "name": "snap",
            }
            kube.create(
                core_path("persistentvolumeclaims", "default"), pvc_body("restored", "1Gi", source)
            )
            kube.create(
                core_path("pods", "default"),
                pod_body("reader", "restored", "cat /data/hello.txt", read_only=True),
            )
            assert run_to_completion(kube, "default", "reader") == "Succeeded"
            logs = kubectl(cluster, "logs", "reader", check=True)
            assert logs.stdout == "written-in-pod\n"

            for pod in ("writer", "reader"):
                kube.delete(core_path("pods", "default", pod) + "?gracePeriodSeconds=0")
            for pod in ("writer", "reader"):
                wait_for(gone(kube, core_path("pods", "default", pod)), f"pod {pod} to be deleted")
            wait_for(lambda: not csi_mounts(cluster.state_dir), "the kubelet to unpublish")
    finally:
        cluster.stop(remove_state=True)
    assert not cluster.state_dir.exists()
    assert not [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(cluster.state_dir) in line
    ]


def pod_body(
    name: str, claim: str, script: str, *, fs_group: int | None = None, read_only: bool = False
) -> dict[str, Any]:
    security: dict[str, Any] = {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}
    if fs_group is not None:
        security["fsGroup"] = fs_group
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": security,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": NODE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": read_only}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }
