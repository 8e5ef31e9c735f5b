"""What the node benchmarks share: percentiles, waiting, readiness, watching."""

from __future__ import annotations

import base64
import collections
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from devcluster import controlplane, deploy  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from tests.kube import JSON, ApiError, KubeJSON, api_path, core_path  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_row(label: str, values: list[float]) -> str:
    p50, p90 = statistics.median(values) * 1000, percentile(values, 0.9) * 1000
    return f"  {label:<36} p50 {p50:8.1f} ms   p90 {p90:8.1f} ms"


def _stat(proc: Path) -> list[str]:
    """The fields of /proc/PID/stat after the process name (field 3 on: state)."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def _cpu(stat: list[str]) -> float:
    """CPU seconds (user + system, all threads) from `_stat` fields."""
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    return _cpu(_stat(Path(f"/proc/{pid}")))


# Node processes by the start of their name (/proc/PID/comm), first match wins.
COMPONENTS = (
    ("kube-apiserver", "kube-apiserver"),
    ("etcd", "etcd"),
    ("kubelet", "kubelet"),
    ("kube-controller", "kube-controller-manager"),
    ("kube-scheduler", "kube-scheduler"),
    ("containerd-shim", "containerd shims"),
    ("containerd", "containerd"),
    ("kopf", "operator"),
    ("sandbox-gateway", "gateway"),
    ("sandbox-agent", "sandbox agents"),
)


def _processes() -> dict[tuple[int, str], tuple[str, float]]:
    """Every process now, keyed by PID and start time (a reused PID is another
    process), to its component and the CPU seconds it has used."""
    me = os.getpid()
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            stat = _stat(entry)
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        label = next((name for prefix, name in COMPONENTS if comm.startswith(prefix)), "other")
        found[(pid, stat[19])] = ("benchmark" if pid == me else label, _cpu(stat))
    return found


def _machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the machine so far, summed over its cores."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / tick, sum(ticks) / tick


@dataclass
class CpuUse:
    """What the machine's CPUs did over a stretch of time (`cpu_use`)."""

    wall: float = 0.0
    busy: float = 0.0
    available: float = 0.0
    by_component: dict[str, float] = field(default_factory=dict)

    def report(self) -> str:
        share = self.busy / self.available if self.available else 0.0
        ranked = sorted(self.by_component.items(), key=lambda item: -item[1])
        parts = ", ".join(f"{name} {cpu:.2f}" for name, cpu in ranked)
        return (
            f"  CPU: {self.busy:.2f} of {self.available:.2f} CPU-s busy ({share:.0%}) over"
            f" {self.wall:.2f} s on {os.cpu_count()} cores\n  by component (CPU-s): {parts}"
        )

    def to_json(self) -> JSON:
        return {
            "wall_s": self.wall,
            "busy_cpu_s": self.busy,
            "available_cpu_s": self.available,
            "by_component_cpu_s": dict(self.by_component),
        }


@contextmanager
def cpu_use() -> Iterator[CpuUse]:
    """Measures, from entry to exit, the CPU seconds of the whole machine and of
    each node component (processes that ended meanwhile count only in the
    machine's total): whether a stretch was bound by CPU, and by whose."""
    use = CpuUse()
    before, (busy0, all0), started = _processes(), _machine_cpu(), time.monotonic()
    yield use
    after, (busy1, all1) = _processes(), _machine_cpu()
    use.wall, use.busy, use.available = time.monotonic() - started, busy1 - busy0, all1 - all0
    for key, (label, cpu) in after.items():
        used = cpu - before.get(key, (label, 0.0))[1]
        use.by_component[label] = use.by_component.get(label, 0.0) + used


def write_results(name: str, results: dict[str, Any]) -> None:
    """benchmarks/results/<name>-<time>.json (not tracked by git)."""
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


def audit_flags(work: Path, users: list[str]) -> tuple[list[str], Path]:
    """kube-apiserver flags for an audit log of the requests of `users` (metadata
    only, every other user left out), and the log's path. One file, never
    rotated (left at 0, the size limit is 100 MB): the counts read only this
    file, and a 10,000-Sandbox run writes more than that."""
    log = work / "audit.log"
    policy = work / "audit-policy.json"
    return controlplane.audit_flags(policy, log, {"users": users}, max_megabytes=100_000), log


