"""The agent image's launcher, run for real: it listens before the agent's
imports, and the agent serves on the socket it was handed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from devcluster import images


def _agent_env(tmp: Path, port: int) -> dict[str, str]:
    (tmp / "token").write_text("t" * 32)
    for sub in ("workspace", "run", "logs"):
        (tmp / sub).mkdir()
    return {
        "PATH": "/usr/bin:/bin",
        "SANDBOX_AGENT_HOST": "127.0.0.1",
        "SANDBOX_AGENT_PORT": str(port),
        "SANDBOX_AGENT_TOKEN_FILE": str(tmp / "token"),
        "SANDBOX_AGENT_WORKSPACE": str(tmp / "workspace"),
        "SANDBOX_AGENT_RUNTIME_DIR": str(tmp / "run"),
        "SANDBOX_AGENT_LOG_DIR": str(tmp / "logs"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launcher(tmp: Path) -> Path:
    """The image's /usr/local/bin/sandbox-agent; run with this interpreter
    (where the agent is installed) instead of the image's python3."""
    command, entry = images.AGENT.launchers[0]
    path = tmp / command
    path.write_text(images.launcher_script(images.AGENT, command, entry))
    return path


def test_the_agent_launcher_listens_first_and_the_agent_serves_on_that_socket(
    tmp_path: Path,
) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(_launcher(tmp_path))],
        env=_agent_env(tmp_path, port),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the agent never answered"
                time.sleep(0.1)
        # The agent took the socket over: the variable is gone from its environment.
        environ = (Path("/proc") / str(proc.pid) / "environ").read_bytes().split(b"\0")
        assert not any(e.startswith(images.AGENT_LISTEN_FD_ENV.encode()) for e in environ)
        # One listener on the port: the handed one (the agent made no second).
        listeners = [
            line
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
        ]
        assert len(listeners) == 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_agent_launcher_listens_before_it_imports_the_agent(tmp_path: Path) -> None:
    """An agent whose imports take long (a loaded node) is already listening:
    a probe waits in the backlog instead of being refused."""
    slow = tmp_path / "sandbox_agent"  # found first: the launcher's directory
    slow.mkdir()
    (slow / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(_launcher(tmp_path))], env=_agent_env(tmp_path, port)
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "nothing listened"
                time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(30)


def test_a_bad_port_is_reported_by_the_agent_in_its_own_words(tmp_path: Path) -> None:
    env = {**_agent_env(tmp_path, 1), "SANDBOX_AGENT_PORT": "http"}
    proc = subprocess.run(
        [sys.executable, str(_launcher(tmp_path))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "SANDBOX_AGENT_PORT" in proc.stderr


def test_the_agent_refuses_a_handed_socket_on_another_port(tmp_path: Path) -> None:
    """A socket handed over on a port that is not the configured one is a
    deployment mistake: the agent says so and exits, it does not serve there."""
    env = _agent_env(tmp_path, _free_port())
    with socket.create_server(("127.0.0.1", 0)) as other:
        other.set_inheritable(True)
        env[images.AGENT_LISTEN_FD_ENV] = str(other.fileno())
        proc = subprocess.run(
            [sys.executable, "-m", "sandbox_agent"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=(other.fileno(),),
        )
    assert proc.returncode == 1
    assert f"{images.AGENT_LISTEN_FD_ENV} listens on port" in proc.stderr


def test_launchers_without_a_prelude_import_their_project_first() -> None:
    script = images.launcher_script(images.PipProject("x", "x", ()), "x", "x.main:run")
    assert script.splitlines()[2:] == [
        "import sys",
        "",
        'sys.path.insert(0, "/opt/x")',
        "from x.main import run",
        "",
        "sys.exit(run())",
    ]
