"""A file change's event: the SDK's watch through the gateway against two baselines, side by side.

    python benchmarks/watch_bench.py [--writes 200]

One sandbox under each runtime (runc, then gVisor) on the real local node. A
command in its sandbox container makes `--writes` new files in a directory,
one at a time, 40-120 ms apart at random (never in step with a poll), and
notes the time just before each. Three clients watch that directory at once
and note when each file's first event reaches them:

- sdk: `sandbox.files.watch()` through the API server's service proxy and
  the gateway, the route users take; the agent watches in its own container;
- agent: the same watch read straight from the agent at its pod IP (no
  proxy, no gateway, no SDK);
- kubectl exec: inotify inside the sandbox container itself (a python3
  loop, what `inotifywait -m` does), its lines streamed back by `kubectl
  exec`: how one follows a container's files without this feature.

Latency: arrival at the client minus the write's time in the sandbox. One
clock: the benchmark runs on the node, whose clock runc containers read, and
gVisor's kernel keeps its time from the host's (a negative latency would
show an offset; the script prints the smallest).

Why these baselines. `kubectl exec` is the ratio that matters to a user: the
same changes, by the Kubernetes route they would otherwise take, and inotify
at the source, which sees every change at once under both runtimes (it runs
in the container that writes). Under gVisor it is also the floor: the agent's
inotify cannot see the other container's changes there and the agent polls
(`SANDBOX_AGENT_WATCH_POLL_INTERVAL`, 0.25 s), so sdk over kubectl exec is
the price of polling. sdk over agent is what the access path adds (API
server proxy, gateway, SDK) to the agent's own stream. All three see the
same writes at the same moments, so the machine's load weighs on each alike.

And what watching costs while nothing changes: the pod's CPU (its cgroup's
cpuacct.usage: agent and runner under runc; gVisor's kernel, the agent and
the gofers under gVisor) over `--cpu-seconds`, without a watch, then with a
recursive watch held open of the directory: the latency run's files and a
tree of 2,000 more in 20 directories.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    latency_row,
    operator_cluster,
    percentile,
    sandbox_ready,
    token_kubeconfig,
    wait_until,
    write_results,
)
from devcluster import gvisor  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from sandbox_sdk import SandboxClient, Watch  # noqa: E402
from tests.kube import KubeJSON, api_path, core_path  # noqa: E402

NS = "bench-watch"
DIR = "bench"
RUNTIMES = {"runc": None, "gvisor": gvisor.RUNTIME_CLASS}
CLIENTS = ("sdk", "agent", "kubectl exec")
WARMUP = 5  # first files left out: connections and caches warming
TREE_FILES = 2000  # TREE below (with WRITER's files beside them)

# Run in the sandbox container: new files, apart at random; "index time" for each.
WRITER = """
import os, random, sys, time
count, where = int(sys.argv[1]), sys.argv[2]
pause = random.Random(7)
for i in range(count):
    time.sleep(pause.uniform(0.04, 0.12))
    began = time.time()
    fd = os.open(f"{where}/f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"x")
    os.close(fd)
    print(i, repr(began))
"""
# Run in the sandbox container: 20 directories of 100 files (and WRITER's files).
TREE = """
import os, sys
for d in range(20):
    os.makedirs(f"{sys.argv[1]}/tree/d{d}")
    for f in range(100):
        with open(f"{sys.argv[1]}/tree/d{d}/f{f}", "w") as out:
            out.write("x")
"""
# Run by `kubectl exec` in the sandbox container: each name created, a line.
INOTIFY = """
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
if fd < 0 or libc.inotify_add_watch(fd, sys.argv[1].encode(), 0x100) < 0:  # IN_CREATE
    sys.exit(f"inotify: errno {ctypes.get_errno()}")
print("ready", flush=True)
while True:
    buf, pos, names = os.read(fd, 65536), 0, []
    while pos < len(buf):
        _wd, _mask, _cookie, size = struct.unpack_from("iIII", buf, pos)
        names.append(buf[pos + 16 : pos + 16 + size].rstrip(b"\\0").decode())
        pos += 16 + size
    sys.stdout.write("".join(name + "\\n" for name in names))
    sys.stdout.flush()
"""


class Arrivals:
    """When each file's first event reached one client (wall clock, as the writer's)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.lock = threading.Lock()
        self.failed: Exception | None = None

    def saw(self, name: str) -> None:
        now = time.time()
        index = int(name.rsplit("/", 1)[-1].removeprefix("f"))
        with self.lock:
            self.at.setdefault(index, now)

    def count(self) -> int:
        with self.lock:
            return len(self.at)


