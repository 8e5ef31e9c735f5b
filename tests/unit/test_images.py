"""The agent image's entry, run for real: listen-first (compiled as the image
build compiles it) listens before the agent's interpreter starts, and the
agent serves on the socket it was handed."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import images
from devcluster.controlplane import free_ports
from sandbox_agent.server import LISTEN_FD_ENV


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
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def listen_first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("programs") / "listen-first"
    images.compile_static(images.program_source("listen-first"), binary)
    return binary


def _entry(tmp: Path, listen_first: Path) -> list[str]:
    """The image's entrypoint: listen-first, then /usr/local/bin/sandbox-agent,
    run with this interpreter (where the agent is installed) instead of the
    image's python3."""
    command, entry = images.AGENT.launchers[0]
    path = tmp / command
    path.write_text(images.launcher_script(images.AGENT, command, entry))
    return [str(listen_first), sys.executable, str(path)]


def _listeners(port: int) -> int:
    return sum(
        1
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
    )


@contextlib.contextmanager
def _started(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The process, killed when the test is done with it."""
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


def _serving(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                assert r.status == 200
                return
        except OSError:
            assert time.monotonic() < deadline, "the agent never answered"
            time.sleep(0.1)


def test_listen_first_listens_and_the_agent_serves_on_that_socket(
    tmp_path: Path, listen_first: Path
) -> None:
    port = _free_port()
    with _started(_entry(tmp_path, listen_first), _agent_env(tmp_path, port)) as proc:
        _serving(proc, port)
        # One listener on the port: the handed one (the agent made no second).
        assert _listeners(port) == 1


def test_listen_first_listens_before_the_agent_starts(tmp_path: Path, listen_first: Path) -> None:
    """An agent whose imports take long (a loaded node) is already listening:
    a probe waits in the backlog instead of being refused."""
    slow = tmp_path / "sandbox_agent"  # found first: the launcher's directory
    slow.mkdir()
    (slow / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    port = _free_port()
    with _started(_entry(tmp_path, listen_first), _agent_env(tmp_path, port)) as proc:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "nothing listened"
                time.sleep(0.05)

        # Handed on: the agent's interpreter has it, under the name the agent
        # reads. /proc shows the environment of the last exec, and listen-first
        # listens before it execs: the connection can come first.
        def handed_on() -> bool:
            environ = (Path("/proc") / str(proc.pid) / "environ").read_bytes()
            prefix = LISTEN_FD_ENV.encode() + b"="
            return any(e.startswith(prefix) for e in environ.split(b"\0"))

        while not handed_on():
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the agent was never executed"
            time.sleep(0.05)


def test_listen_first_leaves_a_host_name_to_the_agent(tmp_path: Path, listen_first: Path) -> None:
    """A name, not an address: the agent resolves it and listens itself, as it
    would without listen-first."""
    port = _free_port()
    env = {**_agent_env(tmp_path, port), "SANDBOX_AGENT_HOST": "localhost"}
    with _started(_entry(tmp_path, listen_first), env) as proc:
        _serving(proc, port)
        assert _listeners(port) == 1


@pytest.mark.parametrize(
    ("port", "words"),
    [("http", "SANDBOX_AGENT_PORT"), ("taken", "cannot listen on 127.0.0.1")],
)
def test_a_bad_port_is_reported_by_the_agent_in_its_own_words(
    tmp_path: Path, listen_first: Path, port: str, words: str
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        value = str(taken.getsockname()[1]) if port == "taken" else port
        proc = subprocess.run(
            _entry(tmp_path, listen_first),
            env={**_agent_env(tmp_path, 1), "SANDBOX_AGENT_PORT": value},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode in (1, 2), proc.stderr
    assert words in proc.stderr


def test_listen_first_without_a_command_or_with_a_missing_one(
    tmp_path: Path, listen_first: Path
) -> None:
    usage = subprocess.run([str(listen_first)], capture_output=True, text=True, timeout=10)
    assert (usage.returncode, usage.stderr) == (2, "usage: listen-first COMMAND [ARGUMENT...]\n")
    missing = subprocess.run(
        [str(listen_first), str(tmp_path / "nothing")], capture_output=True, text=True, timeout=10
    )
    assert missing.returncode == 127
    assert "cannot run" in missing.stderr
    assert "No such file or directory" in missing.stderr


def test_the_agent_refuses_a_handed_socket_on_another_port(tmp_path: Path) -> None:
    """A socket handed over on a port that is not the configured one is a
    deployment mistake: the agent says so and exits, it does not serve there."""
    env = _agent_env(tmp_path, _free_port())
    with socket.create_server(("127.0.0.1", 0)) as other:
        other.set_inheritable(True)
        env[LISTEN_FD_ENV] = str(other.fileno())
        proc = subprocess.run(
            [sys.executable, "-m", "sandbox_agent"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=(other.fileno(),),
        )
    assert proc.returncode == 1
    assert f"{LISTEN_FD_ENV} listens on port" in proc.stderr


def test_launchers_import_their_project_from_opt() -> None:
    script = images.launcher_script(images.PipProject("x", "x", ()), "x", "x.main:run")
    assert script.splitlines()[2:] == [
        "import sys",
        "",
        'sys.path.insert(0, "/opt/x")',
        "from x.main import run",
        "",
        "sys.exit(run())",
    ]
