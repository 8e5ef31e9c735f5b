"""The Sandbox lifecycle against a real API server, with the operator in Kopf."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from devcluster.controlplane import ControlPlane
from tests.integration.conftest import kubectl
from tests.integration.harness import (
    AgentProcess,
    Node,
    OperatorProcess,
    next_pod_ip,
    secret_token,
    wait_for,
)
from tests.kube import JSON, ApiError, KubeJSON, api_path, core_path
from tests.sandboxes import Sandboxes
from tests.templates import cluster_template_path, create_cluster_template

MANAGED = "app.kubernetes.io/managed-by=sandbox-operator"


def _pod(ns: str, name: str) -> str:
    return core_path("pods", ns, name)


def _claim(ns: str, sandbox: str) -> str:
    return core_path("persistentvolumeclaims", ns, f"{sandbox}-workspace")


def _exists(kube: KubeJSON, path: str) -> bool:
    """False on 404; any other error is raised."""
    return kube.get(path) is not None


def _children(kube: KubeJSON, ns: str, name: str) -> dict[str, bool]:
    return {
        "pod": _exists(kube, _pod(ns, name)),
        "claim": _exists(kube, _claim(ns, name)),
        "secret": _exists(kube, core_path("secrets", ns, f"{name}-agent-token")),
        "policy": _exists(kube, api_path("networking.k8s.io/v1", "networkpolicies", ns, name)),
    }


def _workspace_claim_name(pod: dict[str, Any]) -> str:
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "workspace")
    name: str = volume["persistentVolumeClaim"]["claimName"]
    return name


def _wait_replaced(kube: KubeJSON, ns: str, name: str, old_uid: str) -> None:
    """Until the sandbox's pod exists again under another UID."""

    def replaced() -> bool:
        try:
            return bool(kube.read(_pod(ns, name))["metadata"]["uid"] != old_uid)
        except ApiError:
            return False

    wait_for(replaced, 30, "a new pod")


def _wait_event(kube: KubeJSON, ns: str, name: str, reason: str) -> None:
    wait_for(
        lambda: any(
            e["reason"] == reason and e["involvedObject"]["name"] == name
            for e in kube.list(f"/api/v1/namespaces/{ns}/events")
        ),
        10,
        f"a {reason} Event on {name}",
    )


def _ready(
    sandboxes: Sandboxes,
    kube: KubeJSON,
    node: Node,
    agents: Callable[[str], AgentProcess],
    name: str,
) -> AgentProcess:
    """Play the node for a sandbox's pod and run its real agent; return the agent."""
    ns = sandboxes.namespace
    wait_for(lambda: _exists(kube, _pod(ns, name)), 20, f"pod {name}")
    agent = agents(secret_token(kube, ns, name))
    node.run_pod(ns, name, agent.ip)
    sandboxes.wait_phase(name, "Running")
    return agent


