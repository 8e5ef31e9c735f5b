"""Resuming an idle-paused sandbox on the real local node, against a pod start.

    python benchmarks/resume_bench.py [--count 8]

Per chat turn, an AI backend resumes a sandbox its idle policy paused: by the
resume annotation, or just by creating an Execution for it. Both should cost a
pod start and little more. Three timings, interleaved, `--count` each:

1. resume -> Ready: `sandbox.dev/resume-requested-at` written on an idle-paused
   Sandbox, until its Ready condition is True again;
2. auto-resume -> Execution done: an Execution (`echo hi`) created for an
   idle-paused Sandbox, until it has Succeeded;
3. baseline, a pod start: the pod the operator would build, created directly on
   an existing bound claim, until the pod is Ready;
4. floor, a minimal pod: the same runtime image, one container, no probes, no
   volumes, until it is Ready;
5. floor of the pod's shape: the same minimal pod with a native sidecar (an
   init container with `restartPolicy: Always`, as the agent is) of the same
   image beside its container, no probes, no volumes: what the kubelet itself
   adds for a sidecar (it starts the main container in a later sync, once it
   has seen the sidecar running);
6. the same two containers as plain containers of the pod, started together:
   what a pod shape without the sidecar's ordering would cost.

Timed from just before the request to the first watch event showing the end.
For the resumes, the pod's own milestones are timed the same way (from its
watch events: scheduled, agent running, agent started, sandbox container
running, agent ready, pod Ready), then the Sandbox's Ready: where the time
between the request and Ready goes.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    Watcher,
    create_namespace,
    latency_row,
    operator_cluster,
    wait_until,
    write_results,
)
from sandbox_operator import identity  # noqa: E402
from sandbox_operator.api.sandbox import SandboxSpec  # noqa: E402
from sandbox_operator.builders import sandbox as build  # noqa: E402
from sandbox_operator.config import Settings  # noqa: E402
from sandbox_operator.resources import EXECUTIONS, PODS, RESUME_ANNOTATION, SANDBOXES  # noqa: E402
from tests.kube import JSON, KubeJSON, core_path  # noqa: E402

NS = "bench-resume"
# Idle-pausing is the setup, not what is timed: short idle, frequent ticks.
IDLE = {"idleTimeout": "2s", "onIdle": "Pause"}
OPERATOR_VALUES = ["settings.reconcile_interval_seconds=2"]


def _ready(obj: JSON) -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def sandbox_state(obj: JSON) -> str | None:
    status = obj.get("status") or {}
    if status.get("idlePausedAt") and status.get("phase") == "Paused":
        return "paused"
    resumed = RESUME_ANNOTATION in (obj["metadata"].get("annotations") or {})
    if _ready(obj):
        return "resumed" if resumed else "ready"
    return None


def execution_state(obj: JSON) -> str | None:
    phase = (obj.get("status") or {}).get("phase")
    return phase if phase in ("Succeeded", "Failed", "TimedOut", "Cancelled") else None


def pod_state(obj: JSON) -> str | None:
    return "ready" if _ready(obj) else None


# A resumed sandbox's pod, in the order its watch events show them.
STAGES = (
    "scheduled",
    "agent running",
    "agent started",
    "sandbox running",
    "agent ready",
    "pod ready",
)


def _container(obj: JSON, key: str, name: str) -> JSON:
    found = ((obj.get("status") or {}).get(key)) or []
    return next((c for c in found if c.get("name") == name), {})


def pod_stage(obj: JSON) -> str | None:
    """The furthest of STAGES a sandbox pod has reached (the Watcher notes when
    each was first seen; a stage passed within one event gets the next one's time)."""
    agent = _container(obj, "containerStatuses", identity.AGENT_CONTAINER)
    sandbox = _container(obj, "containerStatuses", identity.SANDBOX_CONTAINER)
    reached = [
        bool(obj.get("spec", {}).get("nodeName")),
        "running" in (agent.get("state") or {}),
        bool(agent.get("started")),
        "running" in (sandbox.get("state") or {}),
        bool(agent.get("ready")),
        _ready(obj),
    ]
    furthest = None
    for stage, done in zip(STAGES, reached, strict=True):
        if done:
            furthest = stage
    return furthest


def timeline(stages: Watcher, pod: str, started: float, end: float) -> list[float]:
    """Seconds from `started` to each of STAGES for `pod`, then `end` (a stage not
    seen by itself takes the time of the next one seen)."""
    seen = stages.seen.get(pod, {})
    times = [seen.get(stage) for stage in STAGES] + [end]
    for i in range(len(times) - 2, -1, -1):
        if times[i] is None:
            times[i] = times[i + 1]
    return [float(t) - started for t in times if t is not None]


def idle_paused(kube: KubeJSON, sandboxes: Watcher, name: str) -> None:
    """A new Sandbox, Ready once, then paused by its idle policy (pod gone)."""
    kube.create(
        SANDBOXES.path(NS),
        {
            "apiVersion": SANDBOXES.api_version,
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"lifecycle": IDLE},
        },
    )
    sandboxes.wait(name, {"ready"})
    sandboxes.wait(name, {"paused"})
    wait_until(lambda: kube.get(PODS.path(NS, name)) is None)


