"""Executions against a real API server, with the operator in Kopf and real agents."""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Callable

from devcluster.controlplane import ControlPlane
from sandbox_operator.api.common import MAX_INPUT_CHARACTERS
from sandbox_operator.api.execution import TERMINAL_PHASES
from tests.executions import Executions
from tests.integration.conftest import kubectl
from tests.integration.harness import AgentProcess, Node, OperatorProcess, wait_for
from tests.kube import KubeJSON, core_path
from tests.sandboxes import Sandboxes

LiveSandbox = Callable[..., AgentProcess]


def _cond(status: dict[str, object], kind: str) -> dict[str, str]:
    conds = status.get("conditions")
    assert isinstance(conds, list)
    found: dict[str, str] = next(c for c in conds if c["type"] == kind)
    return found


def test_command_succeeds_with_output_and_conditions(
    executions: Executions, live_sandbox: LiveSandbox, control_plane: ControlPlane
) -> None:
    live_sandbox("box")
    executions.create(
        "hello", {"sandboxRef": {"name": "box"}, "command": ["sh", "-c", "echo hi; echo oops >&2"]}
    )
    waited = kubectl(
        control_plane,
        "wait",
        "-n",
        executions.namespace,
        "--for=condition=Complete",
        "execution/hello",
        "--timeout=30s",
    )
    assert waited.returncode == 0, waited.stderr
    status = executions.status("hello")
    assert status["phase"] == "Succeeded"
    assert status["reason"] == "Succeeded"
    assert status["exitCode"] == 0
    assert status["stdout"] == "hi\n"
    assert status["stderr"] == "oops\n"
    assert status["stdoutTruncated"] is False
    assert status["sandbox"] == "box"
    assert status["agentExecutionId"]
    assert status["startTime"] <= status["completionTime"]
    assert status["duration"].endswith("s")
    assert _cond(status, "Complete")["status"] == "True"
    assert _cond(status, "Succeeded")["status"] == "True"
    assert _cond(status, "Scheduled")["status"] == "True"
    listed = kubectl(control_plane, "get", "-n", executions.namespace, "executions")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "SANDBOX", "PHASE", "EXIT", "DURATION", "AGE"]
    assert row.split()[:4] == ["hello", "box", "Succeeded", "0"]


