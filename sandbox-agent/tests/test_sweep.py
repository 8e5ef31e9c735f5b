"""Kills that reach the processes a command started outside its process group.

Every command carries SANDBOX_EXECUTION=<execution id>; a timeout, a cancel, a
KILL/TERM signal and a dropped agent connection make the runner sweep /proc for
that mark (stop, then kill, pass after pass) and report the end only once no
marked process is left. The runner here is a plain process on the test host,
not PID 1 of a container: the tests also check that nothing but the marked
processes is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PY, Sandbox, wait_until

from sandbox_agent import runner as wire

# A child in a session of its own (setsid: out of the command's process group,
# so killpg misses it) that writes its pid to FILE, then the command prints it.
ESCAPE = (
    "setsid sh -c 'echo $$ > {file}; exec sleep 300' </dev/null >/dev/null 2>&1 &\n"
    "while [ ! -s {file} ]; do sleep 0.05; done; cat {file}\n"
)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by the runner, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _session(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def _mark_of(pid: str) -> str | None:
    """SANDBOX_EXECUTION of a process, read whole (independently of the runner's reader)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"SANDBOX_EXECUTION="):
            return entry.partition(b"=")[2].decode(errors="replace")
    return None


def _marked(mark: str) -> list[int]:
    """Live processes on this host whose environment carries ``mark``."""
    return [
        int(name)
        for name in os.listdir("/proc")
        if name.isdigit() and _mark_of(name) == mark and _alive(int(name))
    ]


class Leftovers:
    """What a test must not leave running, whatever happens: its own children,
    processes carrying a mark, processes working in a private sandbox's
    directory (checked when killing: a pid alone may have been reused)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.marks: list[str] = []
        self.roots: list[Path] = []

    def _matches(self, name: str) -> bool:
        if self.marks and _mark_of(name) in self.marks:
            return True
        with contextlib.suppress(OSError):
            cwd = os.readlink(f"/proc/{name}/cwd")
            return any(
                cwd == os.path.normpath(root) or cwd.startswith(os.path.normpath(root) + "/")
                for root in self.roots
            )
        return False

    def kill(self) -> None:
        """Stop, then kill, until none is left (bounded)."""
        for p in self.procs:
            p.kill()
            p.wait()
        for _ in range(200):
            found = [
                int(n)
                for n in os.listdir("/proc")
                if n.isdigit() and int(n) != os.getpid() and self._matches(n) and _alive(int(n))
            ]
            if not found:
                return
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in found:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)


@pytest.fixture
def reap() -> Iterator[Leftovers]:
    left = Leftovers()
    yield left
    left.kill()


def _escaping(
    sb: Sandbox, reap: Leftovers, cwd: str, tail: str, **body: Any
) -> tuple[dict[str, Any], int]:
    """Start ``ESCAPE + tail`` in ``cwd`` in the background; the execution and
    the escaped pid."""
    reap.roots.append(sb.workspace / cwd)
    command = ESCAPE.format(file="escaped.pid") + tail
    ex = sb.run(expect=202, command=command, cwd=cwd, background=True, **body)
    reap.marks.append(ex["id"])
    pid = wait_until(lambda: _pid_from(sb.workspace / cwd / "escaped.pid"), 20)
    leader = wait_until(lambda: sb.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    assert _alive(pid), "the escaped child did not start"
    assert _session(pid) == pid != _session(leader), "the child did not leave the group"
    return ex, pid


def _pid_from(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return None


def _decoys(mark: str, reap: Leftovers) -> list[subprocess.Popen[bytes]]:
    """Processes that look like a command's but are not (the test's own children)."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    envs = [
        {**base, "SANDBOX_EXECUTION": mark + "0"},  # the mark is a prefix of theirs
        {**base, "XSANDBOX_EXECUTION": mark, "SANDBOX_EXECUTION_": mark},
        {**base, "NOTE": f"SANDBOX_EXECUTION={mark}"},  # in a value, not a name
    ]
    procs = [subprocess.Popen(["sleep", "300"], env=env) for env in envs]
    reap.procs.extend(procs)
    return procs


