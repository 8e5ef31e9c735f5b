"""The Sandbox lifecycle against a real API server, with the operator in Kopf."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

from kubernetes import client as k8s

from devcluster.controlplane import ControlPlane
from tests.integration.conftest import Sandboxes, kubectl
from tests.integration.harness import AgentProcess, Node, OperatorProcess, secret_token, wait_for


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
        return True
    except k8s.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def _children(core: k8s.CoreV1Api, api: k8s.ApiClient, ns: str, name: str) -> dict[str, bool]:
    net = k8s.NetworkingV1Api(api)
    return {
        "pod": _exists(lambda: core.read_namespaced_pod(name, ns)),
        "claim": _exists(
            lambda: core.read_namespaced_persistent_volume_claim(f"{name}-workspace", ns)
        ),
        "secret": _exists(lambda: core.read_namespaced_secret(f"{name}-agent-token", ns)),
        "policy": _exists(lambda: net.read_namespaced_network_policy(name, ns)),
    }


def _ready(
    sandboxes: Sandboxes,
    core: k8s.CoreV1Api,
    node: Node,
    agents: Callable[[str], AgentProcess],
    name: str,
) -> AgentProcess:
    """Play the node for a sandbox's pod and run its real agent; return the agent."""
    ns = sandboxes.namespace
    wait_for(lambda: _exists(lambda: core.read_namespaced_pod(name, ns)), 20, f"pod {name}")
    agent = agents(secret_token(core, ns, name))
    node.run_pod(ns, name, agent.ip)
    sandboxes.wait_phase(name, "Running")
    return agent


def test_create_makes_children_and_conditions(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, api: k8s.ApiClient
) -> None:
    sandboxes.create(
        "alpha", {"runtime": "python", "network": {"exposedPorts": [{"name": "web", "port": 8000}]}}
    )
    ns = sandboxes.namespace
    wait_for(lambda: all(_children(core, api, ns, "alpha").values()), 20, "all children")
    body = sandboxes.wait_phase("alpha", "Pending")
    status = body["status"]
    assert status["observedGeneration"] == 1
    assert status["podName"] == "alpha"
    assert status["workspaceClaim"] == "alpha-workspace"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert ready["reason"] == "PodPending"
    pod = core.read_namespaced_pod("alpha", ns)
    assert pod.metadata.owner_references[0].uid == body["metadata"]["uid"]
    assert pod.spec.automount_service_account_token is False
    assert core.read_namespaced_service("alpha", ns).spec.ports[0].port == 8000
    # Kopf's bookkeeping lives under the project's prefix, never kopf.zalando.org.
    meta = body["metadata"]
    assert meta["finalizers"] == ["sandbox.dev/finalizer"]
    assert not any("kopf.zalando.org" in key for key in meta.get("annotations", {}))


def test_ready_via_kubectl_wait(
    sandboxes: Sandboxes,
    core: k8s.CoreV1Api,
    node: Node,
    agents: Callable[[str], AgentProcess],
    control_plane: ControlPlane,
) -> None:
    sandboxes.create("bravo")
    ns = sandboxes.namespace
    wait_for(lambda: _exists(lambda: core.read_namespaced_pod("bravo", ns)), 20, "pod")
    agent = agents(secret_token(core, ns, "bravo"))
    node.run_pod(ns, "bravo", agent.ip)
    waited = kubectl(
        control_plane, "-n", ns, "wait", "--for=condition=Ready", "sandbox/bravo", "--timeout=30s"
    )
    assert waited.returncode == 0, waited.stderr
    status = sandboxes.get("bravo")["status"]  # type: ignore[index]
    assert status["agentEndpoint"] == f"http://{agent.ip}:8080"
    assert status["phase"] == "Running"
    shown = kubectl(control_plane, "-n", ns, "get", "sandboxes", "bravo")
    assert "Running" in shown.stdout
    assert "True" in shown.stdout


