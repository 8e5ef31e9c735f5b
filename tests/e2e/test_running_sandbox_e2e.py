"""A running sandbox on a real node: what reaches it without a restart, what makes
the node's machinery restart part of it, and how that is reported."""

from __future__ import annotations

import time
from functools import partial

import httpx
import pytest

from devcluster import deploy
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, core_path
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(1800)


def _pod_uid(kube: KubeJSON, ns: str, name: str) -> str | None:
    pod = kube.get(core_path("pods", ns, name))
    return None if pod is None else str(pod["metadata"]["uid"])


def _events(kube: KubeJSON, ns: str, kind: str, name: str) -> list[JSON]:
    selector = f"involvedObject.kind={kind},involvedObject.name={name}"
    listed = kube.get(core_path("events", ns) + f"?fieldSelector={selector}") or {}
    items: list[JSON] = listed.get("items") or []
    return items


def _message(kube: KubeJSON, ns: str, sandbox: str, reason: str) -> str | None:
    """The message of the Sandbox's Event with `reason`, once there is one."""
    for event in _events(kube, ns, "Sandbox", sandbox):
        if event["reason"] == reason:
            return str(event["message"])
    return None


def _runtime_restarts(kube: KubeJSON, ns: str, name: str) -> int:
    pod = kube.read(core_path("pods", ns, name))
    for status in pod["status"].get("containerStatuses") or []:
        if status["name"] == "sandbox":
            return int(status.get("restartCount", 0))
    return 0


def _kubelet_cache_retry(event: JSON) -> bool:
    """The kubelet's own retry of a volume whose Secret its watch had not yet
    delivered (seen on a loaded node: "failed to sync secret cache: timed out
    waiting for the condition"): the Secret existed before the pod, the mount
    succeeds on the kubelet's next try, and nothing the operator does decides it."""
    return event["reason"] == "FailedMount" and "failed to sync secret cache" in event["message"]


