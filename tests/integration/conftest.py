"""Fixtures of the integration tier: a real control plane, the CRDs, the
operator running through Kopf under the chart's own RBAC rules, and helpers."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from devcluster.helm import helm_binary
from tests.executions import Executions
from tests.integration.harness import (
    AgentProcess,
    GatewayProcess,
    Node,
    OperatorProcess,
    gateway_credentials,
    log_tail,
    next_pod_ip,
    operator_credentials,
    secret_token,
    wait_for,
)
from tests.kube import JSON, KubeJSON, core_path
from tests.sandboxes import Sandboxes

# Short intervals so lifecycle tests finish in seconds, not minutes.
OPERATOR_ENV = {
    "SANDBOX_OPERATOR_RECONCILE_INTERVAL_SECONDS": "1",
    "SANDBOX_OPERATOR_AGENT_TIMEOUT_SECONDS": "2",
    "SANDBOX_OPERATOR_DEFAULT_IDLE_TIMEOUT": "null",
    # Small enough that queueing and the wait bound show within a test.
    "SANDBOX_OPERATOR_MAX_EXECUTIONS_PER_SANDBOX": "2",
    "SANDBOX_OPERATOR_EXECUTION_SANDBOX_WAIT": "15s",
    # A sandbox refused by a quota looks again for room this often.
    "SANDBOX_OPERATOR_QUOTA_RETRY_SECONDS": "1",
}


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> Iterator[KubeJSON]:
    """The API server as the cluster admin, in JSON."""
    with KubeJSON(control_plane.kubeconfig) as client:
        yield client


def kubectl(
    cp: ControlPlane, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cp.kubectl), f"--kubeconfig={cp.kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def namespace_manifest(name: str) -> JSON:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane, repo: Path) -> None:
    applied = kubectl(control_plane, "apply", "-f", str(repo / "crds"))
    assert applied.returncode == 0, applied.stderr
    established = kubectl(
        control_plane,
        "wait",
        "--for=condition=Established",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=sandbox-operator",
        "--timeout=60s",
    )
    assert established.returncode == 0, established.stderr


@pytest.fixture(scope="session")
def audit_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a module's own control plane leaves its audit log when it stops, for
    the least-privilege tests, which read it with the session control plane's."""
    return tmp_path_factory.mktemp("audit")


def archive_audit_logs(cluster: ControlPlane, archive: Path) -> None:
    for log in cluster.audit_logs:
        shutil.copy(log, archive / f"{cluster.name}-{log.name}")