def resume(
    kube: KubeJSON, sandboxes: Watcher, stages: Watcher, name: str
) -> tuple[float, list[float]]:
    pod = identity.names(name)["pod"]
    with stages.changed:
        stages.seen.pop(pod, None)  # the stages of its first start
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    started = time.monotonic()
    kube.patch(SANDBOXES.path(NS, name), {"metadata": {"annotations": {RESUME_ANNOTATION: stamp}}})
    _, seen = sandboxes.wait(name, {"resumed"})
    return seen - started, timeline(stages, pod, started, seen)


def auto_resume(kube: KubeJSON, executions: Watcher, stages: Watcher, sandbox: str) -> float:
    name = f"{sandbox}-run"
    with stages.changed:
        stages.seen.pop(identity.names(sandbox)["pod"], None)
    started = time.monotonic()
    kube.create(
        EXECUTIONS.path(NS),
        {
            "apiVersion": EXECUTIONS.api_version,
            "kind": "Execution",
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}, "command": ["echo", "hi"]},
        },
    )
    state, seen = executions.wait(name, {"Succeeded", "Failed", "TimedOut", "Cancelled"})
    if state != "Succeeded":
        raise SystemExit(f"{name} ended {state}")
    return seen - started


def bare_claim(kube: KubeJSON, settings: Settings) -> identity.SandboxRef:
    """A Secret and a bound claim, as the operator would make them, unowned."""
    ref = identity.SandboxRef(name="bare", namespace=NS, uid="00000000-0000-0000-0000-000000000000")
    secret = build.build_secret(ref, base64.b64encode(os.urandom(24)).decode())
    claim = build.build_claim(ref, SandboxSpec(), settings)
    assert claim is not None
    for obj, plural in ((secret, "secrets"), (claim, "persistentvolumeclaims")):
        obj["metadata"].pop("ownerReferences")
        obj["metadata"]["labels"] = {"bench": "bare"}
        kube.create(core_path(plural, NS), obj)
    wait_until(
        lambda: (
            (
                kube.read(core_path("persistentvolumeclaims", NS, "bare-workspace"))
                .get("status", {})
                .get("phase")
            )
            == "Bound"
        )
    )
    return ref


def pod_start(kube: KubeJSON, pods: Watcher, ref: identity.SandboxRef, i: int) -> float:
    """The operator's pod for `ref`, on its bound claim, created directly."""
    pod = build.build_pod(ref, SandboxSpec(), Settings())
    pod["metadata"].pop("ownerReferences")
    pod["metadata"]["name"] = f"bare-{i}"
    pod["metadata"]["labels"] = {"bench": "bare"}
    return timed_pod(kube, pods, pod)


def timed_pod(kube: KubeJSON, pods: Watcher, pod: JSON) -> float:
    """Seconds from creating `pod` to seeing it Ready; then it is removed."""
    name = pod["metadata"]["name"]
    started = time.monotonic()
    kube.create(core_path("pods", NS), pod)
    _, seen = pods.wait(name, {"ready"})
    kube.delete(core_path("pods", NS, name))
    wait_until(lambda: kube.get(core_path("pods", NS, name)) is None)
    return seen - started


