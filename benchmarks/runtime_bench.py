"""runc against gVisor on the real local node, side by side in one run.

    python benchmarks/runtime_bench.py [--count 10] [--execs 50]

The same Sandbox is created under each runtime (runc: no runtimeClassName;
gVisor: `runtimeClassName: gvisor`), interleaved so both see the same node:

1. Cold start: Sandbox created -> Ready, one at a time, `--count` each.
2. Command round trip: `true` through the agent at the pod IP, `--execs` each.
3. Work that crosses the kernel often: a Python loop of file create, write,
   stat and unlink in the workspace, and a pure-CPU loop, timed inside the
   sandbox (so the agent's round trip is not in it).
4. Memory: the pod's working set once idle (kubelet stats), which for gVisor
   includes its own kernel (the Sentry) and the gofers.

Ratios are gVisor over runc: above 1 means gVisor is slower or bigger.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    latency_row,
    operator_cluster,
    sandbox_ready,
    wait_until,
    write_results,
)
from devcluster import gvisor  # noqa: E402
from tests.kube import KubeJSON, api_path  # noqa: E402

NS = "bench"
RUNTIMES = {"runc": None, "gvisor": gvisor.RUNTIME_CLASS}

FILE_LOOP = """
import os, time
began = time.perf_counter()
for i in range(2000):
    name = f"bench-{i}.tmp"
    with open(name, "w") as f:
        f.write("x" * 100)
    os.stat(name)
    os.unlink(name)
print(time.perf_counter() - began)
"""
CPU_LOOP = """
import time
began = time.perf_counter()
total = 0
for i in range(3_000_000):
    total += i * i
print(time.perf_counter() - began)
"""


def start(kube: KubeJSON, name: str, runtime_class: str | None) -> float:
    spec: dict[str, object] = {}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    began = time.monotonic()
    kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxes", NS),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    wait_until(lambda: sandbox_ready(kube, NS, name))
    return time.monotonic() - began


def run(client: httpx.Client, argv: list[str]) -> str:
    response = client.post("/v1/executions", json={"argv": argv})
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["exitCode"] == 0, record
    return str(record["stdout"])


def round_trips(client: httpx.Client, count: int) -> list[float]:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        run(client, ["true"])
        times.append(time.perf_counter() - began)
    return times


def inside(client: httpx.Client, program: str, repeats: int = 3) -> float:
    """Median seconds `program` reports for itself."""
    return statistics.median(float(run(client, ["python3", "-c", program])) for _ in range(repeats))


def pod_working_set(kube: KubeJSON, node: str, pod: str) -> int:
    summary = kube.read(f"/api/v1/nodes/{node}/proxy/stats/summary")
    for entry in summary.get("pods", []):
        if (entry["podRef"]["namespace"], entry["podRef"]["name"]) == (NS, pod):
            return int(entry["memory"]["workingSetBytes"])
    raise AssertionError(f"no stats for pod {pod}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--execs", type=int, default=50)
    args = parser.parse_args()
    with operator_cluster(f"bench-runtime-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        starts: dict[str, list[float]] = {name: [] for name in RUNTIMES}
        for i in range(args.count):
            for name, runtime_class in RUNTIMES.items():
                starts[name].append(start(kube, f"{name}-{i}", runtime_class))
                if i < args.count - 1:
                    kube.delete(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, f"{name}-{i}"))
        last = {name: f"{name}-{args.count - 1}" for name in RUNTIMES}
        clients = {name: agent_client(kube, NS, pod) for name, pod in last.items()}
        kernels = {name: run(client, ["uname", "-r"]).strip() for name, client in clients.items()}
        assert kernels["gvisor"] != kernels["runc"], kernels  # really two runtimes
        execs = {name: round_trips(client, args.execs) for name, client in clients.items()}
        files = {name: inside(client, FILE_LOOP) for name, client in clients.items()}
        cpu = {name: inside(client, CPU_LOOP) for name, client in clients.items()}
        time.sleep(15)  # idle, and the kubelet's stats are fresh
        memory = {name: pod_working_set(kube, cluster.node_name, pod) for name, pod in last.items()}

        def ratio(measured: dict[str, float]) -> float:
            return measured["gvisor"] / measured["runc"]

        p50 = {name: statistics.median(values) for name, values in starts.items()}
        exec_p50 = {name: statistics.median(values) for name, values in execs.items()}
        print(f"\nKernels seen from inside: {kernels}")
        print(f"\nCold start, create -> Ready, {args.count} each, one at a time:")
        for name, values in starts.items():
            print(latency_row(name, values))
        print(f"  gVisor/runc p50: {ratio(p50):.2f}x")
        print(f"\nCommand round trip `true` through the agent, {args.execs} each:")
        for name, values in execs.items():
            print(latency_row(name, values))
        print(f"  gVisor/runc p50: {ratio(exec_p50):.2f}x")
        print("\nInside the sandbox (median of 3):")
        print(
            f"  2,000 file create/write/stat/unlink: runc {files['runc'] * 1000:.0f} ms, "
            f"gVisor {files['gvisor'] * 1000:.0f} ms, {ratio(files):.2f}x"
        )
        print(
            f"  3,000,000-step CPU loop:             runc {cpu['runc'] * 1000:.0f} ms, "
            f"gVisor {cpu['gvisor'] * 1000:.0f} ms, {ratio(cpu):.2f}x"
        )
        mib = {name: value / 2**20 for name, value in memory.items()}
        print(
            f"\nIdle pod working set: runc {mib['runc']:.1f} MiB, gVisor {mib['gvisor']:.1f} MiB, "
            f"{ratio(mib):.2f}x"
        )
        write_results(
            "runtime",
            {
                "count": args.count,
                "execs": args.execs,
                "kernels": kernels,
                "cold_start_s": starts,
                "exec_s": execs,
                "file_loop_s": files,
                "cpu_loop_s": cpu,
                "idle_pod_working_set_bytes": memory,
                "ratios": {
                    "cold_start_p50": ratio(p50),
                    "exec_p50": ratio(exec_p50),
                    "file_loop": ratio(files),
                    "cpu_loop": ratio(cpu),
                    "idle_memory": ratio(mib),
                },
            },
        )


if __name__ == "__main__":
    main()
