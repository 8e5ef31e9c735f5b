"""Sandboxes on the real local node, side by side with their baselines.

    python benchmarks/node_bench.py [--count 20] [--execs 30]

1. Cold start: Sandbox created -> Ready, against a bare Pod with the same
   images, volume and token Secret created directly (the pod the operator
   would build, without the operator) -> Ready. One at a time, `--count` each.
2. Command round trip: `true` through the agent at the pod IP against
   `kubectl exec` of `true` in the same pod's sandbox container.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    latency_row,
    operator_cluster,
    sandbox_ready,
    wait_until,
)
from devcluster.cluster import LocalCluster  # noqa: E402
from sandbox_operator import identity  # noqa: E402
from sandbox_operator.api.sandbox import SandboxSpec  # noqa: E402
from sandbox_operator.builders import sandbox as build  # noqa: E402
from sandbox_operator.config import Settings  # noqa: E402
from tests.kube import KubeJSON, api_path, core_path  # noqa: E402

NS = "bench"


def _pod_ready(kube: KubeJSON, name: str) -> bool:
    pod = kube.get(core_path("pods", NS, name)) or {}
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def sandbox_start(kube: KubeJSON, name: str) -> float:
    started = time.monotonic()
    kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxes", NS),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {},
        },
    )
    wait_until(lambda: sandbox_ready(kube, NS, name))
    return time.monotonic() - started


def bare_start(kube: KubeJSON, name: str, settings: Settings) -> float:
    """The same PVC, Secret and Pod the operator builds, created directly, unowned."""
    ref = identity.SandboxRef(name=name, namespace=NS, uid="00000000-0000-0000-0000-000000000000")
    spec = SandboxSpec()
    objects = [
        build.build_secret(ref, base64.b64encode(os.urandom(24)).decode()),
        build.build_claim(ref, spec, settings),
        build.build_pod(ref, spec, settings),
    ]
    started = time.monotonic()
    for obj in objects:
        assert obj is not None
        obj["metadata"].pop("ownerReferences")
        obj["metadata"]["labels"] = {"bench": "bare"}  # not the operator's
        plural = {
            "Secret": "secrets",
            "PersistentVolumeClaim": "persistentvolumeclaims",
            "Pod": "pods",
        }
        kube.create(core_path(plural[obj["kind"]], NS), obj)
    wait_until(lambda: _pod_ready(kube, name))
    return time.monotonic() - started


def exec_round_trips(
    cluster: LocalCluster, kube: KubeJSON, name: str, count: int
) -> tuple[list[float], list[float]]:
    agent_times, kubectl_times = [], []
    with agent_client(kube, NS, name) as client:
        for _ in range(count):
            began = time.perf_counter()
            response = client.post("/v1/executions", json={"argv": ["true"]})
            agent_times.append(time.perf_counter() - began)
            assert response.status_code == 200, response.text
            assert response.json()["exitCode"] == 0, response.text
    argv = [
        str(cluster.kubectl),
        f"--kubeconfig={cluster.kubeconfig}",
        "exec",
        "-n",
        NS,
        name,
        "-c",
        "sandbox",
        "--",
        "true",
    ]
    for _ in range(count):
        began = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        kubectl_times.append(time.perf_counter() - began)
    return agent_times, kubectl_times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--execs", type=int, default=30)
    args = parser.parse_args()
    with operator_cluster(f"bench-node-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        settings = Settings()
        sandbox_times, bare_times = [], []
        for i in range(args.count):
            # Interleaved, and each deleted before the next: same node load for both.
            sandbox_times.append(sandbox_start(kube, f"s{i}"))
            if i > 0:
                kube.delete(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, f"s{i - 1}"))
            bare_times.append(bare_start(kube, f"b{i}", settings))
            kube.delete(core_path("pods", NS, f"b{i}"))
        agent, kubectl = exec_round_trips(cluster, kube, f"s{args.count - 1}", args.execs)

        print(f"\nCold start, create -> Ready, {args.count} each, one at a time:")
        print(latency_row("Sandbox (operator, agent, runner)", sandbox_times))
        print(latency_row("bare Pod (same images, PVC, Secret)", bare_times))
        ratio = statistics.median(sandbox_times) / statistics.median(bare_times)
        print(f"  ratio p50: {ratio:.2f}x (target <= 1.5x)")
        print(f"\nCommand round trip `true`, {args.execs} each, same pod:")
        print(latency_row("agent HTTP (keep-alive)", agent))
        print(latency_row("kubectl exec", kubectl))
        speedup = statistics.median(kubectl) / statistics.median(agent)
        print(f"  agent is {speedup:.1f}x faster at p50 (target >= 20x)")


if __name__ == "__main__":
    main()
