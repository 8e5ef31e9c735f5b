"""Services, cluster DNS and NetworkPolicy on the node (devcluster/netstack.py).

Real pods on the session's node cluster probe real addresses: other pods,
ClusterIPs, the node's own address, and listeners this test opens on this
machine. Every address is on this machine: the cluster's own bridge, its
pod subnet and Service range, and two addresses the NetworkPolicy test puts
on the cluster's bridge for as long as it runs (169.254.169.254, a
link-local address like a cloud's metadata service, and 192.0.2.10, from
a documentation range that no network routes): nothing leaves the machine.

Each assertion fails without the part it is about: without kube-proxy no
ClusterIP answers, without CoreDNS or the kubelet's clusterDNS no name
resolves (and the kubelet warns MissingClusterDNS), without an enforcer
every probe a policy forbids would get through.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import socketserver
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster import netstack
from devcluster.cluster import LocalCluster
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders.sandbox import build_network_policy
from sandbox_operator.config import Settings
from sandbox_operator.identity import SandboxRef, labels
from tests.devcluster.support import JSON, Pods, http_get, pod, restricted, wait_for
from tests.kube import KubeJSON, api_path, core_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

IMAGE = "sandbox-runtime-python:dev"
OK = "ok"

# Run in a pod: each argument is a probe, `tcp:HOST:PORT` (connect, 3 s),
# `dns:NAME` (the pod's resolver) or `http:URL` (the body); prints one JSON
# object: probe -> [result, seconds]. The first argument is a delay: a pod
# that a policy selects must be known to the enforcer before its first
# packet (see test_egress_deny_all_blocks_pods_the_node_and_dns).
PROBE = r"""
import json, socket, sys, time, urllib.request
time.sleep(float(sys.argv[1]))
results = {}
for probe in sys.argv[2:]:
    kind, _, rest = probe.partition(":")
    began = time.monotonic()
    try:
        if kind == "tcp":
            host, port = rest.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=3).close()
            result = "ok"
        elif kind == "dns":
            result = socket.gethostbyname(rest)
        else:
            with urllib.request.urlopen(rest, timeout=5) as response:
                result = response.read().decode().strip()
    except Exception as error:
        result = f"{type(error).__name__}: {error}"
    results[probe] = [result, round(time.monotonic() - began, 2)]
print(json.dumps(results), flush=True)
"""


@pytest.fixture
def other_namespace(kube: KubeJSON) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create(core_path("namespaces"), {"metadata": {"name": name}})
    wait_for(
        lambda: kube.get(core_path("serviceaccounts", name, "default")) is not None,
        f"default ServiceAccount in {name}",
    )
    yield name
    kube.delete(core_path("namespaces", name=name))


def probe(pods: Pods, name: str, probes: list[str], *, delay: float = 0.0, **meta: Any) -> JSON:
    """Run PROBE in a pod `name` (labels etc. from `meta`); probe -> result."""
    body = pod(
        name,
        IMAGE,
        ["python3", "-c", PROBE, str(delay), *probes],
        container={"securityContext": restricted(1000)},
    )
    body["metadata"].update(meta)
    finished = pods.run(body)
    log = pods.logs(name)
    assert finished["status"]["phase"] == "Succeeded", log
    results: JSON = {key: value[0] for key, value in json.loads(log.splitlines()[-1]).items()}
    print(f"\n{pods.namespace}/{name} {meta.get('labels', {})}: {results}")
    return results


def web_server(pods: Pods, name: str, pod_labels: dict[str, str]) -> str:
    """A pod serving its own name over HTTP on 8000; its IP."""
    script = (
        "import http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        f"        self.send_response(200); self.end_headers(); self.wfile.write(b'{name}')\n"
        "http.server.ThreadingHTTPServer(('', 8000), H).serve_forever()\n"
    )
    body = pod(
        name,
        IMAGE,
        ["python3", "-c", script],
        restartPolicy="Always",
        container={
            "securityContext": restricted(1000),
            "ports": [{"containerPort": 8000}],
            "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
        },
    )
    body["metadata"]["labels"] = pod_labels
    running = pods.run(body)
    return str(running["status"]["podIP"])


@contextlib.contextmanager
def host_listener(address: str) -> Iterator[int]:
    """A TCP listener of this process on `address` (of this machine); its port."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            pass

    with socketserver.ThreadingTCPServer((address, 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield int(server.server_address[1])
        finally:
            server.shutdown()


@contextlib.contextmanager
def bridge_addresses(cluster: LocalCluster, *addresses: str) -> Iterator[None]:
    """Extra /32 addresses on the cluster's own bridge (so listeners on them
    are on this machine), removed afterwards."""
    bridge = cluster.pod_network.bridge
    added = []
    try:
        for address in addresses:
            subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", bridge], check=True)
            added.append(address)
        yield
    finally:
        for address in added:
            subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", bridge], check=False)


def create_policy(kube: KubeJSON, namespace: str, policy: JSON) -> None:
    kube.create(api_path("networking.k8s.io/v1", "networkpolicies", namespace), policy)


def dns_query(server: str, name: str) -> tuple[int, list[str]]:
    """One A query over UDP from this process: (rcode, addresses)."""
    query = struct.pack(">HHHHHH", 0x5EED, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(part)]) + part.encode() for part in name.split(".")) + b"\0"
    query += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(3)
        sock.sendto(query, (server, 53))
        answer = sock.recv(4096)
    rcode, count = answer[3] & 0xF, struct.unpack(">H", answer[6:8])[0]
    found = []
    offset = len(query)  # the question comes back as it was sent
    for _ in range(count):
        # The owner name: labels, ended by a zero byte or a 2-byte pointer.
        while answer[offset] and answer[offset] < 0xC0:
            offset += 1 + answer[offset]
        offset += 2 if answer[offset] >= 0xC0 else 1
        kind, _cls, _ttl, length = struct.unpack(">HHIH", answer[offset : offset + 10])
        if kind == 1:
            found.append(socket.inet_ntoa(answer[offset + 10 : offset + 10 + length]))
        offset += 10 + length
    return rcode, found


