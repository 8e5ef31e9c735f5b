"""A real single-node Kubernetes cluster on this machine: `LocalCluster`.

The control plane of `ControlPlane` (etcd, kube-apiserver,
kube-controller-manager) plus kube-scheduler, a private containerd (Debian's
1.6, with runc and the CRI plugin), CNI bridge networking and a kubelet, all
as host processes with their state under the cluster's state dir. Pods run
for real, from images built locally (`devcluster.images`).

Addresses: every node cluster has its own pod bridge and /24
(`devcluster.network`), and the matching /24 of 10.96.0.0/16 for its
Services. The bridge's address (the pods' gateway) is where kube-apiserver
listens (instead of 127.0.0.1) and what it advertises, so the `kubernetes`
Service's endpoints are reachable from pods. The node's InternalIP is that
address too, and the kubelet serves on it. kube-proxy makes every ClusterIP
(the `kubernetes` Service's included) work from pods and from this machine,
CoreDNS resolves Service names, kube-network-policies enforces
NetworkPolicy (`devcluster.netstack`). The serving certificate has the
bridge address and the first Service IP in its SANs.

Start order: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
containerd (then the images are imported), kubelet (ready once its Node is
Ready), kube-proxy (then the CoreDNS objects are applied),
kube-network-policies (then CoreDNS is waited for), then any addons (CSI
storage). Stop runs that backwards, and then removes what processes leave
behind: pod sandboxes through CRI (CNI DEL: veths, IPAM, portmap rules),
shims and container processes, mounts under the state dir, the bridge,
iptables rules, nftables tables, cgroups, the kubelet's kernel settings
(restored), and the node's state dirs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import yaml

from devcluster import (
    build,
    gvisor,
    hostdeps,
    mounts,
    netbuild,
    netstack,
    network,
    pki,
    probes,
    processes,
    records,
    versions,
)
from devcluster import images as imagelib
from devcluster.controlplane import (
    Component,
    ControlPlane,
    ControlPlaneError,
    free_ports,
    loopback_controller,
)
from devcluster.state import LOOPBACK, NodePorts, Ports, clusters_root

log = logging.getLogger("devcluster.cluster")

DEFAULT_NODE_CLUSTER = "local"
# The kubelet's podPidsLimit: the most processes and threads (tasks) all
# containers of one pod may have together, enforced by pids.max on the pod's
# cgroup. Sandboxes run code nobody reviewed, and without a limit one fork
# bomb takes every PID of the machine (kernel.pid_max is 32768 on these VMs,
# shared by every cluster and test run on it) and with them every other pod
# and the node itself. 2048 is well above what a sandbox's builds, test
# runners and language servers use at once (every thread counts), and a
# sixteenth of that pid_max, so one bomb leaves the node and the other pods
# their share. The agent sidecar shares the pod's budget: a bomb in the
# sandbox container leaves it none to start processes with until the bomb
# is killed.
POD_PIDS_LIMIT = 2048
# sockaddr_un.sun_path holds 108 bytes including the NUL.
_MAX_SOCKET_PATH = 107
# Set by the kubelet on start (setupKernelTunables) unless
# protectKernelDefaults makes it fail instead: there is no "leave alone".
# Recorded before the first node cluster starts, restored after the last stops.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)


class NodeAddon(Protocol):
    """Extra components of a node cluster (e.g. CSI storage), started after the
    kubelet and stopped before it. `LocalCluster(addons=[...])`."""

    def binaries(self, *, build_missing: bool) -> dict[str, Path]: ...

    def components(
        self,
        cluster: LocalCluster,
        ports: Ports,
        certs: pki.PKI,
        binaries: Mapping[str, Path],
    ) -> list[Component]: ...


def node_binaries(*, build_missing: bool) -> dict[str, Path]:
    """kube-scheduler and kubelet (the Kubernetes module wrapper of build.py)
    and crictl (its own Go module)."""
    kube = build.kubernetes_binaries(versions.KUBERNETES_NODE_COMMANDS, build_missing=build_missing)
    crictl = build.go_module_binaries(
        "cri-tools",
        "sigs.k8s.io/cri-tools",
        versions.CRI_TOOLS,
        ["sigs.k8s.io/cri-tools/cmd/crictl"],
        ldflags=f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version={versions.CRI_TOOLS}",
        build_missing=build_missing,
    )
    return {**kube, **crictl}


def _node_name(cluster: str) -> str:
    # Node names are DNS subdomains: no underscores, at most 63 here.
    return re.sub(r"[^a-z0-9.-]", "-", cluster.lower()).strip(".-")[:63] or "node"


class LocalCluster(ControlPlane):
    """A single-node cluster on this machine; see the module docstring.

    `images`: names of `devcluster.imagelib.IMAGES` imported into the node's
    containerd on start (built first if needed; the pause image always).
    Default: all of them (the pause and CoreDNS images always). After start:
    everything of `ControlPlane`, plus `node_name`, `pod_network` (subnet,
    gateway, bridge, service_subnet, dns_ip), `kubelet_root_dir`,
    `containerd_socket`, `crictl_command()`.
    """

    kind = "node"

    def __init__(
        self,
        name: str = DEFAULT_NODE_CLUSTER,
        *,
        images: Sequence[str] | None = None,
        addons: Sequence[NodeAddon] = (),
        node_name: str | None = None,
        state_dir: Path | None = None,
        die_with_parent: bool = False,
        stop_grace: float = 10.0,
        start_attempts: int = 3,
        apiserver_args: Sequence[str] = (),
    ) -> None:
        """See `ControlPlane` for the other arguments (`die_with_parent` for tests)."""
        super().__init__(
            name,
            state_dir=state_dir,
            die_with_parent=die_with_parent,
            stop_grace=stop_grace,
            start_attempts=start_attempts,
            apiserver_args=apiserver_args,
        )
        wanted = list(images) if images is not None else list(imagelib.IMAGES)
        unknown = [image for image in wanted if image not in imagelib.IMAGES]
        if unknown:
            raise ValueError(f"unknown images {unknown}; known: {list(imagelib.IMAGES)}")
        always = [imagelib.PAUSE, imagelib.COREDNS]
        self.image_names = [*always, *[i for i in wanted if i not in always]]
        self.addons = list(addons)
        self.node_name = node_name or _node_name(name)
        self.cgroup_root = f"/devcluster-{name}"
        self._seed: Path | None = None
        self.apiserver_args += [
            # The Node's Hostname address (the node name) resolves nowhere;
            # its InternalIP is the bridge address the kubelet serves on.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # ...with a serving certificate from the cluster CA: verify it.
            f"--kubelet-certificate-authority={pki.paths(self.pki_dir).ca.cert}",
        ]

    @staticmethod
    def images_all() -> list[str]:
        return list(imagelib.IMAGES)

    # ---- layout -----------------------------------------------------------------

    @property
    def node_dir(self) -> Path:
        """Everything of the node (removed on every stop): containerd, kubelet, CNI."""
        return self.state_dir / "node"

    @property
    def kubelet_root_dir(self) -> Path:
        return self.node_dir / "kubelet"

    @property
    def pod_logs_dir(self) -> Path:
        return self.node_dir / "pod-logs"

    @property
    def containerd_dir(self) -> Path:
        return self.node_dir / "containerd"

    @property
    def checkpoint_dir(self) -> Path:
        """The node's checkpoint store (sandbox-node's; memory images of paused pods)."""
        return self.node_dir / "checkpoints"

    @property
    def runsc_root(self) -> Path:
        """The shim's runsc root (runsc.toml's `root`)."""
        return self.containerd_dir / "runsc"

    @property
    def runsc_state_dir(self) -> Path:
        """Where runsc keeps the state of the CRI's sandboxes: the shim's root,
        per containerd namespace (`k8s.io`). sandbox-checkpoint and checkpointd
        are given this as their `--root`."""
        return self.runsc_root / "k8s.io"

    def checkpointd_values(self) -> list[str]:
        """The chart's checkpointd values for this node: its runsc (the build
        sandbox-runsc runs), the shim's runsc root, the checkpoint store."""
        runsc = gvisor.binaries(build_missing=False)["runsc"]
        return [
            "checkpointd.enabled=true",
            f"checkpointd.runsc={runsc}",
            f"checkpointd.runscRoot={self.runsc_state_dir}",
            f"checkpointd.store={self.checkpoint_dir}",
        ]

    @property
    def image_store_dir(self) -> Path:
        """containerd's root (content store, snapshots, metadata). Outside
        node_dir: kept across stops while no pod sandbox is recorded in it,
        so a restart need not import the images again (seconds per image)."""
        return self.state_dir / "containerd-root"

    @property
    def containerd_socket(self) -> Path:
        socket = self.containerd_dir / "containerd.sock"
        if len(str(socket)) + len(".ttrpc") > _MAX_SOCKET_PATH:
            # A long SANDBOX_CACHE_DIR: fall back to a short per-cluster path.
            return Path("/run/devcluster") / self.name / "containerd.sock"
        return socket

    @property
    def cni_conf_dir(self) -> Path:
        return self.node_dir / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.node_dir / "cni" / "ipam"

    @property
    def _network_record(self) -> Path:
        # In the state dir itself (not node/): kept across stops, so a
        # restarted cluster keeps its subnet and its certificates stay valid.
        return self.state_dir / "network.json"

    @property
    def pod_network(self) -> network.PodNetwork:
        try:
            return records.load(network.PodNetwork, self._network_record)
        except (FileNotFoundError, ValueError) as error:
            raise ControlPlaneError(f"cluster {self.name!r} has no pod network yet") from error

    @property
    def node_ports(self) -> NodePorts:
        return self._started(self.record.node_ports)

    def pod_cgroup(self, controller: str, uid: str) -> Path:
        """A pod's cgroup in one v1 hierarchy (the kubelet's cgroupfs layout:
        <cgroupRoot>/kubepods[/<qos class>]/pod<uid>); its containers' cgroups are
        its subdirectories, named by container ID."""
        hierarchy = mounts.cgroup_hierarchy(controller)
        if hierarchy is None:
            raise ControlPlaneError(f"no {controller} cgroup hierarchy on this host")
        found = list((hierarchy / self.cgroup_root.lstrip("/")).glob(f"kubepods/**/pod{uid}"))
        if len(found) != 1:
            raise ControlPlaneError(f"pod {uid}: {len(found)} {controller} cgroups: {found}")
        return found[0]

    def crictl_command(self, *args: str) -> list[str]:
        crictl = node_binaries(build_missing=False)["crictl"]
        endpoint = f"unix://{self.containerd_socket}"
        return [
            str(crictl),
            f"--runtime-endpoint={endpoint}",
            f"--image-endpoint={endpoint}",
            "--timeout=60s",
            *args,
        ]

    def kill_container(self, namespace: str, pod: str, container: str) -> str:
        """SIGKILL a container's processes through the node's CRI (`crictl stop
        --timeout 0`), as a crash would; the kubelet restarts it per the pod's
        restartPolicy. Returns the container's ID."""
        found = subprocess.run(
            self.crictl_command(
                "ps",
                "-q",
                "--name",
                f"^{container}$",
                "--label",
                f"io.kubernetes.pod.namespace={namespace}",
                "--label",
                f"io.kubernetes.pod.name={pod}",
            ),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.split()
        if len(found) != 1:
            raise ControlPlaneError(f"{namespace}/{pod} {container}: running containers {found}")
        subprocess.run(
            self.crictl_command("stop", "--timeout", "0", found[0]),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return found[0]

    # ---- build and start ----------------------------------------------------------

    def binaries(self, *, build_missing: bool) -> dict[str, Path]:
        found = {**super().binaries(build_missing=build_missing)}
        found.update(node_binaries(build_missing=build_missing))
        found.update(gvisor.binaries(build_missing=build_missing))
        found.update(netbuild.network_binaries(build_missing=build_missing))
        for addon in self.addons:
            found.update(addon.binaries(build_missing=build_missing))
        return found

    def start(self) -> None:
        """Install missing Debian packages, build what is missing (binaries,
        images: minutes when cold, outside the timed part), then start."""
        if os.geteuid() != 0:
            raise ControlPlaneError("a node cluster needs root (containerd, mounts, bridge)")
        if mounts.cgroup_hierarchy("pids") is None:
            # Better no node than one whose pods all fail to start (runc:
            # "cannot set pids limit") or whose PID limit is not there.
            raise ControlPlaneError(
                "the pids cgroup controller is not mounted on this host: the node's "
                f"per-pod PID limit ({POD_PIDS_LIMIT}) cannot be enforced"
            )
        hostdeps.ensure()
        hostdeps.raise_limits()
        built = [imagelib.ensure_built(imagelib.IMAGES[name]) for name in self.image_names]
        # A fresh image store starts as a clone of a seeded one (a second,
        # instead of importing every image); the seed is made once per set.
        self._seed = imagelib.ensure_seed(built)
        super().start()

    def _prepare_start(self) -> str:
        for directory in (
            self.kubelet_root_dir,
            self.pod_logs_dir,
            self.containerd_dir,
            self.cni_conf_dir,
            self.cni_ipam_dir,
            self.containerd_socket.parent,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        if not self.image_store_dir.exists() and self._seed is not None:
            began = time.monotonic()
            try:
                imagelib.clone_seed(self._seed, self.image_store_dir)
                log.info("image store cloned in %.1fs", time.monotonic() - began)
            except imagelib.ImageError as error:
                # E.g. a state dir on another filesystem (no hard links across):
                # containerd's post-start import fills the store instead.
                log.warning("image store not cloned, importing instead: %s", error)
        pod_net = network.allocate(self.name, self._network_record, clusters_root())
        # Before the API server's flags and serving certificate are made.
        self.service_cidr = str(pod_net.service_subnet)
        network.create_bridge(pod_net)
        network.enable_forwarding(pod_net)
        self._update_record(
            node_ports=NodePorts(*free_ports(6)),
            node_name=self.node_name,
            cgroup_root=self.cgroup_root,
        )
        (self.cni_conf_dir / "10-devcluster.conflist").write_text(
            json.dumps(pod_net.cni_config(self.cni_ipam_dir), indent=2) + "\n"
        )
        self._create_cgroup_root()
        _record_kernel_tunables()
        return pod_net.gateway

    def components(
        self, ports: Ports, certs: pki.PKI, binaries: Mapping[str, Path]
    ) -> list[Component]:
        """Control plane, then kube-scheduler, containerd, kubelet, kube-proxy,
        kube-network-policies, then addons."""
        with contextlib.suppress(ControlPlaneError):
            # Also when the list is made again to stop the cluster.
            self.service_cidr = str(self.pod_network.service_subnet)
        found = super().components(ports, certs, binaries)
        found += self.node_components(ports, certs, binaries)
        for addon in self.addons:
            found += addon.components(self, ports, certs, binaries)
        return found

    def node_components(
        self, ports: Ports, certs: pki.PKI, binaries: Mapping[str, Path]
    ) -> list[Component]:
        node_ports = self.node_ports
        pod_net = self.pod_network
        server = self.server
        scheduler_client = pki.ensure_leaf(
            certs, "scheduler", pki.Leaf("system:kube-scheduler", client=True)
        )
        scheduler_serving = pki.ensure_leaf(
            certs, "scheduler-serving", pki.Leaf.loopback_serving("kube-scheduler")
        )
        scheduler_kubeconfig = self.state_dir / "scheduler.kubeconfig"
        self._write_kubeconfig(scheduler_kubeconfig, server, certs, scheduler_client)

        # The Node authorizer and NodeRestriction know a kubelet by this name.
        kubelet_client = pki.ensure_leaf(
            certs,
            "kubelet-client",
            pki.Leaf(f"system:node:{self.node_name}", "system:nodes", client=True),
        )
        kubelet_serving = pki.ensure_leaf(
            certs,
            "kubelet-serving",
            pki.Leaf(
                self.node_name,
                server=True,
                dns_names=(self.node_name, "localhost"),
                ip_addresses=(pod_net.gateway, LOOPBACK),
            ),
        )
        kubelet_kubeconfig = self.state_dir / "kubelet.kubeconfig"
        self._write_kubeconfig(kubelet_kubeconfig, server, certs, kubelet_client)

        containerd_config = self.containerd_dir / "config.toml"
        containerd_config.write_text(self._containerd_config())
        # containerd finds shims by name on its PATH.
        shims = gvisor.link_commands(self.node_dir / "bin", binaries)
        runsc_config = self.containerd_dir / "runsc.toml"
        (self.node_dir / "runsc-logs").mkdir(parents=True, exist_ok=True)
        runsc_config.write_text(
            gvisor.runsc_config(
                sandbox_runsc=shims / gvisor.SANDBOX_RUNSC,
                root=self.runsc_root,
                log_dir=self.node_dir / "runsc-logs",
            )
        )
        kubelet_config = self.node_dir / "kubelet-config.yaml"
        kubelet_config.write_text(
            yaml.safe_dump(
                self._kubelet_config(certs, kubelet_serving, node_ports, pod_net), sort_keys=False
            )
        )
        admin = self._client_context(certs)
        api_host, api_port = self.apiserver_host, ports.apiserver

        return [
            loopback_controller(
                "kube-scheduler",
                binaries["kube-scheduler"],
                kubeconfig=scheduler_kubeconfig,
                port=node_ports.scheduler,
                serving=scheduler_serving,
                certs=certs,
                state_dir=self.state_dir,
                flags=[],
            ),
            Component(
                name="containerd",
                argv=["containerd", f"--config={containerd_config}"],
                env={
                    "PATH": f"{shims}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                    **gvisor.containerd_env(
                        runsc=binaries["runsc"],
                        checkpoints=self.checkpoint_dir,
                        kubelet_root_dir=self.kubelet_root_dir,
                    ),
                },
                ready=self._containerd_ready,
                ready_timeout=60.0,
                post_start=self._import_images,
            ),
            Component(
                name="kubelet",
                argv=[
                    str(binaries["kubelet"]),
                    f"--config={kubelet_config}",
                    f"--kubeconfig={kubelet_kubeconfig}",
                    f"--root-dir={self.kubelet_root_dir}",
                    f"--hostname-override={self.node_name}",
                    f"--node-ip={pod_net.gateway}",
                    "--v=1",
                ],
                ready=lambda: (
                    probes.http_ok(node_ports.kubelet_healthz, "/healthz", body=probes.says_ok)
                    and _node_ready(api_host, api_port, admin, self.node_name)
                ),
                ports=[node_ports.kubelet, node_ports.kubelet_healthz],
                ready_timeout=120.0,
                post_start=lambda: _after_node_ready(
                    api_host, api_port, admin, self.node_name, str(pod_net.subnet)
                ),
                # Runs while containerd still does: pods are torn down through
                # CRI, so the CNI plugins undo their own work.
                cleanup=self._remove_pods,
            ),
            *netstack.components(
                pod_net=pod_net,
                node_name=self.node_name,
                state_dir=self.state_dir,
                certs=certs,
                binaries=binaries,
                kubeconfig=self.kubeconfig,
                ports=(
                    node_ports.kube_proxy_healthz,
                    node_ports.kube_proxy_metrics,
                    node_ports.network_policy_metrics,
                ),
                write_kubeconfig=lambda path, pair: self._write_kubeconfig(
                    path, server, certs, pair
                ),
            ),
        ]

    def _containerd_config(self) -> str:
        """containerd 1.6 config (version 2): everything per cluster, CRI on cgroupfs."""
        root = self.containerd_dir
        socket = self.containerd_socket
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""# Written by devcluster/cluster.py for cluster {self.name!r}.
version = 2
root = "{self.image_store_dir}"
state = "{root / "state"}"
# opt: would create /opt/containerd; tracing, btrfs, zfs, aufs, devmapper:
# unused here and noisy in the log.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.gc.v1.scheduler"]
  startup_delay = "100ms"

[{cri}]
  sandbox_image = "{imagelib.PAUSE}"
  # Pod network namespaces under our state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # hugetlb is not mounted on this cgroup v1 host.
  disable_hugetlb_controller = true
  tolerate_missing_hugetlb_controller = true
  enable_unprivileged_ports = false
  enable_unprivileged_icmp = false
  # Root here lacks CAP_SYS_RESOURCE (not in the bounding set), so no process
  # may lower its oom_score_adj: runc failed every pod sandbox writing the
  # kubelet's -998 ("failed to update /proc/self/oom_score_adj: Permission
  # denied", seen by kubelet as "can't get final child's PID from pipe: EOF").
  # This clamps the kubelet's values to containerd's own (0) instead.
  restrict_oom_score_adj = true

  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{cri}.containerd.runtimes.runc.options]
        # cgroupfs, as the kubelet (cgroupDriver) and this host (no systemd).
        SystemdCgroup = false
        # runc's state per cluster too (default /run/containerd/runc).
        Root = "{root / "runc"}"
{gvisor.containerd_runtime(cri, root / "runsc.toml")}
  [{cri}.cni]
    bin_dir = "{network.CNI_BIN_DIR}"
    conf_dir = "{self.cni_conf_dir}"
    max_conf_num = 1

  [{cri}.registry]
    # No registry is reachable; images come from `ctr images import`.
    config_path = ""
"""

    def _kubelet_config(
        self,
        certs: pki.PKI,
        serving: pki.CertPair,
        node_ports: NodePorts,
        pod_net: network.PodNetwork,
    ) -> dict[str, object]:
        endpoint = f"unix://{self.containerd_socket}"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # Kubelet API on the node address only (the API server reaches
            # it there for logs/exec); a port per cluster.
            "address": pod_net.gateway,
            "port": node_ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": node_ports.kubelet_healthz,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "serverTLSBootstrap": False,
            "rotateCertificates": False,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(certs.ca.cert)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            # cgroup v1 host without systemd as init: cgroupfs, like containerd.
            "cgroupDriver": "cgroupfs",
            # Pod cgroups under a per-cluster root, not /kubepods of the host.
            "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": True,
            # 1.34 still runs on cgroup v1 by default (1.35 flips this to true).
            "failCgroupV1": False,
            # Dev machines may have swap; the kubelet refuses to start then.
            "failSwapOn": False,
            "podCIDR": str(pod_net.subnet),
            # CoreDNS's Service (devcluster.netstack): pods of dnsPolicy
            # ClusterFirst resolve <svc>.<ns>.svc.cluster.local.
            "clusterDomain": netstack.CLUSTER_DOMAIN,
            "clusterDNS": [pod_net.dns_ip],
            # For dnsPolicy Default pods, and the search domains the others
            # inherit from this machine.
            "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(self.pod_logs_dir),
            # Default /usr/libexec/kubernetes/...: keep out of the host's dirs.
            "volumePluginDir": str(self.kubelet_root_dir / "volume-plugins"),
            # No iptables chains (KUBE-FIREWALL, canaries): host-wide names,
            # and kube-proxy (nftables mode) uses none of them.
            "makeIPTablesUtilChains": False,
            # Images cannot be pulled again: never garbage-collect them, and
            # no disk-pressure eviction on a full developer disk.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "serializeImagePulls": False,
            "registerNode": True,
            "maxPods": 110,
            "podPidsLimit": POD_PIDS_LIMIT,
        }

    # ---- containerd -------------------------------------------------------------

    def _crictl(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.crictl_command(*args),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def _containerd_ready(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        try:
            proc = self._crictl("info", timeout=5.0)
        except subprocess.TimeoutExpired:
            return False
        if proc.returncode != 0:
            return False
        try:
            conditions = json.loads(proc.stdout)["status"]["conditions"]
        except (ValueError, KeyError, TypeError):
            return False
        # NetworkReady too: the CNI config is there before containerd starts.
        return all(condition.get("status") is True for condition in conditions)

    def _import_images(self) -> None:
        built = [imagelib.ensure_built(imagelib.IMAGES[name]) for name in self.image_names]
        began = time.monotonic()
        done = imagelib.import_images(self.containerd_socket, built)
        if done:
            log.info("imported %s in %.1fs", ", ".join(done), time.monotonic() - began)

    def load_images(self, names: Sequence[str]) -> list[str]:
        """Build (if needed) and import images into the running node; the
        references that were new or changed."""
        built = [imagelib.ensure_built(imagelib.IMAGES[name]) for name in names]
        return imagelib.import_images(self.containerd_socket, built)

    def _remove_pods(self) -> None:
        """Stop and remove every pod sandbox through CRI (containerd is still
        up): containers are killed, CNI DEL removes veths, IP allocations and
        portmap rules, netns mounts go. Best effort: the sweep after it
        handles what a broken containerd leaves."""
        containerd = self.run_dir / "containerd.json"
        with contextlib.suppress(OSError, ValueError):
            if not processes.ProcessRecord.load(containerd).is_running():
                return
        with contextlib.suppress(subprocess.TimeoutExpired, OSError, KeyError):
            proc = self._crictl("rmp", "--all", "--force", timeout=120.0)
            if proc.returncode != 0:
                log.warning("crictl rmp: %s", proc.stderr.strip())

    # ---- stop ---------------------------------------------------------------------

    def _stop_locked(self) -> None:
        try:
            super()._stop_locked()
        finally:
            self._node_cleanup()

    def _node_cleanup(self) -> None:
        """Remove what the node's processes leave behind; safe to repeat and
        after a crash. Raises if something could not be removed (the state dir
        is then kept: removing it through a mount point could reach into
        another filesystem)."""
        problems: list[str] = []
        pod_net: network.PodNetwork | None = None
        with contextlib.suppress(ControlPlaneError):
            pod_net = self.pod_network
        killed = self._kill_leftover_processes()
        if killed:
            log.info("killed %d leftover container/shim processes", killed)
        self._remove_shim_sockets()

        # Everything mounted below the state dir (not the dir itself, should
        # someone have put it on a filesystem of its own): overlay rootfs and
        # netns mounts of containerd, tmpfs volumes and CSI bind mounts of the
        # kubelet, whatever an addon mounted. Deepest first.
        def below() -> list[Path]:
            found = mounts.mount_points_under(self.state_dir, include_root=False)
            if self.containerd_socket.parent != self.containerd_dir:
                found += mounts.mount_points_under(self.containerd_socket.parent)
            return found

        for point in below():
            mounts.unmount(point)
        left = below()
        if left:
            problems.append(f"mounts left: {left}")
        sandboxes = self._sandbox_ids()
        if pod_net is not None:
            _remove_cni_cache(pod_net, sandboxes)
            with contextlib.suppress(network.NetworkError):
                network.delete_bridge(pod_net)
            if network.bridge_exists(pod_net.bridge):
                problems.append(f"bridge {pod_net.bridge} is still there")
            else:
                network.remove_forward_table(pod_net)
            rules = network.remove_iptables_rules(pod_net)
            if rules:
                log.info("removed %d iptables rules left by a crashed run", len(rules))
            remaining = network.rules_of(pod_net)
            if remaining:
                problems.append(f"iptables rules left: {remaining}")
            try:
                tables = netstack.remove_tables(pod_net)
            except (netstack.NetstackError, FileNotFoundError, ValueError) as error:
                tables = [f"(could not list nftables tables: {error})"]
            if tables:
                problems.append(f"nftables tables left: {tables}")
        problems += _remove_cgroup_root(self.cgroup_root)
        _remove_container_log_links(self.pod_logs_dir)
        _restore_kernel_tunables(exclude=self.state_dir)
        if not problems:
            # The pods' logs (the operator's, the gateway's) stay with the
            # cluster's own logs, for a failed test session to be read after.
            kept = self.logs_dir / "pods"
            shutil.rmtree(kept, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.pod_logs_dir.rename(kept)
            shutil.rmtree(self.node_dir, ignore_errors=True)
            if sandboxes:
                # Pods were not torn down through CRI (a crash): containerd
                # would try to recover them on the next start. Images go too.
                shutil.rmtree(self.image_store_dir, ignore_errors=True)
            if self.containerd_socket.parent != self.containerd_dir:
                shutil.rmtree(self.containerd_socket.parent, ignore_errors=True)
        if problems:
            raise ControlPlaneError("node cleanup incomplete: " + "; ".join(problems))

    def _sandbox_ids(self) -> list[str]:
        sandboxes = self.image_store_dir / "io.containerd.grpc.v1.cri" / "sandboxes"
        with contextlib.suppress(FileNotFoundError):
            return [entry.name for entry in sandboxes.iterdir()]
        return []

    def _kill_leftover_processes(self) -> int:
        """SIGKILL containerd shims of this cluster (their command line names
        our socket) and every process in our pod cgroups; wait until gone."""
        socket = str(self.containerd_socket).encode()
        victims: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and socket in cmdline:
                    victims.add(int(entry.name))
        for hierarchy in mounts.cgroup_hierarchies():
            base = hierarchy / self.cgroup_root.lstrip("/")
            if not base.is_dir():
                continue
            for procs in base.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    victims.update(int(pid) for pid in procs.read_text().split())
        victims.discard(os.getpid())
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            alive = [
                pid
                for pid in victims
                if processes.process_start_ticks(pid) is not None and not processes.is_zombie(pid)
            ]
            if not alive:
                break
            time.sleep(0.05)
        return len(victims)

    def _remove_shim_sockets(self) -> None:
        """A killed shim leaves its socket in /run/containerd/s/; each task's
        bundle dir says which one is its."""
        tasks = self.containerd_dir / "state" / "io.containerd.runtime.v2.task"
        if not tasks.is_dir():
            return
        for address in tasks.glob("*/*/address"):
            with contextlib.suppress(OSError):
                target = address.read_text().strip().removeprefix("unix://")
                if target.startswith("/run/containerd/s/"):
                    Path(target).unlink(missing_ok=True)

    def _create_cgroup_root(self) -> None:
        """The kubelet requires its cgroupRoot to exist in every hierarchy."""
        for hierarchy in mounts.cgroup_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":
                # A new cpuset cgroup starts with no CPUs and memory nodes:
                # nothing could run in it.
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    if not (path / knob).read_text().strip():
                        (path / knob).write_text((hierarchy / knob).read_text())


# ---- helpers (module level: also used on clusters found on disk) ----------------------


def _api(
    host: str,
    port: int,
    context: ssl.SSLContext,
    method: str,
    path: str,
    body: object | None = None,
    content_type: str = "application/json",
) -> tuple[int, object]:
    connection = http.client.HTTPSConnection(host, port, timeout=5.0, context=context)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": content_type} if payload is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode(errors="replace")
    finally:
        connection.close()


def _node_ready(host: str, port: int, context: ssl.SSLContext, node: str) -> bool:
    try:
        status, body = _api(host, port, context, "GET", f"/api/v1/nodes/{node}")
    except (OSError, http.client.HTTPException):
        return False
    if status != 200 or not isinstance(body, dict):
        return False
    conditions = body.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _after_node_ready(host: str, port: int, context: ssl.SSLContext, node: str, cidr: str) -> None:
    _set_pod_cidr(host, port, context, node, cidr)
    _ensure_runtime_class(host, port, context)
    # A pod created before the service-account controller made `default` is
    # refused ("serviceaccount default not found"): a cluster that says it
    # is up must take pods right away.
    deadline = time.monotonic() + 60.0
    path = "/api/v1/namespaces/default/serviceaccounts/default"
    while _api(host, port, context, "GET", path)[0] != 200:
        if time.monotonic() > deadline:
            raise ControlPlaneError("ServiceAccount default/default did not appear within 60s")
        time.sleep(0.1)


def _ensure_runtime_class(host: str, port: int, context: ssl.SSLContext) -> None:
    """The RuntimeClass of the node's gVisor runtime (kept across restarts)."""
    status, body = _api(
        host, port, context, "POST", "/apis/node.k8s.io/v1/runtimeclasses", gvisor.runtime_class()
    )
    if status not in (201, 409):
        raise ControlPlaneError(
            f"could not create RuntimeClass {gvisor.RUNTIME_CLASS}: {status} {body}"
        )


def _set_pod_cidr(host: str, port: int, context: ssl.SSLContext, node: str, cidr: str) -> None:
    """Record the node's pod subnet on the Node (spec.podCIDR(s)), as a
    controller-manager with --allocate-node-cidrs would: tools that read it
    (network policy enforcers, `kubectl describe node`) see the truth. The
    CNI config has the subnet already; the kubelet does not need this."""
    status, body = _api(host, port, context, "GET", f"/api/v1/nodes/{node}")
    if status == 200 and isinstance(body, dict) and body.get("spec", {}).get("podCIDR") == cidr:
        return
    status, body = _api(
        host,
        port,
        context,
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}},
        content_type="application/strategic-merge-patch+json",
    )
    if status != 200:
        raise ControlPlaneError(f"could not set podCIDR of node {node}: {status} {body}")


