"""The node tier: a real single-node cluster (devcluster/cluster.py) runs pods.

Pods run from the locally built images (devcluster/images.py) on the pod
bridge; this process reaches pod IPs directly. The last test starts and stops
clusters of its own (beside the session's) and checks that nothing of them is
left: processes, shims, mounts, the bridge, iptables rules, cgroups.

Needs root, like the node tier itself. Preparing the tier (Debian packages,
kubelet/scheduler/crictl builds, images) happens during collection.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from devcluster import images, mounts, netstack, network, processes, versions
from devcluster.cluster import POD_PIDS_LIMIT, LocalCluster
from tests.devcluster.support import (
    Pods,
    devcluster_cli,
    http_get,
    pod,
    processes_using,
    restricted,
    wait_for,
)
from tests.kube import KubeJSON, core_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


# ---- the session's node cluster ---------------------------------------------------


def test_node_registers_ready_with_its_pod_subnet(
    local_cluster: LocalCluster, kube: KubeJSON
) -> None:
    node = kube.read(core_path("nodes", name=local_cluster.node_name))
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    net = local_cluster.pod_network
    assert node["spec"]["podCIDR"] == str(net.subnet)
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == net.gateway
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == versions.KUBERNETES
    assert info["containerRuntimeVersion"].startswith("containerd://1.6")
    # The pause image and every image of the catalogue are in the node's store.
    present = {name for image in node["status"].get("images", []) for name in image["names"]}
    for spec in images.IMAGES.values():
        assert spec.reference in present, f"{spec.reference} not imported"


def test_python_runtime_pod_runs_and_its_log_is_readable(pods: Pods) -> None:
    body = pod(
        "hello",
        "sandbox-runtime-python:dev",
        ["python3", "-c", "import os, sys; print('hello', sys.version_info[:2], os.getuid())"],
        securityContext={"fsGroup": 1000},
        container={"securityContext": restricted(1000)},
    )
    finished = pods.run(body)
    assert finished["status"]["phase"] == "Succeeded", finished["status"]
    assert pods.logs("hello").strip() == "hello (3, 11) 1000"


def test_this_host_reaches_a_pod_ip_and_emptydir_is_shared(
    local_cluster: LocalCluster, pods: Pods
) -> None:
    marker = uuid.uuid4().hex
    body = pod(
        "web",
        "sandbox-runtime-python:dev",
        ["python3", "-m", "http.server", "8000", "--directory", "/data"],
        restartPolicy="Always",
        initContainers=[
            {
                "name": "fill",
                "image": "sandbox-runtime-python:dev",
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", f"echo {marker} > /data/index.html"],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                "securityContext": restricted(1000),
            }
        ],
        volumes=[{"name": "data", "emptyDir": {}}],
        container={
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "securityContext": restricted(1000),
            "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
        },
    )
    running = pods.run(body)
    ip = running["status"]["podIP"]
    assert ipaddress.ip_address(ip) in local_cluster.pod_network.subnet
    status, text = http_get(ip, 8000, "/index.html")
    assert (status, text.strip()) == (200, marker)


def test_hostport_reaches_the_pod_through_portmap(local_cluster: LocalCluster, pods: Pods) -> None:
    # Below the range the clusters' own ports come from (20000 and up): a
    # hostPort DNATs every local connection to that port.
    host_port = 18100 + int(uuid.uuid4().hex[:4], 16) % 800
    body = pod(
        "mapped",
        "sandbox-runtime-python:dev",
        ["python3", "-m", "http.server", "8000", "--directory", "/etc"],
        restartPolicy="Always",
        container={
            "ports": [{"containerPort": 8000, "hostPort": host_port}],
            "securityContext": restricted(1000),
            "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
        },
    )
    pods.run(body)
    net = local_cluster.pod_network
    assert network.rules_of(net), "portmap added no rules carrying the network's name"
    status, text = http_get(net.gateway, host_port, "/hostname")
    assert status == 200
    assert text.strip() == "mapped"


def test_image_without_python_fails_clearly_and_runs_a_shell(pods: Pods) -> None:
    failed = pods.run(
        pod("python", "sandbox-runtime-nopython:dev", ["python3", "-c", "print(1)"]),
    )
    assert failed["status"]["phase"] == "Failed"
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["reason"] == "StartError"
    assert "python3" in terminated["message"]
    shell = pods.run(
        pod("shell", "sandbox-runtime-nopython:dev", ["sh", "-c", "echo shell-ok"]),
    )
    assert shell["status"]["phase"] == "Succeeded"
    assert pods.logs("shell").strip() == "shell-ok"


def test_node_and_operator_images_run_read_only_and_non_root(pods: Pods) -> None:
    node = pods.run(
        pod(
            "node",
            "sandbox-runtime-node:dev",
            ["sh", "-c", "node -e 'console.log(6*7)' && npm --version >/dev/null && python3 -V"],
            container={"securityContext": restricted(1000)},
        ),
    )
    assert node["status"]["phase"] == "Succeeded", node["status"]
    assert pods.logs("node").split()[:2] == ["42", "Python"]
    operator = pods.run(
        pod(
            "operator",
            "sandbox-operator:dev",
            ["/usr/local/bin/kopf", "--version"],
            container={"securityContext": restricted(65532)},
        ),
    )
    assert operator["status"]["phase"] == "Succeeded", operator["status"]
    assert "kopf" in pods.logs("operator").lower()


def test_agent_image_serves_as_uid_65532_on_a_read_only_root(
    kube: KubeJSON, namespace: str, pods: Pods
) -> None:
    kube.create(
        core_path("secrets", namespace),
        {"metadata": {"name": "agent-token"}, "stringData": {"token": uuid.uuid4().hex}},
    )
    body = pod(
        "agent",
        "sandbox-agent:dev",
        None,  # the image's entrypoint
        restartPolicy="Always",
        securityContext={"fsGroup": 1000},
        volumes=[
            {"name": "token", "secret": {"secretName": "agent-token"}},
            {"name": "workspace", "emptyDir": {}},
            {"name": "run", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
        container={
            "env": [{"name": "SANDBOX_AGENT_TOKEN_FILE", "value": "/token/token"}],
            "volumeMounts": [
                {"name": "token", "mountPath": "/token", "readOnly": True},
                {"name": "workspace", "mountPath": "/workspace"},
                {"name": "run", "mountPath": "/sandbox/run"},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            "securityContext": restricted(65532),
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1},
        },
    )
    running = pods.run(body)
    assert running["status"]["phase"] == "Running", running["status"]
    status, _ = http_get(running["status"]["podIP"], 8080, "/healthz")
    assert status == 200


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(
    kube: KubeJSON, namespace: str, local_cluster: LocalCluster, pods: Pods
) -> None:
    # kube-root-ca.crt is published into every namespace by the controller
    # manager; verifying against it checks the serving certificate's SANs.
    wait_for(
        lambda: kube.get(core_path("configmaps", namespace, "kube-root-ca.crt")) is not None,
        "kube-root-ca.crt",
    )
    # No env of ours: what the kubelet injects (the `kubernetes` ClusterIP,
    # through kube-proxy), then the Service's name (through cluster DNS).
    script = (
        "import json, os, ssl, http.client\n"
        "ctx = ssl.create_default_context(cafile='/ca/ca.crt')\n"
        "host = os.environ['KUBERNETES_SERVICE_HOST']\n"
        "port = os.environ['KUBERNETES_SERVICE_PORT']\n"
        "for server in (host, 'kubernetes.default.svc'):\n"
        "    c = http.client.HTTPSConnection(server, int(port), context=ctx, timeout=10)\n"
        "    c.request('GET', '/version')\n"
        "    print(server, json.loads(c.getresponse().read())['gitVersion'])\n"
    )
    body = pod(
        "api",
        "sandbox-runtime-python:dev",
        ["python3", "-c", script],
        volumes=[{"name": "ca", "configMap": {"name": "kube-root-ca.crt"}}],
        container={
            "volumeMounts": [{"name": "ca", "mountPath": "/ca"}],
            "securityContext": restricted(1000),
        },
    )
    finished = pods.run(body)
    assert finished["status"]["phase"] == "Succeeded", pods.logs("api")
    cluster_ip = str(local_cluster.pod_network.service_subnet.network_address + 1)
    assert pods.logs("api").split() == [
        cluster_ip,
        versions.KUBERNETES,
        "kubernetes.default.svc",
        versions.KUBERNETES,
    ]
    # The `kubernetes` Service points at the API server's bridge address (lease reconciler).
    endpoints = kube.read(core_path("endpoints", "default", "kubernetes"))
    assert endpoints["subsets"][0]["addresses"][0]["ip"] == local_cluster.apiserver_host


def test_pause_reaps_orphans_of_a_shared_process_namespace(pods: Pods) -> None:
    # With a shared PID namespace the pause process is PID 1 of the pod: an
    # orphan that exits becomes its zombie until it reaps it.
    script = (
        "import os, time\n"
        "for _ in range(5):\n"
        "    if os.fork() == 0:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(0.2)\n"
        "            os._exit(0)\n"
        "        os._exit(0)\n"
        "    os.wait()\n"
        "time.sleep(1.5)\n"
        "init = open('/proc/1/cmdline').read().strip(chr(0))\n"
        "zombies = [p for p in os.listdir('/proc') if p.isdigit()"
        " and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z']\n"
        "print(init, len(zombies))\n"
    )
    body = pod(
        "reaper",
        "sandbox-runtime-python:dev",
        ["python3", "-c", script],
        shareProcessNamespace=True,
        container={"securityContext": restricted(1000)},
    )
    finished = pods.run(body)
    assert finished["status"]["phase"] == "Succeeded", finished["status"]
    assert pods.logs("reaper").split() == ["/pause", "0"]


# Run in the pod: start processes (posix_spawn of sleep: cheap, no copy of the
# interpreter) until the kernel refuses one, try one plain fork() at that
# point, then kill them all and report. The cap stops a node without a limit
# from being flooded: reaching it means no limit applied.
_FORK_BOMB = """
import errno, json, os, signal, sys, time
cap = int(sys.argv[1])
children, spawn_error, fork_error = [], None, None
while len(children) < cap:
    try:
        children.append(os.posix_spawn("/bin/sleep", ["sleep", "600"], {}))
    except OSError as error:
        spawn_error = errno.errorcode.get(error.errno, str(error.errno))
        break
