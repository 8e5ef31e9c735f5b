"""CSI storage with snapshots for the local cluster: a hostpath driver and the
upstream sidecars, all as host processes.

- `storage_binaries()` builds (or reuses) everything: the external-provisioner
  and the external-snapshotter's snapshot-controller and csi-snapshotter from
  their upstream Go modules at the versions pinned in versions.py, and the
  hostpath driver and the kubelet registrar from devcluster/csi/ (the module
  proxy reachable here refuses every version of
  github.com/kubernetes-csi/csi-driver-host-path and node-driver-registrar).
  The VolumeSnapshot CRDs (from the external-snapshotter client module) and
  the sidecars' upstream RBAC rules are copied beside the binaries.
- `storage_components(cluster, ports, certs, binaries, node_name=...,
  kubelet_root_dir=...)` returns the `Component`s to append to a cluster's
  components: driver, registrar (only with a kubelet), provisioner,
  snapshot-controller, csi-snapshotter.
- `install_storage_objects(kubeconfig)` applies the CRDs, the CSIDriver, the
  default StorageClass and VolumeSnapshotClass and the sidecars' RBAC. The
  driver component runs it as its post-start hook (once the driver serves,
  before the first sidecar starts): the sidecars need their RBAC, and
  snapshot-controller exits if the CRDs do not appear within 30 s.
- `StorageAddon`: the same as an addon of `devcluster.cluster.LocalCluster`
  (`LocalCluster(addons=[StorageAddon()])`): node name and kubelet root dir
  come from the cluster.
- `StorageControlPlane`: a `ControlPlane` with the storage components, for
  the control-plane tier (no kubelet: provisioning and snapshots work, mounts
  need the node tier).

Everything lives under `<state dir>/storage/`: the driver's data (volume
directories, snapshot tar files, its state.json), the CSI socket, sidecar
credentials. The driver's cleanup hook removes that directory once every
storage process is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devcluster import build, mounts, pki, probes, records, versions
from devcluster.controlplane import (
    Component,
    ControlPlane,
    ControlPlaneError,
    free_ports,
    run_kubectl,
)
from devcluster.state import Ports

DRIVER_NAME = "hostpath.csi.k8s.io"
"""The upstream hostpath driver's name, so manifests written for it work here."""
STORAGE_CLASS = "csi-hostpath-sc"
SNAPSHOT_CLASS = "csi-hostpath-snapclass"
DEFAULT_NODE_NAME = "devcluster-node"

# Component names (also their log file names and PID record names).
DRIVER = "csi-hostpathplugin"
REGISTRAR = "csi-node-driver-registrar"
PROVISIONER = "csi-provisioner"
SNAPSHOT_CONTROLLER = "snapshot-controller"
SNAPSHOTTER = "csi-snapshotter"

# RPC timeout of the sidecars towards the driver. Creating a volume from a
# snapshot and taking a snapshot copy all the data (tar) inside the call; the
# default 10 s (provisioner) would time out on a GiB and retry needlessly.
_CSI_TIMEOUT = "300s"
# Failed operations back off up to this; upstream's 5 min would stall tests.
_RETRY_MAX = "30s"
# A unix socket path must fit sockaddr_un.sun_path (108 bytes incl. NUL).
_MAX_SOCKET_PATH = 107

_CSI_SOURCE = Path(__file__).resolve().parent / "csi"
_SIDECAR_ROLES = {
    # user (client certificate CN) -> upstream ClusterRole it is bound to
    PROVISIONER: "external-provisioner-runner",
    SNAPSHOT_CONTROLLER: "snapshot-controller-runner",
    SNAPSHOTTER: "external-snapshotter-runner",
}
_CRD_FILES = (
    "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
    "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
    "snapshot.storage.k8s.io_volumesnapshots.yaml",
)


class StorageError(ControlPlaneError):
    """Building, configuring or installing the storage stack failed; says why."""


# ---- binaries -------------------------------------------------------------------