def audit_requests(log: Path, user: str, since: float, until: float) -> collections.Counter[str]:
    """The API requests `user` made from `since` to `until` (epoch seconds, to the
    microsecond), by "verb resource[/subresource]": one per request (a watch's
    stages are one), from an audit log that `audit_flags` set up."""
    counts: collections.Counter[str] = collections.Counter()
    seen: set[str] = set()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != user or event["auditID"] in seen:
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if not since <= received <= until:
            continue
        seen.add(event["auditID"])
        ref = event.get("objectRef") or {}
        sub = ref.get("subresource")
        counts[f"{event['verb']} {ref.get('resource', '?')}{'/' + sub if sub else ''}"] += 1
    return counts


def wait_until(probe: Callable[[], Any], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)


@contextmanager
def operator_cluster(name: str, values: list[str] | None = None) -> Iterator[LocalCluster]:
    """A new node cluster with the operator installed from the chart (with `values`,
    `key=value` as for `helm --set`); removed at the end."""
    cluster = deploy.node_cluster(name)
    cluster.start()
    try:
        deploy.install_operator(cluster, extra_values=values)
        deploy.wait_for_crds(cluster)
        yield cluster
    finally:
        cluster.stop(remove_state=True)


def create_namespace(kube: KubeJSON, name: str, labels: dict[str, str] | None = None) -> None:
    """A namespace, once its `default` ServiceAccount (which pods need) is there."""
    kube.create(core_path("namespaces"), {"metadata": {"name": name, "labels": labels or {}}})
    wait_until(lambda: kube.get(core_path("serviceaccounts", name, "default")) is not None)


def sandbox_ready(kube: KubeJSON, namespace: str, name: str) -> bool:
    body = kube.get(api_path("sandbox.dev/v1alpha1", "sandboxes", namespace, name)) or {}
    conds = (body.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def ready_sandbox(kube: KubeJSON, namespace: str, name: str) -> str:
    """Create a python Sandbox and wait until it is Ready; its pod's name."""
    kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxes", namespace),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"runtime": "python"},
        },
    )
    wait_until(lambda: sandbox_ready(kube, namespace, name))
    body = kube.get(api_path("sandbox.dev/v1alpha1", "sandboxes", namespace, name)) or {}
    return str((body.get("status") or {}).get("podName") or name)


def echo_pod(
    kube: KubeJSON, namespace: str, name: str, image: str, program: str, port: int
) -> JSON:
    """A floor's pod: `python3 -c program` listening on `port`, with no probe but a
    TCP readiness check, and a Service of the same name in front of it (the
    gateway's route shape: the API server's service proxy); the pod, once Ready."""
    kube.create(
        core_path("services", namespace),
        {
            "metadata": {"name": name},
            "spec": {"selector": {"bench": name}, "ports": [{"port": port, "targetPort": port}]},
        },
    )
    kube.create(
        core_path("pods", namespace),
        {
            "metadata": {"name": name, "labels": {"bench": name}},
            "spec": {
                "containers": [
                    {
                        "name": "echo",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python3", "-c", program],
                        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
                    }
                ],
                "terminationGracePeriodSeconds": 0,
            },
        },
    )

    def ready() -> JSON | None:
        pod = kube.get(core_path("pods", namespace, name)) or {}
        conditions = (pod.get("status") or {}).get("conditions") or []
        return (
            pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None
        )

    wait_until(ready, 120)
    return kube.read(core_path("pods", namespace, name))


