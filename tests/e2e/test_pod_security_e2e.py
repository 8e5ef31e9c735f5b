"""Pod Security `restricted` on a real node: every namespace of this tier enforces
it (conftest), so each shape of sandbox below running at all proves admission;
a server dry run of each pod again, warnings as errors, proves it came without
a warning. The chart's own pods are checked in their namespace the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devcluster import deploy, gvisor
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import JSON, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots

pytestmark = pytest.mark.timeout(1200)


def _warnings(e2e: E2E, pod: JSON, tmp_path: Path) -> str:
    """What admission says about `pod` under a fresh name: "" when it admits it silently."""
    meta = pod["metadata"]
    copy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{meta['name'][:40]}-psa", "namespace": meta["namespace"]},
        "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"},
    }
    path = tmp_path / f"{meta['name']}.json"
    path.write_text(json.dumps(copy))
    done = e2e.kubectl("create", "--dry-run=server", "--warnings-as-errors", "-f", str(path))
    return "" if done.returncode == 0 and "Warning" not in done.stderr else done.stderr


def _labels(e2e: E2E, namespace: str) -> dict[str, str]:
    labels: dict[str, str] = e2e.kube.read(core_path("namespaces", name=namespace))["metadata"][
        "labels"
    ]
    return labels


def test_every_pod_shape_runs_under_restricted_without_warnings(e2e: E2E, tmp_path: Path) -> None:
    ns = e2e.namespace()
    assert deploy.POD_SECURITY_RESTRICTED.items() <= _labels(e2e, ns).items()
    sandboxes, executions = Sandboxes(e2e.kube, ns), Executions(e2e.kube, ns)
    snapshots = Snapshots(e2e.kube, ns)
    sandboxes.create("persistent")
    sandboxes.create("ports", {"network": {"exposedPorts": [{"name": "web", "port": 8000}]}})
    sandboxes.wait_ready("persistent")
    snapshots.create("base", "persistent")
    snapshots.wait_phase("base", "Ready")
    sandboxes.create("restored", {"workspace": {"fromSnapshot": "base"}})
    sandboxes.create("ephemeral", {"workspace": {"ephemeral": True}})
    sandboxes.create("gvisor", {"runtimeClassName": gvisor.RUNTIME_CLASS})
    for name in ("ports", "restored", "ephemeral", "gvisor"):
        sandboxes.wait_ready(name)
    # A one-shot Execution's sandbox lives as long as its command: catch it running.
    executions.create(
        "one-shot",
        {
            "sandboxTemplate": {"runtime": "python", "workspace": {"ephemeral": True}},
            "script": "sleep 60",
        },
    )

    def one_shot_pod() -> JSON | None:
        owned = [
            p
            for p in e2e.kube.list(core_path("pods", ns))
            if p["metadata"]["name"]
            not in ("persistent", "ports", "restored", "ephemeral", "gvisor")
        ]
        return owned[0] if owned else None

    wait_for(one_shot_pod, 180, "the one-shot Execution's pod")
    pods = e2e.kube.list(core_path("pods", ns))
    assert len(pods) == 6, [p["metadata"]["name"] for p in pods]
    said = {p["metadata"]["name"]: _warnings(e2e, p, tmp_path) for p in pods}
    assert said == {name: "" for name in said}


def test_the_charts_pods_run_under_restricted_without_warnings(e2e: E2E, tmp_path: Path) -> None:
    assert deploy.POD_SECURITY_RESTRICTED.items() <= _labels(e2e, deploy.NAMESPACE).items()
    pods = [
        p
        for p in e2e.kube.list(core_path("pods", deploy.NAMESPACE))
        if p["status"].get("phase") == "Running"
    ]
    names = {p["metadata"]["labels"].get("app.kubernetes.io/name") for p in pods}
    assert {"sandbox-operator", "sandbox-gateway"} <= names, names
    said = {p["metadata"]["name"]: _warnings(e2e, p, tmp_path) for p in pods}
    assert said == {name: "" for name in said}
