"""End to end on a real node: real pods, real agent and runner, real storage.

The operator runs in-cluster, installed from charts/ like a user would.
"""

from __future__ import annotations

import base64
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sandbox_operator.api.common import API_VERSION
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import KubeJSON, api_path, core_path
from tests.sandboxes import Sandboxes

# The session fixture's setup (node binaries, CSI builds and images when the
# cache is cold) is charged to the first test: allow for a cold machine.
pytestmark = pytest.mark.timeout(1800)


def _gone(kube: KubeJSON, path: str) -> bool:
    return kube.get(path) is None


def _pod(kube: KubeJSON, ns: str, name: str) -> dict[str, Any] | None:
    return kube.get(core_path("pods", ns, name))


def test_examples_become_ready_and_serve_exec_and_files(e2e: E2E, repo: Path) -> None:
    ns = e2e.namespace()
    applied = e2e.kubectl("apply", "-n", ns, "-f", str(repo / "examples"))
    assert applied.returncode == 0, applied.stderr
    documents = [
        document
        for path in sorted((repo / "examples").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
    ]
    names = [d["metadata"]["name"] for d in documents if d["kind"] == "Sandbox"]
    for name in names:
        # A Sandbox of a template with setup steps waits for the base snapshot's build.
        waited = e2e.kubectl(
            "wait", "-n", ns, "--for=condition=Ready", f"sandbox/{name}", "--timeout=300s"
        )
        assert waited.returncode == 0, waited.stderr + e2e.describe(ns, name)
    runs = Executions(e2e.kube, ns)
    for document in documents:
        if document["kind"] == "Execution":
            status = runs.wait_done(document["metadata"]["name"], timeout=180)
            assert status["phase"] == "Succeeded", status
            assert status["stdout"], status
    agent = Agent.of(e2e.kube, ns, names[0])
    result = agent.run(["python3", "-c", "print(6 * 7)"])
    assert result["exitCode"] == 0
    assert result["stdout"] == "42\n"
    agent.write("notes/hello.txt", "hello from the test host\n")
    assert agent.read("notes/hello.txt") == "hello from the test host\n"
    listed = agent.run(shell="cat notes/hello.txt && id -u")
    assert listed["stdout"] == "hello from the test host\n1000\n"

    # The template example: its setup ran once, into the base snapshot its Sandbox started from.
    template = e2e.kube.read(api_path(API_VERSION, "sandboxtemplates", ns, "python-data"))
    assert template["status"]["baseSnapshot"].startswith("python-data-base-"), template["status"]
    assert "--- tools (Succeeded) ---" in template["status"]["buildLog"]
    used = Sandboxes(e2e.kube, ns).read("data-demo")["status"]["template"]
    assert used["baseSnapshot"] == template["status"]["baseSnapshot"]
    prepared = Agent.of(e2e.kube, ns, "data-demo").run(
        shell='cat .setup-done && "$VIRTUAL_ENV/bin/python" -c'
        ' \'import sys; sys.path.insert(0, "lib"); import greeting; print(greeting.greet("you"))\''
    )
    assert prepared["stdout"] == "ready\nhello you\n", prepared
    # The template's dense resource profile, under the Sandbox's own memory limit.
    pod = e2e.kube.read(core_path("pods", ns, "data-demo"))
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "5m", "memory": "32Mi", "ephemeral-storage": "64Mi"}
    assert resources["limits"]["memory"] == "512Mi"

    # The pool example: its Sandbox was served (by a member, or cold when the pool
    # had none ready yet); the next claim takes a warm member with the setup's files.
    warm = Sandboxes(e2e.kube, ns).read("data-warm-demo")["status"]["pool"]
    assert warm["outcome"] in ("Claimed", "ColdStart"), warm
    task = Agent.of(e2e.kube, ns, "data-warm-demo").run(shell="echo $TASK; cat task/prompt.md")
    assert task["stdout"] == "warm-start\nSummarise the data in data/", task
    pools = api_path(API_VERSION, "sandboxpools", ns, "python-data-warm")
    wait_for(
        lambda: (e2e.kube.read(pools).get("status") or {}).get("ready") == 1, 300, "a warm member"
    )
    sandboxes = Sandboxes(e2e.kube, ns)
    turn = [{"path": "turn.txt", "content": "2"}]
    sandboxes.create("data-warm-2", {"poolRef": {"name": "python-data-warm"}, "files": turn})
    claimed = sandboxes.wait_ready("data-warm-2", timeout=30)["status"]["pool"]
    assert claimed["outcome"] == "Claimed", claimed
    warmed = Agent.of(e2e.kube, ns, "data-warm-2").run(shell="cat .setup-done turn.txt")
    assert warmed["stdout"] == "ready\n2", warmed


