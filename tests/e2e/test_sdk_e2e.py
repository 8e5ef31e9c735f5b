"""The SDK and `kubectl sandbox` on the real node, as a user on a laptop runs them:
the examples under examples/sdk/ run as they are, and the CLI as a subprocess,
both with the cluster's admin kubeconfig (a client certificate: the SDK reaches
the gateway through the API server's service proxy, with a ServiceAccount token
it provisions for the gateway)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(1800)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sdk"
BIN = Path(sys.executable).parent


@pytest.fixture
def user_env(e2e: E2E) -> dict[str, str]:
    """The environment of a user in a fresh namespace: the kubeconfig, the
    namespace, and the venv's bin on PATH (where `kubectl-sandbox` lives)."""
    ns = e2e.namespace()
    return {
        **os.environ,
        "KUBECONFIG": str(e2e.cluster.kubeconfig),
        "SANDBOX_NAMESPACE": ns,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def _run_example(name: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_sandbox_client_flow(user_env: dict[str, str], e2e: E2E) -> None:
    out = _run_example("sandbox_client.py", user_env)
    assert "API server proxy" in out, out  # the route a laptop takes
    assert "snapshot " in out
    assert "destroyed; done" in out
    ns = user_env["SANDBOX_NAMESPACE"]
    assert e2e.kube.list(Sandboxes(e2e.kube, ns).path()) == []


def test_chat_tools(user_env: dict[str, str]) -> None:
    out = _run_example("chat_tools.py", user_env)
    assert "passed test_mul" in out
    assert "timed-out command stopped; sandbox still usable" in out


def test_workflow_saga_destroys_the_sandbox_when_a_step_fails(user_env: dict[str, str]) -> None:
    out = _run_example("workflow_saga.py", user_env)
    assert "the workflow failed at step 3" in out
    assert "was destroyed by the compensation" in out


def test_per_turn_chat(user_env: dict[str, str]) -> None:
    out = _run_example("chat_turns.py", user_env)
    for turn in (1, 2):
        assert f"turn {turn}: worker process reconnected" in out
        assert f"turn {turn}: disposed before suspending" in out
    warming = [
        float(line.split("warming took ")[1].split()[0])
        for line in out.splitlines()
        if "warming took" in line
    ]
    assert warming, out
    assert max(warming) < 50, out  # milliseconds of the turn: it does not wait


def test_a_terminal_in_a_real_pod(user_env: dict[str, str]) -> None:
    """A login shell on a pty in the runtime container (runc), through the
    gateway and the API server's proxy, attached over a WebSocket (the proxy
    passes the upgrade on) and driven over HTTP; a watch of the workspace (the
    agent's inotify on the volume it shares with the runtime container) sees
    what the terminal changes."""
    out = _run_example("terminal.py", user_env)
    assert "attached over websocket" in out, out  # not the HTTP fallback
    # The image gives the sandbox user /bin/sh; an interactive terminal gets bash.
    assert re.search(r"a login shell \(\S*bash\) on /dev/pts/", out), out
    assert "the REPL kept total between sends" in out
    assert "create notes" in out, out  # the watch, inotify on the pod's workspace volume
    assert "notes/todo.txt" in out, out
    assert "the shell exited with 3; done" in out


def test_code_interpreter_in_a_real_pod(user_env: dict[str, str]) -> None:
    """Jupyter kernels in the runtime image (Debian's ipykernel): state across
    runs, a pandas table as HTML, a matplotlib figure as PNG, an exception, a
    timeout that keeps the state, separate contexts, a restart."""
    out = _run_example("code_interpreter.py", user_env)
    assert "turn 2: the table as text, html" in out, out
    assert "bytes of PNG" in out
    assert "turn 4: KeyError: 'missing'" in out
    assert "the table is kept" in out
    assert "a restart clears one; done" in out


def test_javascript_context_in_the_node_runtime(user_env: dict[str, str]) -> None:
    """The node runtime's own `node` runs a JavaScript context: state across runs.
    Code runs and commands go through the API server over HTTP/2 (over HTTP/1.1
    its proxy now and then cuts an event stream that answers a POST)."""
    env = {**os.environ, **user_env}
    script = (
        "from sandbox_sdk import SandboxClient\n"
        "with SandboxClient() as c, c.create('node') as sb:\n"
        "    seen = set()\n"
        "    hooks = c.gateway.kube.events.event_hooks['response']\n"
        "    hooks.append(lambda r: seen.add((r.url.path.split('/')[-1], r.http_version)))\n"
        "    sb.run_code('let n = 6; console.log(process.version)', language='javascript')\n"
        "    r = sb.run_code('n * 7', language='javascript')\n"
        "    sb.execute('echo streamed', stdout=lambda text: None)\n"
        "    print(r.status, r.text, r.context_id, sorted(seen))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "ok 42 default-javascript [('run', 'HTTP/2'), ('stream', 'HTTP/2')]"
    ), done.stdout


def test_one_shot(user_env: dict[str, str]) -> None:
    out = _run_example("one_shot.py", user_env)
    assert "5050 100" in out
    assert "the sandbox is gone" in out


def _cli(
    env: dict[str, str], *args: str, input: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kubectl-sandbox"), *args],
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_kubectl_sandbox(user_env: dict[str, str], e2e: E2E, tmp_path: Path) -> None:
    env = user_env
    ns = env["SANDBOX_NAMESPACE"]
    created = _cli(env, "create", "demo", "--runtime", "python", "--port", "8000")
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == "sandbox/demo created and ready"

    # Through kubectl's own plugin mechanism (kubectl-sandbox on PATH), with -n.
    listed = subprocess.run(
        [str(e2e.cluster.kubectl), "sandbox", "-n", ns, "get", "-o", "wide"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "PHASE", "READY", "RUNTIME"]
    assert row.split()[:4] == ["demo", "Running", "True", "python"]
    as_json = json.loads(_cli(env, "get", "demo", "-o", "json").stdout)
    assert as_json["metadata"]["name"] == "demo"
    assert _cli(env, "get", "-o", "name").stdout == "sandbox/demo\n"

    # exec: output streams, the exit code propagates, stdin passes through.
    ran = _cli(env, "exec", "demo", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, "out\n", "err\n")
    piped = _cli(env, "exec", "-i", "demo", "--", "wc", "-c", input="12345")
    assert (piped.returncode, piped.stdout.strip()) == (0, "5")
    timed = _cli(env, "exec", "demo", "--timeout", "1", "--", "sleep 30")
    assert timed.returncode == 124
    # shell: a command on a terminal, its exit code ours.
    shell = _cli(env, "shell", "demo", "--", "sh", "-c", "tty; exit 4")
    assert shell.returncode == 4, shell.stderr
    assert shell.stdout.startswith("/dev/pts/"), shell.stdout

    # cp both ways, a directory and a large file with a progress bar.
    local = tmp_path / "project"
    (local / "src").mkdir(parents=True)
    (local / "src" / "app.py").write_text("line one\nline two\nline three\n")
    (local / "blob.bin").write_bytes(os.urandom(3 << 20))
    up = _cli(env, "cp", str(local), "demo:project", "--progress")
    assert up.returncode == 0, up.stderr
    assert "MiB" in up.stderr
    assert _cli(env, "ls", "demo", "project").stdout.split() == ["project/blob.bin", "project/src/"]
    assert _cli(env, "cat", "demo", "project/src/app.py", "--lines", "2:3").stdout == (
        "line two\nline three\n"
    )
    grep = _cli(env, "grep", "demo", "two", "project")
    assert grep.stdout == "project/src/app.py:2:line two\n"
    assert _cli(env, "grep", "demo", "absent-text").returncode == 1
    down = _cli(env, "cp", "demo:project", str(tmp_path / "back"))
    assert down.returncode == 0, down.stderr
    assert (tmp_path / "back" / "blob.bin").read_bytes() == (local / "blob.bin").read_bytes()
    single = _cli(env, "cp", "demo:project/src/app.py", str(tmp_path))
    assert single.returncode == 0, single.stderr
    assert (tmp_path / "app.py").read_text().startswith("line one")

    # Snapshot, fork, restore, pause, resume.
    snap = _cli(env, "snapshot", "demo", "--tag", "v1", "--name", "demo-v1")
    assert snap.returncode == 0, snap.stderr
    assert "demo-v1" in _cli(env, "snapshots", "demo").stdout
    _cli(env, "exec", "demo", "--", "rm -rf project")
    forked = _cli(env, "fork", "demo", "demo-copy", "--snapshot", "demo-v1")
    assert forked.returncode == 0, forked.stderr
    assert _cli(env, "cat", "demo-copy", "project/src/app.py").returncode == 0
    restored = _cli(env, "restore", "demo", "demo-v1")
    assert restored.returncode == 0, restored.stderr
    assert _cli(env, "cat", "demo", "project/src/app.py").stdout.startswith("line one")
    assert _cli(env, "pause", "demo").returncode == 0
    paused = _cli(env, "exec", "demo", "--", "true")
    assert paused.returncode == 1
    assert paused.stderr.startswith("error: ")
    assert len(paused.stderr.splitlines()) == 1
    assert "sandbox_paused" in paused.stderr
    assert _cli(env, "resume", "demo").returncode == 0

    port = _cli(env, "port", "demo", "8000")
    assert port.returncode == 0, port.stderr
    assert "/sandboxes/demo/ports/8000/" in port.stdout

    # logs: an Execution's full output.
    Executions(e2e.kube, ns).create_with(
        "lots", {"sandboxRef": {"name": "demo"}, "script": "seq 1 3000"}
    )
    wait_for(
        lambda: (
            (Executions(e2e.kube, ns).get("lots") or {}).get("status", {}).get("phase")
            == "Succeeded"
        ),
        120,
        "the Execution",
    )
    logs = _cli(env, "logs", "lots")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == [str(n) for n in range(1, 3001)]

    one = _cli(env, "run", "--runtime", "python", "--", "python3 -c 'print(6*7)'")
    assert (one.returncode, one.stdout) == (0, "42\n"), one.stderr

    missing = _cli(env, "get", "nowhere")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: ")
    assert len(missing.stderr.splitlines()) == 1
    completion = _cli(env, "completion", "bash")
    assert "complete -F" in completion.stdout
    assert "demo" in _cli(env, "__complete", "exec").stdout.split()

    deleted = _cli(env, "delete", "demo", "demo-copy")
    assert deleted.returncode == 0, deleted.stderr
    # `run` deletes its one-shot sandbox without waiting for it to be gone (its
    # pod stops first): it may still be terminating here, and is gone soon after.
    wait_for(lambda: _cli(env, "get", "-o", "name").stdout == "", 60, "every sandbox gone")