def test_create_makes_children_and_conditions(sandboxes: Sandboxes, kube: KubeJSON) -> None:
    sandboxes.create(
        "alpha", {"runtime": "python", "network": {"exposedPorts": [{"name": "web", "port": 8000}]}}
    )
    ns = sandboxes.namespace
    wait_for(lambda: all(_children(kube, ns, "alpha").values()), 20, "all children")
    body = sandboxes.wait_phase("alpha", "Pending")
    status = body["status"]
    assert status["observedGeneration"] == 1
    assert status["podName"] == "alpha"
    assert status["workspaceClaim"] == "alpha-workspace"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert ready["reason"] == "PodPending"
    pod = kube.read(_pod(ns, "alpha"))
    assert pod["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    service = kube.read(core_path("services", ns, "alpha"))
    assert service["spec"]["ports"][0]["port"] == 8000
    # Kopf's bookkeeping lives under the project's prefix, never kopf.zalando.org.
    meta = body["metadata"]
    assert meta["finalizers"] == ["sandbox.dev/finalizer"]
    assert not any("kopf.zalando.org" in key for key in meta.get("annotations", {}))


def test_ready_via_kubectl_wait(
    sandboxes: Sandboxes,
    kube: KubeJSON,
    node: Node,
    agents: Callable[[str], AgentProcess],
    control_plane: ControlPlane,
) -> None:
    sandboxes.create("bravo")
    ns = sandboxes.namespace
    wait_for(lambda: _exists(kube, _pod(ns, "bravo")), 20, "pod")
    agent = agents(secret_token(kube, ns, "bravo"))
    node.run_pod(ns, "bravo", agent.ip)
    waited = kubectl(
        control_plane, "-n", ns, "wait", "--for=condition=Ready", "sandbox/bravo", "--timeout=30s"
    )
    assert waited.returncode == 0, waited.stderr
    status = sandboxes.read("bravo")["status"]
    assert status["agentEndpoint"] == f"http://{agent.ip}:8080"
    assert status["phase"] == "Running"
    shown = kubectl(control_plane, "-n", ns, "get", "sandboxes", "bravo")
    assert "Running" in shown.stdout
    assert "True" in shown.stdout


def test_pause_and_resume_keep_the_workspace_claim(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("charlie")
    _ready(sandboxes, kube, node, agents, "charlie")
    claim_uid = kube.read(_claim(ns, "charlie"))["metadata"]["uid"]
    sandboxes.patch("charlie", {"spec": {"paused": True}})
    wait_for(lambda: not _exists(kube, _pod(ns, "charlie")), 20, "pod gone")
    # Phase Paused comes with Pausing while the operator still sees the pod;
    # the condition turns True once it has seen the pod go.
    body = sandboxes.wait_object(
        "charlie",
        "phase Paused, condition Paused=True",
        lambda s: (
            s.get("phase") == "Paused"
            and any(
                c["type"] == "Paused" and c["status"] == "True" for c in s.get("conditions", [])
            )
        ),
    )
    assert body["status"].get("podIP") is None
    assert kube.read(_claim(ns, "charlie"))["metadata"]["uid"] == claim_uid
    # Users see it in `kubectl describe`: an Event on the Sandbox.
    _wait_event(kube, ns, "charlie", "Paused")
    # Paused, the workspace is still there and bound: it says so (not Unknown).
    node.bind_claim(ns, "charlie-workspace")
    wait_for(
        lambda: (sandboxes.condition("charlie", "WorkspaceReady") or {}).get("status") == "True",
        20,
        "WorkspaceReady while paused",
    )
    sandboxes.patch("charlie", {"spec": {"paused": False}})
    wait_for(lambda: _exists(kube, _pod(ns, "charlie")), 20, "pod back")
    assert _workspace_claim_name(kube.read(_pod(ns, "charlie"))) == "charlie-workspace"
    assert kube.read(_claim(ns, "charlie"))["metadata"]["uid"] == claim_uid
    _wait_event(kube, ns, "charlie", "Resumed")


def test_env_and_ports_change_without_a_new_pod(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    """env goes to the agent as an overlay for new commands (Secrets resolved),
    ports to the Service: the pod and its running commands stay."""
    ns = sandboxes.namespace
    kube.create(
        core_path("secrets", ns),
        {"metadata": {"name": "api"}, "stringData": {"key": "s3cret"}},
    )
    sandboxes.create("oscar", {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]})
    agent = _ready(sandboxes, kube, node, agents, "oscar")
    uid = kube.read(_pod(ns, "oscar"))["metadata"]["uid"]
    env = [
        {"name": "A", "value": "one"},
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}},
    ]
    ports = {"exposedPorts": [{"name": "web", "port": 8000}]}
    sandboxes.patch("oscar", {"spec": {"env": env, "network": ports}})

    def overlay() -> JSON | None:
        current: JSON = agent.call("GET", "/v1/environment")
        return current if current["env"] else None

    current = wait_for(overlay, 20, "the agent's environment overlay")
    assert current["env"] == {"A": "one", "KEY": "s3cret"}
    assert current["unset"] == ["B"]
    wait_for(lambda: _exists(kube, core_path("services", ns, "oscar")), 20, "the Service")
    assert kube.read(_pod(ns, "oscar"))["metadata"]["uid"] == uid
    _wait_event(kube, ns, "oscar", "EnvironmentUpdated")

    # Back to the env the pod started with: the overlay is taken back.
    sandboxes.patch(
        "oscar", {"spec": {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}}
    )
    wait_for(lambda: overlay() is None, 20, "the overlay taken back")
    assert agent.call("GET", "/v1/environment")["unset"] == []
    assert kube.read(_pod(ns, "oscar"))["metadata"]["uid"] == uid