def test_runtime_images_provide_their_tools(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("py", {"runtime": "python", "workspace": {"ephemeral": True}})
    sandboxes.create("js", {"runtime": "node", "workspace": {"ephemeral": True}})
    python = Agent.of(e2e.kube, ns, sandboxes.wait_ready("py")["metadata"]["name"])
    node = Agent.of(e2e.kube, ns, sandboxes.wait_ready("js")["metadata"]["name"])
    assert python.run(["python3", "--version"])["stdout"].startswith("Python 3.11")
    assert node.run(["node", "--version"])["stdout"].startswith("v")
    assert node.run(["python3", "--version"])["exitCode"] == 0  # the runner needs it


def test_pause_resume_and_pod_loss_keep_workspace_data(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("keeper")
    sandboxes.wait_ready("keeper")
    Agent.of(e2e.kube, ns, "keeper").write("state.txt", "v1\n")

    sandboxes.patch("keeper", {"spec": {"paused": True}})
    wait_for(lambda: _pod(e2e.kube, ns, "keeper") is None, 60, "pod deleted on pause")
    sandboxes.patch("keeper", {"spec": {"paused": False}})
    sandboxes.wait_ready("keeper")
    assert Agent.of(e2e.kube, ns, "keeper").read("state.txt") == "v1\n"

    # The pod is deleted behind the operator's back: a new one, same data.
    old_uid = e2e.kube.read(core_path("pods", ns, "keeper"))["metadata"]["uid"]
    e2e.kube.delete(core_path("pods", ns, "keeper"))
    wait_for(
        lambda: (p := _pod(e2e.kube, ns, "keeper")) is not None and p["metadata"]["uid"] != old_uid,
        60,
        "a replacement pod",
    )
    sandboxes.wait_ready("keeper")
    agent = Agent.of(e2e.kube, ns, "keeper")
    assert agent.read("state.txt") == "v1\n"

    # The sandbox container is killed from the node (as an OOM or a crash would):
    # the kubelet restarts it in the same pod, the workspace is untouched.
    e2e.kill_container(ns, "keeper", "sandbox")
    wait_for(
        lambda: any(
            s["name"] == "sandbox" and s.get("restartCount", 0) >= 1
            for s in (
                e2e.kube.read(core_path("pods", ns, "keeper"))["status"].get("containerStatuses")
                or []
            )
        ),
        60,
        "the sandbox container restarted",
    )
    agent.wait_ready(60)
    assert agent.run(["cat", "state.txt"])["stdout"] == "v1\n"


def test_idle_timeout_and_deletion_remove_everything(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("sleepy", {"lifecycle": {"idleTimeout": "10s"}})
    sandboxes.wait_ready("sleepy")
    sandboxes.wait_gone("sleepy", 90, "idle deletion")
    for path in (
        core_path("pods", ns, "sleepy"),
        core_path("persistentvolumeclaims", ns, "sleepy-workspace"),
        core_path("secrets", ns, "sleepy-agent-token"),
    ):
        wait_for(partial(_gone, e2e.kube, path), 90, f"{path} gone")


def test_memory_hog_is_oom_killed_and_the_sandbox_recovers(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("hog", {"resources": {"memory": "128Mi"}, "workspace": {"ephemeral": True}})
    sandboxes.wait_ready("hog")
    agent = Agent.of(e2e.kube, ns, "hog")
    hog = agent.run(
        ["python3", "-c", "x = bytearray(512 * 1024 * 1024); print(len(x))"], timeoutSeconds=60
    )
    assert hog["exitCode"] != 0 or hog.get("signalName") == "SIGKILL", hog
    assert hog.get("oomKilled") is True or hog.get("signalName") == "SIGKILL", hog
    agent.wait_ready(90)
    assert agent.run(["echo", "still here"])["stdout"] == "still here\n"


def test_running_pods_have_the_security_context_we_claim(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("locked", {"workspace": {"ephemeral": True}})
    sandboxes.wait_ready("locked")
    agent = Agent.of(e2e.kube, ns, "locked")
    # Inside the sandbox container, seen by the user's code.
    facts = agent.run(
        shell=(
            "id -u; id -g; grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status;"
            " grep NoNewPrivs /proc/self/status;"
            " ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1 || true"
        )
    )["stdout"].splitlines()
    assert facts[0] == "1000"
    assert facts[1] == "1000"
    for line in facts[2:5]:
        assert line.split()[1] == "0000000000000000", line
    assert facts[5].split()[1] == "1"
    assert "No such file or directory" in facts[6]
    # Inside the agent container: another UID, a read-only root, no token file for users.
    probe = e2e.kubectl(
        "exec",
        "-n",
        ns,
        "locked",
        "-c",
        "agent",
        "--",
        "python3",
        "-c",
        "import os\ntry:\n    open('/probe', 'w')\nexcept OSError as e:\n    print('ro', e.errno)\n"
        "print(os.getuid())",
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["ro", "30", "1001"]
    token_from_sandbox = agent.run(["cat", "/var/run/sandbox-agent/token/token"])
    assert token_from_sandbox["exitCode"] != 0  # not mounted in the sandbox container


def test_runtime_without_python_is_not_ready_with_a_clear_reason(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create(
        "nopy", {"image": "sandbox-runtime-nopython:dev", "workspace": {"ephemeral": True}}
    )

    def failed() -> dict[str, Any] | None:
        body = sandboxes.get("nopy") or {}
        ready = next(
            (c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == "Ready"),
            None,
        )
        return ready if ready and ready["reason"] == "RuntimeMissingPython" else None

    ready = wait_for(failed, 120, "Ready=False with reason RuntimeMissingPython")
    assert ready["status"] == "False"
    assert "python3 >= 3.9" in ready["message"]
    body = sandboxes.get("nopy")
    assert body is not None
    assert body["status"]["phase"] == "Failed"


def test_agent_token_is_per_sandbox(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("one", {"workspace": {"ephemeral": True}})
    sandboxes.create("two", {"workspace": {"ephemeral": True}})
    one, _two = sandboxes.wait_ready("one"), sandboxes.wait_ready("two")
    token_two = base64.b64decode(
        e2e.kube.read(core_path("secrets", ns, "two-agent-token"))["data"]["token"]
    ).decode()
    refused = httpx.post(
        one["status"]["agentEndpoint"] + "/v1/executions",
        json={"argv": ["true"]},
        headers={"Authorization": f"Bearer {token_two}"},
        timeout=30,
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthorized"
