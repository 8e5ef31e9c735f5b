"""Fixtures that run the real agent and the real runner as separate processes.

Layout per sandbox (all in a tmp dir): workspace/, run/ (runner.py is copied
there by the agent, runner.sock is created there by the runner), logs/, and a
token file. The agent listens on a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandbox_agent.config import env_names

PY = sys.executable
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(pred: Any, timeout: float = 30.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def rss_kib(pid: int) -> int:
    """Resident set size of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def stop_process(p: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


class Sandbox:
    """A running agent (+ runner) pair in a temporary directory."""

    def __init__(self, root: Path, env: dict[str, str] | None = None, host: str = "127.0.0.1"):
        self.root = root
        self.workspace = root / "workspace"
        self.runtime = root / "run"
        self.logs = root / "logs"
        for d in (self.workspace, self.runtime):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.runtime, 0o777)
        os.chmod(self.workspace, 0o777)
        self.token = secrets.token_urlsafe(32)
        self.token_file = root / "token"
        self.token_file.write_text(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        self.host = host
        self.port = free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root),
            "SANDBOX_AGENT_HOST": host,
            "SANDBOX_AGENT_PORT": str(self.port),
            "SANDBOX_AGENT_TOKEN_FILE": str(self.token_file),
            "SANDBOX_AGENT_WORKSPACE": str(self.workspace),
            "SANDBOX_AGENT_RUNTIME_DIR": str(self.runtime),
            "SANDBOX_AGENT_LOG_DIR": str(self.logs),
            "SANDBOX_AGENT_LOG_LEVEL": "warning",
            # The agent runs the code the tests import (a checkout's, not an install's).
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
            **(env or {}),
        }
        self.agent: subprocess.Popen[bytes] | None = None
        self.runner: subprocess.Popen[bytes] | None = None
        self.runners: list[subprocess.Popen[bytes]] = []
        self.client = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=60.0,
        )
        self.anon = httpx.Client(base_url=self.base_url, timeout=30.0)

    # -- processes ---------------------------------------------------------

    def start_agent(self, wait: bool = True) -> subprocess.Popen[bytes]:
        out = open(self.root / "agent.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.agent = subprocess.Popen(
            [PY, "-m", "sandbox_agent"], env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        out.close()
        if wait:
            wait_until(self._healthy, 15.0)
        return self.agent

    def _healthy(self) -> bool:
        assert self.agent is not None
        if self.agent.poll() is not None:
            raise AssertionError(f"agent exited with {self.agent.returncode}: {self.agent_log()}")
        try:
            return self.anon.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def start_runner(
        self,
        wait_ready: bool = True,
        user: int | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        out = open(self.root / "runner.log", "ab")  # noqa: SIM115
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.workspace),
            "LANG": "C.UTF-8",
            **(extra_env or {}),
        }
        # Another UID cannot use our venv (under /root): take the system python3,
        # which is also closer to the user image's interpreter.
        python = PY if user is None else SYSTEM_PY
        self.runner = subprocess.Popen(
            [python, str(self.runtime / "runner.py")],
            cwd=self.workspace,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=user,
            group=65534 if user is not None else None,
            extra_groups=[] if user is not None else None,
        )
        out.close()
        self.runners.append(self.runner)
        if wait_ready:
            wait_until(lambda: self.anon.get("/readyz").status_code == 200, 15.0)
        return self.runner

    def kill_runner(self, sig: int = signal.SIGKILL) -> None:
        assert self.runner is not None
        self.runner.send_signal(sig)
        self.runner.wait(10)

    def stop(self) -> None:
        self.client.close()
        self.anon.close()
        for r in self.runners:
            stop_process(r)
        stop_process(self.agent)

    def agent_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "agent.log").read_text(errors="replace")[-4000:]
        return ""

    # -- API helpers -------------------------------------------------------

    def run(self, expect: int = 200, **body: Any) -> dict[str, Any]:
        r = self.client.post("/v1/executions", json=body)
        assert r.status_code == expect, r.text
        result: dict[str, Any] = r.json()
        return result

    def sh(self, command: str, **body: Any) -> dict[str, Any]:
        return self.run(command=command, **body)

    def wait_finished(self, ex_id: str, timeout: float = 30.0) -> dict[str, Any]:
        r = self.client.get(f"/v1/executions/{ex_id}", params={"waitSeconds": timeout})
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        assert result["status"] != "running", result
        return result

    def write(self, path: str, data: bytes) -> dict[str, Any]:
        r = self.client.put("/v1/files/content", params={"path": path}, content=data)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result

    def read(self, path: str, **params: Any) -> bytes:
        r = self.client.get("/v1/files/content", params={"path": path, **params})
        assert r.status_code == 200, r.text
        return r.content

    def error(self, r: httpx.Response, status: int) -> str:
        assert r.status_code == status, (r.status_code, r.text)
        body = r.json()
        assert set(body) == {"error"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        code: str = body["error"]["code"]
        return code


def make_sandbox(root: Path, env: dict[str, str] | None = None, runner: bool = True) -> Sandbox:
    sb = Sandbox(root, env)
    try:
        sb.start_agent()
        if runner:
            sb.start_runner()
    except BaseException:
        sb.stop()
        raise
    return sb


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """One agent+runner for the many tests that do not disturb it."""
    sb = make_sandbox(tmp_path_factory.mktemp("shared"))
    yield sb
    sb.stop()


@pytest.fixture
def sandbox(shared: Sandbox, request: pytest.FixtureRequest) -> Sandbox:
    """The shared sandbox, with a fresh sub-directory name reserved for the test."""
    return shared


@pytest.fixture
def wsdir(shared: Sandbox, request: pytest.FixtureRequest) -> str:
    """A per-test directory inside the shared workspace (relative path)."""
    name = "t-" + request.node.name.replace("[", "-").replace("]", "").replace("/", "_")[:80]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    d = shared.workspace / name
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o777)
    return name


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Any]:
    """Factory for a private agent+runner (for tests that kill or limit things)."""
    made: list[Sandbox] = []

    def factory(
        env: dict[str, str] | None = None,
        runner: bool = True,
        root: Path | None = None,
        **settings: object,
    ) -> Sandbox:
        """``settings``: agent settings by name (max_log_bytes=1000), set through
        their environment variables as the pod spec would."""
        names = env_names()
        env = {**(env or {}), **{names[k]: str(v) for k, v in settings.items()}}
        sb = make_sandbox((root or tmp_path) / f"sb{len(made)}", env, runner)
        made.append(sb)
        return sb

    yield factory
    for sb in made:
        sb.stop()


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A tmp dir other UIDs can traverse (pytest's own tmp root is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="sandbox-agent-test-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
