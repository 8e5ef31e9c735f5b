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
from typing import Any

import pytest

from devcluster import deploy
from devcluster.cluster import LocalCluster
from devcluster.pytest_plugin import private_cluster
from tests.e2e import chart, e2b_support
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
# A pause whose save failed is tried again within seconds (default 30).
E2E_MEMORY_RETRY = "settings.memory_retry_seconds=5"


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
        deploy.install_operator(
            cluster, extra_values=[E2E_RECONCILE, E2E_MEMORY_RETRY, e2b_support.CHART_VALUE]
        )
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


# -- the E2B adapter (tests/e2e/e2b.py) ---------------------------------------------

CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1"


@pytest.fixture(scope="session")
def e2b_session(request: pytest.FixtureRequest) -> Iterator[e2b_support.E2BTarget]:
    target = e2b_support.from_environment()
    owned = target is not None
    if target is None:
        context: E2E = request.getfixturevalue("e2e_context")
        main, url = e2b_support.chart_urls(context.kube)
        template = os.environ.get(e2b_support.TEMPLATE_VARIABLE, "base")
        target = e2b_support.E2BTarget(context.kube, url, main, template)
    try:
        yield target
    finally:
        target.cleanup()
        if owned:
            target.kube.close()


@pytest.fixture
def e2b_target(e2b_session: e2b_support.E2BTarget) -> Iterator[e2b_support.E2BTarget]:
    """The E2B listener; the namespaces a test makes are deleted after it."""
    before = set(e2b_session.namespaces)
    yield e2b_session
    e2b_session.cleanup([n for n in e2b_session.namespaces if n not in before])


@pytest.fixture(scope="module")
def e2b_opts(e2b_session: e2b_support.E2BTarget) -> Iterator[dict[str, Any]]:
    """The E2B SDK's connection options of a user in a namespace of its own (a
    ServiceAccount with the chart's user role, its token as the key), for one
    test module; the namespace and what is in it go at the module's end."""
    ns, key = e2b_session.user()
    yield e2b_session.opts(key)
    e2b_session.cleanup([ns])


@pytest.fixture(scope="module")
def e2b_sandbox(e2b_session: e2b_support.E2BTarget, e2b_opts: dict[str, Any]) -> Iterator[Any]:
    """An `e2b.Sandbox` of the base template, made through the E2B adapter, shared
    by a test module (a test that kills it makes its own)."""
    from e2b import Sandbox

    sandbox = Sandbox.create(e2b_session.template, timeout=1800, **e2b_opts)
    yield sandbox
    sandbox.kill()


@pytest.fixture(scope="module")
def e2b_interpreter(e2b_opts: dict[str, Any]) -> Iterator[Any]:
    """An `e2b_code_interpreter.Sandbox` of the code-interpreter-v1 template."""
    from e2b_code_interpreter import Sandbox  # type: ignore[import-untyped]

    sandbox = Sandbox.create(CODE_INTERPRETER_TEMPLATE, timeout=1800, **e2b_opts)
    yield sandbox
    sandbox.kill()


@pytest.fixture
def e2b_env(e2b_target: e2b_support.E2BTarget) -> dict[str, str]:
    """The environment a user of E2B's SDKs sets, for a fresh namespace."""
    _ns, key = e2b_target.user()
    return {**e2b_target.env(key), "E2B_TEMPLATE": CODE_INTERPRETER_TEMPLATE}
