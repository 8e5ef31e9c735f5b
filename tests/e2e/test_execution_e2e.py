"""Executions end to end on a real node: the operator in-cluster, real sandbox pods."""

from __future__ import annotations

import base64
import time

import pytest

from devcluster import deploy
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import core_path
from tests.sandboxes import Sandboxes

# The session fixture's setup may be charged to the first test: allow for a cold machine.
pytestmark = pytest.mark.timeout(1800)


def _setup(e2e: E2E) -> tuple[str, Sandboxes, Executions]:
    ns = e2e.namespace()
    return ns, Sandboxes(e2e.kube, ns), Executions(e2e.kube, ns)


def test_commands_with_inputs_outcomes_queueing_and_cancel(e2e: E2E) -> None:
    ns, sandboxes, executions = _setup(e2e)
    sandboxes.create("work", {"runtime": "python", "workspace": {"ephemeral": True}})
    sandboxes.wait_ready("work")
    e2e.kube.create(
        core_path("secrets", ns),
        {"metadata": {"name": "api"}, "data": {"key": base64.b64encode(b"k-123").decode()}},
    )
    executions.create(
        "inputs",
        {
            "sandboxRef": {"name": "work"},
            "command": ["python3", "tool.py"],
            "workingDir": "job",
            "stdin": "21",
            "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}],
            "files": [
                {
                    "path": "job/tool.py",
                    "content": "import os, sys\nprint(int(sys.stdin.read()) * 2, os.environ['KEY'],"
                    " os.getcwd(), os.getuid())\n",
                }
            ],
        },
    )
    executions.run("fails", "work", "echo bad >&2; exit 7")
    executions.run("too-slow", "work", "sleep 60", timeout="2s")
    waited = e2e.kubectl(
        "wait", "-n", ns, "--for=condition=Complete", "execution/inputs", "--timeout=60s"
    )
    assert waited.returncode == 0, waited.stderr
    status = executions.status("inputs")
    assert (status["phase"], status["stdout"]) == ("Succeeded", "42 k-123 /workspace/job 1000\n")
    status = executions.wait_done("fails")
    assert (status["phase"], status["exitCode"], status["stderr"]) == ("Failed", 7, "bad\n")
    status = executions.wait_done("too-slow", timeout=60)
    assert status["phase"] == "TimedOut"

    # Twelve at once against the default limit of 8 per sandbox: the rest queue.
    names = [f"batch-{i:02d}" for i in range(12)]
    for name in names:
        executions.run(name, "work", "sleep 2")
    running_max = 0
    queued_seen = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        statuses = executions.statuses(names)
        phases = [s.get("phase") for s in statuses]
        running_max = max(running_max, phases.count("Running"))
        queued_seen |= any(s.get("reason") == "ConcurrencyLimit" for s in statuses)
        if all(p == "Succeeded" for p in phases):
            break
        time.sleep(0.2)
    assert phases == ["Succeeded"] * 12
    assert running_max <= 8
    assert queued_seen

    # Cancel through the spec, and by deleting: the process group is killed.
    executions.run("cancel-me", "work", "(sleep 4; touch survived-cancel) & sleep 60")
    executions.run("delete-me", "work", "(sleep 4; touch survived-delete) & sleep 60")
    for name in ("cancel-me", "delete-me"):
        executions.wait_phase(name, "Running")
        executions.wait_status(name, "agent id", lambda s: bool(s.get("agentExecutionId")))
    executions.patch("cancel-me", {"spec": {"cancel": True}})
    executions.delete("delete-me")
    assert executions.wait_done("cancel-me", timeout=30)["phase"] == "Cancelled"
    wait_for(lambda: executions.get("delete-me") is None, 30, "deleted Execution gone")
    time.sleep(5)
    agent = Agent.of(e2e.kube, ns, "work")
    assert agent.run(shell="ls survived-* 2>/dev/null | wc -l")["stdout"] == "0\n"