def gateway_pod_url(kube: KubeJSON) -> str:
    """A gateway replica at its pod IP: the route a client in the cluster has
    (the gateway Service's name), without the API server's service proxy."""
    pods = kube.list(
        core_path("pods", deploy.NAMESPACE), label_selector="app.kubernetes.io/name=sandbox-gateway"
    )
    ready = [p for p in pods if (p.get("status") or {}).get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080"


def agent_client(
    kube: KubeJSON, namespace: str, name: str, timeout: float | None = 120
) -> httpx.Client:
    """An HTTP client of a Ready Sandbox's agent at its pod IP, with its token."""
    body = kube.read(api_path("sandbox.dev/v1alpha1", "sandboxes", namespace, name))
    secret = kube.read(core_path("secrets", namespace, f"{name}-agent-token"))
    token = base64.b64decode(secret["data"]["token"]).decode()
    return httpx.Client(
        base_url=body["status"]["agentEndpoint"],
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout,
    )


class Watcher:
    """Follows a collection through one watch at a time (re-opened when the server
    ends it) and notes, per object name, when each state `classify` gives it was
    first seen (monotonic clock, on arrival of the event), and how many objects
    reached each state. `keep_last` keeps each object's latest version in `last`
    (a benchmark of thousands of pods leaves it off)."""

    def __init__(
        self,
        kubeconfig: Path | str,
        path: str,
        classify: Callable[[JSON], str | None],
        keep_last: bool = True,
    ) -> None:
        self.path, self.classify, self.keep_last = path, classify, keep_last
        self.kube = KubeJSON(kubeconfig)
        self.seen: dict[str, dict[str, float]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.last: dict[str, JSON] = {}
        self.changed = threading.Condition()
        self.closing = False
        # The list's version: events from here on; the thread starts watching now.
        self.version = self._list_version()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.closing:
            try:
                for event in self.kube.watch(self.path, self.version, timeout_seconds=120):
                    arrived = time.monotonic()
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        raise ApiError(int(obj.get("code", 500)), str(obj.get("message")), obj)
                    self.version = obj["metadata"]["resourceVersion"]
                    if event["type"] not in ("ADDED", "MODIFIED"):
                        continue
                    state = self.classify(obj)
                    with self.changed:
                        name = obj["metadata"]["name"]
                        if self.keep_last:
                            self.last[name] = obj
                        states = self.seen.setdefault(name, {})
                        if state is not None and state not in states:
                            states[state] = arrived
                            self.counts[state] += 1
                        self.changed.notify_all()
            except ApiError as exc:
                if self.closing:
                    return
                if exc.status != 410:
                    raise
                # Too old a version: go on from the present (states may be missed).
                self.version = self._list_version()
            except Exception:
                if self.closing:
                    return  # the client was closed under the open watch
                raise

    def wait(self, name: str, states: set[str], timeout: float = 300) -> tuple[str, float]:
        """The first of `states` that `name` reached, and when it was seen."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                reached = [(t, s) for s, t in self.seen.get(name, {}).items() if s in states]
                if reached:
                    moment, state = min(reached)
                    return state, moment
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    raise SystemExit(f"{name}: none of {sorted(states)} within {timeout} s")
                self.changed.wait(min(left, 1.0))

    def _list_version(self) -> str:
        # A just-created CRD's storage answers 429 ("storage is (re)initializing")
        # for a moment.
        for _ in range(60):
            try:
                return str(self.kube.read(self.path)["metadata"]["resourceVersion"])
            except ApiError as exc:
                if exc.status != 429:
                    raise
                time.sleep(0.5)
        raise SystemExit(f"{self.path}: still 429 after 30 s")

    def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Whether `done()` (asked under the lock after each event: keep it cheap)
        came true within `timeout` seconds."""
        with self.changed:
            self.changed.wait_for(lambda: done() or not self.thread.is_alive(), timeout)
            if not done() and not self.thread.is_alive():
                raise SystemExit(f"the watch of {self.path} ended")
            return done()

    def close(self) -> None:
        self.closing = True
        self.kube.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_kubeconfig(
    kube: KubeJSON, namespace: str, binding: str, admin: Path, target: Path
) -> None:
    """`admin` with its user swapped for a cluster-admin ServiceAccount's token:
    the cluster's own kubeconfig holds a client certificate, which the gateway
    does not take (the SDK would fetch a token per call)."""
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(core_path("serviceaccounts", namespace), {"metadata": {"name": "bench"}})
    kube.create(
        api_path(rbac, "clusterrolebindings"),
        {
            "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "bench", "namespace": namespace}],
        },
    )  # fmt: skip
    issued = kube.create(
        core_path("serviceaccounts", namespace, "bench", "token"),
        {"spec": {"expirationSeconds": 7200}},
    )
    config: dict[str, Any] = yaml.safe_load(admin.read_text())
    for user in config["users"]:
        user["user"] = {"token": issued["status"]["token"]}
    target.write_text(yaml.safe_dump(config))