def _remove_cgroup_root(cgroup_root: str) -> list[str]:
    """rmdir the cluster's cgroup tree, deepest first (cgroups are removed
    with rmdir, only once empty of processes)."""
    problems = []
    for hierarchy in mounts.cgroup_hierarchies():
        base = hierarchy / cgroup_root.lstrip("/")
        if not base.is_dir():
            continue
        directories = [p for p in base.rglob("*") if p.is_dir()]
        for directory in [*sorted(directories, key=lambda p: len(p.parts), reverse=True), base]:
            for attempt in range(20):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    # EBUSY right after the last process died: it is still exiting.
                    if attempt == 19:
                        problems.append(f"cgroup {directory} not removable")
                    time.sleep(0.05)
    return problems


def _remove_cni_cache(pod_net: network.PodNetwork, sandbox_ids: Sequence[str]) -> None:
    """libcni caches each attachment's result in /var/lib/cni/results (its
    default, containerd 1.6 has no setting for it); CNI DEL removes the file,
    a crash leaves it."""
    results = Path("/var/lib/cni/results")
    if not results.is_dir():
        return
    for entry in results.iterdir():
        name = entry.name
        if name.startswith(f"{pod_net.name}-") or any(f"-{sid}-" in name for sid in sandbox_ids):
            entry.unlink(missing_ok=True)