# ---- Services and DNS ------------------------------------------------------------------


def test_services_are_reached_by_clusterip_and_by_name_from_pods_and_this_host(
    local_cluster: LocalCluster, kube: KubeJSON, namespace: str, pods: Pods
) -> None:
    net = local_cluster.pod_network
    web_server(pods, "web", {"app": "web"})
    service = kube.create(
        core_path("services", namespace),
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8000}]},
        },
    )
    cluster_ip = service["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in net.service_subnet
    fqdn = f"web.{namespace}.svc.cluster.local"

    def served() -> bool:
        try:
            return http_get(cluster_ip, 80, "/") == (200, "web")
        except OSError:
            return False

    # The pod is Ready before kube-proxy has its endpoint (until then the
    # ClusterIP rejects connections): wait for the rules, as a client would retry.
    wait_for(served, f"kube-proxy serving {cluster_ip}", 30)
    results = probe(
        pods,
        "client",
        [
            f"dns:{fqdn}",
            "dns:web",  # the pod's search path: <ns>.svc.cluster.local
            "dns:kubernetes.default.svc.cluster.local",
            "http:http://web/",
            f"http:http://{cluster_ip}/",
            "dns:sandbox-devcluster-nothing.example.com",
        ],
    )
    assert results[f"dns:{fqdn}"] == cluster_ip
    assert results["dns:web"] == cluster_ip
    assert results["dns:kubernetes.default.svc.cluster.local"] == str(
        net.service_subnet.network_address + 1
    )
    assert results["http:http://web/"] == "web"
    assert results[f"http:http://{cluster_ip}/"] == "web"
    # A name outside the cluster does not resolve; that CoreDNS refuses it
    # rather than forwarding it upstream is asserted below with the rcode.
    assert results["dns:sandbox-devcluster-nothing.example.com"].startswith("gaierror"), results

    # The pod's resolver is the cluster's DNS, and the kubelet no longer warns.
    client = kube.read(core_path("pods", namespace, "client"))
    assert client["spec"]["dnsPolicy"] == "ClusterFirst"
    events = kube.list(core_path("events", namespace))
    assert [e for e in events if e.get("reason") == "MissingClusterDNS"] == []

    # From this machine: the ClusterIP (kube-proxy's output chain), and
    # CoreDNS through its own ClusterIP.
    assert http_get(cluster_ip, 80, "/") == (200, "web")
    assert dns_query(net.dns_ip, fqdn) == (0, [cluster_ip])
    assert dns_query(net.dns_ip, "nothing.example.com")[0] == 5  # REFUSED


def test_dns_runs_in_the_cluster_as_the_operator_expects_it(
    local_cluster: LocalCluster, kube: KubeJSON
) -> None:
    # Settings.dns_namespace / dns_pod_labels: the peer of the DNS egress rule.
    settings = Settings()
    selector = ",".join(f"{key}={value}" for key, value in settings.dns_pod_labels.items())
    dns_pods = kube.list(core_path("pods", settings.dns_namespace), label_selector=selector)
    assert len(dns_pods) == 1
    assert dns_pods[0]["status"]["phase"] == "Running"
    service = kube.read(core_path("services", netstack.DNS_NAMESPACE, netstack.DNS_SERVICE))
    assert service["spec"]["clusterIP"] == local_cluster.pod_network.dns_ip
    config = (local_cluster.node_dir / "kubelet-config.yaml").read_text()
    assert local_cluster.pod_network.dns_ip in config


# ---- NetworkPolicy ------------------------------------------------------------------------


def test_ingress_policy_admits_only_the_labelled_peer(
    kube: KubeJSON, namespace: str, other_namespace: str, local_cluster: LocalCluster
) -> None:
    here = Pods(local_cluster, kube, namespace)
    there = Pods(local_cluster, kube, other_namespace)
    target = web_server(here, "agent", {"app": "agent"})
    # The shape of the operator's agent rule: one namespace, one pod label.
    create_policy(
        kube,
        namespace,
        {
            "metadata": {"name": "only-operator"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "agent"}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchLabels": {"kubernetes.io/metadata.name": other_namespace}
                                },
                                "podSelector": {"matchLabels": {"role": "operator"}},
                            }
                        ],
                        "ports": [{"port": 8000, "protocol": "TCP"}],
                    }
                ],
            },
        },
    )
    wanted = f"tcp:{target}:8000"
    # The enforcer picks the policy up within its 1 s sync.
    time.sleep(2)
    peer = probe(there, "peer", [wanted], labels={"role": "operator"})
    stranger = probe(there, "stranger", [wanted], labels={"role": "other"})
    same_label_wrong_namespace = probe(here, "imposter", [wanted], labels={"role": "operator"})
    assert peer[wanted] == OK
    assert stranger[wanted].startswith("TimeoutError"), stranger
    assert same_label_wrong_namespace[wanted].startswith("TimeoutError")
    # Root-owned sockets of this machine are always let through (upstream's
    # rule for kubelet probes): this test process is one.
    assert http_get(target, 8000, "/") == (200, "agent")


