"""Fixtures of the integration tier: a real control plane, the CRDs, the
operator running through Kopf under the chart's own RBAC rules, and helpers."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from devcluster.controlplane import ControlPlane
from tests.integration.harness import (
    AgentProcess,
    Node,
    OperatorProcess,
    next_pod_ip,
    operator_credentials,
    wait_for,
)

GROUP, VERSION = "sandbox.dev", "v1alpha1"
# Short intervals so lifecycle tests finish in seconds, not minutes.
OPERATOR_ENV = {
    "SANDBOX_OPERATOR_RECONCILE_INTERVAL_SECONDS": "1",
    "SANDBOX_OPERATOR_AGENT_TIMEOUT_SECONDS": "2",
    "SANDBOX_OPERATOR_DEFAULT_IDLE_TIMEOUT": "null",
}


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> k8s.ApiClient:
    client: k8s.ApiClient = k8s_config.new_client_from_config(
        config_file=str(control_plane.kubeconfig)
    )
    return client


@pytest.fixture(scope="session")
def core(api: k8s.ApiClient) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(api)


@pytest.fixture(scope="session")
def custom(api: k8s.ApiClient) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(api)


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
def operator_kubeconfig(
    control_plane: ControlPlane,
    api: k8s.ApiClient,
    repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """Credentials bound to exactly the chart's ClusterRole rules, so every
    integration test also proves the operator's RBAC is sufficient."""
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    return operator_credentials(control_plane, api, repo, path)


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


@pytest.fixture
def ns(core: k8s.CoreV1Api, running_operator: OperatorProcess) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def node(core: k8s.CoreV1Api) -> Node:
    return Node(core)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[[str], AgentProcess]]:
    """Start a real agent + runner for a token; all stopped after the test."""
    started: list[AgentProcess] = []

    def start(token: str, port: int = 8080) -> AgentProcess:
        agent = AgentProcess(tmp_path / f"agent-{len(started)}", next_pod_ip(), port, token)
        started.append(agent)
        agent.start()
        return agent

    yield start
    for agent in started:
        agent.stop()


class Sandboxes:
    """Create, read and wait on Sandboxes of one namespace."""

    def __init__(self, custom: k8s.CustomObjectsApi, namespace: str) -> None:
        self.custom = custom
        self.namespace = namespace

    def create(self, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": spec or {},
        }
        result: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "sandboxes", body
        )
        return result

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "sandboxes", name
            )
            return result
        except k8s.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "sandboxes", name, body
        )

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "sandboxes", name
        )

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        body = self.get(name) or {}
        for cond in (body.get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                result: dict[str, Any] = cond
                return result
        return None

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> dict[str, Any]:
        return wait_for(
            lambda: (b := self.get(name)) and (b.get("status") or {}).get("phase") == phase and b,
            timeout,
            f"sandbox {name} phase {phase}",
        )


@pytest.fixture
def sandboxes(custom: k8s.CustomObjectsApi, ns: str) -> Sandboxes:
    return Sandboxes(custom, ns)