def test_every_command_carries_its_execution_id(sandbox: Sandbox) -> None:
    ex = sandbox.sh('echo "$SANDBOX_EXECUTION"', env={"SANDBOX_EXECUTION": "mine"})
    assert ex["stdout"] == ex["id"] + "\n"  # the request's env cannot replace it


def test_timeout_kills_the_children_that_left_the_group(
    sandbox: Sandbox, wsdir: str, reap: Leftovers
) -> None:
    ex, escaped = _escaping(sandbox, reap, wsdir, "sleep 300", timeoutSeconds=5)
    decoys = _decoys(ex["id"], reap)
    done = sandbox.wait_finished(ex["id"], 60)
    assert done["status"] == "timed_out" and done["error"] is None, done
    assert done["signal"] == signal.SIGKILL
    assert not _alive(escaped), "the escaped child survived the timeout"
    assert _marked(ex["id"]) == []
    assert [p.poll() for p in decoys] == [None, None, None], "a decoy was killed"


def test_cancel_kills_the_children_that_left_the_group(
    sandbox: Sandbox, wsdir: str, reap: Leftovers
) -> None:
    ex, escaped = _escaping(sandbox, reap, wsdir, "sleep 300")
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "cancelled" and body["error"] is None, body
    assert not _alive(escaped), "the escaped child survived the cancel"
    assert _marked(ex["id"]) == []


def test_term_reaches_them_and_the_end_takes_the_rest_along(
    sandbox: Sandbox, wsdir: str, reap: Leftovers
) -> None:
    """A graceful cancel: TERM goes to the escaped processes too; those still
    alive when the command's own process has exited (this one ignores TERM) are
    killed with it, as when the PID 1 of a container exits."""
    ex = sandbox.run(
        expect=202,
        command='setsid sh -c \'trap "" TERM; echo $$ > ignores.pid; '
        "while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &\n"
        'setsid sh -c \'trap "echo got-term > polite.out; exit 0" TERM; echo $$ > polite.pid; '
        "sleep 300 & wait' </dev/null >/dev/null 2>&1 &\n"
        # The command's own process ends once the polite one has answered TERM
        # (both get it at once; on a loaded machine the polite one's trap could
        # otherwise still be on its way when the end takes it along).
        "trap 'n=0; while [ ! -s polite.out ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1));"
        " done; exit 0' TERM\n"
        "while [ ! -s ignores.pid ] || [ ! -s polite.pid ]; do sleep 0.05; done\n"
        "echo ready; sleep 300 & wait",
        cwd=wsdir,
        background=True,
    )
    reap.roots.append(sandbox.workspace / wsdir)
    reap.marks.append(ex["id"])
    ignores = wait_until(lambda: _pid_from(sandbox.workspace / wsdir / "ignores.pid"))
    wait_until(lambda: sandbox.client.get(f"/v1/executions/{ex['id']}").json()["stdoutBytes"])
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={"graceSeconds": 60})
    body = r.json()
    assert body["status"] == "cancelled" and body["exitCode"] == 0 and body["error"] is None, body
    assert not _alive(ignores)
    assert _marked(ex["id"]) == []
    assert (sandbox.workspace / wsdir / "polite.out").read_text() == "got-term\n"


def test_a_normal_end_leaves_what_the_command_started_on_purpose(
    sandbox: Sandbox, wsdir: str, reap: Leftovers
) -> None:
    reap.roots.append(sandbox.workspace / wsdir)
    ex = sandbox.sh(
        "setsid nohup sh -c 'echo $$ > server.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &\n"
        "while [ ! -s server.pid ]; do sleep 0.05; done",
        cwd=wsdir,
    )
    reap.marks.append(ex["id"])
    assert ex["status"] == "completed" and ex["exitCode"] == 0, ex
    server = int((sandbox.workspace / wsdir / "server.pid").read_text())
    # Another command's kill and sweep leave it alone too.
    assert sandbox.sh("sleep 300", timeoutSeconds=0.5)["status"] == "timed_out"
    assert _alive(server) and _marked(ex["id"]) == [server]