def follow_sdk(watch: Watch, arrivals: Arrivals) -> None:
    try:
        for event in watch:
            if event.type == "create" and event.path:
                arrivals.saw(event.path)
    except Exception as exc:  # reported by the main thread
        arrivals.failed = exc


def follow_agent(lines: Any, arrivals: Arrivals) -> None:
    try:
        for line in lines:
            if line:
                event = json.loads(line)
                if event["type"] == "create":
                    arrivals.saw(event["path"])
    except Exception as exc:  # reported by the main thread
        arrivals.failed = exc


def follow_kubectl(proc: subprocess.Popen[bytes], arrivals: Arrivals) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        name = raw.decode().strip()
        if name.startswith("f"):
            arrivals.saw(name)


def create_sandbox(kube: KubeJSON, name: str, runtime_class: str | None) -> None:
    spec: dict[str, object] = {"runtime": "python"}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxes", NS),
        {"apiVersion": "sandbox.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": name},
         "spec": spec},
    )  # fmt: skip


def measure(
    kubectl: Path, kubeconfig: Path, kube: KubeJSON, name: str, writes: int
) -> dict[str, Any]:
    """One sandbox: the three clients watching while the writer runs."""
    arrivals = {client: Arrivals() for client in CLIENTS}
    threads: list[threading.Thread] = []
    with SandboxClient(NS, kubeconfig=kubeconfig) as sdk:
        box = sdk.connect(name)
        box.execute(f"rm -rf {DIR} && mkdir {DIR}", check=True)
        proc = subprocess.Popen(
            [str(kubectl), f"--kubeconfig={kubeconfig}", "exec", "-n", NS, name, "-c", "sandbox",
             "--", "python3", "-u", "-c", INOTIFY, f"/workspace/{DIR}"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        direct = agent_client(kube, NS, name, timeout=None)
        stream = direct.stream("GET", "/v1/files/watch", params={"path": DIR})
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                raise SystemExit("kubectl exec: the in-container watch did not start")
            response = stream.__enter__()
            lines = response.iter_lines()
            started = json.loads(next(line for line in lines if line))
            assert started["type"] == "started", started
            with box.files.watch(DIR) as watch:
                assert watch.started is not None
                mode = watch.started.mode
                threads = [
                    threading.Thread(target=follow_sdk, args=(watch, arrivals["sdk"])),
                    threading.Thread(target=follow_agent, args=(lines, arrivals["agent"])),
                    threading.Thread(target=follow_kubectl, args=(proc, arrivals["kubectl exec"])),
                ]
                for thread in threads:
                    thread.daemon = True
                    thread.start()
                ran = box.execute(
                    ["python3", "-c", WRITER, str(writes), DIR], timeout=writes * 0.2 + 60
                )
                assert ran.exit_code == 0, ran.stderr
                written = {
                    int(i): float(t) for i, t in (line.split() for line in ran.stdout.splitlines())
                }

                def complete() -> bool:
                    for client, seen in arrivals.items():
                        if seen.failed is not None:
                            raise SystemExit(f"{client}: {seen.failed!r}")
                    return all(seen.count() >= writes for seen in arrivals.values())

                wait_until(complete, timeout=60)
        finally:
            proc.kill()
            proc.wait(10)
            stream.__exit__(None, None, None)
            direct.close()
    latencies = {
        client: [seen.at[i] - written[i] for i in range(WARMUP, writes)]
        for client, seen in arrivals.items()
    }
    return {"mode": mode, "latencies": latencies}


def pod_cpu(cluster: LocalCluster, kube: KubeJSON, name: str) -> float:
    """CPU seconds the sandbox's pod has used so far (its cgroup)."""
    body = kube.read(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, name))
    pod = kube.read(core_path("pods", NS, body["status"].get("podName") or name))
    usage = cluster.pod_cgroup("cpuacct", pod["metadata"]["uid"]) / "cpuacct.usage"
    return int(usage.read_text()) / 1e9


def idle_watch_cpu(
    cluster: LocalCluster, kube: KubeJSON, kubeconfig: Path, name: str, seconds: float
) -> dict[str, float]:
    """The pod's CPU share (of one core) with nothing changing: no watch, then a
    recursive watch of TREE_FILES files held open."""
    with SandboxClient(NS, kubeconfig=kubeconfig) as sdk:
        box = sdk.connect(name)
        box.execute(["python3", "-c", TREE, DIR], check=True)
        time.sleep(1)
        before = pod_cpu(cluster, kube, name)
        time.sleep(seconds)
        idle = pod_cpu(cluster, kube, name) - before
        with box.files.watch(DIR, recursive=True) as watch:
            assert watch.started is not None
            directories = watch.started.watches or 0
            time.sleep(1)  # past its first scans
            before = pod_cpu(cluster, kube, name)
            time.sleep(seconds)
            watching = pod_cpu(cluster, kube, name) - before
    return {
        "idle_cpu_share": idle / seconds,
        "watching_cpu_share": watching / seconds,
        "directories": directories,
    }


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_s": statistics.median(values),
        "p90_s": percentile(values, 0.9),
        "p99_s": percentile(values, 0.99),
        "min_s": min(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--cpu-seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.writes <= WARMUP:
        raise SystemExit(f"--writes must be more than {WARMUP}")
    results: dict[str, Any] = {"load": os.getloadavg(), "writes": args.writes}
    with operator_cluster(f"bench-watch-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        kubeconfig = cluster.kubeconfig.parent / "bench-watch.kubeconfig"
        token_kubeconfig(kube, NS, "bench-watch", cluster.kubeconfig, kubeconfig)
        for runtime, runtime_class in RUNTIMES.items():
            create_sandbox(kube, runtime, runtime_class)
        for runtime in RUNTIMES:
            wait_until(functools.partial(sandbox_ready, kube, NS, runtime))
        for runtime in RUNTIMES:
            measured = measure(cluster.kubectl, kubeconfig, kube, runtime, args.writes)
            lat: dict[str, list[float]] = measured["latencies"]
            count = args.writes - WARMUP
            print(
                f"\n{runtime}: a new file -> its first event at the client, {count} files"
                f" (the agent's watch: {measured['mode']})"
            )
            for client in CLIENTS:
                values = lat[client]
                p99 = percentile(values, 0.99) * 1000
                print(f"{latency_row(client, values)}   p99 {p99:8.1f} ms")
            ratio_exec = statistics.median(lat["sdk"]) / statistics.median(lat["kubectl exec"])
            ratio_exec_p99 = percentile(lat["sdk"], 0.99) / percentile(lat["kubectl exec"], 0.99)
            ratio_agent = statistics.median(lat["sdk"]) / statistics.median(lat["agent"])
            smallest = min(min(values) for values in lat.values()) * 1000
            print(
                f"  sdk / kubectl exec: p50 {ratio_exec:.2f}x, p99 {ratio_exec_p99:.2f}x;"
                f" sdk / agent: p50 {ratio_agent:.2f}x  (smallest latency {smallest:.1f} ms)"
            )
            results[runtime] = {
                "agent_mode": measured["mode"],
                **{client: summary(lat[client]) for client in CLIENTS},
                "ratio_sdk_over_kubectl_exec_p50": ratio_exec,
                "ratio_sdk_over_kubectl_exec_p99": ratio_exec_p99,
                "ratio_sdk_over_agent_p50": ratio_agent,
            }
        for runtime in RUNTIMES:
            cpu = idle_watch_cpu(cluster, kube, kubeconfig, runtime, args.cpu_seconds)
            print(
                f"\n{runtime}: the pod's CPU with nothing changing, {args.cpu_seconds:.0f} s each:"
                f" no watch {cpu['idle_cpu_share']:.1%} of a core; a recursive watch of"
                f" {TREE_FILES:,} files in {cpu['directories']:.0f} directories"
                f" {cpu['watching_cpu_share']:.1%}"
            )
            results[runtime].update(cpu)
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("watch_bench", results)


if __name__ == "__main__":
    main()
