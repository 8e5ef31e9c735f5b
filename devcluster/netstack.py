"""Services, cluster DNS and NetworkPolicy on a local node cluster.

What makes the node behave like the clusters users run, as a client sees it:

- kube-proxy (host process, nftables mode): ClusterIPs and NodePorts, from
  pods and from this machine. Its table is `ip <bridge>-kube-proxy`: every
  node cluster on this machine shares the host's network namespace (that is
  what lets the test process reach pod IPs and the pods reach the API server
  on the bridge address), and upstream's fixed table name would make two
  clusters' kube-proxies rewrite each other's rules (see netbuild.py). The
  Service range is the cluster's own /24 (`PodNetwork.service_subnet`) for
  the same reason; NodePorts open on the node address only.
- CoreDNS (in the cluster: Deployment `kube-system/coredns`, pods labelled
  `k8s-app: kube-dns`, Service `kube-dns` at the range's .10), from a locally
  built image holding only the static binary (images.py). In the cluster
  rather than on the host because a NetworkPolicy peer can only select pods:
  the operator's `Internet` egress allows DNS to `k8s-app: kube-dns` pods in
  `kube-system`, as on kubeadm, kind or GKE clusters. It serves
  `cluster.local` and the reverse zones from the API and nothing else: no
  upstream resolver is reachable from here, so other names get REFUSED at
  once instead of a forward that times out.
- kube-network-policies (host process): NetworkPolicy, enforced on the first
  packet of each connection through NFQUEUE. Its table is
  `inet <bridge>-network-policies` and its queue number 1000 + the subnet's
  third octet (unique while the subnet is). Upstream's exception stays: it
  accepts packets of root-owned sockets of this machine (kubelet probes, and
  the test process). New connections from pods to this machine itself (the
  node address, where the API server and the kubelet listen) are judged too,
  at its input hook. Fail-closed (`--fail-open=false`): while it is not running, packets to and
  from pods that a policy selects are dropped, not let through. Built with three
  patches for this kernel and for per-cluster names (netbuild.py).
- The bridge's forwarding guard (devcluster.network.enable_forwarding):
  what lets a pod's packet reach another pod through a ClusterIP.

`components()` returns kube-proxy and kube-network-policies as `Component`s
of `LocalCluster` (after the kubelet). kube-proxy's post-start hook applies
the RBAC of both and the CoreDNS objects; kube-network-policies' waits until
CoreDNS answers. Each process's cleanup deletes its nftables table, which
kube-proxy never does itself and kube-network-policies skips when it is
killed; `remove_tables` is the check for `LocalCluster`'s stop.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from devcluster import build, images, netbuild, network, pki, probes
from devcluster.controlplane import Component, run_kubectl

CLUSTER_DOMAIN = "cluster.local"
DNS_NAMESPACE = "kube-system"
DNS_LABELS = {"k8s-app": "kube-dns"}
"""What the operator's NetworkPolicy builder allows DNS to (settings
`dns_namespace`, `dns_pod_labels`), as kubeadm labels CoreDNS."""
DNS_SERVICE = "kube-dns"
NETWORK_POLICY_USER = "system:devcluster:kube-network-policies"
KUBE_PROXY_USER = "system:kube-proxy"
"""Bound to system:node-proxier by the API server's bootstrap RBAC."""
NFQUEUE_BASE = 1000
_FIELD_MANAGER = "devcluster-netstack"


class NetstackError(RuntimeError):
    """Services, DNS or NetworkPolicy could not be set up on the node."""


def kube_proxy_table(pod_net: network.PodNetwork) -> str:
    return f"{pod_net.bridge}-kube-proxy"


def network_policy_table(pod_net: network.PodNetwork) -> str:
    return f"{pod_net.bridge}-network-policies"


def nfqueue_id(pod_net: network.PodNetwork) -> int:
    """Queue numbers are per network namespace, and bound by one process each."""
    return NFQUEUE_BASE + pod_net.subnet.network_address.packed[2]