def test_pause_and_resume_keep_the_workspace_claim(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("charlie")
    _ready(sandboxes, core, node, agents, "charlie")
    claim_uid = core.read_namespaced_persistent_volume_claim("charlie-workspace", ns).metadata.uid
    sandboxes.patch("charlie", {"spec": {"paused": True}})
    wait_for(lambda: not _exists(lambda: core.read_namespaced_pod("charlie", ns)), 20, "pod gone")
    body = sandboxes.wait_phase("charlie", "Paused")
    assert sandboxes.condition("charlie", "Paused")["status"] == "True"  # type: ignore[index]
    assert body["status"].get("podIP") is None
    assert (
        core.read_namespaced_persistent_volume_claim("charlie-workspace", ns).metadata.uid
        == claim_uid
    )
    sandboxes.patch("charlie", {"spec": {"paused": False}})
    wait_for(lambda: _exists(lambda: core.read_namespaced_pod("charlie", ns)), 20, "pod back")
    pod = core.read_namespaced_pod("charlie", ns)
    volume = next(v for v in pod.spec.volumes if v.name == "workspace")
    assert volume.persistent_volume_claim.claim_name == "charlie-workspace"
    assert (
        core.read_namespaced_persistent_volume_claim("charlie-workspace", ns).metadata.uid
        == claim_uid
    )


def test_delete_removes_children_through_garbage_collection(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, api: k8s.ApiClient
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("delta")
    wait_for(lambda: all(_children(core, api, ns, "delta").values()), 20, "children")
    sandboxes.delete("delta")
    wait_for(lambda: sandboxes.get("delta") is None, 30, "sandbox gone")
    wait_for(lambda: not any(_children(core, api, ns, "delta").values()), 60, "children collected")


def test_deletion_waits_for_the_operator(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, running_operator: OperatorProcess
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("echo")
    wait_for(lambda: _exists(lambda: core.read_namespaced_pod("echo", ns)), 20, "pod")
    running_operator.kill()
    sandboxes.delete("echo")
    time.sleep(3)
    body = sandboxes.get("echo")
    assert body is not None and body["metadata"].get("deletionTimestamp"), (
        "finalizer must hold deletion"
    )
    assert _exists(lambda: core.read_namespaced_pod("echo", ns))
    running_operator.start()
    wait_for(lambda: sandboxes.get("echo") is None, 30, "deletion completes after restart")
    wait_for(lambda: not _exists(lambda: core.read_namespaced_pod("echo", ns)), 30, "pod gone")


def test_restart_mid_creation_creates_no_duplicates(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, running_operator: OperatorProcess
) -> None:
    ns = sandboxes.namespace
    names = [f"fox-{i}" for i in range(12)]
    for name in names:
        sandboxes.create(name)
    time.sleep(0.4)  # some are half-way through their handlers now
    running_operator.kill()
    tokens = {}
    for name in names:
        with contextlib.suppress(k8s.ApiException):
            tokens[name] = secret_token(core, ns, name)
    running_operator.start()
    for name in names:
        sandboxes.wait_phase(name, "Pending", timeout=40)
    pods = core.list_namespaced_pod(
        ns, label_selector="app.kubernetes.io/managed-by=sandbox-operator"
    )
    assert sorted(p.metadata.name for p in pods.items) == sorted(names)
    secrets = core.list_namespaced_secret(
        ns, label_selector="app.kubernetes.io/managed-by=sandbox-operator"
    )
    assert len(secrets.items) == len(names)
    for name, token in tokens.items():
        assert secret_token(core, ns, name) == token, "a token was replaced: agents would lose auth"


def test_idle_timeout_follows_real_agent_activity(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    sandboxes.create("golf", {"lifecycle": {"idleTimeout": "4s"}})
    agent = _ready(sandboxes, core, node, agents, "golf")
    # A background command keeps the sandbox busy past the idle timeout.
    started = agent.call(
        "POST",
        "/v1/executions",
        json.dumps({"argv": ["sleep", "7"], "background": True}).encode(),
    )
    assert started["id"]
    busy_until = time.monotonic() + 6
    while time.monotonic() < busy_until:
        body = sandboxes.get("golf")
        assert body is not None and not body["metadata"].get("deletionTimestamp"), (
            "deleted while busy"
        )
        time.sleep(0.5)
    status = sandboxes.get("golf")["status"]  # type: ignore[index]
    assert status["activeExecutions"] == 1
    # Then, after the command ends and 4 s pass without activity, it goes.
    wait_for(lambda: sandboxes.get("golf") is None, 30, "idle deletion")


def test_idle_pause_keeps_the_claim_and_resumes_on_request(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("hotel", {"lifecycle": {"idleTimeout": "2s", "onIdle": "Pause"}})
    _ready(sandboxes, core, node, agents, "hotel")
    body = sandboxes.wait_phase("hotel", "Paused", timeout=30)
    assert body["status"]["idlePausedAt"]
    assert body["spec"]["paused"] is False, "the operator never writes spec"
    wait_for(lambda: not _exists(lambda: core.read_namespaced_pod("hotel", ns)), 20, "pod gone")
    assert _exists(lambda: core.read_namespaced_persistent_volume_claim("hotel-workspace", ns))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    sandboxes.patch(
        "hotel", {"metadata": {"annotations": {"sandbox.dev/resume-requested-at": stamp}}}
    )
    wait_for(
        lambda: _exists(lambda: core.read_namespaced_pod("hotel", ns)), 20, "pod back after resume"
    )


def test_failed_pod_is_recreated_on_the_same_claim(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("india")
    _ready(sandboxes, core, node, agents, "india")
    old_uid = core.read_namespaced_pod("india", ns).metadata.uid
    node.fail_pod(ns, "india", "Evicted")

    def replaced() -> bool:
        try:
            return bool(core.read_namespaced_pod("india", ns).metadata.uid != old_uid)
        except k8s.ApiException:
            return False

    wait_for(replaced, 30, "a new pod")
    pod = core.read_namespaced_pod("india", ns)
    volume = next(v for v in pod.spec.volumes if v.name == "workspace")
    assert volume.persistent_volume_claim.claim_name == "india-workspace"


def test_invalid_spec_is_explained_and_blocks_nobody(
    sandboxes: Sandboxes, core: k8s.CoreV1Api
) -> None:
    sandboxes.create("juliet", {"runtime": "cobol"})
    sandboxes.create("kilo")
    body = sandboxes.wait_phase("juliet", "Failed")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec"
    assert "unknown runtime 'cobol'" in ready["message"]
    assert "python" in ready["message"]
    sandboxes.wait_phase("kilo", "Pending")
    # Fixing the spec heals it.
    sandboxes.patch("juliet", {"spec": {"runtime": "python"}})
    sandboxes.wait_phase("juliet", "Pending")


def test_runtime_without_python_is_not_ready_with_a_reason(
    sandboxes: Sandboxes, core: k8s.CoreV1Api, node: Node
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("lima", {"image": "busybox:1.36"})
    wait_for(lambda: _exists(lambda: core.read_namespaced_pod("lima", ns)), 20, "pod")
    node.crash_runtime(ns, "lima", 'exec: "python3": executable file not found in $PATH')
    body = sandboxes.wait_phase("lima", "Failed")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "RuntimeMissingPython"
    assert "python3 >= 3.9" in ready["message"]


def test_metrics_report_reconciles_and_phases(
    sandboxes: Sandboxes, running_operator: OperatorProcess
) -> None:
    sandboxes.create("mike")
    sandboxes.wait_phase("mike", "Pending")
    text = running_operator.metrics()
    assert 'sandbox_operator_reconciles_total{kind="Sandbox"' in text
    assert 'sandbox_operator_sandboxes{phase="Pending"}' in text