def _driver_requires() -> dict[str, str]:
    return {
        "github.com/container-storage-interface/spec": versions.CSI_SPEC,
        "google.golang.org/grpc": versions.CSI_GRPC,
        "google.golang.org/protobuf": versions.CSI_PROTOBUF,
        # Plugin registration API of the kubelet (pkg/apis/pluginregistration).
        "k8s.io/kubelet": versions.KUBERNETES_STAGING,
    }


@dataclass(frozen=True)
class _UpstreamBuild:
    """Commands of one upstream sidecar module, named like their components."""

    name: str
    module: str
    version: str
    commands: tuple[str, ...]
    local_replaces: Mapping[str, str] = field(default_factory=dict)

    def binaries(self, *, build_missing: bool) -> dict[str, Path]:
        return build.go_module_binaries(
            self.name,
            self.module,
            self.version,
            [f"{self.module}/cmd/{command}" for command in self.commands],
            local_replaces=self.local_replaces,
            ldflags=f"-s -w -X main.version={self.version}",
            build_missing=build_missing,
        )


_UPSTREAM = (
    _UpstreamBuild(
        "csi-snapshotter",
        versions.CSI_SNAPSHOTTER_MODULE,
        versions.CSI_SNAPSHOTTER,
        (SNAPSHOT_CONTROLLER, SNAPSHOTTER),
        # Its go.mod points the client module at ./client, a nested module
        # that is not part of the module zip: use the client's own tag.
        {versions.CSI_SNAPSHOTTER_CLIENT_MODULE: versions.CSI_SNAPSHOTTER_CLIENT},
    ),
    _UpstreamBuild(
        "csi-provisioner", versions.CSI_PROVISIONER_MODULE, versions.CSI_PROVISIONER, (PROVISIONER,)
    ),
)


def manifests_dir() -> Path:
    """CRD and RBAC YAMLs copied from the pinned modules (by `storage_binaries`)."""
    return (
        build.cache_root()
        / "bin"
        / f"csi-manifests-{versions.CSI_SNAPSHOTTER}-{versions.CSI_PROVISIONER}"
    )


def storage_binaries(*, build_missing: bool = True) -> dict[str, Path]:
    """The storage binaries by component name, building the missing ones
    (cold: a few minutes on 2 cores) and copying the manifests;
    `build_missing=False` only says where they are (or will be)."""
    own = build.go_source_binaries(
        "csi-devcluster",
        _CSI_SOURCE,
        _driver_requires(),
        ["hostpathplugin", "registrar"],
        ldflags=f"-s -w -X main.version=devcluster-{versions.KUBERNETES}",
        build_missing=build_missing,
    )
    found = {DRIVER: own["hostpathplugin"], REGISTRAR: own["registrar"]}
    for upstream in _UPSTREAM:
        found.update(upstream.binaries(build_missing=build_missing))
    if build_missing:
        _ensure_manifests()
    return found


def csi_sanity_binary() -> Path:
    """csi-sanity, upstream's CSI conformance suite (from csi-test), for
    testing the in-repo driver; built on first use, not by storage_binaries()."""
    module = versions.CSI_TEST_MODULE
    return build.go_module_binaries(
        "csi-sanity", module, versions.CSI_TEST, [f"{module}/cmd/csi-sanity"]
    )["csi-sanity"]


def _module_dir(module: str, version: str) -> Path:
    """The extracted module in the module cache (downloaded if missing)."""
    try:
        return Path(build.go_module_download(module, version)["Dir"])
    except RuntimeError as error:
        raise StorageError(str(error)) from error


