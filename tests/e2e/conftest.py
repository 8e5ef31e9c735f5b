"""The end-to-end tier: a real single-node cluster with the operator deployed from the chart.

The cluster is private to the session and removed at its end. It never
skips: when the node cannot start, every test errors with the reason.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from devcluster import deploy
from devcluster.cluster import LocalCluster
from devcluster.pytest_plugin import private_cluster
from tests.e2e import chart
from tests.integration.harness import wait_for
from tests.kube import KubeJSON, core_path


class E2E:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.kube = KubeJSON(cluster.kubeconfig)
        self.namespaces: list[str] = []

    def kubectl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return deploy.kubectl(self.cluster, *args, timeout=timeout)

    def namespace(self) -> str:
        name = f"e2e-{uuid.uuid4().hex[:8]}"
        self.kube.create(core_path("namespaces"), deploy.restricted_namespace(name))
        # Pods need the namespace's default ServiceAccount to exist first.
        wait_for(
            lambda: self.kube.get(core_path("serviceaccounts", name, "default")) is not None,
            30,
            f"default ServiceAccount in {name}",
        )
        self.namespaces.append(name)
        return name

    def kill_container(self, namespace: str, pod: str, container: str) -> None:
        """SIGKILL a container's processes through the node's CRI, like a crash would."""
        self.cluster.kill_container(namespace, pod, container)

    def describe(self, namespace: str, sandbox: str) -> str:
        """What to look at when a sandbox does not become Ready."""
        parts = [
            self.kubectl("get", "-n", namespace, "sandbox", sandbox, "-o", "yaml").stdout,
            self.kubectl("describe", "-n", namespace, "pod", sandbox).stdout,
            self.kubectl(
                "logs",
                "-n",
                deploy.NAMESPACE,
                "-l",
                deploy.OPERATOR_SELECTOR,
                "--prefix",
                "--tail=50",
            ).stdout,
        ]
        return "\n".join(parts)


E2E_RECONCILE = "settings.reconcile_interval_seconds=5"


def _gone(kube: KubeJSON, path: str) -> bool:
    return kube.get(path) is None


@pytest.fixture(scope="session")
def e2e_install(
    request: pytest.FixtureRequest, node_tier: None
) -> Iterator[tuple[LocalCluster, chart.Before]]:
    """The cluster, with the chart installed the way users get it: the previous
    chart version first, a Sandbox started under it, then `helm upgrade` to
    this tree's chart (tests/e2e/test_chart_e2e.py checks what it kept)."""
    cluster = deploy.node_cluster(f"pytest-{os.getpid()}-e2e", die_with_parent=True)
    with private_cluster(request, cluster):
        with tempfile.TemporaryDirectory() as tmp:
            previous = chart.previous_chart(Path(tmp))
            deploy.install_operator(cluster, chart=previous)
            version = chart.chart_version(previous)
        deploy.wait_for_crds(cluster)
        before = chart.start_sandbox(cluster, version)
        # What the operator learns on its periodic pass (limits biting, a full
        # workspace, idle deadlines) shows within seconds instead of the
        # default 30: the tests wait on conditions, not on the clock.
        deploy.install_operator(cluster, extra_values=[E2E_RECONCILE])
        deploy.wait_for_crds(cluster)
        yield cluster, before


@pytest.fixture(scope="session")
def e2e_cluster(e2e_install: tuple[LocalCluster, chart.Before]) -> LocalCluster:
    return e2e_install[0]


@pytest.fixture(scope="session")
def before_upgrade(e2e_install: tuple[LocalCluster, chart.Before]) -> chart.Before:
    return e2e_install[1]


@pytest.fixture(scope="session")
def e2e_context(e2e_cluster: LocalCluster) -> Iterator[E2E]:
    context = E2E(e2e_cluster)
    yield context
    context.kube.close()


@pytest.fixture
def e2e(e2e_context: E2E) -> Iterator[E2E]:
    """The cluster, with each test's namespaces deleted after it: a 2-core node
    holds only a few sandboxes at a time."""
    yield e2e_context
    for name in e2e_context.namespaces:
        e2e_context.kube.delete(core_path("namespaces", name=name))
    for name in e2e_context.namespaces:
        path = core_path("namespaces", name=name)
        wait_for(partial(_gone, e2e_context.kube, path), 120, f"namespace {name} deleted")
    e2e_context.namespaces.clear()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