def _remove_container_log_links(pod_logs_dir: Path) -> None:
    """The kubelet keeps symlinks in /var/log/containers (a fixed path) to the
    container logs; those into our pod log dir go with the cluster."""
    legacy = Path("/var/log/containers")
    if not legacy.is_dir():
        return
    for link in legacy.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(str(pod_logs_dir)):
                link.unlink()


def _kernel_tunables_record() -> Path:
    return clusters_root() / ".kernel-tunables.json"


def _record_kernel_tunables() -> None:
    """Remember the kernel settings the kubelet will change, once: while any
    node cluster runs, the values on the machine are the kubelet's."""
    record = _kernel_tunables_record()
    if record.exists():
        return
    values = {}
    for key in KUBELET_SYSCTLS:
        with contextlib.suppress(OSError):
            values[key] = (Path("/proc/sys") / key).read_text().strip()
    record.write_text(json.dumps(values, indent=2) + "\n")


def _other_kubelets_running(exclude: Path) -> bool:
    root = clusters_root()
    for record in root.glob("*/run/kubelet.json"):
        if record.parent.parent == exclude:
            continue
        with contextlib.suppress(OSError, ValueError):
            if processes.ProcessRecord.load(record).is_running():
                return True
    return False


def _restore_kernel_tunables(*, exclude: Path) -> None:
    """Put back the kernel settings of before the first node cluster, once no
    other node cluster's kubelet runs."""
    record = _kernel_tunables_record()
    if not record.exists() or _other_kubelets_running(exclude):
        return
    with contextlib.suppress(OSError, ValueError):
        for key, value in json.loads(record.read_text()).items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(str(value))
    record.unlink(missing_ok=True)
