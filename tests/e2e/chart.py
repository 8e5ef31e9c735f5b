"""The chart's upgrade path, as the e2e session runs it: the previous chart
version (charts/ as it was at a fixed commit) installed first, a Sandbox
started under it, then `helm upgrade` to the chart in this tree."""

from __future__ import annotations

import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from devcluster import deploy
from devcluster.cluster import LocalCluster
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import KubeJSON, core_path
from tests.sandboxes import Sandboxes

REPO = Path(__file__).resolve().parents[2]
CHART = "charts/sandbox-operator"
# The last commit of chart version 0.1.0 (the version before the current one).
PREVIOUS_COMMIT = "c58441211f7ceaf4e92d779bdabcfe116fa5fdee"
NAMESPACE = "e2e-upgrade"
SANDBOX = "kept"
MARKER = "kept across the upgrade"


def previous_chart(target: Path) -> Path:
    """The chart at PREVIOUS_COMMIT, extracted under `target` (git archive)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS_COMMIT, CHART],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target / CHART


def chart_version(chart: Path) -> str:
    version: str = yaml.safe_load((chart / "Chart.yaml").read_text())["version"]
    return version


@dataclass(frozen=True)
class Before:
    """What the test after the upgrade compares with."""

    chart_version: str
    pod_uid: str


def start_sandbox(cluster: LocalCluster, chart_version: str) -> Before:
    """A Sandbox with a file in its workspace, Ready under the previous chart."""
    with KubeJSON(cluster.kubeconfig) as kube:
        kube.create(core_path("namespaces"), deploy.restricted_namespace(NAMESPACE))
        wait_for(
            lambda: kube.get(core_path("serviceaccounts", NAMESPACE, "default")),
            30,
            f"default ServiceAccount in {NAMESPACE}",
        )
        sandboxes, executions = Sandboxes(kube, NAMESPACE), Executions(kube, NAMESPACE)
        sandboxes.create(SANDBOX, {"runtime": "python"})
        status = sandboxes.wait_ready(SANDBOX, timeout=300)["status"]
        executions.run("write", SANDBOX, f"printf '{MARKER}' > marker.txt")
        done = executions.wait_done("write", timeout=120)
        if done["phase"] != "Succeeded":
            raise RuntimeError(f"writing the marker failed: {done}")
        return Before(chart_version=chart_version, pod_uid=status["podUID"])