def tables_of(pod_net: network.PodNetwork) -> list[tuple[str, str]]:
    """(family, name) of the nftables tables this cluster may have made
    (the bridge's forwarding guard of devcluster.network included)."""
    return [
        ("inet", network.forward_table(pod_net)),
        ("ip", kube_proxy_table(pod_net)),
        ("ip6", kube_proxy_table(pod_net)),
        ("inet", network_policy_table(pod_net)),
    ]


def nft_tables() -> set[tuple[str, str]]:
    """(family, name) of every nftables table on this machine."""
    proc = subprocess.run(
        ["nft", "-j", "list", "tables"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise NetstackError(f"nft list tables: {proc.stderr.strip()}")
    found = set()
    for item in json.loads(proc.stdout).get("nftables", []):
        table = item.get("table")
        if isinstance(table, dict):
            found.add((str(table["family"]), str(table["name"])))
    return found


def delete_tables(tables: list[tuple[str, str]]) -> None:
    """`nft delete table` of those of `tables` (family, name) that exist."""
    for family, name in sorted(set(tables) & nft_tables()):
        subprocess.run(
            ["nft", "delete", "table", family, name], capture_output=True, text=True, check=False
        )


def remove_tables(pod_net: network.PodNetwork) -> list[str]:
    """Delete this cluster's nftables tables; the ones still there after.
    The bridge's forwarding guard stays while the bridge does."""
    guard = ("inet", network.forward_table(pod_net))
    keep = [guard] if network.bridge_exists(pod_net.bridge) else []
    delete_tables([table for table in tables_of(pod_net) if table not in keep])
    return [f"{family} {name}" for family, name in sorted(set(tables_of(pod_net)) & nft_tables())]


def queue_bound(queue: int) -> bool:
    """Whether a process listens on NFQUEUE `queue` (this network namespace)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/netfilter/nfnetlink_queue").read_text().splitlines():
            fields = line.split()
            if fields and int(fields[0]) == queue:
                return True
    return False


# ---- cluster objects ---------------------------------------------------------------


COREFILE = f"""# devcluster: the cluster's zones from the API, nothing forwarded (no
# upstream resolver is reachable here): other names get REFUSED at once.
{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        ttl 30
    }}
    loadbalance
    cache 30
}}
"""


def objects(pod_net: network.PodNetwork) -> list[dict[str, object]]:
    """RBAC of kube-network-policies and everything of CoreDNS (pure)."""
    rbac = "rbac.authorization.k8s.io"
    dns_meta = {"name": "coredns", "namespace": DNS_NAMESPACE, "labels": dict(DNS_LABELS)}
    read = ["get", "list", "watch"]
    return [
        # Upstream's ClusterRole of kube-network-policies (install.yaml), bound
        # to the user of its client certificate.
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "kube-network-policies"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": read},
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": read,
                },
            ],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kube-network-policies"},
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": "kube-network-policies"},
            "subjects": [{"apiGroup": rbac, "kind": "User", "name": NETWORK_POLICY_USER}],
        },
        # CoreDNS as kubeadm deploys it, less what needs more than one node.
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dns_meta},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": "system:coredns"},
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": DNS_NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": dns_meta,
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": dns_meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": dict(DNS_LABELS)},
                "template": {
                    "metadata": {"labels": dict(DNS_LABELS)},
                    "spec": _coredns_pod(),
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": DNS_SERVICE,
                "namespace": DNS_NAMESPACE,
                "labels": {**DNS_LABELS, "kubernetes.io/name": "CoreDNS"},
            },
            "spec": {
                "selector": dict(DNS_LABELS),
                "clusterIP": pod_net.dns_ip,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        },
    ]


def _coredns_pod() -> dict[str, object]:
    return {
        "serviceAccountName": "coredns",
        "priorityClassName": "system-cluster-critical",
        # Its own lookups must not go to itself.
        "dnsPolicy": "Default",
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
            # Port 53 without root or a capability: the NetworkPolicy port
            # of DNS egress is the pod's own port (after the Service's DNAT),
            # so CoreDNS must listen on 53 itself. A "safe" sysctl: namespaced
            # to the pod's network namespace, allowed by the kubelet by default.
            "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "53"}],
        },
        "containers": [
            {
                "name": "coredns",
                "image": images.COREDNS,
                "imagePullPolicy": "Never",
                "args": ["-conf", "/etc/coredns/Corefile"],
                "ports": [
                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                ],
                "readinessProbe": {
                    "httpGet": {"path": "/ready", "port": 8181},
                    "periodSeconds": 1,
                },
                "livenessProbe": {
                    "httpGet": {"path": "/health", "port": 8080},
                    "periodSeconds": 10,
                    "failureThreshold": 5,
                },
                "resources": {
                    "requests": {"cpu": "20m", "memory": "32Mi"},
                    "limits": {"memory": "128Mi"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}],
            }
        ],
        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
    }


def _kubectl(kubectl: Path, kubeconfig: Path, args: list[str], stdin: str | None = None) -> str:
    return run_kubectl(kubectl, kubeconfig, args, stdin=stdin, error=NetstackError)


def install_objects(kubeconfig: Path, pod_net: network.PodNetwork) -> None:
    """Apply `objects()` (idempotent, server-side apply)."""
    _kubectl(
        build.kubernetes_paths()["kubectl"],
        kubeconfig,
        [
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={_FIELD_MANAGER}",
            "-f",
            "-",
        ],
        stdin=yaml.safe_dump_all(objects(pod_net)),
    )


def wait_for_dns(kubeconfig: Path, timeout: float = 120.0) -> None:
    """Until the CoreDNS Deployment has a ready pod (the kubelet's readiness
    probe: its `ready` plugin answers once the kubernetes plugin has synced)."""
    kubectl = build.kubernetes_paths()["kubectl"]
    deadline = time.monotonic() + timeout
    while True:
        out = _kubectl(
            kubectl,
            kubeconfig,
            [
                "get",
                "-n",
                DNS_NAMESPACE,
                "deployment/coredns",
                "-o",
                "jsonpath={.status.readyReplicas}",
            ],
        )
        if out.strip() not in ("", "0"):
            return
        if time.monotonic() > deadline:
            pods = _kubectl(kubectl, kubeconfig, ["describe", "pods", "-n", DNS_NAMESPACE])
            raise NetstackError(f"CoreDNS not ready after {timeout:.0f}s:\n{pods[-3000:]}")
        time.sleep(0.2)


# ---- host processes ---------------------------------------------------------------


def _write_if_changed(path: Path, text: str) -> None:
    """kube-proxy exits ("content of the proxy server's configuration file was
    updated") on any write to its config file, and the component list (so
    this file) is made again by every status() and stop()."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == text:
            return
    path.write_text(text)