def _ensure_manifests() -> None:
    """The CSI CRDs and RBAC manifests, copied from the modules once. CI's lanes
    start storage clusters side by side on a cold cache: one process copies,
    the others wait for it (the build lock) and then find the copy made."""
    target = manifests_dir()
    wanted = [
        *_CRD_FILES,
        "rbac-provisioner.yaml",
        "rbac-snapshotter.yaml",
        "rbac-snapshot-controller.yaml",
    ]
    if all((target / name).exists() for name in wanted):
        return
    with records.file_lock(build.cache_root() / f".{target.name}.lock"):
        if not all((target / name).exists() for name in wanted):
            _copy_manifests(target)


def _copy_manifests(target: Path) -> None:
    client = _module_dir(versions.CSI_SNAPSHOTTER_CLIENT_MODULE, versions.CSI_SNAPSHOTTER_CLIENT)
    snapshotter = _module_dir(versions.CSI_SNAPSHOTTER_MODULE, versions.CSI_SNAPSHOTTER)
    provisioner = _module_dir(versions.CSI_PROVISIONER_MODULE, versions.CSI_PROVISIONER)
    sources = {name: client / "config" / "crd" / name for name in _CRD_FILES}
    sources["rbac-provisioner.yaml"] = provisioner / "deploy/kubernetes/rbac.yaml"
    deploy = snapshotter / "deploy/kubernetes"
    sources["rbac-snapshotter.yaml"] = deploy / "csi-snapshotter/rbac-csi-snapshotter.yaml"
    sources["rbac-snapshot-controller.yaml"] = (
        deploy / "snapshot-controller/rbac-snapshot-controller.yaml"
    )
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, source in sources.items():
        shutil.copyfile(source, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


# ---- layout, ports, credentials --------------------------------------------------


@dataclass(frozen=True)
class StorageLayout:
    """Files of the storage stack of one cluster (all under `<state dir>/storage`)."""

    root: Path

    @classmethod
    def of(cls, cluster: ControlPlane) -> StorageLayout:
        return cls(cluster.state_dir / "storage")

    @property
    def data_dir(self) -> Path:
        """The driver's volumes/, snapshots/ and state.json."""
        return self.root / "data"

    @property
    def socket(self) -> Path:
        return self.root / "csi.sock"

    @property
    def ports_file(self) -> Path:
        return self.root / "ports.json"

    @property
    def registrar_status(self) -> Path:
        return self.root / "registrar.status"

    def registration_confirmed(self) -> bool:
        """Whether the kubelet confirmed the driver's registration (the
        registrar writes this file on NotifyRegistrationStatus)."""
        return self.registrar_status.exists()

    def kubeconfig(self, user: str) -> Path:
        return self.root / f"{user}.kubeconfig"

    @property
    def credentials_dir(self) -> Path:
        return self.root / "pki"


REGISTRATION_SOCKET_NAME = "hostpath-reg.sock"
"""Shorter than upstream's `<driver name>-reg.sock` (the kubelet takes any
name): the kubelet root dir of a node cluster is deep in the state dir, and
the whole path must fit the 107 bytes of a unix socket path."""


def registration_socket(kubelet_root_dir: Path) -> Path:
    """The registrar's socket, which the kubelet's plugin watcher picks up."""
    return kubelet_root_dir / "plugins_registry" / REGISTRATION_SOCKET_NAME


@dataclass(frozen=True)
class StoragePorts:
    """HTTP diagnostics (metrics) ports of the sidecars, also their readiness probes."""

    provisioner: int
    snapshot_controller: int
    snapshotter: int


@dataclass(frozen=True)
class _PortsRecord:
    """`ports.json`: the sidecars' ports and the API server port of the start
    that chose them."""

    apiserver: int
    sidecars: StoragePorts


def _storage_ports(layout: StorageLayout, ports: Ports) -> StoragePorts:
    """The sidecars' ports for this start of the cluster.

    Kept in a file keyed on the API server's port: components() is called
    again by stop() and status() and must then describe the same processes;
    a new start (new API server port, also after a port collision) chooses anew.
    """
    with contextlib.suppress(FileNotFoundError, ValueError):
        recorded = records.load(_PortsRecord, layout.ports_file)
        if recorded.apiserver == ports.apiserver:
            return recorded.sidecars
    chosen = StoragePorts(*free_ports(3))
    layout.root.mkdir(parents=True, exist_ok=True)
    records.save(_PortsRecord(ports.apiserver, chosen), layout.ports_file)
    return chosen


def user_name(component: str) -> str:
    """The user a sidecar authenticates as (its client certificate's CN), for RBAC."""
    return f"devcluster:{component}"


# ---- readiness and cleanup -----------------------------------------------------------


def remove_storage_state(layout: StorageLayout) -> None:
    """Remove the driver's data, sockets and credentials.

    Anything still mounted below the storage dir is unmounted first, so that
    the removal never reaches into another filesystem through a mount point.
    """
    for point in mounts.mount_points_under(layout.root):
        mounts.unmount(point)
    if mounts.mount_points_under(layout.root):
        raise StorageError(f"could not unmount everything below {layout.root}")
    shutil.rmtree(layout.root, ignore_errors=True)
    if layout.root.exists():
        raise StorageError(f"could not remove {layout.root}")


# ---- components ------------------------------------------------------------------------


def storage_components(
    cluster: ControlPlane,
    ports: Ports,
    certs: pki.PKI,
    binaries: Mapping[str, Path],
    *,
    node_name: str = DEFAULT_NODE_NAME,
    kubelet_root_dir: Path | None = None,
    snapshots: bool = True,
    install_objects: bool = True,
) -> list[Component]:
    """The storage processes of `cluster`, in start order, to append to its components.

    `ports`, `certs` and `binaries` are what `ControlPlane.components` gets
    (`binaries` must include `storage_binaries()`). `node_name` is the node id
    the driver reports (the kubelet's node name). `kubelet_root_dir` (the
    kubelet's --root-dir) adds the registrar, which registers the driver in
    `<root>/plugins_registry`; without a kubelet there is nothing to register
    with and volumes cannot be mounted, but provisioning and snapshots work.
    `snapshots=False` runs a driver without snapshot capability and neither
    snapshot sidecar, and installs no VolumeSnapshot CRDs (the "no snapshot
    support" cluster). `install_objects`: the driver's post-start hook
    applies `install_storage_objects` with the cluster's admin kubeconfig.

    Writes the sidecars' client certificates and kubeconfigs (idempotent).
    """
    layout = StorageLayout.of(cluster)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.root.chmod(0o700)
    if len(str(layout.socket)) > _MAX_SOCKET_PATH:
        raise StorageError(
            f"CSI socket path {layout.socket} is longer than a unix socket path may be; "
            "use a shorter SANDBOX_CACHE_DIR or cluster state dir"
        )
    sidecar_ports = _storage_ports(layout, ports)
    # The cluster's own idea of its address (a node tier may bind the API
    # server to a bridge address instead of loopback).
    server = cluster.server
    kubeconfigs: dict[str, Path] = {}
    users = [PROVISIONER, *((SNAPSHOT_CONTROLLER, SNAPSHOTTER) if snapshots else ())]
    # Each sidecar authenticates as its own user, bound by install_storage_objects
    # to the upstream ClusterRole of that sidecar: least privilege, as upstream
    # deploys them (minus the leader-election Role: leader election is off).
    layout.credentials_dir.mkdir(mode=0o700, exist_ok=True)
    for component in users:
        user = user_name(component)
        pair = pki.ensure_leaf(
            certs, user, pki.Leaf(user, client=True), directory=layout.credentials_dir
        )
        kubeconfigs[component] = layout.kubeconfig(component)
        pki.write_kubeconfig(
            kubeconfigs[component], server=server, ca=certs.ca.cert, user=pair, context=user
        )
    csi_address = str(layout.socket)

    components = [
        Component(
            name=DRIVER,
            argv=[
                str(binaries[DRIVER]),
                f"--endpoint=unix://{csi_address}",
                f"--drivername={DRIVER_NAME}",
                f"--nodeid={node_name}",
                f"--datadir={layout.data_dir}",
                f"--snapshots={'true' if snapshots else 'false'}",
            ],
            ready=lambda: probes.unix_socket_accepts(layout.socket),
            ready_timeout=30.0,
            post_start=(
                (lambda: install_storage_objects(cluster.kubeconfig, snapshots=snapshots))
                if install_objects
                else None
            ),
            # Started first, stopped last: by then no sidecar uses the data.
            cleanup=lambda: remove_storage_state(layout),
        )
    ]
    if kubelet_root_dir is not None:
        registration = registration_socket(kubelet_root_dir)
        if len(str(registration)) > _MAX_SOCKET_PATH:
            raise StorageError(
                f"registration socket path {registration} is longer than a unix socket "
                "path may be; use a shorter cluster name, state dir or SANDBOX_CACHE_DIR"
            )

        def remove_registration() -> None:
            registration.unlink(missing_ok=True)
            layout.registrar_status.unlink(missing_ok=True)

        components.append(
            Component(
                name=REGISTRAR,
                argv=[
                    str(binaries[REGISTRAR]),
                    f"--csi-address={csi_address}",
                    f"--kubelet-registration-path={csi_address}",
                    f"--plugin-registration-dir={registration.parent}",
                    f"--socket-name={registration.name}",
                    f"--status-file={layout.registrar_status}",
                ],
                # Serving the registration socket; the kubelet's confirmation
                # (registrar.status, CSINode) follows when the kubelet runs.
                ready=lambda: probes.unix_socket_accepts(registration),
                ready_timeout=60.0,
                cleanup=remove_registration,
            )
        )
    provisioner_argv = [
        str(binaries[PROVISIONER]),
        f"--csi-address={csi_address}",
        f"--kubeconfig={kubeconfigs[PROVISIONER]}",
        "--leader-election=false",
        f"--http-endpoint=127.0.0.1:{sidecar_ports.provisioner}",
        f"--timeout={_CSI_TIMEOUT}",
        f"--retry-interval-max={_RETRY_MAX}",
        # PVC name/namespace reach the driver's log as parameters.
        "--extra-create-metadata",
        "--v=2",
    ]
    components.append(
        Component(
            name=PROVISIONER,
            argv=provisioner_argv,
            # The metrics endpoint opens once the provisioner has connected to
            # the driver and learnt its name.
            ready=lambda: probes.http_ok(sidecar_ports.provisioner, "/metrics"),
            ready_timeout=120.0,
        )
    )
    if snapshots:
        components += [
            Component(
                name=SNAPSHOT_CONTROLLER,
                argv=[
                    str(binaries[SNAPSHOT_CONTROLLER]),
                    f"--kubeconfig={kubeconfigs[SNAPSHOT_CONTROLLER]}",
                    "--leader-election=false",
                    f"--http-endpoint=127.0.0.1:{sidecar_ports.snapshot_controller}",
                    f"--retry-interval-max={_RETRY_MAX}",
                    "--v=2",
                ],
                # Serves only after it found the VolumeSnapshot CRDs.
                ready=lambda: probes.http_ok(sidecar_ports.snapshot_controller, "/metrics"),
                ready_timeout=90.0,
            ),
            Component(
                name=SNAPSHOTTER,
                argv=[
                    str(binaries[SNAPSHOTTER]),
                    f"--csi-address={csi_address}",
                    f"--kubeconfig={kubeconfigs[SNAPSHOTTER]}",
                    "--leader-election=false",
                    f"--http-endpoint=127.0.0.1:{sidecar_ports.snapshotter}",
                    f"--timeout={_CSI_TIMEOUT}",
                    f"--retry-interval-max={_RETRY_MAX}",
                    "--extra-create-metadata",
                    "--v=2",
                ],
                ready=lambda: probes.http_ok(sidecar_ports.snapshotter, "/metrics"),
                ready_timeout=90.0,
            ),
        ]
    return components


# ---- cluster objects -----------------------------------------------------------------------


def _documents(path: Path) -> list[dict[str, object]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]


def _name_of(document: Mapping[str, object]) -> object:
    metadata = document.get("metadata")
    return metadata.get("name") if isinstance(metadata, dict) else None


def _cluster_roles(snapshots: bool) -> list[dict[str, object]]:
    """Upstream's ClusterRole of each sidecar, and a binding to its own user."""
    files = {
        PROVISIONER: "rbac-provisioner.yaml",
        SNAPSHOT_CONTROLLER: "rbac-snapshot-controller.yaml",
        SNAPSHOTTER: "rbac-snapshotter.yaml",
    }
    objects: list[dict[str, object]] = []
    for component, file in files.items():
        if not snapshots and component != PROVISIONER:
            continue
        role_name = _SIDECAR_ROLES[component]
        roles = [
            doc
            for doc in _documents(manifests_dir() / file)
            if doc.get("kind") == "ClusterRole" and _name_of(doc) == role_name
        ]
        if len(roles) != 1:
            raise StorageError(f"no ClusterRole {role_name} in {manifests_dir() / file}")
        objects.append(roles[0])
        objects.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": user_name(component)},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role_name,
                },
                "subjects": [
                    {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "User",
                        "name": user_name(component),
                    }
                ],
            }
        )
    return objects


