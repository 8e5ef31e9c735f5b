"""Create N Sandboxes against a real local control plane; measure the operator.

    python benchmarks/sandbox_scale.py [--count 1000]

Reports the time from the first create until every Sandbox has its pod and a
written status, the operator's peak RSS, and the API requests the operator
made per Sandbox (counted from the API server's audit log, by the operator's
ServiceAccount identity). The operator runs as in production (`kopf run -m
sandbox_operator`, default settings) under the chart's RBAC rules. There is no
kubelet in this tier: "done" means pod created and status written.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import audit_flags  # noqa: E402
from devcluster.controlplane import ControlPlane  # noqa: E402
from sandbox_operator.kube import Kube  # noqa: E402
from sandbox_operator.resources import PODS, SANDBOXES  # noqa: E402
from tests.integration.harness import OperatorProcess, operator_credentials  # noqa: E402
from tests.kube import KubeJSON  # noqa: E402

OPERATOR_USER = "system:serviceaccount:sandbox-system:sandbox-operator"
NAMESPACE = "bench"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def create_all(kubeconfig: Path, count: int, concurrency: int) -> None:
    kube = Kube.from_environment(str(kubeconfig))
    path = SANDBOXES.path(NAMESPACE)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": f"sbx-{i:04d}"},
            "spec": {"runtime": "python", "lifecycle": {"idleTimeout": "30m"}},
        }
        async with gate:
            await kube.create(path, body)

    await asyncio.gather(*(one(i) for i in range(count)))
    await kube.close()


def progress(kube: KubeJSON) -> tuple[int, int]:
    sandboxes = kube.list(SANDBOXES.path(NAMESPACE))
    with_status = sum(1 for s in sandboxes if (s.get("status") or {}).get("podName"))
    pods = kube.list(PODS.path(NAMESPACE))
    return with_status, len(pods)


def audit_counts(log: Path, since: float, until: float) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != OPERATOR_USER:
            continue
        stamp = time.mktime(
            time.strptime(event["requestReceivedTimestamp"][:19], "%Y-%m-%dT%H:%M:%S")
        )
        stamp -= time.timezone  # the audit stamps are UTC
        if not since - 1 <= stamp <= until + 1:
            continue
        resource = (event.get("objectRef") or {}).get("resource", "?")
        sub = (event.get("objectRef") or {}).get("subresource")
        counts[f"{event['verb']} {resource}{'/' + sub if sub else ''}"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=20, help="client-side creates in flight")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sandbox-scale-"))
    flags, audit_log = audit_flags(work, [OPERATOR_USER])
    cp = ControlPlane(f"bench-{os.getpid()}", apiserver_args=flags)
    cp.start()
    operator: OperatorProcess | None = None
    try:
        admin = KubeJSON(cp.kubeconfig)
        crds = [json.loads(json.dumps(d)) for d in _crds()]
        for crd in crds:
            admin.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)  # CRDs established
        creds = operator_credentials(cp, admin, REPO, work / "operator.kubeconfig")
        admin.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        operator = OperatorProcess(creds, work, {})
        operator.start()
        assert operator.proc is not None
        rss_idle = peak_rss_mib(operator.proc.pid)
        cpu_operator0 = cpu_seconds(operator.proc.pid)
        cpu_cluster0 = sum(cpu_seconds(pid) for pid in cp.pids().values())

        started = time.time()
        t0 = time.monotonic()
        asyncio.run(create_all(cp.kubeconfig, args.count, args.concurrency))
        created_s = time.monotonic() - t0
        done = (0, 0)
        while time.monotonic() - t0 < args.timeout:
            done = progress(admin)
            if done == (args.count, args.count):
                break
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        finished = time.time()
        if done != (args.count, args.count):
            raise SystemExit(f"not done after {args.timeout}s: status {done[0]}, pods {done[1]}")
        rss_peak = peak_rss_mib(operator.proc.pid)
        cpu_operator = cpu_seconds(operator.proc.pid) - cpu_operator0
        cpu_cluster = sum(cpu_seconds(pid) for pid in cp.pids().values()) - cpu_cluster0
        time.sleep(1)  # let the audit backend flush
        counts = audit_counts(audit_log, started, finished)
        total = sum(counts.values())
        print(f"\nSandboxes: {args.count} (client: {args.concurrency} creates in flight)")
        print(f"  all creates accepted after      {created_s:7.1f} s")
        print(f"  every pod and status written in {elapsed:7.1f} s   (target <= 60 s for 1,000)")
        print(
            f"  operator peak RSS               {rss_peak:7.1f} MiB"
            f" (idle {rss_idle:.1f}; target <= 250 MB)"
        )
        print(
            f"  CPU: operator {cpu_operator:.1f} s, etcd + apiserver + controller-manager "
            f"{cpu_cluster:.1f} s (2 cores)"
        )
        print(
            f"  operator API requests           {total:7d}   = {total / args.count:.2f} per Sandbox"
        )
        for key, value in counts.most_common():
            print(f"    {key:<40} {value:6d}  ({value / args.count:.2f}/Sandbox)")
        errors = operator.errors()
        print(f"  handler tracebacks in the operator log: {len(errors)}")
    finally:
        if operator is not None:
            operator.stop()
        cp.stop(remove_state=True)


def _crds() -> list[dict[str, Any]]:
    from sandbox_operator.api.crd import all_crds

    return list(all_crds().values())


if __name__ == "__main__":
    main()
