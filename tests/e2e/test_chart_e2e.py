"""The chart on a real node: `helm upgrade` from the previous chart version
(done by the session fixture, with a Sandbox running) upgraded the CRDs and
left the sandbox alone, and `helm test` passes and cleans up after itself."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from devcluster import deploy
from devcluster.helm import helm_binary
from tests.e2e import chart
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import api_path, core_path
from tests.sandboxes import Sandboxes
from tests.templates import cluster_template_path

pytestmark = pytest.mark.timeout(1800)


def _helm(e2e: E2E, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(helm_binary()),
            *args,
            f"--kubeconfig={e2e.cluster.kubeconfig}",
            "--namespace",
            deploy.NAMESPACE,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def _schemas(crd: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}


def test_upgrade_from_the_previous_chart_keeps_running_sandboxes(
    e2e: E2E, before_upgrade: chart.Before
) -> None:
    e2e.namespaces.append(chart.NAMESPACE)  # deleted after this test
    history = _helm(e2e, "history", deploy.RELEASE, "-o", "json")
    assert history.returncode == 0, history.stderr
    charts = [revision["chart"] for revision in json.loads(history.stdout)]
    current = chart.chart_version(chart.REPO / chart.CHART)
    assert before_upgrade.chart_version != current
    assert charts[:2] == [
        f"sandbox-operator-{before_upgrade.chart_version}",
        f"sandbox-operator-{current}",
    ]

    # The CRDs are the chart's now, applied by the pre-upgrade hook (helm
    # itself leaves crds/ as the first install made them).
    for path in sorted((chart.REPO / chart.CHART / "crds").glob("*.yaml")):
        shipped = yaml.safe_load(path.read_text())
        live = e2e.kube.read(
            api_path("apiextensions.k8s.io/v1", "customresourcedefinitions", None, path.stem)
        )
        assert _schemas(live) == _schemas(shipped), path.name
        managers = {entry["manager"] for entry in live["metadata"]["managedFields"]}
        assert "sandbox-operator-chart" in managers, managers

    # The runtime catalog came with the upgrade, after the CRD it needs.
    listed = {t["metadata"]["name"]: t["spec"] for t in e2e.kube.list(cluster_template_path())}
    assert listed["python"]["description"] == "Python 3"
    assert listed["python"]["sandbox"]["runtime"] == "python"
    assert set(listed) == {"python", "node", "e2b", "base", "code-interpreter-v1"}, listed
    assert listed["base"]["sandbox"]["workspace"]["mountPath"] == "/home/user"

    # The sandbox started under the previous chart: same pod, still Ready, its
    # workspace as it was.
    sandboxes = Sandboxes(e2e.kube, chart.NAMESPACE)
    body = sandboxes.read(chart.SANDBOX)
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", body["status"]
    assert body["status"]["podUID"] == before_upgrade.pod_uid
    pod = e2e.kube.read(core_path("pods", chart.NAMESPACE, body["status"]["podName"]))
    assert pod["metadata"]["uid"] == before_upgrade.pod_uid
    executions = Executions(e2e.kube, chart.NAMESPACE)
    executions.run("read", chart.SANDBOX, "cat marker.txt")
    status = executions.wait_done("read", timeout=120)
    assert (status["phase"], status["stdout"]) == ("Succeeded", chart.MARKER)
    assert status["podUID"] == before_upgrade.pod_uid
    waited = e2e.kubectl(
        "wait", "-n", chart.NAMESPACE, "--for=condition=Ready", f"sandbox/{chart.SANDBOX}",
        "--timeout=30s",
    )  # fmt: skip
    assert waited.returncode == 0, waited.stderr


def test_helm_test_runs_a_command_in_a_new_sandbox_and_cleans_up(e2e: E2E) -> None:
    done = _helm(e2e, "test", deploy.RELEASE, "--timeout=10m")
    hook = f"{deploy.RELEASE}-test"
    if done.returncode != 0:  # a failed test Pod is kept: say what it printed
        logs = e2e.kubectl("logs", "-n", deploy.NAMESPACE, f"pod/{hook}").stdout
        pytest.fail(f"helm test failed:\n{done.stdout}{done.stderr}\ntest pod:\n{logs}")
    smoke = f"{deploy.RELEASE}-smoke"
    sandboxes = Sandboxes(e2e.kube, deploy.NAMESPACE)
    executions = Executions(e2e.kube, deploy.NAMESPACE)
    wait_for(lambda: sandboxes.get(smoke) is None, 120, f"sandbox {smoke} deleted")
    assert executions.get(smoke) is None
    # The hook's own objects go when it succeeded.
    assert e2e.kube.get(core_path("pods", deploy.NAMESPACE, hook)) is None
    assert e2e.kube.get(core_path("serviceaccounts", deploy.NAMESPACE, hook)) is None
