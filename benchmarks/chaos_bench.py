"""Chaos on the real local node: Sandboxes, Executions and Snapshots while the
active operator replica is killed again and again, the API server restarts once
and a sandbox container is killed through the CRI.

    python benchmarks/chaos_bench.py [--sandboxes 50] [--executions 200]
        [--snapshots 20] [--workers 10] [--duration 180] [--kill-every 6]

The operator runs as the chart installs it: two replicas, one active (Kopf
peering). Over `--duration` seconds the workload is spread evenly:

- `--workers` Sandboxes (created and Ready first) take the Executions and the
  Snapshots; each Execution appends its own name to `ran.log` in its sandbox's
  workspace;
- `--sandboxes` more are created and deleted again, 5-40 s later, some before
  they are Ready (churn);
- every `--kill-every` seconds the active replica's pod is deleted with no
  grace period (the kubelet SIGKILLs it; the Deployment makes a new one), found
  from the peering object: the live peer of the highest priority;
- halfway, kube-apiserver is stopped and started again;
- at a third, the first worker's sandbox container is SIGKILLed through the CRI.

Then the kills stop, and the run waits until everything has converged:

- every Execution is terminal, and no name appears twice in any `ran.log`
  (ran at most once; a Succeeded one exactly once);
- every worker is Ready and every churned Sandbox is gone;
- every Snapshot is Ready or Failed;
- nothing in the namespace is left deleting (no finalizer left behind), and
  no pod, PVC, Secret, Service or NetworkPolicy of the operator's outlives its
  Sandbox, nor a VolumeSnapshot its Snapshot.

It reports the time to converge after the last kill, the kills and failovers,
the API server's downtime, the outcomes, and exits 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    create_namespace,
    operator_cluster,
    percentile,
    write_results,
)
from devcluster import deploy  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from tests.e2e.agent import Agent  # noqa: E402
from tests.kube import JSON, ApiError, KubeJSON, api_path, core_path  # noqa: E402

NS = "chaos"
GROUP = "sandbox.dev/v1alpha1"
KOPF = "kopf.dev/v1"
MANAGED = "app.kubernetes.io/managed-by=sandbox-operator"
LABEL_SANDBOX = "sandbox.dev/sandbox"
LABEL_SNAPSHOT_UID = "sandbox.dev/snapshot-uid"
TERMINAL = {"Succeeded", "Failed", "TimedOut", "Cancelled"}
DENSE = {"resources": {"profile": "dense"}}
# How long one API call keeps being retried (the API server's restart, a
# connection cut by it) before the run gives up.
API_PATIENCE = 120.0


def path(plural: str, name: str | None = None) -> str:
    return api_path(GROUP, plural, NS, name)


def patiently(call: Callable[[], Any]) -> Any:
    """`call`, retried while the API server is away; an AlreadyExists or NotFound
    answer to a retry means the first attempt went through."""
    deadline = time.monotonic() + API_PATIENCE
    attempt = 0
    while True:
        try:
            return call()
        except ApiError as error:
            if attempt and error.status in (404, 409):
                return None
            if error.status < 500 and error.status != 429:
                raise
            failure: Exception = error
        except httpx.TransportError as error:  # refused, reset: the API server restarting
            failure = error
        attempt += 1
        if time.monotonic() > deadline:
            raise SystemExit(f"the API server did not answer for {API_PATIENCE} s: {failure}")
        time.sleep(0.5)


def ready(obj: JSON | None) -> bool:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def wait(what: str, probe: Callable[[], bool], timeout: float) -> float:
    began = time.monotonic()
    while not probe():
        if time.monotonic() - began > timeout:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)
    return time.monotonic() - began


# ---- the chaos ------------------------------------------------------------------------


def active_replica(kube: KubeJSON) -> str | None:
    """The operator pod whose peer is live with the highest priority (Kopf's active one)."""
    pods = [
        p["metadata"]["name"]
        for p in kube.list(core_path("pods", deploy.NAMESPACE), deploy.OPERATOR_SELECTOR)
        if not p["metadata"].get("deletionTimestamp")
    ]
    now = datetime.now(UTC)
    best: tuple[int, str] | None = None
    for peering in kube.list(api_path(KOPF, "clusterkopfpeerings")):
        for peer, info in (peering.get("status") or {}).items():
            if not isinstance(info, dict) or "priority" not in info:
                continue
            seen = datetime.fromisoformat(str(info.get("lastseen", "")).replace("Z", "+00:00"))
            if seen.tzinfo is None:
                seen = seen.replace(tzinfo=UTC)
            if (now - seen).total_seconds() > float(info.get("lifetime", 60)):
                continue
            pod = next((name for name in pods if name in peer), None)
            if pod is not None and (best is None or int(info["priority"]) > best[0]):
                best = (int(info["priority"]), pod)
    return best[1] if best else None


@dataclass
class Chaos:
    """Kills the active replica every `every` seconds until stopped."""

    kube: KubeJSON
    every: float
    kills: list[tuple[float, str]] = field(default_factory=list)
    misses: int = 0  # rounds that found no live active replica to kill
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                victim = active_replica(self.kube)
                if victim is None:
                    self.misses += 1
                    continue
                self.kube.delete(
                    core_path("pods", deploy.NAMESPACE, victim) + "?gracePeriodSeconds=0"
                )
                self.kills.append((time.monotonic(), victim))
                print(f"  killed {victim}", flush=True)
            except (ApiError, httpx.TransportError, ValueError) as error:  # API server restarting
                self.misses += 1
                print(f"  no kill this round: {error}", flush=True)


# ---- the workload ---------------------------------------------------------------------


def sandbox_body(name: str) -> JSON:
    return {"apiVersion": GROUP, "kind": "Sandbox", "metadata": {"name": name}, "spec": DENSE}


def execution_body(name: str, sandbox: str) -> JSON:
    return {
        "apiVersion": GROUP,
        "kind": "Execution",
        "metadata": {"name": name},
        "spec": {
            "sandboxRef": {"name": sandbox},
            "command": ["sh", "-c", f"echo {name} >> ran.log"],
            "timeout": "2m",
        },
    }


def snapshot_body(name: str, sandbox: str) -> JSON:
    return {
        "apiVersion": GROUP,
        "kind": "Snapshot",
        "metadata": {"name": name},
        "spec": {"sandboxRef": {"name": sandbox}},
    }


@dataclass(order=True)
class Step:
    at: float
    what: str = field(compare=False)
    act: Callable[[], Any] = field(compare=False)


def timeline(
    kube: KubeJSON, cluster: LocalCluster, args: argparse.Namespace, workers: list[str]
) -> tuple[list[Step], dict[str, str], list[str]]:
    """The run's steps by time offset; which worker each Execution runs in; the churned names."""
    rng = random.Random(1)
    steps: list[Step] = []
    placed: dict[str, str] = {}
    span = args.duration
    for i in range(args.executions):
        name, worker = f"e-{i:03d}", workers[i % len(workers)]
        placed[name] = worker
        body = execution_body(name, worker)
        steps.append(
            Step(span * i / args.executions, f"create {name}", _creator(kube, "executions", body))
        )
    for i in range(args.snapshots):
        name, worker = f"s-{i:02d}", workers[i % len(workers)]
        body = snapshot_body(name, worker)
        steps.append(
            Step(span * i / args.snapshots, f"create {name}", _creator(kube, "snapshots", body))
        )
    churned = [f"c-{i:02d}" for i in range(args.sandboxes)]
    for i, name in enumerate(churned):
        at = span * i / args.sandboxes
        steps.append(Step(at, f"create {name}", _creator(kube, "sandboxes", sandbox_body(name))))
        steps.append(
            Step(min(at + rng.uniform(5, 40), span), f"delete {name}", _deleter(kube, name))
        )
    steps.append(
        Step(
            span / 3,
            "kill a sandbox container",
            lambda: cluster.kill_container(NS, workers[0], "sandbox"),
        )
    )
    steps.append(
        Step(span / 2, "restart kube-apiserver", lambda: cluster.restart("kube-apiserver"))
    )
    return sorted(steps), placed, churned


def _creator(kube: KubeJSON, plural: str, body: JSON) -> Callable[[], Any]:
    return lambda: patiently(lambda: kube.create(path(plural), body))


def _deleter(kube: KubeJSON, sandbox: str) -> Callable[[], Any]:
    return lambda: patiently(lambda: kube.delete(path("sandboxes", sandbox)))


def play(steps: list[Step]) -> dict[str, float]:
    """Run the steps at their offsets (a slow step delays the next ones, never
    skips them); the seconds the special ones took."""
    began = time.monotonic()
    took: dict[str, float] = {}
    for step in steps:
        delay = began + step.at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        started = time.monotonic()
        result = step.act()
        if step.what.startswith(("restart", "kill")):
            took[step.what] = round(
                result if isinstance(result, float) else time.monotonic() - started, 2
            )
            print(f"  {step.what} at {step.at:.0f} s ({took[step.what]} s)", flush=True)
    return took


# ---- convergence and invariants ---------------------------------------------------


def leftovers(kube: KubeJSON, workers: list[str]) -> list[str]:
    """What keeps the run from having converged, in words (empty once it has)."""
    problems: list[str] = []
    sandboxes = kube.list(path("sandboxes"))
    names = {s["metadata"]["name"] for s in sandboxes}
    problems += [
        f"worker {w} not Ready"
        for w in workers
        if not ready(next((s for s in sandboxes if s["metadata"]["name"] == w), None))
    ]
    problems += [f"sandbox {n} still there" for n in sorted(names - set(workers))]
    for e in kube.list(path("executions")):
        phase = (e.get("status") or {}).get("phase")
        if phase not in TERMINAL:
            problems.append(f"execution {e['metadata']['name']} {phase}")
    snapshots = kube.list(path("snapshots"))
    for s in snapshots:
        phase = (s.get("status") or {}).get("phase")
        if phase not in ("Ready", "Failed"):
            problems.append(f"snapshot {s['metadata']['name']} {phase}")
    for plural, items in (
        ("sandboxes", sandboxes),
        ("executions", kube.list(path("executions"))),
        ("snapshots", snapshots),
    ):
        problems += [
            f"{plural} {o['metadata']['name']} deleting: {o['metadata'].get('finalizers')}"
            for o in items
            if o["metadata"].get("deletionTimestamp")
        ]
    for kind, collection in (
        ("pod", core_path("pods", NS)),
        ("pvc", core_path("persistentvolumeclaims", NS)),
        ("secret", core_path("secrets", NS)),
        ("service", core_path("services", NS)),
        ("networkpolicy", api_path("networking.k8s.io/v1", "networkpolicies", NS)),
    ):
        for obj in kube.list(collection, MANAGED):
            owner = (obj["metadata"].get("labels") or {}).get(LABEL_SANDBOX)
            if owner not in names:
                problems.append(f"orphaned {kind} {obj['metadata']['name']} (sandbox {owner})")
    snapshot_uids = {s["metadata"]["uid"] for s in snapshots}
    for vs in kube.list(api_path("snapshot.storage.k8s.io/v1", "volumesnapshots", NS), MANAGED):
        if (vs["metadata"].get("labels") or {}).get(LABEL_SNAPSHOT_UID) not in snapshot_uids:
            problems.append(f"orphaned volumesnapshot {vs['metadata']['name']}")
    return problems


def runs_per_execution(kube: KubeJSON, workers: list[str]) -> collections.Counter[str]:
    """How often each Execution's name appears in its sandbox's ran.log."""
    seen: collections.Counter[str] = collections.Counter()
    for worker in workers:
        agent = Agent.of(kube, NS, worker)
        try:
            reply = agent.run(["sh", "-c", "cat ran.log 2>/dev/null; true"], timeoutSeconds=30)
        finally:
            agent.close()
        seen.update(line for line in reply["stdout"].split() if line)
    return seen


def operator_restarts(kube: KubeJSON) -> dict[str, int]:
    pods = kube.list(core_path("pods", deploy.NAMESPACE), deploy.OPERATOR_SELECTOR)
    return {
        p["metadata"]["name"]: sum(
            s.get("restartCount", 0) for s in p["status"].get("containerStatuses") or []
        )
        for p in pods
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandboxes", type=int, default=50, help="churned Sandboxes")
    parser.add_argument("--executions", type=int, default=200)
    parser.add_argument("--snapshots", type=int, default=20)
    parser.add_argument("--workers", type=int, default=10, help="Sandboxes that run the Executions")
    parser.add_argument(
        "--duration", type=float, default=180.0, help="seconds the workload is spread over"
    )
    parser.add_argument("--kill-every", type=float, default=6.0, help="seconds between kills")
    parser.add_argument("--converge-timeout", type=float, default=900.0)
    args = parser.parse_args()

    with operator_cluster(f"bench-chaos-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS, deploy.POD_SECURITY_RESTRICTED)
        workers = [f"w-{i:02d}" for i in range(args.workers)]
        for name in workers:
            kube.create(path("sandboxes"), sandbox_body(name))
        wait(
            "the workers to be Ready",
            lambda: all(ready(kube.get(path("sandboxes", w))) for w in workers),
            600,
        )
        steps, placed, churned = timeline(kube, cluster, args, workers)

        print(
            f"chaos: {len(steps)} steps over {args.duration:.0f} s,"
            f" a kill every {args.kill_every:.0f} s",
            flush=True,
        )
        chaos = Chaos(KubeJSON(cluster.kubeconfig), args.kill_every)
        killer = threading.Thread(target=chaos.run, daemon=True)
        began = time.monotonic()
        killer.start()
        took = play(steps)
        chaos.stop.set()
        killer.join()
        calm = time.monotonic()
        print(
            f"workload done in {calm - began:.0f} s; {len(chaos.kills)} kills; converging",
            flush=True,
        )

        problems: list[str] = []

        def converged() -> bool:
            nonlocal problems
            problems = patiently(lambda: leftovers(kube, workers))
            return not problems

        try:
            converge = wait("convergence", converged, args.converge_timeout)
        except SystemExit:
            print("not converged:\n  " + "\n  ".join(problems[:50]), flush=True)
            raise
        runs = runs_per_execution(kube, workers)
        executions = kube.list(path("executions"))
        phases = {e["metadata"]["name"]: e["status"]["phase"] for e in executions}
        # Created -> ended, by the API server's and the operator's clocks (one machine).
        took_each = [
            (stamp(e["status"]["completionTime"]) - stamp(e["metadata"]["creationTimestamp"]))
            for e in executions
            if e["status"].get("completionTime")
        ]
        twice = sorted(n for n, c in runs.items() if c > 1)
        lost = sorted(n for n, p in phases.items() if p == "Succeeded" and runs[n] != 1)
        unknown = sorted(set(runs) - set(placed))
        snapshot_phases = collections.Counter(
            (s.get("status") or {}).get("phase") for s in kube.list(path("snapshots"))
        )
        results = {
            "parameters": vars(args),
            "kills": len(chaos.kills),
            "rounds_without_an_active_replica": chaos.misses,
            "operator_pods_now": operator_restarts(kube),
            "special_steps_seconds": took,
            "workload_seconds": round(calm - began, 1),
            "converged_seconds_after_the_chaos": round(converge, 1),
            "execution_phases": dict(collections.Counter(phases.values())),
            "execution_create_to_end_seconds": {
                "p50": round(percentile(took_each, 0.5), 2),
                "p90": round(percentile(took_each, 0.9), 2),
                "max": round(max(took_each), 2),
            },
            "executions_run_twice": twice,
            "succeeded_but_not_run_once": lost,
            "unknown_lines_in_ran_log": unknown,
            "snapshot_phases": dict(snapshot_phases),
            "churned_sandboxes": len(churned),
        }
        for key, value in results.items():
            print(f"{key}: {value}")
        write_results("chaos", results)
        failed = twice or lost or unknown or len(phases) != args.executions
        if failed:
            raise SystemExit("chaos: an invariant failed (see above)")


if __name__ == "__main__":
    main()
