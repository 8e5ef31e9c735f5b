"""A pause that keeps memory (lifecycle.pauseMode: Memory) on the real node:
gVisor, the chart's checkpointd, sandbox-runsc under the kubelet.

A gVisor sandbox runs a server holding 200 MiB and a secret made at its start,
and a background command counting. Paused, its pod goes and its image stays
on the node; resumed, the same server (same process, same secret, same
memory digest) answers on its port, the count went on from where it was, and
MemoryKept says MemoryRestored. Then the bad cases: an image lost while
paused gives a resume from the workspace alone, saying so (condition and
Event); a save the node fails (its store cannot be written) or a
checkpointd that is down holds the pause, the sandbox running and the
condition saying why, until it can be done. The idle policy's pause keeps
memory too; an Execution running at the pause finishes after it; a REPL
terminal and, through E2B's own SDK, a code interpreter's kernel keep their
variables."""

from __future__ import annotations

import shutil
import uuid

import pytest

from devcluster import gvisor
from devcluster.deploy import RELEASE
from sandbox_sdk import SandboxClient
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.e2e.e2b_support import E2BTarget
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import JSON, api_path, core_path
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(900)

SERVER = """\
import hashlib, http.server, os, secrets
secret = secrets.token_hex(8)
held = bytearray(os.urandom(1 << 20)) * 200  # 200 MiB that must come back as they were
digest = hashlib.sha256(held).hexdigest()

class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{secret} {digest} {os.getpid()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", 8000), Answer).serve_forever()
"""
ASK = (
    'python3 -c "import urllib.request as u;'
    " print(u.urlopen('http://127.0.0.1:8000', timeout=5).read().decode())\""
)


def _spec() -> dict[str, object]:
    return {
        "runtime": "python",
        "runtimeClassName": gvisor.RUNTIME_CLASS,
        "resources": {"memory": "1Gi"},
        "lifecycle": {"pauseMode": "Memory"},
    }


def _memory_kept(sandboxes: Sandboxes, name: str) -> tuple[str, str, str]:
    cond = sandboxes.condition(name, "MemoryKept") or {}
    return cond.get("status", ""), cond.get("reason", ""), cond.get("message", "")


def _wait_kept(sandboxes: Sandboxes, name: str, reason: str) -> None:
    wait_for(lambda: _memory_kept(sandboxes, name)[1] == reason, 60, f"MemoryKept: {reason}")


def _paused(e2e: E2E, sandboxes: Sandboxes, ns: str, name: str) -> JSON:
    """Wait until the sandbox is Paused and its pod gone; the Sandbox then."""
    paused = sandboxes.wait_phase(name, "Paused", timeout=120)
    wait_for(lambda: e2e.kube.get(core_path("pods", ns, name)) is None, 60, "the pod to go")
    return paused


def _ask(agent: Agent) -> str:
    asked = agent.run(shell=ASK)
    assert asked["exitCode"] == 0, asked
    return str(asked["stdout"]).strip()


def _reasons(e2e: E2E, ns: str, name: str) -> list[str]:
    listed = e2e.kube.read(core_path("events", ns) + f"?fieldSelector=involvedObject.name={name}")
    return [event.get("reason", "") for event in listed.get("items", [])]


def _pause(sandboxes: Sandboxes, name: str, paused: bool) -> None:
    sandboxes.patch(name, {"spec": {"paused": paused}})