def components(
    *,
    pod_net: network.PodNetwork,
    node_name: str,
    state_dir: Path,
    certs: pki.PKI,
    binaries: Mapping[str, Path],
    kubeconfig: Path,
    ports: tuple[int, int, int],
    write_kubeconfig: Callable[[Path, pki.CertPair], None],
) -> list[Component]:
    """kube-proxy and kube-network-policies of a node cluster (after its
    kubelet). `ports`: kube-proxy healthz and metrics, kube-network-policies
    metrics (127.0.0.1). `kubeconfig`: the admin's, for the cluster objects."""
    healthz, metrics, policy_metrics = ports
    directory = state_dir / "netstack"
    directory.mkdir(parents=True, exist_ok=True)

    proxy_kubeconfig = directory / "kube-proxy.kubeconfig"
    write_kubeconfig(
        proxy_kubeconfig,
        pki.ensure_leaf(certs, "kube-proxy", pki.Leaf(KUBE_PROXY_USER, client=True)),
    )
    policy_kubeconfig = directory / "kube-network-policies.kubeconfig"
    write_kubeconfig(
        policy_kubeconfig,
        pki.ensure_leaf(certs, "kube-network-policies", pki.Leaf(NETWORK_POLICY_USER, client=True)),
    )
    proxy_config = directory / "kube-proxy.yaml"
    _write_if_changed(
        proxy_config,
        yaml.safe_dump(
            {
                "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                "kind": "KubeProxyConfiguration",
                "clientConnection": {"kubeconfig": str(proxy_kubeconfig)},
                # nftables: the one mode whose rules can be named per cluster.
                "mode": "nftables",
                "hostnameOverride": node_name,
                "healthzBindAddress": f"127.0.0.1:{healthz}",
                "metricsBindAddress": f"127.0.0.1:{metrics}",
                # Pods are this /24; anything else reaching a ClusterIP (this
                # machine, say) is masqueraded to the node address.
                "clusterCIDR": str(pod_net.subnet),
                "detectLocalMode": "ClusterCIDR",
                # NodePorts on this cluster's node address, not on every
                # address of the machine (other clusters' bridges, eth0).
                "nodePortAddresses": [f"{pod_net.gateway}/32"],
                # Leave the machine's conntrack settings alone (nf_conntrack_max
                # is host-wide; other clusters and sessions share it).
                "conntrack": {
                    "maxPerCore": 0,
                    "min": 0,
                    "tcpEstablishedTimeout": "0s",
                    "tcpCloseWaitTimeout": "0s",
                    "udpTimeout": "0s",
                    "udpStreamTimeout": "0s",
                },
                # Root here cannot lower its oom_score_adj (no CAP_SYS_RESOURCE).
                "oomScoreAdj": 0,
                # A Service change reaches the rules at once (a small cluster).
                "nftables": {"minSyncPeriod": "0s", "syncPeriod": "30s"},
            },
            sort_keys=False,
        ),
    )
    queue = nfqueue_id(pod_net)
    proxy_table = kube_proxy_table(pod_net)
    policy_table = network_policy_table(pod_net)

    def after_proxy() -> None:
        install_objects(kubeconfig, pod_net)

    return [
        Component(
            name="kube-proxy",
            argv=[str(binaries["kube-proxy"]), f"--config={proxy_config}", "--v=1"],
            env={"DEVCLUSTER_KUBE_PROXY_TABLE": proxy_table},
            # /healthz answers 200 once the rules are synced.
            ready=lambda: probes.http_ok(healthz, "/healthz"),
            ports=[healthz, metrics],
            ready_timeout=120.0,
            post_start=after_proxy,
            cleanup=lambda: delete_tables([("ip", proxy_table), ("ip6", proxy_table)]),
        ),
        Component(
            name="kube-network-policies",
            argv=[
                str(binaries["kube-network-policies"]),
                f"--kubeconfig={policy_kubeconfig}",
                f"--hostname-override={node_name}",
                f"--nfqueue-id={queue}",
                f"--metrics-bind-address=127.0.0.1:{policy_metrics}",
                # Fail closed: no traffic the policies would refuse while the
                # enforcer is down (and it removes its table on SIGTERM).
                "--fail-open=false",
                # NRI: containerd 1.6 has none, and its socket path is host-wide.
                "--disable-nri=true",
                # Not needed on kernels 6.12+ (this one is 6.18), and it adds
                # DNS rules to the prerouting hook.
                "--netfilter-bug-1766-fix=false",
                # Needs conntrack labels set through NFQUEUE verdicts, which do
                # not stick on this kernel (see devcluster/netbuild.py).
                "--strict-mode=false",
                "--v=1",
            ],
            env={
                netbuild.NETWORK_POLICY_TABLE_ENV: policy_table,
                # Packets of pods it does not know yet are dropped (netbuild.py).
                netbuild.POD_SUBNET_ENV: str(pod_net.subnet),
                netbuild.POD_GATEWAY_ENV: str(pod_net.gateway),
            },
            # Ready: rules synced and the queue bound (before that, packets of
            # selected pods are dropped: fail closed).
            ready=lambda: (
                probes.http_ok(policy_metrics, "/metrics")
                and queue_bound(queue)
                and ("inet", policy_table) in nft_tables()
            ),
            ports=[policy_metrics],
            ready_timeout=120.0,
            post_start=lambda: wait_for_dns(kubeconfig),
            cleanup=lambda: delete_tables([("inet", policy_table)]),
        ),
    ]