def minimal_pod(settings: Settings, name: str, second: str = "") -> JSON:
    """A pod of the same runtime image, one container, no probes or volumes;
    `second`: "sidecar" adds a native sidecar of the same image, "container"
    a second plain container."""

    def sleeper(container: str) -> JSON:
        return {
            "name": container,
            "image": settings.runtimes[settings.default_runtime].image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-c", "import time; time.sleep(3600)"],
        }

    spec: JSON = {
        "containers": [sleeper("main")],
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if second == "sidecar":
        spec["initContainers"] = [{**sleeper("side"), "restartPolicy": "Always"}]
    elif second == "container":
        spec["containers"].append(sleeper("side"))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "minimal"}},
        "spec": spec,
    }


def minimal_start(kube: KubeJSON, pods: Watcher, settings: Settings, i: int) -> float:
    """The floor: a minimal pod of the same runtime image."""
    return timed_pod(kube, pods, minimal_pod(settings, f"minimal-{i}"))


def pair_start(kube: KubeJSON, pods: Watcher, settings: Settings, second: str, i: int) -> float:
    """The minimal pod with a second container: a native sidecar (the floor of
    the operator's pod shape) or a plain one."""
    return timed_pod(kube, pods, minimal_pod(settings, f"{second}-{i}", second))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=8)
    args = parser.parse_args()
    with operator_cluster(f"bench-resume-{os.getpid()}", OPERATOR_VALUES) as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        ref = bare_claim(kube, Settings())
        settings = Settings()
        results: dict[str, list[float]] = {
            "resume": [],
            "auto_resume": [],
            "pod_start": [],
            "minimal_pod": [],
            "sidecar_pod": [],
            "two_containers": [],
        }
        timelines: list[list[float]] = []
        with (
            Watcher(cluster.kubeconfig, SANDBOXES.path(NS), sandbox_state) as sandboxes,
            Watcher(cluster.kubeconfig, EXECUTIONS.path(NS), execution_state) as executions,
            Watcher(cluster.kubeconfig, core_path("pods", NS), pod_state) as pods,
            Watcher(cluster.kubeconfig, core_path("pods", NS), pod_stage) as stages,
        ):
            minimal_start(kube, pods, settings, -1)  # the image in the node's cache, warm
            for i in range(args.count):
                idle_paused(kube, sandboxes, f"r{i}")
                took, stamps = resume(kube, sandboxes, stages, f"r{i}")
                results["resume"].append(took)
                timelines.append(stamps)
                idle_paused(kube, sandboxes, f"e{i}")
                results["auto_resume"].append(auto_resume(kube, executions, stages, f"e{i}"))
                results["pod_start"].append(pod_start(kube, pods, ref, i))
                results["minimal_pod"].append(minimal_start(kube, pods, settings, i))
                results["sidecar_pod"].append(pair_start(kube, pods, settings, "sidecar", i))
                results["two_containers"].append(pair_start(kube, pods, settings, "container", i))
                for name in (f"r{i}", f"e{i}"):
                    kube.delete(SANDBOXES.path(NS, name))
        print(f"\nIdle-paused sandbox back at work, {args.count} each, interleaved:")
        print(latency_row("resume annotation -> Ready", results["resume"]))
        print(latency_row("Execution -> Succeeded (auto-resume)", results["auto_resume"]))
        print(latency_row("baseline: pod on a bound claim", results["pod_start"]))
        print(latency_row("floor: minimal pod, same image", results["minimal_pod"]))
        print(latency_row("floor: minimal pod + native sidecar", results["sidecar_pod"]))
        print(latency_row("minimal pod, two plain containers", results["two_containers"]))
        floor = statistics.median(results["minimal_pod"])
        shape = statistics.median(results["sidecar_pod"])
        for key in ("resume", "auto_resume", "pod_start", "sidecar_pod", "two_containers"):
            p50 = statistics.median(results[key])
            print(
                f"  {key}: p50 {p50 / floor:.2f}x the minimal pod,"
                f" {p50 / shape:.2f}x the one with a sidecar"
            )
        print("\nWhere a resume's time goes (p50 of the time since the request):")
        marks = [*STAGES, "Sandbox Ready"]
        previous = 0.0
        for k, mark in enumerate(marks):
            at = statistics.median(t[k] for t in timelines) * 1000
            print(f"  {mark:<16} {at:8.0f} ms   (+{at - previous:6.0f} ms)")
            previous = at
        write_results("resume_bench", {**results, "timelines": timelines, "stages": marks})


if __name__ == "__main__":
    main()
