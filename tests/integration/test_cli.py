"""`kubectl sandbox` (sandbox_sdk.cli) as a person runs it: a new process each
time, against a real API server, the operator, the gateway and real agents."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from sandbox_sdk import SandboxClient
from sandbox_sdk.cli import PIPE_EXIT, TRUNCATED_EXIT
from tests.executions import Executions
from tests.integration.conftest import RELEASE
from tests.integration.harness import GatewayProcess, Node, TcpRelay, wait_for
from tests.integration.test_sdk import (
    LiveSandbox,
    _ca_for_children,
    _explicit_env,
    _start,
    alice,
    client,
)
from tests.kube import ApiError, KubeJSON, api_path, core_path

__all__ = ["_ca_for_children", "alice", "client"]  # fixtures of test_sdk, used here too

BIN = Path(sys.executable).parent  # the venv's, where `kubectl-sandbox` lives

# What `kubectl sandbox` must not import before it needs it: each costs every
# call its start-up (together ~340 ms of a 450 ms `exec` on a laptop).
HEAVY = ("pydantic", "sandbox_sdk.models.agent", "sandbox_sdk.models.resources", "rich", "click")


def _imported(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after `statement`."""
    probe = f"{statement}\nimport json, sys\nprint(json.dumps(list(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(done.stdout))


def test_the_cli_starts_without_the_heavy_modules() -> None:
    """Importing the entry point pulls neither the client nor its dependencies;
    the client `exec` needs before its first request pulls httpx but none of
    the models, pydantic or httpx's own command line (rich, click)."""
    entry = _imported("import sandbox_sdk.cli")
    assert not entry & {*HEAVY, "httpx", "yaml", "sandbox_sdk._sync.client", "http.server"}, entry
    client = _imported("import sandbox_sdk.cli as cli; cli._client_class()")
    assert {"httpx", "sandbox_sdk._sync.client"} <= client
    assert not client & set(HEAVY), sorted(client & set(HEAVY))
    # The package's public names still resolve (imported on first use).
    names = _imported("from sandbox_sdk import SandboxClient, CommandResult, NotFound")
    assert "sandbox_sdk._sync.client" in names


# -- against the cluster --------------------------------------------------------------


def _exists(kube: KubeJSON, path: str) -> bool:
    try:
        kube.read(path)
    except ApiError:
        return False
    return True


def _importtime(stderr: str) -> set[str]:
    """The modules a `-X importtime` process imported, from its stderr."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if "|" in line}


def _said(stderr: str) -> str:
    """A `-X importtime` process's stderr without the import times."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