def test_a_forking_tree_that_keeps_escaping_is_killed_whole(
    fresh: Callable[..., Sandbox], world_tmp: Path, reap: Leftovers
) -> None:
    """63 shells, each in a new session, the 32 leaves respawning a setsid child
    whenever it dies: 95 processes. The runner runs as nobody here, as it does in
    a pod (RLIMIT_NPROC binds then, unlike for root: `ulimit -u` caps the tree),
    and it cannot read other users' environments (they are skipped)."""
    sb = fresh(runner=False, root=world_tmp)
    reap.roots.append(sb.root)
    os.chmod(sb.root, 0o755)
    sb.start_runner(user=65534)
    sb.write(
        "tree.sh",
        b"""# $1: levels below this one
if [ "$1" -gt 0 ]; then
  setsid sh tree.sh $(($1 - 1)) </dev/null >/dev/null 2>&1 &
  setsid sh tree.sh $(($1 - 1)) </dev/null >/dev/null 2>&1 &
  echo $$ >> tree.pids
  exec sleep 300
fi
echo $$ >> tree.pids
while :; do setsid sleep 300 </dev/null >/dev/null 2>&1; done
""",
    )
    ex = sb.run(expect=202, command="ulimit -u 512; sh tree.sh 5 & sleep 300", background=True)
    pids_file = sb.workspace / "tree.pids"
    wait_until(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 63, 60)
    pids = [int(p) for p in pids_file.read_text().split()]
    # 31 inner nodes (now sleeps), 32 leaves and their children, the command's 2
    count = wait_until(lambda: (n := len(_marked(ex["id"]))) >= 97 and n, 30)
    assert count <= 200, count
    r = sb.client.post(f"/v1/executions/{ex['id']}/cancel", json={})
    body = r.json()
    assert body["status"] == "cancelled" and body["error"] is None, body
    assert _marked(ex["id"]) == []
    assert not [p for p in pids if _alive(p)]
    print(f"swept a tree of {count} processes")


def test_a_dropped_connection_takes_its_escaped_processes_along(
    fresh: Callable[..., Sandbox], reap: Leftovers
) -> None:
    sb = fresh()
    ex, escaped = _escaping(sb, reap, ".", "sleep 300")
    assert sb.agent is not None
    sb.agent.kill()  # the runner sees the connection close: nobody can watch these now
    sb.agent.wait(10)
    wait_until(lambda: not _alive(escaped), 10)
    assert _marked(ex["id"]) == []


# -- a process that does not die when killed --------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_O_TRACEEXIT = 0x40
WALL = 0x40000000


def test_processes_the_sweep_cannot_end_lead_to_a_runtime_restart(
    fresh: Callable[..., Sandbox], reap: Leftovers
) -> None:
    """A process that does not die on SIGKILL: we (root) trace the escaped child
    with PTRACE_O_TRACEEXIT, so a SIGKILL leaves it stopped at its exit, alive
    with its environment, until we let go (what a process in uninterruptible
    sleep looks like to the runner). The runner sweeps for half the kill grace,
    reports the survivor, and the agent asks for the runtime to be restarted."""
    sb = fresh(kill_grace=4, runner_stall_seconds=0)
    ex, escaped = _escaping(sb, reap, ".", "sleep 300")
    if _libc.ptrace(PTRACE_SEIZE, escaped, None, PTRACE_O_TRACEEXIT) != 0:
        raise OSError(ctypes.get_errno(), "PTRACE_SEIZE (the test needs root)")
    try:
        r = sb.client.post(f"/v1/executions/{ex['id']}/cancel", json={})
        body = r.json()
        assert body["status"] == "cancelled", body
        assert body["error"]["code"] == "kill_incomplete", body
        assert body["error"]["message"].startswith("1 process(es) of the command were still")
        assert _alive(escaped) and _marked(ex["id"]) == [escaped]  # held at its exit
        live = sb.anon.get("/livez/runtime")
        assert live.status_code == 503 and live.json()["reason"] == "kill_not_confirmed"
        assert live.json()["executions"] == [ex["id"]]
        r = sb.client.post("/v1/executions", json={"command": "true"})
        assert sb.error(r, 503) == "runtime_restarting"
    finally:
        # Let go (killed first, should the test have failed before the cancel).
        with contextlib.suppress(ProcessLookupError):
            os.kill(escaped, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, AssertionError):
            wait_until(lambda: os.waitpid(escaped, WALL | os.WNOHANG)[0], 10)  # its exit stop
        _libc.ptrace(PTRACE_DETACH, escaped, None, None)
    wait_until(lambda: not _alive(escaped), 10)
    # What the kubelet does then: a new runtime, and the request is withdrawn.
    sb.kill_runner(signal.SIGKILL)
    sb.start_runner()
    assert sb.anon.get("/livez/runtime").json() == {"status": "ok"}
    assert sb.sh("echo fine")["stdout"] == "fine\n"