def storage_objects(
    *, snapshots: bool = True, binding_mode: str = "Immediate"
) -> list[dict[str, object]]:
    """The cluster objects of the storage stack, CRDs excluded (pure; no I/O
    beyond reading the copied upstream RBAC YAMLs).

    The default StorageClass binds Immediately: on one node there is no
    placement for WaitForFirstConsumer to wait for, and Immediate lets a PVC
    be provisioned (and restored from a snapshot) without a pod or a
    scheduler, which the control-plane tier has neither of. A multi-node
    cluster would want WaitForFirstConsumer and topology instead.
    """
    objects: list[dict[str, object]] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": {"name": DRIVER_NAME},
            "spec": {
                # Volumes are directories on this node: nothing to attach.
                "attachRequired": False,
                "podInfoOnMount": False,
                "volumeLifecycleModes": ["Persistent"],
                # The kubelet applies a pod's fsGroup to the volume, so
                # non-root pods can write to a fresh volume.
                "fsGroupPolicy": "File",
            },
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": DRIVER_NAME,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": binding_mode,
            "allowVolumeExpansion": False,
        },
    ]
    if snapshots:
        objects.append(
            {
                "apiVersion": "snapshot.storage.k8s.io/v1",
                "kind": "VolumeSnapshotClass",
                "metadata": {
                    "name": SNAPSHOT_CLASS,
                    "annotations": {"snapshot.storage.kubernetes.io/is-default-class": "true"},
                },
                "driver": DRIVER_NAME,
                "deletionPolicy": "Delete",
            }
        )
    return objects + _cluster_roles(snapshots)