def test_files_are_in_the_workspace_at_ready_and_a_bad_one_is_named(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    """spec.files goes through the agent before Ready; one the agent refuses holds
    Ready with its path and the agent's words, until the spec is fixed."""
    ns = sandboxes.namespace
    clash = [{"path": "notes", "content": "x"}, {"path": "notes/a.txt", "content": "y"}]
    sandboxes.create("fiona", {"files": clash})
    wait_for(lambda: _exists(kube, _pod(ns, "fiona")), 20, "pod fiona")
    agent = agents(secret_token(kube, ns, "fiona"))
    node.run_pod(ns, "fiona", agent.ip)

    def held(status: JSON) -> bool:
        return any(c.get("reason") == "FilesNotWritten" for c in status.get("conditions", []))

    body = sandboxes.wait_object("fiona", "FilesNotWritten", held, timeout=20)
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert "notes/a.txt" in ready["message"], ready
    assert "not a directory" in ready["message"].lower(), ready
    assert body["status"]["phase"] == "Starting"
    assert not body["status"].get("filesWritten")

    fixed = [clash[0], {"path": "data/a.txt", "content": "y", "mode": 0o600}]
    sandboxes.patch("fiona", {"spec": {"files": fixed}})
    body = sandboxes.wait_ready("fiona", timeout=20)
    assert body["status"]["filesWritten"]
    assert (agent.workspace / "notes").read_text() == "x"
    assert (agent.workspace / "data/a.txt").read_text() == "y"
    assert (agent.workspace / "data/a.txt").stat().st_mode & 0o777 == 0o600
    # Written once: a user's later edit stays through the operator's next passes.
    (agent.workspace / "notes").write_text("edited")
    sandboxes.patch("fiona", {"metadata": {"annotations": {"touch": "1"}}})
    time.sleep(2)
    assert (agent.workspace / "notes").read_text() == "edited"


def test_a_claim_that_cannot_bind_is_explained_and_nothing_churns(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """With a StorageClass that does not exist the claim never binds: no pod is
    made and remade, and the status says why the workspace is pending."""
    ns = sandboxes.namespace
    sandboxes.create("nowhere", {"workspace": {"storageClassName": "nope"}})

    def explained() -> JSON | None:
        cond = sandboxes.condition("nowhere", "WorkspaceReady") or {}
        return cond if "does not exist" in cond.get("message", "") else None

    cond = wait_for(explained, 20, "WorkspaceReady explaining the claim")
    assert (cond["status"], cond["reason"]) == ("False", "ClaimPending")
    assert "StorageClass 'nope' does not exist" in cond["message"]
    ready = sandboxes.condition("nowhere", "Ready") or {}
    assert ready.get("reason") == "WorkspacePending", ready
    time.sleep(4)  # several reconciliations, 1 s apart here
    assert not _exists(kube, _pod(ns, "nowhere")), "a pod was made for a claim that cannot bind"
    pod_events = [
        e for e in kube.list(f"/api/v1/namespaces/{ns}/events") if e["reason"] == "PodReplaced"
    ]
    assert pod_events == []


def test_a_claim_its_provisioner_fails_names_the_provisioners_reason(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """A claim of an existing class that stays unbound: after a short patience the
    status carries the newest Warning the provisioner recorded about it."""
    ns = sandboxes.namespace
    storage = "storage.k8s.io/v1"
    cls = f"unprovisioned-{ns}"
    kube.create(
        api_path(storage, "storageclasses"),
        {
            "apiVersion": storage,
            "kind": "StorageClass",
            "metadata": {"name": cls},
            "provisioner": "example.com/nothing",
            "volumeBindingMode": "Immediate",
        },
    )
    try:
        sandboxes.create("starved", {"workspace": {"storageClassName": cls}})
        claim = wait_for(
            lambda: kube.get(core_path("persistentvolumeclaims", ns, "starved-workspace")),
            20,
            "the workspace claim",
        )
        kube.create(
            core_path("events", ns),
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"starved-workspace.{time.time_ns()}"},
                "involvedObject": {
                    "kind": "PersistentVolumeClaim",
                    "namespace": ns,
                    "name": "starved-workspace",
                    "uid": claim["metadata"]["uid"],
                },
                "type": "Warning",
                "reason": "ProvisioningFailed",
                "message": "no capacity left in example.com/nothing",
                "lastTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": {"component": "example.com/nothing"},
            },
        )

        def explained() -> JSON | None:
            cond = sandboxes.condition("starved", "WorkspaceReady") or {}
            return cond if "ProvisioningFailed" in cond.get("message", "") else None

        cond = wait_for(explained, 40, "WorkspaceReady naming the provisioner's reason")
        assert "no capacity left in example.com/nothing" in cond["message"], cond
    finally:
        kube.delete(api_path(storage, "storageclasses", name=cls))


def test_a_changed_port_list_reaches_the_service(sandboxes: Sandboxes, kube: KubeJSON) -> None:
    """Exposed ports added to a Sandbox are added to its Service in place."""
    ns = sandboxes.namespace
    web = {"name": "web", "port": 8000}
    sandboxes.create("porty", {"network": {"exposedPorts": [web]}})

    def ports() -> list[int]:
        service = kube.get(core_path("services", ns, "porty")) or {"spec": {"ports": []}}
        return sorted(p["port"] for p in service["spec"]["ports"])

    wait_for(lambda: ports() == [8000], 20, "the Service of port 8000")
    uid = kube.get(core_path("services", ns, "porty"))["metadata"]["uid"]  # type: ignore[index]
    sandboxes.patch(
        "porty", {"spec": {"network": {"exposedPorts": [web, {"name": "api", "port": 9000}]}}}
    )
    wait_for(lambda: ports() == [8000, 9000], 20, "the Service with port 9000 too")
    assert kube.get(core_path("services", ns, "porty"))["metadata"]["uid"] == uid  # type: ignore[index]


def test_delete_removes_children_through_garbage_collection(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("delta")
    wait_for(lambda: all(_children(kube, ns, "delta").values()), 20, "children")
    sandboxes.delete("delta")
    sandboxes.wait_gone("delta", 30, "sandbox gone")
    wait_for(lambda: not any(_children(kube, ns, "delta").values()), 60, "children collected")


def _hold(kube: KubeJSON, path: str, finalizer: str, held: bool) -> None:
    """Add or remove a finalizer of the test's, keeping the others (JSON patch)."""
    present = kube.read(path)["metadata"].get("finalizers") or []
    if held:
        op: JSON = {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer}
        if not present:
            op = {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]}
        kube.patch(path, [op], content_type="application/json-patch+json")
    elif finalizer in present:
        at = f"/metadata/finalizers/{present.index(finalizer)}"
        ops = [{"op": "test", "path": at, "value": finalizer}, {"op": "remove", "path": at}]
        kube.patch(path, ops, content_type="application/json-patch+json")


def _controller_uid(kube: KubeJSON, path: str) -> str | None:
    obj = kube.get(path)
    owners = (obj or {}).get("metadata", {}).get("ownerReferences") or [{}]
    uid: str | None = owners[0].get("uid")
    return uid


def test_a_namesake_waits_for_the_last_ones_children_and_gets_its_own(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """A Sandbox deleted and created again under its name at once (a chat backend's
    sandbox per turn) while the garbage collector still removes the first one's
    children: the second one says it waits, takes none of them (a pod bound to a
    claim about to vanish stays unschedulable for good), then gets its own."""
    ns = sandboxes.namespace
    name = "again"
    first = sandboxes.create(name)["metadata"]["uid"]
    wait_for(lambda: all(_children(kube, ns, name).values()), 20, "children")
    # Holds the claim in deletion, as pvc-protection does while the old pod stops.
    hold = "tests.sandbox.dev/hold"
    _hold(kube, _claim(ns, name), hold, held=True)
    sandboxes.delete(name)
    sandboxes.wait_gone(name, 30, "the first Sandbox gone")
    second = sandboxes.create(name)["metadata"]["uid"]
    body = sandboxes.wait_object(
        name,
        "PredecessorDeleting",
        lambda s: any(c.get("reason") == "PredecessorDeleting" for c in s.get("conditions", [])),
    )
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert f"PersistentVolumeClaim {name}-workspace" in ready["message"], ready
    assert "earlier Sandbox" in ready["message"], ready
    assert _controller_uid(kube, _claim(ns, name)) == first
    assert not _exists(kube, _pod(ns, name)), "no pod on the earlier one's claim"
    _hold(kube, _claim(ns, name), hold, held=False)
    paths = [
        _pod(ns, name),
        _claim(ns, name),
        core_path("secrets", ns, f"{name}-agent-token"),
        api_path("networking.k8s.io/v1", "networkpolicies", ns, name),
    ]
    wait_for(
        lambda: all(_controller_uid(kube, p) == second for p in paths),
        60,
        "children of the second Sandbox's own",
    )
    sandboxes.wait_phase(name, "Pending")


def test_a_foreign_token_secret_is_never_taken(sandboxes: Sandboxes, kube: KubeJSON) -> None:
    """A Secret with the agent token's name that the Sandbox does not control (one
    planted to know the token) is refused, not used; the sandbox starts once it goes."""
    ns = sandboxes.namespace
    name = "planted"
    secret = core_path("secrets", ns, f"{name}-agent-token")
    planted = {"metadata": {"name": f"{name}-agent-token"}, "stringData": {"token": "known"}}
    kube.create(core_path("secrets", ns), planted)
    uid = sandboxes.create(name)["metadata"]["uid"]
    body = sandboxes.wait_object(
        name,
        "CreateFailed",
        lambda s: any(c.get("reason") == "CreateFailed" for c in s.get("conditions", [])),
    )
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert "does not control" in ready["message"], ready
    assert not _exists(kube, _pod(ns, name)), "no pod with a planted token"
    kube.delete(secret)
    wait_for(lambda: _controller_uid(kube, _pod(ns, name)) == uid, 60, "the sandbox's pod")
    assert secret_token(kube, ns, name) != "known"


def test_deletion_waits_for_the_operator(
    sandboxes: Sandboxes, kube: KubeJSON, running_operator: OperatorProcess
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("echo")
    wait_for(lambda: _exists(kube, _pod(ns, "echo")), 20, "pod")
    running_operator.kill()
    sandboxes.delete("echo")
    time.sleep(3)
    body = sandboxes.get("echo")
    assert body is not None, "finalizer must hold deletion"
    assert body["metadata"].get("deletionTimestamp"), "finalizer must hold deletion"
    assert _exists(kube, _pod(ns, "echo"))
    running_operator.start()
    sandboxes.wait_gone("echo", 30, "deletion completes after restart")
    wait_for(lambda: not _exists(kube, _pod(ns, "echo")), 30, "pod gone")


def test_restart_mid_creation_creates_no_duplicates(
    sandboxes: Sandboxes, kube: KubeJSON, running_operator: OperatorProcess
) -> None:
    ns = sandboxes.namespace
    names = [f"fox-{i}" for i in range(12)]
    for name in names:
        sandboxes.create(name)
    time.sleep(0.4)  # some are half-way through their handlers now
    running_operator.kill()
    tokens = {}
    for name in names:
        with contextlib.suppress(ApiError):
            tokens[name] = secret_token(kube, ns, name)
    running_operator.start()
    for name in names:
        sandboxes.wait_phase(name, "Pending", timeout=40)
    pods = kube.list(core_path("pods", ns), label_selector=MANAGED)
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(names)
    secrets = kube.list(core_path("secrets", ns), label_selector=MANAGED)
    assert len(secrets) == len(names)
    for name, token in tokens.items():
        assert secret_token(kube, ns, name) == token, "a token was replaced: agents would lose auth"


def test_idle_timeout_follows_real_agent_activity(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    sandboxes.create("golf", {"lifecycle": {"idleTimeout": "4s"}})
    agent = _ready(sandboxes, kube, node, agents, "golf")
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
        assert body is not None, "deleted while busy"
        assert not body["metadata"].get("deletionTimestamp"), "deleted while busy"
        time.sleep(0.5)
    status = sandboxes.read("golf")["status"]
    assert status["activeExecutions"] == 1
    # Then, after the command ends and 4 s pass without activity, it goes.
    sandboxes.wait_gone("golf", 30, "idle deletion")


def test_idle_pause_keeps_the_claim_and_resumes_on_request(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("hotel", {"lifecycle": {"idleTimeout": "2s", "onIdle": "Pause"}})
    _ready(sandboxes, kube, node, agents, "hotel")
    body = sandboxes.wait_phase("hotel", "Paused", timeout=30)
    assert body["status"]["idlePausedAt"]
    assert body["spec"]["paused"] is False, "the operator never writes spec"
    wait_for(lambda: not _exists(kube, _pod(ns, "hotel")), 20, "pod gone")
    assert _exists(kube, _claim(ns, "hotel"))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    sandboxes.patch(
        "hotel", {"metadata": {"annotations": {"sandbox.dev/resume-requested-at": stamp}}}
    )
    wait_for(lambda: _exists(kube, _pod(ns, "hotel")), 20, "pod back after resume")


def test_failed_pod_is_recreated_on_the_same_claim(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node, agents: Callable[[str], AgentProcess]
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("india")
    _ready(sandboxes, kube, node, agents, "india")
    old_uid = kube.read(_pod(ns, "india"))["metadata"]["uid"]
    node.fail_pod(ns, "india", "Evicted")

    _wait_replaced(kube, ns, "india", old_uid)
    assert _workspace_claim_name(kube.read(_pod(ns, "india"))) == "india-workspace"


def test_pod_left_unscheduled_on_an_unbound_claim_is_replaced(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node
) -> None:
    """The scheduler said the claim was unbound and did not come back after it was
    bound: after the patience the operator replaces the pod, which the scheduler
    then sees afresh. While the claim is really unbound, nothing is replaced."""
    ns = sandboxes.namespace
    sandboxes.create("lima")
    wait_for(lambda: _exists(kube, _pod(ns, "lima")), 20, "pod")
    old_uid = kube.read(_pod(ns, "lima"))["metadata"]["uid"]
    node.unschedulable(
        ns, "lima", "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    )
    time.sleep(4)  # several reconciliations (1 s apart here), all past the patience
    assert kube.read(_pod(ns, "lima"))["metadata"]["uid"] == old_uid, "replaced, claim unbound"
    workspace = sandboxes.condition("lima", "WorkspaceReady")
    assert workspace is not None
    assert (workspace["status"], workspace["reason"]) == ("False", "ClaimPending")

    node.bind_claim(ns, "lima-workspace")
    _wait_replaced(kube, ns, "lima", old_uid)
    # Any other reason to wait for a node is left to the scheduler.
    newer_uid = kube.read(_pod(ns, "lima"))["metadata"]["uid"]
    node.unschedulable(ns, "lima", "0/1 nodes are available: 1 Insufficient cpu.")
    time.sleep(3)
    assert kube.read(_pod(ns, "lima"))["metadata"]["uid"] == newer_uid


def test_invalid_spec_is_explained_and_blocks_nobody(sandboxes: Sandboxes) -> None:
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
    # A resource profile the operator does not offer, the same way.
    sandboxes.create("mike", {"resources": {"profile": "roomy"}})
    body = sandboxes.wait_phase("mike", "Failed")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], ready["message"]) == (
        "InvalidSpec",
        "spec.resources.profile: unknown resource profile 'roomy'; this cluster offers:"
        " dense, standard",
    )
    sandboxes.patch("mike", {"spec": {"resources": {"profile": "dense"}}})
    sandboxes.wait_phase("mike", "Pending")
    # The agent's own port is not the sandbox's to publish (where the chart's
    # admission policy is not installed, the operator says so).
    agent_port = {"name": "agent", "port": 8080, "public": True}
    sandboxes.create("nov", {"network": {"exposedPorts": [agent_port]}})
    body = sandboxes.wait_phase("nov", "Failed")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], ready["message"]) == (
        "InvalidSpec",
        "spec.network.exposedPorts[0].port: 8080 is reserved for the sandbox agent"
        " (reserved ports: 8080)",
    )


def _events_of(kube: KubeJSON, ns: str, name: str, reason: str) -> list[JSON]:
    return [
        e
        for e in kube.list(core_path("events", ns))
        if e["involvedObject"]["name"] == name and e.get("reason") == reason
    ]


def test_a_refused_pod_backs_off_and_its_event_counts_the_tries(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """A RuntimeClass that does not exist: the API server refuses the pod every
    time. The retries back off (1, 2, 4 ... 30 s), and each one counts on one
    Event instead of adding another; an invalid spec likewise stays one Event."""
    ns = sandboxes.namespace
    sandboxes.create("norc", {"runtimeClassName": "no-such-class"})
    sandboxes.create("cobol", {"runtime": "cobol"})

    def refused() -> JSON | None:
        ready = sandboxes.condition("norc", "Ready") or {}
        return ready if ready.get("reason") == "CreateFailed" else None

    ready = wait_for(refused, 30, "Ready=False CreateFailed")
    assert "no-such-class" in ready["message"], ready
    first = time.monotonic()
    # Tries 1 s, 2 s, 4 s and 8 s apart: the fifth comes 15 s after the first.
    counted = wait_for(
        lambda: [e for e in _events_of(kube, ns, "norc", "CreateFailed") if e["count"] >= 5],
        60,
        "five tries counted on one Event",
    )
    elapsed = time.monotonic() - first
    events = _events_of(kube, ns, "norc", "CreateFailed")
    assert len(events) == 1, events
    assert counted[0]["type"] == "Warning"
    assert "no-such-class" in counted[0]["message"]
    # Once a second (the defect) would have counted 5 in 4 s.
    assert elapsed > 10, f"5 tries within {elapsed:.1f}s: no backoff"
    invalid = _events_of(kube, ns, "cobol", "InvalidSpec")
    assert len(invalid) == 1, invalid


def test_catalog_templates_have_a_status(kube: KubeJSON) -> None:
    """ClusterSandboxTemplates say whether Sandboxes of them can run here."""
    good, bad = f"cat-{os.urandom(3).hex()}", f"cat-{os.urandom(3).hex()}"
    create_cluster_template(kube, good, {"sandbox": {"runtime": "python"}})
    create_cluster_template(kube, bad, {"sandbox": {"runtime": "cobol"}})
    try:

        def ready_of(name: str) -> JSON | None:
            body = kube.get(cluster_template_path(name)) or {}
            conds = (body.get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "Ready"), None)

        cond = wait_for(lambda: ready_of(good), 30, "the good template's Ready")
        assert cond["status"] == "True", cond
        cond = wait_for(lambda: ready_of(bad), 30, "the bad template's Ready")
        assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec"), cond
        assert "unknown runtime 'cobol'" in cond["message"]
    finally:
        kube.delete(cluster_template_path(good))
        kube.delete(cluster_template_path(bad))


def test_runtime_without_python_is_not_ready_with_a_reason(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node
) -> None:
    ns = sandboxes.namespace
    sandboxes.create("lima", {"image": "busybox:1.36"})
    wait_for(lambda: _exists(kube, _pod(ns, "lima")), 20, "pod")
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


def test_a_sandbox_deleted_during_a_timer_pass_goes_when_the_pass_ends(
    sandboxes: Sandboxes, kube: KubeJSON, node: Node
) -> None:
    """Kopf keeps its finalizer while a timer pass of the Sandbox is in flight
    (idle, paused and lifetime deletions come from one). It looks again within
    seconds: with Kopf's defaults, a minute later."""
    ns = sandboxes.namespace
    with socket.socket() as silent:
        # An agent that takes connections and never answers: every timer pass
        # waits out the agent timeout (2 s) asking it for /v1/info.
        silent.bind((next_pod_ip(), 8080))
        silent.listen(64)
        sandboxes.create("hotel")
        wait_for(lambda: _exists(kube, _pod(ns, "hotel")), 20, "pod hotel")
        node.run_pod(ns, "hotel", silent.getsockname()[0])
        sandboxes.wait_phase("hotel", "Running", timeout=30)
        silent.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # connections of passes that are over
                silent.accept()[0].close()
        silent.settimeout(10)
        asked, _ = silent.accept()  # a pass asks now, and waits
        with asked:
            sandboxes.delete("hotel")
            sandboxes.wait_gone("hotel", 20, "deletion once the timer pass is over")