def test_failures_timeouts_and_truncation(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    live_sandbox("box")
    executions.run("exit3", "box", "exit 3")
    executions.run("slow", "box", "sleep 30", timeout="1s")
    executions.run("loud", "box", "head -c 10000 /dev/zero | tr '\\0' x; echo END")
    status = executions.wait_done("exit3")
    assert (status["phase"], status["reason"], status["exitCode"]) == ("Failed", "NonZeroExit", 3)
    assert _cond(status, "Complete")["status"] == "True"
    assert _cond(status, "Succeeded")["status"] == "False"
    status = executions.wait_done("slow")
    assert (status["phase"], status["reason"]) == ("TimedOut", "TimedOut")
    status = executions.wait_done("loud")
    assert status["phase"] == "Succeeded"
    assert status["stdoutTruncated"] is True
    assert status["stdoutBytes"] == 10004
    assert len(status["stdout"].encode()) == 4096
    assert status["stdout"].endswith("xxEND\n")


def test_env_secrets_workdir_stdin_and_files(
    executions: Executions, live_sandbox: LiveSandbox, kube: KubeJSON
) -> None:
    agent = live_sandbox("box")
    ns = executions.namespace
    kube.create(
        core_path("secrets", ns),
        {
            "metadata": {"name": "creds"},
            "data": {"password": base64.b64encode(b"s3cret").decode()},
        },
    )
    (agent.workspace / "sub").mkdir()
    executions.create(
        "inputs",
        {
            "sandboxRef": {"name": "box"},
            "script": 'echo "$GREETING $PASSWORD $(pwd)"; cat; ./tool.sh',
            "env": [
                {"name": "GREETING", "value": "hello"},
                {
                    "name": "PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
                },
            ],
            "workingDir": "sub",
            "stdin": "from stdin\n",
            "files": [
                {"path": "sub/tool.sh", "content": "#!/bin/sh\necho tool ran\n", "mode": 493}
            ],
        },
    )
    status = executions.wait_done("inputs")
    assert status["phase"] == "Succeeded", status
    assert status["stdout"] == f"hello s3cret {agent.workspace / 'sub'}\nfrom stdin\ntool ran\n"
    assert (agent.workspace / "sub" / "tool.sh").stat().st_mode & 0o777 == 0o755


def test_the_largest_script_runs_and_output_order_can_be_kept(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    """A script as long as the schema admits reaches the shell (not through argv,
    which holds about 128 KiB); `combinedOutput` keeps stdout and stderr in order."""
    live_sandbox("box")
    filler = "# " + "x" * 78 + "\n"
    body = "echo last line\n"
    script = filler * ((MAX_INPUT_CHARACTERS - len(body)) // len(filler)) + body
    script = "#" * (MAX_INPUT_CHARACTERS - len(script) - 1) + "\n" + script
    # Linux limits one argument to 128 KiB with its terminating NUL: this is past it.
    assert len(script) == MAX_INPUT_CHARACTERS == 128 * 1024
    executions.run("long", "box", script)
    status = executions.wait_done("long")
    assert (status["phase"], status["stdout"]) == ("Succeeded", "last line\n"), status

    interleaved = "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; done"
    executions.run("ordered", "box", interleaved, combinedOutput=True)
    status = executions.wait_done("ordered")
    expected = "".join(f"out{i}\nerr{i}\n" for i in range(1, 6))
    assert (status["phase"], status["stdout"]) == ("Succeeded", expected), status
    assert not status.get("stderr")


def test_missing_secret_waits_then_runs(
    executions: Executions, live_sandbox: LiveSandbox, kube: KubeJSON
) -> None:
    live_sandbox("box")
    ns = executions.namespace
    env = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "later", "key": "x"}}}]
    executions.run("needs-secret", "box", 'echo "$X"', env=env)
    status = executions.wait_status(
        "needs-secret", "waiting for the secret", lambda s: s.get("reason") == "SecretNotFound"
    )
    assert status["phase"] == "Queued"
    assert "secret 'later' not found" in status["message"]
    kube.create(
        core_path("secrets", ns),
        {"metadata": {"name": "later"}, "data": {"x": base64.b64encode(b"arrived").decode()}},
    )
    status = executions.wait_done("needs-secret")
    assert status["stdout"] == "arrived\n"


def test_cancel_by_spec_and_by_deletion_kills_the_process_group(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    agent = live_sandbox("box")
    executions.run("by-spec", "box", "(sleep 5; touch spec-survived) & sleep 30")
    executions.wait_status("by-spec", "agent id", lambda s: bool(s.get("agentExecutionId")))
    executions.patch("by-spec", {"spec": {"cancel": True}})
    status = executions.wait_done("by-spec", timeout=15)
    assert (status["phase"], status["reason"]) == ("Cancelled", "Cancelled")

    executions.run("by-delete", "box", "(sleep 5; touch delete-survived) & sleep 30")
    agent_id = executions.wait_status(
        "by-delete", "agent id", lambda s: bool(s.get("agentExecutionId"))
    )["agentExecutionId"]
    executions.delete("by-delete")
    wait_for(lambda: executions.get("by-delete") is None, 15, "the Execution to be gone")
    record = agent.call("GET", f"/v1/executions/{agent_id}")
    assert record["status"] == "cancelled"
    time.sleep(6)  # the background children would have written by now
    assert not (agent.workspace / "spec-survived").exists()
    assert not (agent.workspace / "delete-survived").exists()


def test_cancel_while_queued_never_runs(executions: Executions, sandboxes: Sandboxes) -> None:
    executions.run("early", "not-yet", "touch ran")
    executions.wait_status("early", "queued", lambda s: s.get("reason") == "SandboxNotFound")
    executions.patch("early", {"spec": {"cancel": True}})
    status = executions.wait_done("early")
    assert (status["phase"], status["message"]) == ("Cancelled", "cancelled before it started")
    assert "podUID" not in status
    # The cancel was a spec change: the status that records it has observed it (kstatus).
    assert status["observedGeneration"] == executions.read("early")["metadata"]["generation"] == 2
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Stalled"]["reason"]) == (
        "False",
        "Cancelled",
    )
    assert "Reconciling" not in conditions


