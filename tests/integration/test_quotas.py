"""Tenant limits: SandboxQuotas refuse what does not fit (Ready=False or Queued,
reason QuotaExceeded, no pod), admit it once usage drops, never overshoot
when many objects arrive at once, and survive an operator restart. A
Kubernetes ResourceQuota's refusal reads the same in status."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import pytest

from devcluster.controlplane import ControlPlane
from tests.executions import Executions
from tests.integration.harness import AgentProcess, OperatorProcess, wait_for
from tests.kube import JSON, KubeJSON, core_path
from tests.quotas import SandboxQuotas, quota_exceeded, ready_reason, resource_quota
from tests.sandboxes import Sandboxes


@pytest.fixture
def quotas(kube: KubeJSON, ns: str) -> SandboxQuotas:
    return SandboxQuotas(kube, ns)


def _pod(kube: KubeJSON, ns: str, name: str) -> JSON | None:
    return kube.get(core_path("pods", ns, name))


def _settled(sandboxes: Sandboxes, names: list[str]) -> dict[str, str]:
    """name -> "admitted" or "refused", once every one of `names` is either."""

    def verdicts() -> dict[str, str] | None:
        found: dict[str, str] = {}
        for item in sandboxes.kube.list(sandboxes.path()):
            status = item.get("status") or {}
            if status.get("admitted"):
                found[item["metadata"]["name"]] = "admitted"
            elif quota_exceeded(status):
                found[item["metadata"]["name"]] = "refused"
        return found if set(names) <= set(found) else None

    return wait_for(verdicts, 60, f"a verdict on each of {names}")


# Each limit kind: the quota, the Sandbox spec, and the words of the refusal.
LIMITS: dict[str, tuple[JSON, JSON, str]] = {
    "sandboxes": ({"sandboxes": 2}, {}, "sandboxes limited to 2, used 2, requested 1"),
    # Each Sandbox requests 150m of CPU (the runtime's 100m and the agent's 50m).
    "requests.cpu": (
        {"requests": {"cpu": "400m"}},
        {},
        "requests.cpu limited to 400m, used 300m, requested 150m",
    ),
    # 1Gi for the runtime and 256Mi for the agent.
    "limits.memory": (
        {"limits": {"memory": "3Gi"}},
        {"resources": {"memory": "1Gi"}},
        "limits.memory limited to 3Gi, used 2560Mi, requested 1280Mi",
    ),
    "workspaceStorage": (
        {"workspaceStorage": "5Gi"},
        {"workspace": {"size": "2Gi"}},
        "workspaceStorage limited to 5Gi, used 4Gi, requested 2Gi",
    ),
}


@pytest.mark.parametrize("kind", sorted(LIMITS))
def test_a_sandbox_over_a_limit_waits_without_a_pod_and_starts_when_room_is_made(
    kind: str, sandboxes: Sandboxes, quotas: SandboxQuotas, kube: KubeJSON
) -> None:
    limit, spec, words = LIMITS[kind]
    ns = sandboxes.namespace
    quotas.create("team", limit)
    for name in ("first", "second"):
        sandboxes.create(name, spec)
        sandboxes.wait_object(name, "admitted", lambda s: bool(s.get("admitted")))
    sandboxes.create("third", spec)
    status = sandboxes.wait_object("third", "QuotaExceeded", quota_exceeded)["status"]
    assert ready_reason(status)[1] == f"exceeded SandboxQuota team: {words}"
    assert status["phase"] == "Pending"
    assert not status.get("admitted")
    # Events are posted beside the status write, not before it: wait for it.
    wait_for(
        lambda: any(
            e["involvedObject"]["name"] == "third" and e["reason"] == "QuotaExceeded"
            for e in kube.list(core_path("events", ns))
        ),
        20,
        "the QuotaExceeded Event of the third sandbox",
    )
    # Refused before any child was made: no pod, no claim, no token.
    assert _pod(kube, ns, "third") is None
    assert kube.get(core_path("persistentvolumeclaims", ns, "third-workspace")) is None
    assert kube.get(core_path("secrets", ns, "third-agent-token")) is None
    quota = quotas.wait_object("team", "one waiting", lambda s: s.get("waiting") == 1)["status"]
    assert quota["used"]["sandboxes"] == 2

    sandboxes.delete("first")
    wait_for(lambda: _pod(kube, ns, "third"), 60, "the third sandbox's pod once room was made")
    assert sandboxes.read("third")["status"]["admitted"] is True
    quotas.wait_object("team", "none waiting", lambda s: s.get("waiting") == 0)


def test_concurrent_creates_never_overshoot_and_a_restart_keeps_the_count(
    sandboxes: Sandboxes,
    quotas: SandboxQuotas,
    kube: KubeJSON,
    control_plane: ControlPlane,
    running_operator: OperatorProcess,
) -> None:
    ns = sandboxes.namespace
    quotas.create("team", {"sandboxes": 3})
    wait_for(lambda: (quotas.get("team") or {}).get("status"), 20, "the quota's first status")
    names = [f"burst-{i}" for i in range(10)]

    def create(name: str) -> None:
        # A client per thread: one shared client's TLS handshakes, started from ten
        # threads at once, were seen to fail (alert decode error) under load.
        with KubeJSON(control_plane.kubeconfig) as own:
            Sandboxes(own, ns).create(name)

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(create, names))
    verdicts = _settled(sandboxes, names)
    admitted = sorted(name for name, verdict in verdicts.items() if verdict == "admitted")
    assert len(admitted) == 3, verdicts
    pods = {p["metadata"]["name"] for p in kube.list(core_path("pods", ns))}
    assert pods <= set(admitted)
    quotas.wait_used("team", "three admitted", "sandboxes", 3)
    metrics = running_operator.metrics()
    assert (
        f'sandbox_operator_quota_used{{namespace="{ns}",quota="team",resource="sandboxes"}} 3.0'
        in metrics
    )
    assert (
        f'sandbox_operator_quota_hard{{namespace="{ns}",quota="team",resource="sandboxes"}} 3.0'
        in metrics
    )

    # A restarted operator counts from the recorded admissions.
    running_operator.stop()
    running_operator.start()
    sandboxes.create("after-restart")
    assert _settled(sandboxes, ["after-restart"])["after-restart"] == "refused"
    refused = [name for name, verdict in verdicts.items() if verdict == "refused"]
    for name in refused:
        assert not sandboxes.read(name)["status"].get("admitted")

    # One place freed: exactly one waiting sandbox takes it.
    waiting = [*refused, "after-restart"]

    def taken() -> list[str] | None:
        found = [n for n in waiting if (sandboxes.get(n) or {}).get("status", {}).get("admitted")]
        return found or None

    sandboxes.delete(admitted[0])
    assert len(wait_for(taken, 60, "a waiting sandbox to take the freed place")) == 1
    quotas.wait_used("team", "the freed place taken", "sandboxes", 3)
    assert len(taken() or []) == 1


def test_running_executions_wait_for_the_namespaces_limit(
    sandboxes: Sandboxes,
    executions: Executions,
    quotas: SandboxQuotas,
    live_sandbox: Callable[..., AgentProcess],
) -> None:
    """The limit is the namespace's, not a sandbox's: a command in another sandbox
    waits too, and starts when the running one ends."""
    quotas.create("team", {"runningExecutions": 1})
    one = live_sandbox("one")
    live_sandbox("two")
    gate = one.workspace / "go"
    executions.run("long", "one", "while [ ! -e go ]; do sleep 0.1; done; echo done")
    executions.wait_phase("long", "Running")
    executions.run("short", "two", "echo short")
    waiting = executions.wait_status(
        "short", "QuotaExceeded", lambda s: s.get("reason") == "QuotaExceeded"
    )
    assert waiting["phase"] == "Queued"
    assert waiting["message"] == (
        "exceeded SandboxQuota team: runningExecutions limited to 1, used 1, requested 1"
    )
    status = quotas.wait_object("team", "one running", lambda s: s.get("waiting") == 1)["status"]
    assert status["used"]["runningExecutions"] == 1
    # Waiting for quota is not a broken sandbox: it outlives the sandbox wait bound.
    gate.write_text("")
    assert executions.wait_done("long")["phase"] == "Succeeded"
    done = executions.wait_done("short")
    assert (done["phase"], done["stdout"].strip()) == ("Succeeded", "short")


def test_a_resource_quota_refusing_the_pod_shows_in_status_then_lets_it_start(
    sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    ns = sandboxes.namespace
    quota = resource_quota(kube, ns, "cpu", {"requests.cpu": "100m"})
    sandboxes.create("big")
    status = sandboxes.wait_object("big", "QuotaExceeded", quota_exceeded)["status"]
    message = ready_reason(status)[1]
    assert "exceeded quota: cpu" in message
    assert "requested: requests.cpu=150m" in message
    assert _pod(kube, ns, "big") is None
    # Events are posted in the background: soon after the status, not with it.
    wait_for(
        lambda: any(
            e["involvedObject"]["name"] == "big" and e["reason"] == "QuotaExceeded"
            for e in kube.list(core_path("events", ns))
        ),
        30,
        "a QuotaExceeded Event",
    )
    kube.patch(quota, {"spec": {"hard": {"requests.cpu": "1"}}})
    wait_for(lambda: _pod(kube, ns, "big"), 60, "the pod once the quota allows it")
    sandboxes.wait_object("big", "no longer refused", lambda s: not quota_exceeded(s))


def test_a_one_shot_execution_whose_sandbox_waits_for_quota_says_so(
    executions: Executions, quotas: SandboxQuotas, sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    quotas.create("none", {"sandboxes": 0})
    executions.create("later", {"sandboxTemplate": {"runtime": "python"}, "script": "true"})
    status = executions.wait_status(
        "later", "QuotaExceeded", lambda s: s.get("reason") == "QuotaExceeded"
    )
    assert status["phase"] == "Queued"
    assert "sandboxes limited to 0, used 0, requested 1" in status["message"]
    sandbox = status["sandbox"]
    sandboxes.wait_object(sandbox, "QuotaExceeded", quota_exceeded)
    quotas.delete("none")
    wait_for(lambda: _pod(kube, sandboxes.namespace, sandbox), 30, "the sandbox's pod")