def test_paused_sandbox_is_resumed_and_sandbox_loss_ends_runs(e2e: E2E) -> None:
    ns, sandboxes, executions = _setup(e2e)
    sandboxes.create("napper", {"lifecycle": {"idleTimeout": "5s", "onIdle": "Pause"}})
    sandboxes.wait_ready("napper")
    Agent.of(e2e.kube, ns, "napper").write("kept.txt", "still here\n")
    sandboxes.wait_phase("napper", "Paused", timeout=90)
    executions.run("wake-up", "napper", "cat kept.txt")
    status = executions.wait_done("wake-up", timeout=180)
    assert (status["phase"], status["stdout"], status["sandboxResumed"]) == (
        "Succeeded",
        "still here\n",
        True,
    )

    # The pod goes away mid-run: the run fails and is not run again. The kubelet
    # stops the sandbox container before the agent sidecar, so the agent usually
    # still reports the signal (Signaled); if it is gone first, the outcome is
    # unknown (Lost).
    executions.run("interrupted", "napper", "echo started >> runs.txt; sleep 60")
    executions.wait_status("interrupted", "agent id", lambda s: bool(s.get("agentExecutionId")))
    old_pod = sandboxes.read("napper")["status"]["podUID"]
    e2e.kube.delete(core_path("pods", ns, "napper"))
    status = executions.wait_done("interrupted", timeout=90)
    assert status["phase"] == "Failed"
    assert status["reason"] in ("Signaled", "Lost"), status
    sandboxes.wait_object(
        "napper",
        "Running in a new pod",
        lambda s: s.get("phase") == "Running" and s.get("podUID") not in (None, old_pod),
        timeout=120,
    )
    assert Agent.of(e2e.kube, ns, "napper").read("runs.txt") == "started\n"

    # The sandbox is deleted mid-run.
    executions.run("orphaned", "napper", "sleep 60")
    executions.wait_status("orphaned", "agent id", lambda s: bool(s.get("agentExecutionId")))
    sandboxes.delete("napper")
    status = executions.wait_done("orphaned", timeout=90)
    assert (status["phase"], status["reason"]) == ("Failed", "SandboxDeleted")

    # A reference to a sandbox that does not exist waits, and says so.
    executions.run("patient", "nowhere", "true")
    status = executions.wait_status(
        "patient", "queued", lambda s: s.get("reason") == "SandboxNotFound"
    )
    assert status["phase"] == "Queued"


def test_one_shot_and_ttl(e2e: E2E) -> None:
    _, sandboxes, executions = _setup(e2e)
    executions.create(
        "once",
        {
            "sandboxTemplate": {"runtime": "python", "workspace": {"ephemeral": True}},
            "script": "python3 -c 'print(6 * 7)'",
            "ttlSecondsAfterFinished": 5,
        },
    )
    sandbox = executions.wait_status("once", "sandbox", lambda s: bool(s.get("sandbox")))["sandbox"]
    status = executions.wait_done("once", timeout=180)
    assert (status["phase"], status["stdout"], status["oneShot"]) == ("Succeeded", "42\n", True)
    wait_for(lambda: sandboxes.get(sandbox) is None, 90, "one-shot sandbox deleted")
    wait_for(lambda: executions.get("once") is None, 60, "TTL deletion of the Execution")

    # A one-shot sandbox that cannot start: the Execution fails, the sandbox goes.
    executions.create(
        "no-python",
        {
            "sandboxTemplate": {
                "image": "sandbox-runtime-nopython:dev",
                "imagePullPolicy": "Never",
                "workspace": {"ephemeral": True},
            },
            "script": "true",
        },
    )
    status = executions.wait_done("no-python", timeout=180)
    assert (status["phase"], status["reason"]) == ("Failed", "SandboxFailed")
    wait_for(
        lambda: sandboxes.get(status["sandbox"]) is None, 90, "failed one-shot sandbox deleted"
    )


def test_exactly_once_while_the_operator_pod_is_killed(e2e: E2E) -> None:
    """30 appends while the operator's pod is force-deleted twice: each line once."""
    ns, sandboxes, executions = _setup(e2e)
    sandboxes.create("ledger", {"runtime": "python", "workspace": {"ephemeral": True}})
    sandboxes.wait_ready("ledger")
    names = [f"append-{i:02d}" for i in range(30)]
    for i, name in enumerate(names):
        executions.run(name, "ledger", f"sleep 0.{i % 4}; echo {name} >> ledger.txt")
        if i in (8, 20):
            killed = e2e.kubectl(
                "delete",
                "pod",
                "-n",
                deploy.NAMESPACE,
                "-l",
                "app.kubernetes.io/name=sandbox-operator",
                "--grace-period=0",
                "--force",
            )
            assert killed.returncode == 0, killed.stderr
    for name in names:
        assert executions.wait_done(name, timeout=240)["phase"] == "Succeeded", name
    lines = Agent.of(e2e.kube, ns, "ledger").read("ledger.txt").split()
    assert sorted(lines) == names