def test_a_cold_start_logs_no_warning(e2e: E2E) -> None:
    """The pod waits for its bound claim and the agent's readiness waits for its
    runner: a normal start leaves no FailedScheduling or Unhealthy Event."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("calm")
    sandboxes.wait_ready("calm")
    time.sleep(3)  # Events are posted asynchronously
    warnings = [
        f"{e['reason']}: {e['message']}"
        for e in _events(e2e.kube, ns, "Pod", "calm")
        if e["type"] == "Warning"
        and e["reason"] != "MissingClusterDNS"
        and not _kubelet_cache_retry(e)
    ]
    assert warnings == []
    # The operator's own liveness probe (every 10 s) is not worth a log line.
    # Every replica's log (`deploy/...` would show one of them).
    logs = e2e.kubectl("logs", "-n", deploy.NAMESPACE, "-l", deploy.OPERATOR_SELECTOR, "--tail=-1")
    assert logs.returncode == 0, logs.stderr
    assert "/healthz" not in logs.stdout


def test_env_and_ports_reach_a_running_sandbox_without_a_restart(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create(
        "live", {"env": [{"name": "COLOUR", "value": "red"}, {"name": "GONE", "value": "x"}]}
    )
    sandboxes.wait_ready("live")
    agent = Agent.of(e2e.kube, ns, "live")
    uid = _pod_uid(e2e.kube, ns, "live")
    background = agent.start("sleep 600")
    assert agent.run(shell='echo "$COLOUR/${GONE:-}"')["stdout"] == "red/x\n"

    sandboxes.patch(
        "live",
        {
            "spec": {
                "env": [{"name": "COLOUR", "value": "blue"}, {"name": "SHAPE", "value": "round"}],
                "network": {"exposedPorts": [{"name": "web", "port": 8000}]},
                "lifecycle": {"idleTimeout": "45m"},
            }
        },
    )

    def new_env() -> str | None:
        out = str(agent.run(shell='echo "$COLOUR/${GONE:-}/$SHAPE"')["stdout"])
        return out if out == "blue//round\n" else None

    wait_for(new_env, 60, "new commands to see the new env")
    wait_for(lambda: e2e.kube.get(core_path("services", ns, "live")), 30, "the Service")
    assert _pod_uid(e2e.kube, ns, "live") == uid, "the pod was replaced"
    record = agent.execution(background["id"])
    assert record["status"] == "running", record
    # Events are posted in the background, after the status that shows the change.
    wait_for(lambda: _message(e2e.kube, ns, "live", "EnvironmentUpdated"), 30, "the Event")
    assert _message(e2e.kube, ns, "live", "PodReplaced") is None

    # What only a new pod can apply says so, and that running commands stopped.
    sandboxes.patch("live", {"spec": {"resources": {"memory": "768Mi"}}})
    wait_for(
        lambda: (new := _pod_uid(e2e.kube, ns, "live")) is not None and new != uid,
        90,
        "a new pod for the new memory limit",
    )

    message = wait_for(
        partial(_message, e2e.kube, ns, "live", "PodReplaced"), 30, "the PodReplaced Event"
    )
    assert "spec.resources" in message, message
    assert "running commands were stopped" in message, message
    sandboxes.wait_ready("live")
    # The new pod starts with the spec's env, the overlay is not needed any more.
    fresh = Agent.of(e2e.kube, ns, "live")
    assert fresh.run(shell='echo "$COLOUR/${GONE:-}/$SHAPE"')["stdout"] == "blue//round\n"


def _processes(agent: Agent) -> int:
    return int(agent.run(shell="ls /proc | grep -c '^[0-9]'")["stdout"])


# Each copy starts one copy in a session of its own (out of the command's process
# group, so a kill of the group misses it) and one in the group, then waits.
BOMB = """cat > bomb.sh <<'END'
setsid sh bomb.sh &
sh bomb.sh &
wait
END
sh bomb.sh
"""


def test_a_fork_bomb_is_stopped_and_the_sandbox_heals(e2e: E2E) -> None:
    """The pod's PID limit holds the bomb. Its timeout kills the whole tree, also
    the copies that left the process group: the runner sweeps the container for
    the command's processes, and if it cannot finish, the agent has the kubelet
    restart the runtime container (liveness), which ends every process in it.
    The neighbour sandbox serves throughout; the workspace is kept."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("bomb")
    sandboxes.create("neighbour")
    sandboxes.wait_ready("bomb")
    sandboxes.wait_ready("neighbour")
    bomb, neighbour = Agent.of(e2e.kube, ns, "bomb"), Agent.of(e2e.kube, ns, "neighbour")
    bomb.write("kept.txt", "still here\n")
    baseline = _processes(bomb)
    runs = Executions(e2e.kube, ns)
    runs.create("detonate", {"sandboxRef": {"name": "bomb"}, "script": BOMB, "timeout": "10s"})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and runs.status("detonate").get("phase") in (
        None,
        "Queued",
        "Running",
    ):
        assert neighbour.run(["true"])["exitCode"] == 0
        time.sleep(1)
    status = runs.wait_done("detonate", timeout=120)
    assert status["phase"] == "TimedOut", status

    def healed() -> int | None:
        try:
            agent = Agent.of(e2e.kube, ns, "bomb")
            count = _processes(agent)
        except (AssertionError, httpx.HTTPError):
            return None  # the runtime is restarting: the agent refuses commands
        return count if count <= baseline + 2 else None

    wait_for(healed, 180, "every process of the bomb gone")
    sandboxes.wait_ready("bomb", timeout=180)
    assert Agent.of(e2e.kube, ns, "bomb").run(["cat", "kept.txt"])["stdout"] == "still here\n"
    assert neighbour.run(["true"])["exitCode"] == 0


def test_an_eviction_is_reported_as_one(e2e: E2E) -> None:
    """Past its ephemeral-storage limit the kubelet evicts the pod, and only that
    pod; the Sandbox's Event says evicted and why, and the new pod has the workspace."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("hoarder", {"resources": {"ephemeralStorage": "64Mi"}})
    sandboxes.create("next-door", {"resources": {"profile": "dense"}})
    sandboxes.wait_ready("hoarder")
    sandboxes.wait_ready("next-door")
    next_door = _pod_uid(e2e.kube, ns, "next-door")
    agent = Agent.of(e2e.kube, ns, "hoarder")
    agent.write("kept.txt", "kept\n")
    uid = _pod_uid(e2e.kube, ns, "hoarder")
    # Outside the workspace: the container's writable layer counts as ephemeral storage.
    agent.start("dd if=/dev/zero of=/tmp/filler bs=1M count=200; sleep 600")

    message = wait_for(
        partial(_message, e2e.kube, ns, "hoarder", "PodReplaced"), 240, "the eviction reported"
    )
    assert "evicted" in message, message
    assert "ephemeral" in message.lower(), message
    wait_for(lambda: _pod_uid(e2e.kube, ns, "hoarder") not in (None, uid), 120, "a new pod")
    sandboxes.wait_ready("hoarder")
    assert Agent.of(e2e.kube, ns, "hoarder").read("kept.txt") == "kept\n"
    assert _pod_uid(e2e.kube, ns, "next-door") == next_door
    assert Agent.of(e2e.kube, ns, "next-door").run(["true"])["exitCode"] == 0