def test_egress_deny_all_blocks_pods_the_node_and_dns(
    kube: KubeJSON, namespace: str, local_cluster: LocalCluster, pods: Pods
) -> None:
    net = local_cluster.pod_network
    target = web_server(pods, "target", {"app": "target"})
    create_policy(
        kube,
        namespace,
        {
            "metadata": {"name": "no-egress"},
            "spec": {
                "podSelector": {"matchLabels": {"role": "locked"}},
                "policyTypes": ["Egress"],
                "egress": [],
            },
        },
    )
    with host_listener(net.gateway) as port:
        probes = [
            f"tcp:{target}:8000",  # another pod
            f"tcp:{net.gateway}:{port}",  # this machine, at the node address
            "dns:kubernetes.default.svc.cluster.local",  # CoreDNS, a pod too
        ]
        # Without NRI (containerd 1.6 has none) the enforcer learns a new
        # pod's IP from the API, a moment after the pod got it: a probe in
        # that moment would pass. The delay keeps the test about policy.
        locked = probe(pods, "locked", probes, delay=2, labels={"role": "locked"})
        free = probe(pods, "free", probes, delay=2, labels={"role": "free"})
    assert free[probes[0]] == OK
    assert free[probes[1]] == OK
    assert free[probes[2]] == str(net.service_subnet.network_address + 1)
    assert locked[probes[0]].startswith("TimeoutError"), locked
    # Traffic to this machine itself goes through the input hook, where the
    # enforcer queues new connections of selected pods too.
    assert locked[probes[1]].startswith("TimeoutError"), locked
    assert locked[probes[2]].startswith("gaierror"), locked