def _kubectl(kubectl: Path, kubeconfig: Path, args: list[str], stdin: str | None = None) -> str:
    return run_kubectl(kubectl, kubeconfig, args, stdin=stdin, error=StorageError)


def install_storage_objects(
    kubeconfig: Path,
    *,
    kubectl: Path | None = None,
    snapshots: bool = True,
    binding_mode: str = "Immediate",
) -> None:
    """Apply the VolumeSnapshot CRDs (unless `snapshots=False`), the CSIDriver,
    the default StorageClass and VolumeSnapshotClass and the sidecars' RBAC.

    Idempotent (server-side apply). `kubeconfig` must be allowed to create
    CRDs and RBAC (the cluster's admin). Needs `storage_binaries()` first
    (the YAMLs are copied from the Go modules by it).
    """
    kubectl = kubectl or build.kubernetes_paths()["kubectl"]
    apply = ["apply", "--server-side", "--force-conflicts", "--field-manager=devcluster-storage"]
    if snapshots:
        crds = "\n---\n".join((manifests_dir() / name).read_text() for name in _CRD_FILES)
        _kubectl(kubectl, kubeconfig, [*apply, "-f", "-"], stdin=crds)
        names = [
            f"crd/{name.split('_', 1)[1].removesuffix('.yaml')}.{name.split('_', 1)[0]}"
            for name in _CRD_FILES
        ]
        # Objects of a new kind can only be applied once the CRD is served.
        _kubectl(
            kubectl,
            kubeconfig,
            ["wait", "--for=condition=Established", "--timeout=60s", *names],
        )
    objects = storage_objects(snapshots=snapshots, binding_mode=binding_mode)
    _kubectl(kubectl, kubeconfig, [*apply, "-f", "-"], stdin=yaml.safe_dump_all(objects))