if spawn_error is not None:
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    except OSError as error:
        fork_error = errno.errorcode.get(error.errno, str(error.errno))
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
print(json.dumps({"started": len(children), "spawn": spawn_error, "fork": fork_error}), flush=True)
time.sleep(600)
"""


def test_pod_pid_limit_is_in_its_cgroup_and_stops_a_fork_bomb(
    local_cluster: LocalCluster, pods: Pods
) -> None:
    body = pod(
        "forks",
        "sandbox-runtime-python:dev",
        ["python3", "-c", _FORK_BOMB, str(POD_PIDS_LIMIT + 64)],
        restartPolicy="Always",
        container={"securityContext": restricted(1000)},
    )
    running = pods.run(body)
    cgroup = local_cluster.pod_cgroup("pids", running["metadata"]["uid"])
    assert (cgroup / "pids.max").read_text().strip() == str(POD_PIDS_LIMIT)

    report: dict[str, Any] = {}

    def reported() -> bool:
        nonlocal report
        lines = pods.logs("forks").splitlines()
        report = json.loads(lines[-1]) if lines else {}
        return bool(report)

    wait_for(reported, "the fork bomb's report")
    print(f"\nfork bomb against podPidsLimit {POD_PIDS_LIMIT}: {report}")
    # Refused by the kernel with EAGAIN, a few short of the limit: the pause
    # process and the python parent count too.
    assert report["spawn"] == "EAGAIN", report
    assert report["fork"] == "EAGAIN", report
    assert POD_PIDS_LIMIT - 16 <= report["started"] < POD_PIDS_LIMIT, report
    # ...and refused by the pids cgroup limit, not by some other one (an
    # RLIMIT_NPROC of the user, the machine's pid_max): the refusals are
    # counted in pids.events (by this kernel in the cgroup the fork came from,
    # the container's; by others in the one whose limit was hit), and no cgroup
    # of the pod has a lower limit than the pod's own.
    tree = [cgroup, *(path for path in cgroup.rglob("*") if (path / "pids.max").is_file())]
    refused = 0
    for member in tree:
        events = dict(line.split() for line in (member / "pids.events").read_text().splitlines())
        refused += int(events["max"])
        limit = (member / "pids.max").read_text().strip()
        assert limit == "max" or int(limit) >= POD_PIDS_LIMIT, (member, limit)
    assert refused >= 2, tree


def test_pause_exits_zero_on_sigterm_and_sigint(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    subprocess.run(
        ["gcc", "-static", "-Os", "-o", str(binary), str(images.PAUSE_SOURCE)],
        check=True,
        capture_output=True,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([str(binary)], stderr=subprocess.DEVNULL)
        time.sleep(0.2)
        assert proc.poll() is None, "pause must keep running until signalled"
        proc.send_signal(sig)
        assert proc.wait(timeout=5) == 0


# ---- clusters of this test's own: start twice, crash, stop ---------------------------


def _iptables_lines() -> set[str]:
    return {
        line
        for line in network.iptables_save().splitlines()
        if line and not line.startswith("#") and not line.startswith("COMMIT")
    }


def _shims_of(cluster: LocalCluster) -> list[int]:
    socket = str(cluster.containerd_socket).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and socket in cmdline:
                    found.append(int(entry.name))
    return found


def _populate(cluster: LocalCluster) -> None:
    """Pods that leave every kind of trace: a hostPort (iptables), a Secret
    volume (tmpfs mount under the kubelet dir), an emptyDir, containers
    (overlay mounts, shims, cgroups, a veth on the bridge)."""
    with KubeJSON(cluster.kubeconfig) as kube:
        kube.create(
            core_path("secrets", "default"),
            {"metadata": {"name": "s"}, "stringData": {"k": "v"}},
        )
        body = pod(
            "traces",
            "sandbox-runtime-python:dev",
            ["python3", "-m", "http.server", "8000"],
            restartPolicy="Always",
            volumes=[
                {"name": "s", "secret": {"secretName": "s"}},
                {"name": "e", "emptyDir": {}},
            ],
            container={
                "ports": [{"containerPort": 8000, "hostPort": 18000}],
                "volumeMounts": [
                    {"name": "s", "mountPath": "/s"},
                    {"name": "e", "mountPath": "/e"},
                ],
                "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
            },
        )
        Pods(cluster, kube, "default").run(body)


def _assert_nothing_left(
    cluster: LocalCluster, pids: dict[str, int], iptables_before: set[str]
) -> None:
    for name, pid in pids.items():
        assert processes.group_members(pid) == [], f"{name}'s process group survived"
    assert _shims_of(cluster) == []
    assert processes_using(cluster.state_dir) == []
    assert mounts.mount_points_under(cluster.state_dir) == []
    net = cluster.pod_network
    assert not network.bridge_exists(net.bridge)
    assert network.rules_of(net) == []
    after = _iptables_lines()
    added = after - iptables_before
    ours = [line for line in added if net.name in line or str(net.subnet) in line]
    assert not ours, ours
    # portmap's shared chains go once no pod of any cluster has a hostPort
    # (other sessions' clusters may have some right now).
    if not any(line.startswith("-A CNI-HOSTPORT-DNAT ") for line in after):
        assert not [line for line in added if "CNI-HOSTPORT" in line], added
    # kube-proxy's and kube-network-policies' tables, and the NFQUEUE binding.
    tables = netstack.nft_tables()
    assert not set(netstack.tables_of(net)) & tables, tables
    assert not netstack.queue_bound(netstack.nfqueue_id(net))
    for hierarchy in mounts.cgroup_hierarchies():
        assert not (hierarchy / cluster.cgroup_root.lstrip("/")).exists()
    assert not cluster.node_dir.exists()


def test_stop_leaves_nothing_and_start_recovers_from_a_crash(
    local_cluster: LocalCluster,
) -> None:
    # local_cluster: built everything, and must survive this test's clusters.
    iptables_before = _iptables_lines()
    cluster = LocalCluster(
        f"pytest-{os.getpid()}-node-own",
        images=["sandbox-runtime-python:dev"],
        die_with_parent=True,
    )
    try:
        cluster.start()
        first = cluster.pids()
        cluster.start()  # twice in a row: a clean restart
        assert cluster.is_healthy()
        assert set(cluster.pids().values()).isdisjoint(first.values())
        _populate(cluster)
        net = cluster.pod_network
        assert {
            ("ip", netstack.kube_proxy_table(net)),
            ("inet", netstack.network_policy_table(net)),
        } <= netstack.nft_tables()
        assert _shims_of(cluster)
        assert mounts.mount_points_under(cluster.state_dir)
        assert network.rules_of(cluster.pod_network)

        # A crash: kubelet and containerd die; shims, containers, mounts,
        # the bridge and the portmap rules stay behind.
        crashed = cluster.pids()
        for name in ("kubelet", "containerd"):
            os.killpg(crashed[name], signal.SIGKILL)
        wait_for(lambda: not processes.group_members(crashed["containerd"]), "containerd gone")
        assert _shims_of(cluster), "shims outlive containerd"

        fresh = LocalCluster(
            cluster.name, images=["sandbox-runtime-python:dev"], die_with_parent=True
        )
        fresh.start()  # cleans up the crashed run first
        assert fresh.is_healthy()
        pids = fresh.pids()
        assert set(pids.values()).isdisjoint(crashed.values())
        assert network.rules_of(fresh.pod_network) == [], "the crashed run's rules are gone"

        fresh.stop()
        _assert_nothing_left(fresh, {**crashed, **pids}, iptables_before)
        # Logs and the image store stay after stop(); everything goes with remove_state.
        assert (fresh.logs_dir / "kubelet.log").stat().st_size > 0
        fresh.stop(remove_state=True)
        assert not fresh.state_dir.exists()
    finally:
        cluster.stop(remove_state=True)
    assert local_cluster.is_healthy(), "stopping one node cluster must not touch another"


def test_cli_up_node_and_down(local_cluster: LocalCluster) -> None:
    name = f"pytest-{os.getpid()}-node-cli"
    cluster = LocalCluster(name)
    cli = devcluster_cli
    try:
        up = cli("up", "--node", "--name", name, "--images", "sandbox-runtime-python:dev")
        assert up.returncode == 0, up.stderr
        assert Path(up.stdout.strip()) == cluster.kubeconfig
        net = cluster.pod_network
        assert f"cluster DNS {net.dns_ip}" in up.stderr
        status = cli("status", "--name", name)
        assert status.returncode == 0, status.stdout
        assert "kubelet" in status.stdout
        assert "containerd" in status.stdout
        pids = cluster.pids()
        down = cli("down", "--name", name)
        assert down.returncode == 0, down.stderr
        for pid in pids.values():
            assert processes.group_members(pid) == []
        assert not cluster.state_dir.exists()
        assert not network.bridge_exists(network.PodNetwork(name, network.POD_SUPERNET).bridge)
    finally:
        cluster.stop(remove_state=True)
