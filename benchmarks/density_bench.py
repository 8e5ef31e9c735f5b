"""How many idle sandboxes the real local node holds, by resource profile.

    python benchmarks/density_bench.py [--standard 30] [--dense 130]

For each profile, side by side on one node: that many Sandboxes are created at
once, default in everything but `spec.resources.profile` (a workspace volume
each), and left idle. Once every one is Ready or held back by the scheduler,
the benchmark reports how many are Ready, what held the rest (the scheduler's
message), what the Ready ones request of the node, and what they use: the
kubelet's working set of each container, from its stats summary (the figure
its evictions go by). Then they are deleted, and the node settles before the
next profile.

The counts are for this node (2 cores, 24 GiB, the kubelet's default maxPods
of 110); the report shows which resource ran out first, so other nodes can be
worked out from it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    create_namespace,
    operator_cluster,
    wait_until,
    write_results,
)
from devcluster import deploy  # noqa: E402
from sandbox_operator.api.common import quantity_value  # noqa: E402
from tests.kube import JSON, KubeJSON, api_path, core_path  # noqa: E402

GROUP = "sandbox.dev/v1alpha1"


def ready_or_held(body: JSON) -> str | None:
    """ "Ready", the reason the scheduler holds it back, or None while it starts."""
    for cond in (body.get("status") or {}).get("conditions") or []:
        if cond["type"] != "Ready":
            continue
        if cond["status"] == "True":
            return "Ready"
        if cond.get("reason") == "Unschedulable":
            return f"Unschedulable: {cond.get('message', '')}"
    return None


def run_profile(kube: KubeJSON, node: str, profile: str, count: int) -> JSON:
    ns = f"density-{profile}"
    create_namespace(kube, ns, deploy.POD_SECURITY_RESTRICTED)
    path = api_path(GROUP, "sandboxes", ns)
    names = [f"idle-{i:03d}" for i in range(count)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:
        list(
            pool.map(
                lambda n: kube.create(
                    path,
                    {
                        "apiVersion": GROUP,
                        "kind": "Sandbox",
                        "metadata": {"name": n},
                        "spec": {"resources": {"profile": profile}},
                    },
                ),
                names,
            )
        )
    states: dict[str, str | None] = {}

    def settled() -> bool:
        states.clear()
        states.update({b["metadata"]["name"]: ready_or_held(b) for b in kube.list(path)})
        return len(states) == count and all(states.values())

    wait_until(settled, 1800)
    settle_s = time.monotonic() - started
    ready = sorted(n for n, s in states.items() if s == "Ready")
    held = collections.Counter(s for s in states.values() if s != "Ready")
    time.sleep(20)  # idle: the start's page cache and compiled code settled
    usage = working_sets(kube, node, ns)
    requests = pod_requests(kube, ns)
    result = {
        "profile": profile,
        "created": count,
        "ready": len(ready),
        "held": dict(held),
        "seconds_to_settle": round(settle_s, 1),
        "agent_mib_median": _median_mib(usage, "agent"),
        "sandbox_mib_median": _median_mib(usage, "sandbox"),
        "pod_mib_median": _median_mib(usage, "pod"),
        "requests_per_pod": requests,
    }
    kube.delete(core_path("namespaces", name=ns))
    wait_until(lambda: kube.get(core_path("namespaces", name=ns)) is None, 900)
    return result


def working_sets(kube: KubeJSON, node: str, ns: str) -> dict[str, list[int]]:
    """The working set in bytes of each Ready sandbox's containers and pod, by name."""
    summary = kube.read(f"/api/v1/nodes/{node}/proxy/stats/summary")
    found: dict[str, list[int]] = collections.defaultdict(list)
    for pod in summary.get("pods", []):
        if pod["podRef"]["namespace"] != ns:
            continue
        for container in pod.get("containers", []):
            found[container["name"]].append(container["memory"]["workingSetBytes"])
        found["pod"].append(pod["memory"]["workingSetBytes"])
    return found


def pod_requests(kube: KubeJSON, ns: str) -> dict[str, str]:
    """What one sandbox pod requests (all containers, as the scheduler counts)."""
    pods = kube.list(core_path("pods", ns))
    if not pods:
        return {}
    spec = pods[0]["spec"]
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    total: dict[str, Any] = collections.defaultdict(int)
    for container in containers:
        for key, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[key] += quantity_value(str(value))
    return {
        "cpu": f"{int(total['cpu'] * 1000)}m",
        "memory": f"{int(total['memory'] / 2**20)}Mi",
        "ephemeral-storage": f"{int(total['ephemeral-storage'] / 2**20)}Mi",
    }


def _median_mib(usage: dict[str, list[int]], key: str) -> float:
    values = usage.get(key) or [0]
    return round(statistics.median(values) / 2**20, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--standard", type=int, default=30)
    parser.add_argument("--dense", type=int, default=130)
    args = parser.parse_args()
    with operator_cluster("bench-density") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        node = cluster.node_name
        allocatable = kube.read(core_path("nodes", name=node))["status"]["allocatable"]
        print(f"node {node}: allocatable {allocatable}", flush=True)
        results = []
        for profile, count in (("standard", args.standard), ("dense", args.dense)):
            result = run_profile(kube, node, profile, count)
            results.append(result)
            print(
                f"  {profile:<9} created {count:>4}  Ready {result['ready']:>4}"
                f"  settled in {result['seconds_to_settle']:.0f} s",
                flush=True,
            )
            print(f"            requests per sandbox {result['requests_per_pod']}")
            print(
                f"            idle working set: agent {result['agent_mib_median']} MiB,"
                f" sandbox {result['sandbox_mib_median']} MiB, pod {result['pod_mib_median']} MiB"
            )
            for why, n in result["held"].items():
                print(f"            held back ({n}): {why}")
        standard, dense = results
        if standard["ready"]:
            print(f"dense / standard: {dense['ready'] / standard['ready']:.1f}x the sandboxes")
        write_results("density", {"allocatable": allocatable, "profiles": results})


if __name__ == "__main__":
    main()
