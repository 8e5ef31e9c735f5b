"""Executions on the real local node, side by side with a Kubernetes Job.

    python benchmarks/execution_bench.py [--runs 50] [--sandboxes 10] [--executions 200] [--json]

1. Latency, create -> terminal phase, `echo hi` `--runs` times each:
   an Execution in a Running Sandbox against a Job running the same command
   in the same image (the sandbox runtime image, a restricted pod in the same
   namespace). Interleaved one at a time, the order swapped every pair, so
   that drifts of the machine's load hit both alike; two of each first as a
   warm-up, not counted.
2. Throughput: `--executions` Executions created round-robin across
   `--sandboxes` Ready Sandboxes as fast as 4 client threads create them;
   executions/s from the first create to the last terminal phase seen, and
   the CPU seconds the operator and each cluster component used meanwhile.

Timing: from just before the create request to the arrival of the first
watch event showing the terminal state. One watch per kind (a streaming GET
on the namespace's collection) sees every object; nothing is polled. For
the Job, the terminal state is the first of the conditions SuccessCriteriaMet,
Complete, FailureTarget or Failed (the earliest a client could know).
Nothing is deleted between runs: the cluster is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402
from benchmarks.common import Watcher, latency_row, process_cpu, sandbox_ready  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from devcluster.deploy import NAMESPACE as OPERATOR_NAMESPACE  # noqa: E402
from devcluster.deploy import RELEASE as OPERATOR  # noqa: E402
from sandbox_operator.config import Settings  # noqa: E402
from tests.kube import JSON, KubeJSON, api_path, core_path  # noqa: E402

NS = "bench-exec"
GROUP = "sandbox.dev/v1alpha1"
ARGV = ["echo", "hi"]
# Client threads creating the throughput run's Executions.
CREATORS = 4
TERMINAL = {"Succeeded", "Failed", "TimedOut", "Cancelled"}
JOB_TERMINAL = {"Complete", "Failed"}
# What the watch shows of an Execution on its way, in order.
EXECUTION_STEPS = ["Accepted", "Assigned", "Queued", "Running", "Started", "Succeeded"]


def execution_state(obj: JSON) -> str | None:
    """Terminal phase; Started (the agent took the command); the phase; Assigned
    (sandbox recorded); Accepted (finalizer added); None for a bare new object."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    if phase in TERMINAL:
        return str(phase)
    if status.get("agentExecutionId"):
        return "Started"
    if phase:
        return str(phase)
    if status.get("sandbox"):
        return "Assigned"
    if obj["metadata"].get("finalizers"):
        return "Accepted"
    return None


def job_state(obj: JSON) -> str | None:
    status = obj.get("status") or {}
    true = {c["type"] for c in status.get("conditions") or [] if c.get("status") == "True"}
    if true & {"SuccessCriteriaMet", "Complete"}:
        return "Complete"
    if true & {"FailureTarget", "Failed"}:
        return "Failed"
    if status.get("active") or status.get("ready"):
        return "Active"
    return None


def execution_body(name: str, sandbox: str) -> JSON:
    return {
        "apiVersion": GROUP,
        "kind": "Execution",
        "metadata": {"name": name},
        "spec": {"sandboxRef": {"name": sandbox}, "command": ARGV},
    }