def test_a_paused_sandbox_comes_back_with_its_processes(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("keeper", _spec())
    sandboxes.wait_ready("keeper")
    agent = Agent.of(e2e.kube, ns, "keeper")
    agent.write("server.py", SERVER)
    agent.start("exec python3 server.py")
    counting = agent.start("i=0; while true; do i=$((i+1)); echo $i > count.txt; sleep 0.2; done")
    wait_for(lambda: agent.run(shell=ASK)["exitCode"] == 0, 60, "the server", interval=0.5)
    before = _ask(agent)
    count_before = int(agent.read("count.txt"))
    first_pod = e2e.kube.read(core_path("pods", ns, "keeper"))["metadata"]["uid"]

    _pause(sandboxes, "keeper", True)
    paused = _paused(e2e, sandboxes, ns, "keeper")
    memory = sandboxes.read("keeper")["status"]["memory"]
    assert (memory["podUid"], memory["key"]) == (first_pod, first_pod), memory
    assert memory["bytes"] > 200 << 20, memory
    image = e2e.cluster.checkpoint_dir / ns / memory["key"]
    assert (image / "complete").is_file(), paused
    status, reason, _ = _memory_kept(sandboxes, "keeper")
    assert (status, reason) == ("True", "Checkpointed")

    _pause(sandboxes, "keeper", False)
    sandboxes.wait_ready("keeper")
    _wait_kept(sandboxes, "keeper", "MemoryRestored")
    agent = Agent.of(e2e.kube, ns, "keeper")
    # The same process, with the same secret and memory, on the same port.
    assert _ask(agent) == before
    # The background command counted on from where it stopped.
    count_after = int(agent.read("count.txt"))
    assert count_after >= count_before
    wait_for(lambda: int(agent.read("count.txt")) > count_after, 10, "the count to go on")
    assert agent.execution(counting["id"])["status"] == "running"
    assert "memory" not in sandboxes.read("keeper")["status"]
    wait_for(lambda: not image.exists(), 30, "the used image to be deleted")
    assert "MemoryRestored" in _reasons(e2e, ns, "keeper")

    # An image lost while paused: the resume starts from the workspace, and says so.
    _pause(sandboxes, "keeper", True)
    _paused(e2e, sandboxes, ns, "keeper")
    key = sandboxes.read("keeper")["status"]["memory"]["key"]
    shutil.rmtree(e2e.cluster.checkpoint_dir / ns / key)
    _pause(sandboxes, "keeper", False)
    sandboxes.wait_ready("keeper")
    _wait_kept(sandboxes, "keeper", "MemoryLost")
    agent = Agent.of(e2e.kube, ns, "keeper")
    assert agent.run(shell=ASK)["exitCode"] != 0  # nothing listens: a fresh start
    assert agent.read("server.py") == SERVER  # the workspace is all there
    assert "MemoryLost" in _reasons(e2e, ns, "keeper")


def test_a_pause_waits_for_checkpointd_and_the_sandbox_runs_meanwhile(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("patient", _spec())
    sandboxes.wait_ready("patient")
    daemonset = api_path("apps/v1", "daemonsets", "sandbox-node", f"{RELEASE}-checkpointd")
    away = {"spec": {"template": {"spec": {"nodeSelector": {"sandbox.dev/no-such-node": "x"}}}}}
    e2e.kube.patch(daemonset, away)
    try:
        wait_for(
            lambda: not e2e.kube.read(core_path("pods", "sandbox-node"))["items"],
            120,
            "checkpointd to stop",
        )
        _pause(sandboxes, "patient", True)
        _wait_kept(sandboxes, "patient", "CheckpointerUnavailable")
        # Never half-paused: the pod runs and serves, the phase says Running.
        assert sandboxes.read("patient")["status"]["phase"] == "Running"
        assert Agent.of(e2e.kube, ns, "patient").run(["true"])["exitCode"] == 0
        assert "CheckpointerUnavailable" in _reasons(e2e, ns, "patient")
    finally:
        back = {"spec": {"template": {"spec": {"nodeSelector": None}}}}
        e2e.kube.patch(daemonset, back)
    sandboxes.wait_phase("patient", "Paused", timeout=180)
    status, reason, message = _memory_kept(sandboxes, "patient")
    assert (status, reason) == ("True", "Checkpointed"), message
    assert sandboxes.read("patient")["status"]["memory"]["bytes"] > 0


def test_a_save_that_fails_leaves_the_sandbox_running_and_says_why(e2e: E2E) -> None:
    """The node cannot write the image (its store's directory for the namespace
    is a file): checkpointd answers checkpoint_failed, the pod is not deleted,
    MemoryKept says why; once the store is mended, the retry pauses."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("unsaved", _spec())
    sandboxes.wait_ready("unsaved")
    pod = e2e.kube.read(core_path("pods", ns, "unsaved"))["metadata"]["uid"]
    broken = e2e.cluster.checkpoint_dir / ns
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("")
    try:
        _pause(sandboxes, "unsaved", True)
        _wait_kept(sandboxes, "unsaved", "CheckpointFailed")
        status, _, message = _memory_kept(sandboxes, "unsaved")
        assert status == "False"
        assert "not a directory" in message, message
        # Never half-paused: the same pod runs and serves, the phase says Running.
        assert sandboxes.read("unsaved")["status"]["phase"] == "Running"
        assert e2e.kube.read(core_path("pods", ns, "unsaved"))["metadata"]["uid"] == pod
        assert Agent.of(e2e.kube, ns, "unsaved").run(["true"])["exitCode"] == 0
        assert "CheckpointFailed" in _reasons(e2e, ns, "unsaved")
    finally:
        broken.unlink()
    # Tried again (memory_retry_seconds): saved, then paused.
    sandboxes.wait_phase("unsaved", "Paused", timeout=120)
    status, reason, message = _memory_kept(sandboxes, "unsaved")
    assert (status, reason) == ("True", "Checkpointed"), message
    assert sandboxes.read("unsaved")["status"]["memory"]["podUid"] == pod


def test_the_idle_policy_pauses_with_memory_and_an_execution_wakes_it(e2e: E2E) -> None:
    """onIdle: Pause honours pauseMode: Memory, and an Execution created for the
    idle-paused sandbox resumes it into the same processes."""
    ns = e2e.namespace()
    sandboxes, executions = Sandboxes(e2e.kube, ns), Executions(e2e.kube, ns)
    spec = _spec()
    spec["lifecycle"] = {"pauseMode": "Memory", "idleTimeout": "10s", "onIdle": "Pause"}
    sandboxes.create("dozer", spec)
    sandboxes.wait_ready("dozer")
    agent = Agent.of(e2e.kube, ns, "dozer")
    # Not an agent execution (a running one keeps the sandbox from idling): a
    # process of its own, detached from the command that started it.
    started = agent.run(
        shell="nohup python3 -c 'import time; time.sleep(100000)' >/dev/null 2>&1 & echo $! > pid"
    )
    assert started["exitCode"] == 0, started
    sandboxes.wait_phase("dozer", "Paused", timeout=120)
    status = sandboxes.read("dozer")["status"]
    assert status["idlePausedAt"], status
    assert status["memory"]["bytes"] > 0, status
    executions.run("wake-up", "dozer", 'kill -0 "$(cat pid)" && echo alive')
    done = executions.wait_done("wake-up", timeout=180)
    assert (done["phase"], done["stdout"], done["sandboxResumed"]) == ("Succeeded", "alive\n", True)
    _wait_kept(sandboxes, "dozer", "MemoryRestored")


def test_an_execution_running_at_the_pause_finishes_after_the_resume(e2e: E2E) -> None:
    """An Execution resource whose command is running when the sandbox pauses
    with memory is not Lost: it waits while paused and finishes in the pod
    restored from the image (the Sandbox's processesFrom names the saved pod)."""
    ns = e2e.namespace()
    sandboxes, executions = Sandboxes(e2e.kube, ns), Executions(e2e.kube, ns)
    sandboxes.create("carrier", _spec())
    sandboxes.wait_ready("carrier")
    # Runs until told to finish, after the resume: it spans the pause.
    script = "echo before; until [ -e go ]; do sleep 0.2; done; echo after"
    executions.run("across", "carrier", script)
    executions.wait_phase("across", "Running", timeout=60)
    first_pod = e2e.kube.read(core_path("pods", ns, "carrier"))["metadata"]["uid"]
    assert executions.status("across")["podUID"] == first_pod

    _pause(sandboxes, "carrier", True)
    _paused(e2e, sandboxes, ns, "carrier")
    assert executions.status("across")["phase"] == "Running"

    _pause(sandboxes, "carrier", False)
    sandboxes.wait_ready("carrier")
    _wait_kept(sandboxes, "carrier", "MemoryRestored")
    status = sandboxes.read("carrier")["status"]
    assert status["processesFrom"] == first_pod, status
    Agent.of(e2e.kube, ns, "carrier").write("go", "")
    done = executions.wait_done("across", timeout=120)
    assert (done["phase"], done["stdout"]) == ("Succeeded", "before\nafter\n"), done
    assert done["podUID"] == status["podUID"]


def test_a_repl_terminal_keeps_its_variables_across_a_pause(e2e: E2E) -> None:
    """The issue's own case: a Python REPL on a terminal holding x = 42 and a
    200 MiB array is the same REPL after the resume, reattached by its id."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("repl", _spec())
    sandboxes.wait_ready("repl")
    with SandboxClient(ns, kubeconfig=e2e.cluster.kubeconfig) as client:
        term = client.connect("repl").terminals.create(argv=["python3", "-q", "-i"])
        term.read_until(">>> ")
        term.send("x = 42; big = bytearray(b'7' * (200 << 20))\r")
        term.read_until(">>> ")
        _pause(sandboxes, "repl", True)
        sandboxes.wait_phase("repl", "Paused", timeout=120)
        _pause(sandboxes, "repl", False)
        sandboxes.wait_ready("repl")
        again = client.connect("repl").terminals.get(term.id)
        again.send("print(x, len(big), big[-1])\r")
        assert b"42 209715200 55" in again.read_until("42 209715200 55")
    _wait_kept(sandboxes, "repl", "MemoryRestored")


def test_e2bs_sdk_keeps_a_kernels_variables_across_pause_and_connect(
    e2e: E2E, e2b_target: E2BTarget
) -> None:
    """E2B code, unchanged: `run_code`, `pause()`, `Sandbox.connect()`, and the
    kernel still holds its variables (what E2B's own SDK tests check of its
    pause), given a template of gVisor with `pauseMode: Memory`, as a cluster
    admin adds it to the catalog."""
    from e2b_code_interpreter import Sandbox  # type: ignore[import-untyped]

    template = f"interpreter-memory-{uuid.uuid4().hex[:6]}"
    templates = api_path("sandbox.dev/v1alpha1", "clustersandboxtemplates")
    e2e.kube.create(
        templates,
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "ClusterSandboxTemplate",
            "metadata": {"name": template},
            "spec": {
                "sandbox": {
                    "runtime": "e2b",
                    "runtimeClassName": gvisor.RUNTIME_CLASS,
                    "workspace": {"mountPath": "/home/user"},
                    "resources": {"memory": "1Gi"},
                    "lifecycle": {"pauseMode": "Memory"},
                }
            },
        },
    )
    try:
        ns, key = e2b_target.user()
        opts = e2b_target.opts(key)
        sbx = Sandbox.create(template, timeout=600, **opts)
        made = sbx.run_code("import os; x = 42; pid = os.getpid()")
        assert made.error is None, made.error
        [name] = e2b_target.sandboxes(ns)
        sandboxes = Sandboxes(e2e.kube, ns)
        assert sbx.pause() is True
        # Saved and gone, so that the connect below is a restore, not a pause undone.
        sandboxes.wait_phase(name, "Paused", timeout=120)
        assert _memory_kept(sandboxes, name)[1] == "Checkpointed"
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        same = resumed.run_code("(x, pid == os.getpid())")
        assert same.error is None, same.error
        assert same.text == "(42, True)"
        _wait_kept(sandboxes, name, "MemoryRestored")
        resumed.kill()
    finally:
        e2e.kube.delete(f"{templates}/{template}")