@contextlib.contextmanager
def stray_address(cluster: LocalCluster, address: str) -> Iterator[str]:
    """A network namespace on the cluster's bridge holding `address` of the pod
    subnet, as a new pod's would be before its IP reaches the API (no pod in
    the API has it); its name, for `ip netns exec`."""
    net = cluster.pod_network
    name, outside = f"stray-{uuid.uuid4().hex[:6]}", f"st{uuid.uuid4().hex[:10]}"
    inside = f"{outside}i"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", outside, "type", "veth", "peer", "name", inside],
        ["ip", "link", "set", inside, "netns", name],
        ["ip", "link", "set", outside, "master", net.bridge, "up"],
        ["ip", "-n", name, "addr", "add", f"{address}/{net.subnet.prefixlen}", "dev", inside],
        ["ip", "-n", name, "link", "set", inside, "up"],
        ["ip", "-n", name, "route", "add", "default", "via", str(net.gateway)],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", outside], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def test_a_pod_the_enforcer_does_not_know_yet_reaches_nothing(
    kube: KubeJSON, namespace: str, local_cluster: LocalCluster, pods: Pods
) -> None:
    """Without NRI the enforcer learns a pod's IP from the API, a moment after
    the pod has it (longer on a busy node). Upstream lets that moment's
    packets through; here they are dropped, whatever the policies say: a
    sandbox's code has no first second without its egress policy."""
    net = local_cluster.pod_network
    target = web_server(pods, "open-target", {"app": "open-target"})  # no policy selects it
    taken = {p["status"].get("podIP") for p in kube.list(core_path("pods"))}
    address = str(net.subnet.broadcast_address - 3)
    assert address not in taken
    with host_listener(net.gateway) as port, stray_address(local_cluster, address) as netns:
        for host, host_port in ((target, 8000), (str(net.gateway), port)):
            code = f"import socket; socket.create_connection(({host!r}, {host_port}), timeout=3)"
            ran = subprocess.run(
                ["ip", "netns", "exec", netns, "python3", "-c", code],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert ran.returncode != 0, (host, "reached from an unknown pod address")
            assert "TimeoutError" in ran.stderr, (host, ran.stderr)
    # The same target from a pod the enforcer knows: reached.
    assert probe(pods, "known", [f"tcp:{target}:8000"], delay=2)[f"tcp:{target}:8000"] == OK


def test_the_operators_internet_egress_keeps_dns_and_public_addresses_only(
    kube: KubeJSON, namespace: str, local_cluster: LocalCluster, pods: Pods
) -> None:
    net = local_cluster.pod_network
    other_pod = web_server(pods, "neighbour", {"app": "neighbour"})
    # The policy the operator gives a sandbox with `network.egress: Internet`,
    # from its own builder and default settings.
    spec = SandboxSpec.model_validate({"network": {"egress": "Internet"}})
    ref = SandboxRef(name="sbx", namespace=namespace, uid=str(uuid.uuid4()))
    policy = build_network_policy(ref, spec, Settings())
    excepted = policy["spec"]["egress"][1]["to"][0]["ipBlock"]["except"]
    assert "169.254.0.0/16" in excepted
    assert "10.0.0.0/8" in excepted
    create_policy(kube, namespace, policy)
    metadata, public = "169.254.169.254", "192.0.2.10"
    kubernetes_ip = str(net.service_subnet.network_address + 1)
    with (
        bridge_addresses(local_cluster, metadata, public),
        host_listener(metadata) as metadata_port,
        host_listener(public) as public_port,
        host_listener(net.gateway) as node_port,
    ):
        probes = {
            "dns": "dns:kubernetes.default.svc.cluster.local",
            "public": f"tcp:{public}:{public_port}",
            "metadata": f"tcp:{metadata}:{metadata_port}",
            "node": f"tcp:{net.gateway}:{node_port}",
            "pod": f"tcp:{other_pod}:8000",
            "api-service": f"tcp:{kubernetes_ip}:443",
        }
        sandbox = probe(pods, "sandbox", list(probes.values()), delay=2, labels=labels("sbx"))
        plain = probe(pods, "plain", list(probes.values()), delay=2, labels={"app": "plain"})
    assert all(plain[p] in (OK, kubernetes_ip) for p in probes.values()), plain
    # DNS to the kube-dns pods is allowed (its own rule), and so is an
    # address outside the except list.
    assert sandbox[probes["dns"]] == kubernetes_ip
    assert sandbox[probes["public"]] == OK
    # The except list: link-local (the metadata address), the node's and the
    # pods' 10/8, and the API server behind its ClusterIP (the policy sees
    # the address after kube-proxy's DNAT: the node's).
    for blocked in ("metadata", "node", "pod", "api-service"):
        assert sandbox[probes[blocked]].startswith("TimeoutError"), (blocked, sandbox)