@pytest.fixture(scope="session")
def operator_kubeconfig(
    control_plane: ControlPlane,
    kube: KubeJSON,
    repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """Credentials bound to exactly the chart's ClusterRole rules, so every
    integration test also proves the operator's RBAC is sufficient."""
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    return operator_credentials(control_plane, kube, repo, path)


@pytest.fixture(scope="session")
def operator(
    crds: None, operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(
        operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"), OPERATOR_ENV
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture
def running_operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    """The operator, restarted after the test if the test stopped or killed it,
    and checked for handler crashes."""
    yield operator
    if operator.proc is None or operator.proc.poll() is not None:
        operator.start()
    assert operator.errors() == [], f"handler tracebacks in {operator.log}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `after_integration_tier` (what the whole tier did, from the
    audit log) run right after the tier's last other test."""
    later = [item for item in items if item.get_closest_marker("after_integration_tier")]
    if not later:
        return
    rest = [item for item in items if item not in later]
    here = Path(__file__).parent
    tier = [i for i, item in enumerate(rest) if here in Path(item.path).parents]
    at = tier[-1] + 1 if tier else len(rest)
    items[:] = rest[:at] + later + rest[at:]


# The agents a test started (the `agents` fixture), for its report.
AGENTS_STARTED = pytest.StashKey[list[AgentProcess]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries what the operator logged about its
    namespace and the ends of its agents' and runners' logs: a rare failure in
    CI is explained by the run that had it (their files go with the run)."""
    report = yield
    if report.when != "call" or not report.failed:
        return report
    funcargs = getattr(item, "funcargs", {})
    operator, namespace = funcargs.get("running_operator"), funcargs.get("ns")
    if operator is not None and namespace:
        mentions = [line for line in operator.log_lines() if namespace in line]
        report.sections.append((f"operator log about {namespace}", "\n".join(mentions[-300:])))
    for agent in item.stash.get(AGENTS_STARTED, []):
        for name in ("agent.log", "runner.log"):
            report.sections.append((f"{agent.root.name} {name}", log_tail(agent.root / name)))
    return report


@pytest.fixture
def ns(kube: KubeJSON, running_operator: OperatorProcess) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create(core_path("namespaces"), namespace_manifest(name))
    # Pods are refused until the controller manager makes the namespace's default
    # ServiceAccount: right after the cluster starts, that can take a while.
    wait_for(
        lambda: kube.get(core_path("serviceaccounts", name, "default")),
        60,
        f"the default ServiceAccount of {name}",
    )
    yield name
    kube.delete(core_path("namespaces", name=name))


@pytest.fixture
def node(kube: KubeJSON) -> Node:
    return Node(kube)


@pytest.fixture
def agents(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], AgentProcess]]:
    """Start a real agent + runner for a token; all stopped after the test."""
    started: list[AgentProcess] = []
    request.node.stash[AGENTS_STARTED] = started  # for a failed test's report

    def start(token: str, port: int = 8080) -> AgentProcess:
        agent = AgentProcess(tmp_path / f"agent-{len(started)}", next_pod_ip(), port, token)
        started.append(agent)
        agent.start()
        return agent

    yield start
    for agent in started:
        agent.stop()


@pytest.fixture
def sandboxes(kube: KubeJSON, ns: str) -> Sandboxes:
    return Sandboxes(kube, ns)


@pytest.fixture
def executions(kube: KubeJSON, ns: str) -> Executions:
    return Executions(kube, ns)


@pytest.fixture
def live_sandbox(
    sandboxes: Sandboxes,
    kube: KubeJSON,
    node: Node,
    agents: Callable[[str], AgentProcess],
) -> Callable[..., AgentProcess]:
    """Create a Sandbox (or take an existing one), play the node for its pod with
    a real agent, and return the agent once the Sandbox is Running."""

    def start(name: str, spec: JSON | None = None, *, create: bool = True) -> AgentProcess:
        if create:
            sandboxes.create(name, spec or {"runtime": "python"})
        ns = sandboxes.namespace
        wait_for(lambda: kube.get(core_path("pods", ns, name)) is not None, 20, f"pod {name}")
        agent = agents(secret_token(kube, ns, name))
        node.run_pod(ns, name, agent.ip)
        sandboxes.wait_phase(name, "Running")
        return agent

    return start


# The chart's release name in these tests: the user and viewer roles are
# `<release>-user` and `<release>-viewer`.
RELEASE = "sbx"


@pytest.fixture(scope="session")
def access_roles(control_plane: ControlPlane, repo: Path, crds: None) -> None:
    """The chart's user and viewer ClusterRoles, as `helm template` renders them."""
    rendered = subprocess.run(
        [
            str(helm_binary()),
            "template",
            RELEASE,
            str(repo / "charts/sandbox-operator"),
            "-n",
            "sandbox-system",
            "--show-only",
            "templates/access.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    applied = kubectl(control_plane, "apply", "-f", "-", input=rendered)
    assert applied.returncode == 0, applied.stderr


@pytest.fixture(scope="session")
def gateway(
    control_plane: ControlPlane,
    kube: KubeJSON,
    repo: Path,
    crds: None,
    access_roles: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    work = tmp_path_factory.mktemp("gateway")
    credentials = gateway_credentials(control_plane, kube, repo, work / "kubeconfig")
    process = GatewayProcess(credentials, work, {"SANDBOX_GATEWAY_RESUME_WAIT_SECONDS": "20"})
    process.start()
    yield process
    process.stop()
    assert process.errors() == [], f"handler tracebacks in {process.log}"