# ---- as a node addon ------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageAddon:
    """The storage stack as an addon of a node cluster
    (`LocalCluster(addons=[StorageAddon()])`, devcluster.cluster.NodeAddon):
    its node name is the driver's node id and its kubelet root dir gets the
    registrar. Works with a plain ControlPlane too (no registrar then)."""

    snapshots: bool = True
    install_objects: bool = True

    def binaries(self, *, build_missing: bool) -> dict[str, Path]:
        return storage_binaries(build_missing=build_missing)

    def components(
        self,
        cluster: ControlPlane,
        ports: Ports,
        certs: pki.PKI,
        binaries: Mapping[str, Path],
    ) -> list[Component]:
        node_name = getattr(cluster, "node_name", DEFAULT_NODE_NAME)
        kubelet_root = getattr(cluster, "kubelet_root_dir", None)
        return storage_components(
            cluster,
            ports,
            certs,
            binaries,
            node_name=str(node_name),
            kubelet_root_dir=Path(kubelet_root) if kubelet_root is not None else None,
            snapshots=self.snapshots,
            install_objects=self.install_objects,
        )


# ---- a control plane with storage ---------------------------------------------------------


class StorageControlPlane(ControlPlane):
    """`ControlPlane` plus the storage components (no kubelet: no registrar,
    no mounts). What LocalCluster does with `storage_components`, minus the node."""

    def __init__(
        self,
        name: str,
        *,
        node_name: str = DEFAULT_NODE_NAME,
        kubelet_root_dir: Path | None = None,
        snapshots: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        self.node_name = node_name
        self.kubelet_root_dir = kubelet_root_dir
        self.snapshots = snapshots

    @property
    def storage(self) -> StorageLayout:
        return StorageLayout.of(self)

    def binaries(self, *, build_missing: bool) -> dict[str, Path]:
        return {
            **super().binaries(build_missing=build_missing),
            **storage_binaries(build_missing=build_missing),
        }

    def components(
        self, ports: Ports, certs: pki.PKI, binaries: Mapping[str, Path]
    ) -> list[Component]:
        return super().components(ports, certs, binaries) + storage_components(
            self,
            ports,
            certs,
            binaries,
            node_name=self.node_name,
            kubelet_root_dir=self.kubelet_root_dir,
            snapshots=self.snapshots,
        )


# ---- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devcluster.storage")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("build", help="build (or reuse) the storage binaries and print their paths")
    install = sub.add_parser(
        "install", help="apply the storage objects (CRDs, classes, RBAC) to a cluster"
    )
    install.add_argument("--kubeconfig", required=True, type=Path, help="an admin kubeconfig")
    install.add_argument("--no-snapshots", action="store_true", help="no CRDs, no snapshot class")
    args = parser.parse_args(argv)
    if args.action == "install":
        storage_binaries()  # the manifests come with the build
        install_storage_objects(args.kubeconfig, snapshots=not args.no_snapshots)
    else:
        for name, path in storage_binaries().items():
            print(f"{name}\t{path}")


if __name__ == "__main__":
    main()