# -- reading /proc ------------------------------------------------------------


def test_environ_reading_is_bounded_and_byte_exact(reap: Leftovers) -> None:
    """The mark after 200 KiB of other variables (one not UTF-8) is found; after
    300 KiB it is not (read cost is bounded); gone and zombie processes read as
    unmarked."""
    mark = "ex-" + os.urandom(8).hex()

    def start(padding: int) -> subprocess.Popen[bytes]:
        # (one string may be 128 KiB at most: several variables)
        env = {b"JUNK%d" % i: b"\xff\xfe" * (16 << 10) for i in range(padding // (32 << 10))}
        env[b"SANDBOX_EXECUTION"] = mark.encode()
        p = subprocess.Popen(["sleep", "300"], env=env)
        reap.procs.append(p)
        return p

    near, far = start(200 << 10), start(300 << 10)
    assert wire._environ_mark(str(near.pid)) == mark.encode()
    assert wire._environ_mark(str(far.pid)) is None
    near.kill()
    wait_until(lambda: not _alive(near.pid))  # a zombie: no environment left
    assert wire._environ_mark(str(near.pid)) is None
    near.wait()
    assert wire._environ_mark(str(near.pid)) is None  # gone


def _in_own_pid_namespace(sb: Sandbox) -> subprocess.Popen[bytes]:
    """The runner as PID 1 of a PID namespace of its own, as in the sandbox container."""
    out = open(sb.root / "runner.log", "ab")  # noqa: SIM115 - lives as long as the process
    p = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            PY,
            str(sb.runtime / "runner.py"),
        ],
        cwd=sb.workspace,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    sb.runners.append(p)
    wait_until(lambda: sb.anon.get("/readyz").status_code == 200, 15.0)
    return p


# Sheds its mark (env -i) and its process group (setsid), and writes its pid
# as the namespace sees it; its argv is unique so the host can find it.
UNMARKED = "env -i /bin/sh -c 'setsid sleep {n} </dev/null >/dev/null 2>&1 &' \nsleep 0.3\n"


def _host_pids(argv: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").strip() == (
                    argv.encode()
                ):
                    pids.append(int(name))
    return pids


def test_as_pid_1_processes_that_shed_the_mark_are_killed_too(
    fresh: Callable[..., Sandbox], reap: Leftovers
) -> None:
    """A timeout and a cancel reach a daemon that removed the mark from its
    environment, by its start time; a daemon an earlier command left behind
    on purpose (also unmarked) is not touched."""
    sb = fresh(runner=False)
    reap.roots.append(sb.workspace)
    _in_own_pid_namespace(sb)
    n = 4000 + os.getpid() % 1000
    kept = sb.sh(UNMARKED.format(n=n))  # ends normally: its daemon stays
    assert kept["status"] == "completed", kept
    keeper = _host_pids(f"sleep {n}")
    assert len(keeper) == 1
    timed = sb.sh(UNMARKED.format(n=n + 1) + "sleep 300\n", timeoutSeconds=2)
    assert timed["status"] == "timed_out", timed
    assert _host_pids(f"sleep {n + 1}") == [], "an unmarked daemon survived the timeout"
    ex = sb.run(expect=202, command=UNMARKED.format(n=n + 2) + "sleep 300\n", background=True)
    wait_until(lambda: _host_pids(f"sleep {n + 2}"), 10)
    r = sb.client.post(f"/v1/executions/{ex['id']}/cancel", json={})
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert _host_pids(f"sleep {n + 2}") == [], "an unmarked daemon survived the cancel"
    assert _host_pids(f"sleep {n}") == keeper, "the earlier command's daemon was killed"
    for pid in keeper:
        os.kill(pid, signal.SIGKILL)