def job_body(name: str, settings: Settings) -> JSON:
    """`echo hi` in the sandbox runtime image, in a pod Pod Security `restricted` admits."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"bench": "job"}},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": settings.sandbox_uid,
                        "runAsGroup": settings.sandbox_uid,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "main",
                            "image": settings.runtimes[settings.default_runtime].image,
                            "imagePullPolicy": "Never",
                            "command": ARGV,
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }
                    ],
                },
            },
        },
    }


def create_sandbox(kube: KubeJSON, name: str) -> None:
    kube.create(
        api_path(GROUP, "sandboxes", NS),
        {"apiVersion": GROUP, "kind": "Sandbox", "metadata": {"name": name}, "spec": {}},
    )


def check_execution(watcher: Watcher, name: str) -> None:
    status = watcher.last[name].get("status") or {}
    if status.get("phase") != "Succeeded" or status.get("stdout") != "hi\n":
        raise SystemExit(f"Execution {name} did not succeed: {json.dumps(status)}")


def run_execution(kube: KubeJSON, watcher: Watcher, name: str, sandbox: str) -> float:
    began = time.monotonic()
    kube.create(api_path(GROUP, "executions", NS), execution_body(name, sandbox))
    _, ended = watcher.wait(name, TERMINAL, timeout=120)
    check_execution(watcher, name)
    watcher.seen[name]["created"] = began
    return ended - began


def run_job(kube: KubeJSON, watcher: Watcher, name: str, settings: Settings) -> float:
    began = time.monotonic()
    kube.create(api_path("batch/v1", "jobs", NS), job_body(name, settings))
    state, ended = watcher.wait(name, JOB_TERMINAL, timeout=300)
    if state != "Complete":
        raise SystemExit(f"Job {name} failed: {json.dumps(watcher.last[name].get('status'))}")
    watcher.seen[name]["created"] = began
    return ended - began


def steps(watcher: Watcher, names: list[str], order: list[str]) -> list[tuple[str, float]]:
    """p50 (ms) of the time from create to the first sight of each step."""
    out = []
    for step in order:
        offsets = [
            seen[step] - seen["created"]
            for name in names
            if step in (seen := watcher.seen[name]) and "created" in seen
        ]
        if offsets:
            out.append((step, statistics.median(offsets) * 1000))
    return out


def format_steps(found: list[tuple[str, float]]) -> str:
    return ", ".join(f"{step} {ms:.0f} ms" for step, ms in found)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": common.percentile(values, 0.9) * 1000,
        "min_ms": min(values) * 1000,
        "max_ms": max(values) * 1000,
    }


def latency(
    kube: KubeJSON,
    executions: Watcher,
    jobs: Watcher,
    sandbox: str,
    args: argparse.Namespace,
    settings: Settings,
) -> dict[str, Any]:
    """Execution and Job one at a time, interleaved (the order swapped every
    pair), after a warm-up of two each; prints its table."""
    for i in range(2):
        run_execution(kube, executions, f"warm-e{i}", sandbox)
        run_job(kube, jobs, f"warm-j{i}", settings)
    loadavg_start = os.getloadavg()
    exec_times, job_times = [], []
    for i in range(args.runs):
        for kind in ("e", "j") if i % 2 == 0 else ("j", "e"):
            if kind == "e":
                exec_times.append(run_execution(kube, executions, f"e{i}", sandbox))
            else:
                job_times.append(run_job(kube, jobs, f"j{i}", settings))
            time.sleep(args.gap)
    exec_steps = steps(executions, [f"e{i}" for i in range(args.runs)], EXECUTION_STEPS)
    job_steps = steps(jobs, [f"j{i}" for i in range(args.runs)], ["Active", "Complete"])
    exec_p50, job_p50 = statistics.median(exec_times), statistics.median(job_times)
    speedup = job_p50 / exec_p50
    print(f"\nCreate -> terminal phase, `{' '.join(ARGV)}`, {args.runs} each, interleaved:")
    print(latency_row("Execution (running Sandbox)", exec_times))
    print(latency_row("Job (same image, same namespace)", job_times))
    print(f"  Execution is {speedup:.1f}x faster at p50 (target >= 10x): ", end="")
    print("met" if speedup >= 10 else "NOT met")
    print(f"  Execution p50 {exec_p50 * 1000:.1f} ms (target <= 200 ms): ", end="")
    print("met" if exec_p50 <= 0.2 else "NOT met")
    print("  Execution, p50 from create to first seen:", format_steps(exec_steps))
    print("  Job, p50 from create to first seen:", format_steps(job_steps))
    return {
        "runs": args.runs,
        "execution": summary(exec_times),
        "job": summary(job_times),
        "speedup_p50": speedup,
        "execution_steps_p50_ms": dict(exec_steps),
        "job_steps_p50_ms": dict(job_steps),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
    }


def operator_cpu(kube: KubeJSON) -> float:
    """The operator's CPU seconds so far, from its own metrics endpoint."""
    pods = kube.list(core_path("pods", OPERATOR_NAMESPACE), "app.kubernetes.io/name=" + OPERATOR)
    ip = next(p["status"]["podIP"] for p in pods if p["status"].get("phase") == "Running")
    text = httpx.get(f"http://{ip}:{Settings().metrics_port}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("process_cpu_seconds_total "))
    return float(line.split()[1])


def cpu_use(cluster: LocalCluster, kube: KubeJSON) -> dict[str, float]:
    """CPU seconds so far of the operator and of each of the cluster's components."""
    used = {name: process_cpu(pid) for name, pid in cluster.pids().items()}
    used["sandbox-operator"] = operator_cpu(kube)
    return used


def throughput(
    cluster: LocalCluster,
    kube: KubeJSON,
    executions: Watcher,
    sandboxes: list[str],
    count: int,
    settings: Settings,
) -> dict[str, Any]:
    """`count` Executions created round-robin across the Ready `sandboxes` by
    `CREATORS` client threads; prints its table and where the CPU went."""
    loadavg_start = os.getloadavg()
    names = [f"t{i}" for i in range(count)]
    created: dict[str, float] = {}
    local = threading.local()

    def create(index: int) -> None:
        if not hasattr(local, "kube"):
            local.kube = KubeJSON(cluster.kubeconfig)
        name = names[index]
        body = execution_body(name, sandboxes[index % len(sandboxes)])
        created[name] = time.monotonic()
        local.kube.create(api_path(GROUP, "executions", NS), body)

    cpu_before = cpu_use(cluster, kube)
    first = time.monotonic()
    with ThreadPoolExecutor(CREATORS) as pool:
        list(pool.map(create, range(count)))
    all_created = time.monotonic()
    ended = {name: executions.wait(name, TERMINAL, timeout=600)[1] for name in names}
    for name in names:
        check_execution(executions, name)
        executions.seen[name]["created"] = created[name]
    last = max(ended.values())
    latencies = [ended[name] - created[name] for name in names]
    rate = len(names) / (last - first)
    t_steps = steps(executions, names, EXECUTION_STEPS)
    cpu_after = cpu_use(cluster, kube)
    cpu = {k: cpu_after[k] - cpu_before[k] for k in cpu_after if k in cpu_before}
    print(
        f"\nThroughput: {len(names)} Executions round-robin across {len(sandboxes)} "
        f"sandboxes (at most {settings.max_executions_per_sandbox} at once in each):"
    )
    print(f"  created in {all_created - first:.2f} s by {CREATORS} threads; all Succeeded")
    print(f"  {rate:.1f} executions/s, first create to last terminal ({last - first:.2f} s)")
    print(latency_row("create -> terminal, each", latencies))
    print("  p50 from create to first seen:", format_steps(t_steps))
    print(f"  CPU seconds used over the {last - first:.1f} s (of {os.cpu_count()} cores):", end="")
    print(", ".join(f" {k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    return {
        "cpu_seconds": cpu,
        "executions": len(names),
        "sandboxes": len(sandboxes),
        "per_second": rate,
        "seconds": last - first,
        "create_seconds": all_created - first,
        "latency": summary(latencies),
        "steps_p50_ms": dict(t_steps),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=50, help="latency runs of each kind")
    parser.add_argument("--sandboxes", type=int, default=10)
    parser.add_argument("--executions", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between runs")
    parser.add_argument("--json", action="store_true", help="also write benchmarks/results/*.json")
    args = parser.parse_args()
    settings = Settings()
    results: dict[str, Any] = {"loadavg_before": os.getloadavg()}
    with common.operator_cluster(f"bench-exec-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        # Pod Security as a sandbox namespace would have it: the Job must be admitted too.
        common.create_namespace(kube, NS, {"pod-security.kubernetes.io/enforce": "restricted"})
        sandboxes = [f"s{i}" for i in range(args.sandboxes)]
        with (
            Watcher(cluster.kubeconfig, api_path(GROUP, "executions", NS), execution_state) as ex,
            Watcher(cluster.kubeconfig, api_path("batch/v1", "jobs", NS), job_state) as jobs,
        ):
            create_sandbox(kube, sandboxes[0])
            common.wait_until(lambda: sandbox_ready(kube, NS, sandboxes[0]))
            results["latency"] = latency(kube, ex, jobs, sandboxes[0], args, settings)
            began = time.monotonic()
            for name in sandboxes[1:]:
                create_sandbox(kube, name)
            common.wait_until(
                lambda: all(sandbox_ready(kube, NS, name) for name in sandboxes), timeout=600
            )
            ready = results["sandboxes_ready_seconds"] = time.monotonic() - began
            print(f"\n{len(sandboxes)} sandboxes Ready {ready:.1f} s after create")
            time.sleep(2)  # let the sandboxes' own start-up work settle
            results["throughput"] = throughput(
                cluster, kube, ex, sandboxes, args.executions, settings
            )
    results["loadavg_after"] = os.getloadavg()
    print(f"load average before/after: {results['loadavg_before']} / {results['loadavg_after']}")
    if args.json:
        common.write_results("execution_bench", results)


if __name__ == "__main__":
    main()