def _cli(
    env: dict[str, str], *args: str, python: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`kubectl-sandbox ARGS` (`python`: interpreter flags, e.g. -X importtime)."""
    return subprocess.run(
        [sys.executable, *python, str(BIN / "kubectl-sandbox"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_exec_output_usage_errors_and_a_closed_pipe(
    client: SandboxClient, live_sandbox: LiveSandbox
) -> None:
    client.create("python", name="box", wait=False)
    _start(live_sandbox, "box")
    env = {**os.environ, **_explicit_env(client)}

    # A command, start to end, in one request on the standard library: neither
    # the client nor httpx nor the models are imported (their import is most of
    # the start-up): -X importtime lists every module the process imported.
    done = _cli(env, "exec", "box", "--", "echo", "hi", python=("-X", "importtime"))
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr
    imported = _importtime(done.stderr)
    assert not imported & {*HEAVY, "httpx", "http.client", "sandbox_sdk._sync.gateway"}, sorted(
        imported
    )

    # The command's own flags without `--`: where the command goes, not the
    # top-level usage.
    flags = _cli(env, "exec", "box", "ls", "-l")
    assert flags.returncode == 2
    assert "kubectl sandbox exec NAME [flags] -- COMMAND" in flags.stderr, flags.stderr
    assert "usage: kubectl sandbox [-h]" not in flags.stderr, flags.stderr
    nothing = _cli(env, "exec", "box")
    assert nothing.returncode == 2
    assert "kubectl sandbox exec NAME [flags] -- COMMAND" in nothing.stderr, nothing.stderr

    # `--cwd /`: refused, and the message says what paths are.
    root = _cli(env, "exec", "box", "--cwd", "/", "--", "ls")
    assert root.returncode == 1
    assert "relative to the workspace" in root.stderr, root.stderr

    # A bad line range is a usage error, not a traceback.
    client.connect("box").files.write("f.txt", "a\nb\nc\n")
    assert _cli(env, "cat", "box", "f.txt", "--lines", "2:3").stdout == "b\nc\n"
    for bad in ("abc", "3:1", "0:2", "x:"):
        lines = _cli(env, "cat", "box", "f.txt", "--lines", bad)
        assert lines.returncode == 2, (bad, lines.stderr)
        assert lines.stderr.startswith("error: --lines"), (bad, lines.stderr)
        assert "Traceback" not in lines.stderr

    # `| head -1`: the reader goes away; the plugin stops quietly, as a
    # command killed by SIGPIPE does (141).
    proc = subprocess.Popen(
        [str(BIN / "kubectl-sandbox"), "exec", "box", "--", "seq", "1", "500000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.readline() == b"1\n"
    proc.stdout.close()
    assert proc.wait(60) == PIPE_EXIT
    assert proc.stderr.read() == b""


def test_get_across_namespaces_names_the_namespace(
    client: SandboxClient, kube: KubeJSON, ns: str
) -> None:
    client.create("python", name="box", wait=False)
    # -A lists every namespace: alice may read Sandboxes cluster-wide here.
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(
        api_path(rbac, "clusterrolebindings"),
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{ns}-alice-viewer"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": f"{RELEASE}-viewer"},
            "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": ns}],
        },
    )  # fmt: skip
    env = {**os.environ, **_explicit_env(client)}
    try:
        listed = _cli(env, "get", "-A")
        wide = _cli(env, "get", "-A", "-o", "wide")
    finally:
        kube.delete(api_path(rbac, "clusterrolebindings", None, f"{ns}-alice-viewer"))
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:3] == ["NAMESPACE", "NAME", "PHASE"], header
    assert [ns, "box"] in [row.split()[:2] for row in rows], rows
    assert wide.stdout.split()[0] == "NAMESPACE", wide.stdout
    # Within one namespace the column stays away, as kubectl's.
    assert _cli(env, "get").stdout.split()[0] == "NAME"


def test_logs_says_when_the_log_was_cut(
    client: SandboxClient,
    live_sandbox: LiveSandbox,
    executions: Executions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A real agent with a 64 KiB log cap (64 MiB by default) and a command past it.
    monkeypatch.setenv("SANDBOX_AGENT_MAX_LOG_BYTES", str(64 << 10))
    client.create("python", name="box", wait=False)
    _start(live_sandbox, "box")
    # 160 KiB in 8 KiB writes (the log is cut between chunks, and a command
    # that ends at once hands the agent all of its output as one).
    executions.run("loud", "box", "for i in $(seq 20); do head -c 8192 /dev/zero; sleep 0.02; done")
    executions.run("quiet", "box", "echo fine")
    executions.wait_done("loud")
    executions.wait_done("quiet")
    env = {**os.environ, **_explicit_env(client)}
    cut = _cli(env, "logs", "loud")
    assert cut.returncode == TRUNCATED_EXIT, cut.stderr
    assert 0 < len(cut.stdout) < 160 << 10
    assert "warning: the output log of execution loud was cut" in cut.stderr, cut.stderr
    whole = _cli(env, "logs", "quiet")
    assert (whole.returncode, whole.stdout, whole.stderr) == (0, "fine\n", "")


def test_run_says_why_it_waits(
    client: SandboxClient,
    live_sandbox: LiveSandbox,
    node: Node,
    kube: KubeJSON,
    ns: str,
) -> None:
    env = {**os.environ, **_explicit_env(client)}
    proc = subprocess.Popen(
        [str(BIN / "kubectl-sandbox"), "run", "--runtime", "python", "--", "echo", "done"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: said.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        path = api_path("sandbox.dev/v1alpha1", "sandboxes", ns)
        wait_for(lambda: kube.list(path, label_selector="sandbox.dev/one-shot=true"), 30, "run's")
        name = kube.list(path, label_selector="sandbox.dev/one-shot=true")[0]["metadata"]["name"]
        wait_for(lambda: kube.get(core_path("pods", ns, name)) is not None, 30, "its pod")
        node.unschedulable(ns, name, "0/1 nodes are available: 1 Insufficient cpu.")
        # Said while it still waits (the pod is not running), not at the end.
        wait_for(lambda: any("Insufficient cpu" in line for line in said), 30, f"why: {said}")
        assert proc.poll() is None
        _start(live_sandbox, name)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert (proc.returncode, out) == (0, "done\n"), said
    told = [line for line in said if line.startswith("waiting: Unschedulable:")]
    assert len(told) == 1, said  # once per change, not once per look


def test_exec_hands_to_the_client_what_one_request_cannot_do(
    client: SandboxClient,
    live_sandbox: LiveSandbox,
    control_plane: ControlPlane,
    kube: KubeJSON,
    ns: str,
) -> None:
    """A certificate-only kubeconfig: the gateway gets a ServiceAccount's token.
    The first `exec` finds no `sandbox-sdk` account, and the client makes it;
    later ones ask for its token and stay on the one-request path. An error
    answer goes to the client too, which says it in its own words."""
    client.create("python", name="box", wait=False)
    _start(live_sandbox, "box")
    assert client.gateway.url is not None
    env = {
        **os.environ,
        "KUBECONFIG": str(control_plane.kubeconfig),
        "SANDBOX_GATEWAY_URL": client.gateway.url,
        "SANDBOX_NAMESPACE": ns,
    }
    # No account yet (whatever made one in this namespace before).
    for path in (
        core_path("serviceaccounts", ns, "sandbox-sdk"),
        api_path("rbac.authorization.k8s.io/v1", "rolebindings", ns, "sandbox-sdk"),
    ):
        with contextlib.suppress(ApiError):
            kube.delete(path)
    wait_for(lambda: not _exists(kube, core_path("serviceaccounts", ns, "sandbox-sdk")), 30, "gone")
    # The Service names the release whose user role the account is bound to.
    service = f"sbx-gateway-{ns}"
    labels = {"app.kubernetes.io/name": "sandbox-gateway", "app.kubernetes.io/instance": RELEASE}
    kube.create(
        core_path("services", "sandbox-system"),
        {"metadata": {"name": service, "labels": labels}, "spec": {"ports": [{"port": 80}]}},
    )
    try:
        first = _cli(env, "exec", "box", "--", "echo", "one", python=("-X", "importtime"))
    finally:
        kube.delete(core_path("services", "sandbox-system", service))
    assert (first.returncode, first.stdout) == (0, "one\n"), first.stderr
    # (The client is imported with importlib, which -X importtime does not list:
    # httpx, which it imports, says it was.)
    assert "httpx" in _importtime(first.stderr), _said(first.stderr)
    kube.read(core_path("serviceaccounts", ns, "sandbox-sdk"))  # made by the client
    again = _cli(env, "exec", "box", "--", "echo", "two", python=("-X", "importtime"))
    assert (again.returncode, again.stdout) == (0, "two\n"), again.stderr
    assert "httpx" not in _importtime(again.stderr), _said(again.stderr)

    missing = _cli(env, "exec", "nobody", "--", "true")
    assert missing.returncode == 1
    assert "nobody" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr, missing.stderr
    # An exit code and stderr pass through the one-request path unchanged.
    failing = _cli(env, "exec", "box", "--", "sh", "-c", "echo oops >&2; exit 7")
    assert (failing.returncode, failing.stderr) == (7, "oops\n")


class _Pty:
    """`kubectl-sandbox ARGS` on a pseudo-terminal of its own (its controlling
    terminal), as a person's window runs it."""

    def __init__(self, env: dict[str, str], *args: str, cols: int, rows: int) -> None:
        self.master, slave = pty.openpty()
        self.slave = slave
        self.resize(cols, rows)
        self.process = subprocess.Popen(
            [sys.executable, str(BIN / "kubectl-sandbox"), *args],
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            # The pty becomes the controlling terminal: window changes reach it.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        self.seen = b""

    def resize(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def expect(self, text: str, seconds: float = 30) -> None:
        """Until `text` appears in what was shown since the last expect."""
        start = len(self.seen)
        deadline = time.monotonic() + seconds
        while text.encode() not in self.seen[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not shown; last: {self.seen[-600:]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                with contextlib.suppress(OSError):  # EIO: the process is gone
                    self.seen += os.read(self.master, 65536)

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def raw(self) -> bool:
        """The local terminal is in raw mode (no line editing, no echo)."""
        lflag = termios.tcgetattr(self.slave)[3]
        return not lflag & (termios.ICANON | termios.ECHO)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        os.close(self.master)
        os.close(self.slave)


def test_shell_joins_this_terminal_to_one_in_the_sandbox(
    client: SandboxClient, live_sandbox: LiveSandbox
) -> None:
    """`kubectl sandbox shell`: raw mode while it runs, the window size and its
    changes, Ctrl-C to the remote foreground job, the remote exit code as its
    own, and the local terminal put back afterwards, also when it is killed."""
    client.create("python", name="tty", wait=False)
    _start(live_sandbox, "tty")
    env = {**os.environ, **_explicit_env(client)}
    bash = ("--", "env", "PS1=cli> ", "bash", "--norc", "--noprofile", "-i")
    session = _Pty(env, "shell", "tty", *bash, cols=77, rows=19)
    try:
        session.expect("cli> ")
        assert session.raw()
        session.type("stty size\r")
        session.expect("19 77")
        session.resize(100, 30)
        # SIGWINCH, then a resize through the gateway: ask until it shows.
        deadline = time.monotonic() + 20
        while b"30 100" not in session.seen:
            assert time.monotonic() < deadline, session.seen[-600:]
            session.type("stty size\r")
            with contextlib.suppress(AssertionError):
                session.expect("cli> ", seconds=2)
        # "sleeping" once sh is the foreground job there (the echo shows "sle%sing").
        session.type("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 100'\r")
        session.expect("sleeping")
        session.type("\x03")  # to the sleep in the sandbox, not to us
        session.expect("cli> ")
        assert session.process.poll() is None
        session.type("exit 5\r")
        assert session.process.wait(30) == 5
        assert not session.raw(), "the local terminal is back in its own mode"
    finally:
        session.close()
    assert client.connect("tty").terminals.list() == [], "an ended terminal is removed"

    # Killed while joined: the local terminal is put back; the remote one goes on.
    session = _Pty(env, "shell", "tty", *bash, cols=80, rows=24)
    try:
        session.expect("cli> ")
        assert session.raw()
        session.process.send_signal(signal.SIGTERM)
        assert session.process.wait(30) == 128 + signal.SIGTERM
        assert not session.raw()
    finally:
        session.close()
    [left] = client.connect("tty").terminals.list()
    assert left.status == "running"
    # Attached again by id, it shows what happens from now on.
    session = _Pty(env, "shell", "tty", "--attach", left.id, cols=80, rows=24)
    try:
        wait_for(session.raw, 30, "the shell joined (the local terminal raw)")
        session.type("echo back-$((6*7))\r")
        session.expect("back-42")
        session.type("exit\r")
        assert session.process.wait(30) == 0
    finally:
        session.close()
    # Without a terminal: a command's output and exit code.
    done = _cli(env, "shell", "tty", "--", "sh", "-c", "echo piped; exit 3")
    assert (done.returncode, done.stdout.replace("\r", "")) == (3, "piped\n"), done.stderr


def test_shell_says_how_to_attach_again_when_its_connection_drops(
    client: SandboxClient, live_sandbox: LiveSandbox, gateway: GatewayProcess
) -> None:
    """The connection to the gateway dropped under `kubectl sandbox shell` (a
    relay in front of the gateway resets it): the local terminal is put back,
    the exit code is 1, the message names the `--attach` line, and that line
    joins the terminal, which went on meanwhile."""
    client.create("python", name="tty", wait=False)
    _start(live_sandbox, "tty")
    relay = TcpRelay(gateway.port)
    env = {**os.environ, **_explicit_env(client), "SANDBOX_GATEWAY_URL": relay.url}
    bash = ("--", "env", "PS1=cut> ", "bash", "--norc", "--noprofile", "-i")
    session = _Pty(env, "shell", "tty", *bash, cols=80, rows=24)
    try:
        session.expect("cut> ")
        session.type("sleep 1; echo went-on-$((6*7))\r")
        session.expect("went-on-$")  # the echo: the shell has the line
        relay.cut()
        assert session.process.wait(30) == 1
        session.expect("--attach term-")
        assert not session.raw(), "the local terminal is back in its own mode"
    finally:
        session.close()
        relay.close()
    hint = session.seen.decode(errors="replace")
    assert "connection lost" in hint, hint
    term_id = hint.split("--attach ", 1)[1].split()[0]
    [left] = client.connect("tty").terminals.list()
    assert (left.id, left.status) == (term_id, "running")
    session = _Pty(
        env | {"SANDBOX_GATEWAY_URL": gateway.url},
        "shell",
        "tty",
        "--attach",
        term_id,
        cols=80,
        rows=24,
    )
    try:
        wait_for(session.raw, 30, "the shell joined (the local terminal raw)")
        session.type("echo $((6*7))-again\r")
        session.expect("42-again")
        session.type("exit 4\r")
        assert session.process.wait(30) == 4
    finally:
        session.close()