def test_concurrency_limit_queues_in_creation_order(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    agent = live_sandbox("box")
    names = [f"q{i}" for i in range(5)]
    for name in names:
        executions.run(name, "box", f"echo {name} >> order.txt; sleep 1.5")
    seen_running = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        phases = [status.get("phase") for status in executions.statuses(names)]
        seen_running = max(seen_running, phases.count("Running"))
        assert phases.count("Running") <= 2, phases
        if all(p == "Succeeded" for p in phases):
            break
        time.sleep(0.1)
    assert seen_running == 2
    # Two at a time, oldest first (the two of a pair start together, in either order).
    order = (agent.workspace / "order.txt").read_text().split()
    assert [set(order[0:2]), set(order[2:4]), order[4:]] == [{"q0", "q1"}, {"q2", "q3"}, ["q4"]]
    queued = [
        c for n in names[2:] for c in executions.status(n)["conditions"] if c["type"] == "Scheduled"
    ]
    assert all(c["status"] == "True" for c in queued)


def test_missing_sandbox_waits_then_fails_after_the_bound(executions: Executions) -> None:
    executions.run("orphan", "ghost", "true")
    status = executions.wait_status(
        "orphan", "queued", lambda s: s.get("reason") == "SandboxNotFound"
    )
    assert status["phase"] == "Queued"
    assert _cond(status, "Scheduled") == {
        **_cond(status, "Scheduled"),
        "status": "False",
        "reason": "SandboxNotFound",
        "message": "sandbox ghost does not exist",
    }
    status = executions.wait_done("orphan", timeout=40)
    assert (status["phase"], status["reason"]) == ("Failed", "SandboxNotFound")
    assert "gave up after 15s" in status["message"]


def test_sandbox_created_later_runs_the_waiting_execution(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    executions.run("early", "late-box", "echo ran")
    executions.wait_status("early", "queued", lambda s: s.get("phase") == "Queued")
    live_sandbox("late-box")
    assert executions.wait_done("early")["stdout"] == "ran\n"


def test_idle_paused_sandbox_is_resumed_for_an_execution(
    executions: Executions,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
    kube: KubeJSON,
) -> None:
    live_sandbox(
        "sleepy", {"runtime": "python", "lifecycle": {"idleTimeout": "2s", "onIdle": "Pause"}}
    )
    sandboxes.wait_phase("sleepy", "Paused", timeout=30)
    ns = sandboxes.namespace
    wait_for(lambda: kube.get(core_path("pods", ns, "sleepy")) is None, 30, "pod deleted")
    executions.run("wake", "sleepy", "echo awake")
    # Resuming, then waiting for the new pod: the reasons pass quickly, the flag stays.
    status = executions.wait_status("wake", "resuming", lambda s: bool(s.get("sandboxResumed")))
    assert status["reason"] in ("SandboxResuming", "SandboxStarting"), status
    live_sandbox("sleepy", create=False)
    status = executions.wait_done("wake")
    assert (status["phase"], status["stdout"], status["sandboxResumed"]) == (
        "Succeeded",
        "awake\n",
        True,
    )


def test_user_paused_sandbox_is_not_overridden(
    executions: Executions, sandboxes: Sandboxes
) -> None:
    sandboxes.create("held", {"runtime": "python", "paused": True})
    executions.run("waits", "held", "true")
    status = executions.wait_status("waits", "paused", lambda s: s.get("reason") == "SandboxPaused")
    assert "spec.paused" in status["message"]
    assert sandboxes.read("held")["spec"]["paused"] is True


def test_sandbox_deleted_or_pod_replaced_mid_run(
    executions: Executions,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
    node: Node,
) -> None:
    live_sandbox("doomed")
    live_sandbox("flaky")
    executions.run("on-doomed", "doomed", "sleep 60")
    executions.run("on-flaky", "flaky", "sleep 60")
    for name in ("on-doomed", "on-flaky"):
        executions.wait_status(name, "started", lambda s: bool(s.get("agentExecutionId")))
    sandboxes.delete("doomed")
    node.fail_pod(sandboxes.namespace, "flaky")
    status = executions.wait_done("on-doomed", timeout=30)
    assert (status["phase"], status["reason"]) == ("Failed", "SandboxDeleted")
    status = executions.wait_done("on-flaky", timeout=30)
    assert (status["phase"], status["reason"]) == ("Failed", "Lost")
    assert "not run again" in status["message"]


def test_one_shot_sandbox_is_created_and_torn_down(
    executions: Executions,
    sandboxes: Sandboxes,
    kube: KubeJSON,
    node: Node,
    agents: Callable[[str], AgentProcess],
) -> None:
    from tests.integration.harness import secret_token

    ns = executions.namespace
    body = executions.create(
        "once", {"sandboxTemplate": {"runtime": "python"}, "script": "echo one-shot"}
    )
    sandbox = executions.wait_status("once", "sandbox named", lambda s: bool(s.get("sandbox")))[
        "sandbox"
    ]
    assert executions.status("once")["oneShot"] is True
    owner = sandboxes.read(sandbox)["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("Execution", body["metadata"]["uid"])
    wait_for(lambda: kube.get(core_path("pods", ns, sandbox)) is not None, 20, "one-shot pod")
    agent = agents(secret_token(kube, ns, sandbox))
    node.run_pod(ns, sandbox, agent.ip)
    status = executions.wait_done("once")
    assert (status["phase"], status["stdout"]) == ("Succeeded", "one-shot\n")
    wait_for(lambda: sandboxes.get(sandbox) is None, 30, "the one-shot sandbox to be deleted")

    # A one-shot sandbox that fails is torn down too, and the Execution says why.
    executions.create("broken", {"sandboxTemplate": {"runtime": "python"}, "script": "echo never"})
    sandbox = executions.wait_status("broken", "sandbox named", lambda s: bool(s.get("sandbox")))[
        "sandbox"
    ]
    wait_for(lambda: kube.get(core_path("pods", ns, sandbox)) is not None, 20, "one-shot pod")
    node.crash_runtime(ns, sandbox, 'exec: "python3": executable file not found in $PATH')
    status = executions.wait_done("broken", timeout=30)
    assert (status["phase"], status["reason"]) == ("Failed", "SandboxFailed")
    assert "python3" in status["message"]
    wait_for(
        lambda: sandboxes.get(sandbox) is None, 30, "the failed one-shot sandbox to be deleted"
    )


def test_ttl_after_finished_deletes_the_execution(
    executions: Executions, live_sandbox: LiveSandbox
) -> None:
    live_sandbox("box")
    executions.run("short-lived", "box", "true", ttlSecondsAfterFinished=1)
    executions.run("kept", "box", "true")
    executions.wait_done("kept")
    wait_for(lambda: executions.get("short-lived") is None, 20, "TTL deletion")
    time.sleep(1)
    assert executions.get("kept") is not None


def test_status_survives_json_roundtrip_of_kubectl(
    executions: Executions, live_sandbox: LiveSandbox, control_plane: ControlPlane
) -> None:
    """`kubectl get -o json` shows the whole status the operator wrote (schema keeps it)."""
    live_sandbox("box")
    executions.run("shown", "box", "echo shown")
    executions.wait_done("shown")
    shown = kubectl(
        control_plane, "get", "-n", executions.namespace, "execution/shown", "-o", "json"
    )
    status = json.loads(shown.stdout)["status"]
    for key in ("podUID", "agentExecutionId", "stdoutBytes", "observedGeneration", "duration"):
        assert key in status, key


def test_exactly_once_across_operator_kills(
    executions: Executions, live_sandbox: LiveSandbox, running_operator: OperatorProcess
) -> None:
    """100 Executions each append one unique line while the operator is SIGKILLed
    and restarted at random moments: every line lands exactly once, every
    Execution ends, none is lost."""
    agent = live_sandbox("box")
    rng = random.Random(20261126)
    names = [f"line-{i:03d}" for i in range(100)]
    for name in names:
        delay = rng.choice(["0", "0.05", "0.2"])
        executions.run(name, "box", f"sleep {delay}; echo {name} >> lines.txt")

    def unfinished() -> list[str]:
        return [n for n in names if executions.status(n).get("phase") not in TERMINAL_PHASES]

    kills = 0
    while unfinished() and kills < 8:
        time.sleep(rng.uniform(0.1, 1.5))
        running_operator.kill()
        kills += 1
        running_operator.start()
    wait_for(lambda: not unfinished(), 120, "every Execution to end")
    assert kills >= 3, "the operator finished before it could be killed often enough"
    failed = {
        n: (s["phase"], s.get("reason"), s.get("message"))
        for n in names
        if (s := executions.status(n))["phase"] != "Succeeded"
    }
    assert failed == {}
    lines = (agent.workspace / "lines.txt").read_text().split()
    assert sorted(lines) == names


def _record_intent(
    kube: KubeJSON, executions: Executions, name: str, sandbox: str, pod_uid: str
) -> None:
    """Write what the operator writes just before it sends a command."""
    kube.patch(
        executions.path(name) + "/status",
        {
            "status": {
                "phase": "Running",
                "reason": "Started",
                "sandbox": sandbox,
                "podUID": pod_uid,
                "startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        },
    )


def test_restart_after_send_adopts_the_run_and_replaced_pod_is_lost(
    executions: Executions,
    live_sandbox: LiveSandbox,
    running_operator: OperatorProcess,
    kube: KubeJSON,
) -> None:
    """The two crash windows, made deterministic: the operator died after sending
    a command but before recording the agent's id (the restarted operator must
    adopt that run, not start another), and after recording the intent for a
    pod that has since been replaced (the command must never run)."""
    agent = live_sandbox("box")
    ns = executions.namespace
    pod_uid = kube.read(core_path("pods", ns, "box"))["metadata"]["uid"]
    running_operator.stop()
    sent = executions.run("sent", "box", "echo once >> sent.txt")
    never = executions.run("never", "box", "echo ran >> never.txt")
    _record_intent(kube, executions, "sent", "box", pod_uid)
    _record_intent(kube, executions, "never", "box", "a-pod-that-is-gone")
    posted = agent.call(
        "POST",
        "/v1/executions",
        json.dumps(
            {
                "command": "echo once >> sent.txt",
                "idempotencyKey": sent["metadata"]["uid"],
                "timeoutSeconds": 180.0,
                "env": {},
            }
        ).encode(),
    )
    running_operator.start()
    status = executions.wait_done("sent")
    assert (status["phase"], status["agentExecutionId"]) == ("Succeeded", posted["id"])
    assert (agent.workspace / "sent.txt").read_text() == "once\n"
    status = executions.wait_done("never")
    assert (status["phase"], status["reason"]) == ("Failed", "Lost")
    assert not (agent.workspace / "never.txt").exists()
    assert never["metadata"]["uid"] not in json.dumps(agent.call("GET", "/v1/executions"))
