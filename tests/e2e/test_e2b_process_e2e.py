"""E2B's commands and terminals (`process.Process`) through the gateway's E2B
adapter, driven by the unchanged `e2b` Python SDK.

Fixture `e2b_sandbox` (tests/e2e/conftest.py): an `e2b.Sandbox` of the `base`
template made through the chart's gateway, shared by the module (each test
ends the processes it starts); the test that kills a sandbox makes its own. The sandbox's home
directory is its workspace; the tests learn its path from `pwd`. They need
`bash`, `cat`, `sleep` and `tput` in the sandbox's image.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import pytest
from e2b import (
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
    TimeoutException,
)
from e2b.envd.process import process_pb
from e2b.sandbox.commands.command_handle import PtySize
from protobuf import Oneof


def home(sandbox: Sandbox) -> str:
    return sandbox.commands.run("pwd").stdout.strip()


def alive(sandbox: Sandbox, pid: int) -> bool:
    return sandbox.commands.run(f"kill -0 {pid} 2>/dev/null && echo yes || echo no").stdout == (
        "yes\n"
    )


def test_run_returns_output_and_exit_code(e2b_sandbox: Sandbox) -> None:
    result = e2b_sandbox.commands.run('echo "Hello, World!"; echo oops >&2')
    assert (result.stdout, result.stderr, result.exit_code) == ("Hello, World!\n", "oops\n", 0)
    assert result.error is None


def test_non_zero_exit_raises_with_the_output(e2b_sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as caught:
        e2b_sandbox.commands.run("echo out; echo err >&2; exit 3")
    assert caught.value.exit_code == 3
    assert caught.value.stdout == "out\n"
    assert caught.value.stderr == "err\n"
    assert caught.value.error == "exit status 3"


def test_callbacks_stream_while_the_command_runs(e2b_sandbox: Sandbox) -> None:
    seen: list[tuple[str, str, float]] = []
    e2b_sandbox.commands.run(
        "echo first; sleep 1.5; echo second >&2",
        on_stdout=lambda s: seen.append(("out", s, time.monotonic())),
        on_stderr=lambda s: seen.append(("err", s, time.monotonic())),
    )
    assert [(kind, text) for kind, text, _ in seen] == [("out", "first\n"), ("err", "second\n")]
    assert seen[1][2] - seen[0][2] > 1.0  # the first line came before the command ended


def test_output_bytes_that_are_not_utf8(e2b_sandbox: Sandbox) -> None:
    result = e2b_sandbox.commands.run('printf "' + "a" * 8191 + '\\xe2"')
    assert result.stdout == "a" * 8191 + "\ufffd"


def test_large_output(e2b_sandbox: Sandbox) -> None:
    chunks: list[str] = []
    result = e2b_sandbox.commands.run(
        "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo end >&2", on_stdout=chunks.append
    )
    assert result.stdout == "a" * 3_000_000 + "\n"
    assert len(chunks) > 1
    assert result.stderr == "end\n"


def test_background_connect_and_wait(e2b_sandbox: Sandbox) -> None:
    handle = e2b_sandbox.commands.run("sleep 1; echo done", background=True)
    attached = e2b_sandbox.commands.connect(handle.pid)
    assert attached.pid == handle.pid
    result = attached.wait()
    assert (result.stdout, result.exit_code) == ("done\n", 0)
    # The handle that started it sees the same end.
    assert handle.wait().stdout == "done\n"
    # A process that ended is still told by its pid: its start and its end.
    assert e2b_sandbox.commands.connect(handle.pid).wait().exit_code == 0


def test_list_shows_running_commands(e2b_sandbox: Sandbox) -> None:
    first = e2b_sandbox.commands.run("sleep 30", background=True)
    second = e2b_sandbox.commands.run("sleep 31", background=True, cwd="/tmp")
    processes = {p.pid: p for p in e2b_sandbox.commands.list()}
    assert {first.pid, second.pid} <= set(processes)
    one, two = processes[first.pid], processes[second.pid]
    assert (one.cmd, one.args, one.cwd) == (
        "/bin/bash",
        ["-l", "-c", "sleep 30"],
        home(e2b_sandbox),
    )
    assert (two.cmd, two.args, two.cwd) == ("/bin/bash", ["-l", "-c", "sleep 31"], "/tmp")
    assert one.tag is None
    for handle in (first, second):
        handle.kill()


def test_kill(e2b_sandbox: Sandbox) -> None:
    handle = e2b_sandbox.commands.run("sleep 30", background=True)
    assert alive(e2b_sandbox, handle.pid)
    assert e2b_sandbox.commands.kill(handle.pid)
    with pytest.raises(CommandExitException):
        e2b_sandbox.commands.run(f"kill -0 {handle.pid}")
    with pytest.raises(CommandExitException) as caught:
        handle.wait()
    assert (caught.value.exit_code, caught.value.error) == (-1, "signal: killed")
    assert handle.pid not in {p.pid for p in e2b_sandbox.commands.list()}


def test_unknown_pids(e2b_sandbox: Sandbox) -> None:
    assert not e2b_sandbox.commands.kill(999999)
    assert not e2b_sandbox.pty.kill(999999)
    with pytest.raises(NotFoundException):
        e2b_sandbox.commands.connect(999999)
    with pytest.raises(NotFoundException):
        e2b_sandbox.commands.send_stdin(999999, "x")


def test_stdin(e2b_sandbox: Sandbox) -> None:
    handle = e2b_sandbox.commands.run("cat", background=True, stdin=True)
    e2b_sandbox.commands.send_stdin(handle.pid, "Hello,\n")
    handle.send_stdin(b"World!")
    handle.close_stdin()
    assert handle.wait().stdout == "Hello,\nWorld!"
    streamed = e2b_sandbox.commands.run("cat", background=True, stdin=True)
    e2b_sandbox.commands.stream_input(streamed.pid, ["a", b"b", "c"])
    streamed.close_stdin()
    assert streamed.wait().stdout == "abc"


def test_stdin_is_closed_unless_asked_for(e2b_sandbox: Sandbox) -> None:
    assert e2b_sandbox.commands.run("cat").stdout == ""
    handle = e2b_sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(SandboxException):
        e2b_sandbox.commands.send_stdin(handle.pid, "x")
    handle.kill()


def test_cwd_and_envs(e2b_sandbox: Sandbox) -> None:
    root = home(e2b_sandbox)
    e2b_sandbox.commands.run("mkdir -p sub/deeper")
    for cwd, expected in [
        ("sub", f"{root}/sub"),
        (f"{root}/sub/deeper", f"{root}/sub/deeper"),
        ("~/sub", f"{root}/sub"),
        ("sub/../sub/deeper/..", f"{root}/sub"),
        ("/", "/"),
        ("/tmp", "/tmp"),
    ]:
        assert e2b_sandbox.commands.run("pwd", cwd=cwd).stdout == f"{expected}\n", cwd
    result = e2b_sandbox.commands.run("echo $FOO-$BAR", envs={"FOO": "foo", "BAR": "b a r"})
    assert result.stdout == "foo-b a r\n"
    # Scoped to that command.
    assert e2b_sandbox.commands.run("echo ${FOO:-unset}").stdout == "unset\n"
    with pytest.raises(InvalidArgumentException):
        e2b_sandbox.commands.run("pwd", cwd="no/such/dir")


def test_timeout_ends_the_command(e2b_sandbox: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        e2b_sandbox.commands.run("sleep 10", timeout=2)
    handle = e2b_sandbox.commands.run("sleep 10", timeout=2, background=True)
    with pytest.raises(TimeoutException):
        for _ in handle:
            pass
    time.sleep(1)
    assert not alive(e2b_sandbox, handle.pid)
    # timeout=0: no limit (the agent's longest timeout).
    assert e2b_sandbox.commands.run("sleep 0.2; echo ok", timeout=0).stdout == "ok\n"


def test_root_is_refused_and_user_is_the_default(e2b_sandbox: Sandbox) -> None:
    assert e2b_sandbox.commands.run("id -u", user="user").stdout == (
        e2b_sandbox.commands.run("id -u").stdout
    )
    with pytest.raises(SandboxException, match="root is not available"):
        e2b_sandbox.commands.run("id", user="root")


def test_tags(e2b_sandbox: Sandbox) -> None:
    rpc: Any = e2b_sandbox.commands._rpc
    events = rpc.start(
        process_pb.StartRequest(
            process=process_pb.ProcessConfig(cmd="/bin/sleep", args=["30"], cwd="/tmp"),
            tag="my-server",
            stdin=False,
        ),
        timeout_ms=60_000,
    )
    pid = next(events).event.event.value.pid
    try:
        listed = {p.pid: p for p in e2b_sandbox.commands.list()}
        assert (listed[pid].tag, listed[pid].cmd, listed[pid].args, listed[pid].cwd) == (
            "my-server",
            "/bin/sleep",
            ["30"],
            "/tmp",
        )
        by_tag = rpc.connect(
            process_pb.ConnectRequest(
                process=process_pb.ProcessSelector(
                    selector=Oneof[Literal["tag"], str]("tag", "my-server")
                )
            ),
            timeout_ms=10_000,
        )
        assert next(by_tag).event.event.value.pid == pid
        by_tag.close()
    finally:
        e2b_sandbox.commands.kill(pid)
        events.close()


def test_pty(e2b_sandbox: Sandbox) -> None:
    out: list[bytes] = []
    terminal = e2b_sandbox.pty.create(PtySize(cols=80, rows=24), envs={"ABC": "123"}, cwd="/")
    e2b_sandbox.pty.send_stdin(terminal.pid, b"echo $ABC; pwd; echo $(tput cols)x\n")
    for _, _, chunk in terminal:
        out.append(chunk or b"")
        if b"80x" in b"".join(out):
            break
    e2b_sandbox.pty.resize(terminal.pid, PtySize(cols=100, rows=30))
    e2b_sandbox.pty.stream_input(terminal.pid, [b"stty size", "; exit\n"])
    result = terminal.wait(on_pty=out.append)
    text = b"".join(out).decode()
    assert result.exit_code == 0
    for expected in ("123", "\n/\r", "80x", "30 100"):
        assert expected in text, text


def test_pty_reconnect_and_kill(e2b_sandbox: Sandbox) -> None:
    terminal = e2b_sandbox.pty.create(PtySize(80, 24), envs={"FOO": "bar"})
    assert terminal.pid in {p.pid for p in e2b_sandbox.commands.list()}
    terminal.disconnect()
    again = e2b_sandbox.pty.connect(terminal.pid)
    assert again.pid == terminal.pid
    out: list[bytes] = []
    e2b_sandbox.pty.send_stdin(terminal.pid, b"echo $FOO\n")
    deadline = time.monotonic() + 10
    for _, _, chunk in again:
        out.append(chunk or b"")
        if b"bar" in b"".join(out) or time.monotonic() > deadline:
            break
    assert b"bar" in b"".join(out)
    assert e2b_sandbox.pty.kill(terminal.pid)
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert caught.value.exit_code == -1
    assert not alive(e2b_sandbox, terminal.pid)
    with pytest.raises(SandboxException):
        e2b_sandbox.pty.resize(terminal.pid, PtySize(90, 24))


def test_pty_timeout_ends_it(e2b_sandbox: Sandbox) -> None:
    terminal = e2b_sandbox.pty.create(PtySize(24, 80), timeout=2)
    with pytest.raises(TimeoutException):
        terminal.wait()
    time.sleep(1)
    assert not alive(e2b_sandbox, terminal.pid)


def test_pty_and_command_inputs_do_not_mix(e2b_sandbox: Sandbox) -> None:
    terminal = e2b_sandbox.pty.create(PtySize(80, 24))
    command = e2b_sandbox.commands.run("sleep 30", background=True, stdin=True)
    try:
        with pytest.raises(SandboxException):
            e2b_sandbox.commands.send_stdin(terminal.pid, "x")
        with pytest.raises(SandboxException):
            e2b_sandbox.pty.send_stdin(command.pid, b"x")
        with pytest.raises(SandboxException):
            e2b_sandbox.pty.resize(command.pid, PtySize(90, 24))
    finally:
        e2b_sandbox.pty.kill(terminal.pid)
        command.kill()


def test_sandbox_killed_during_a_command(e2b_opts: dict[str, Any]) -> None:
    # A sandbox of its own: the module's shared one lives on.
    doomed = Sandbox.create("base", timeout=300, **e2b_opts)
    handle = doomed.commands.run("sleep 60", background=True)
    doomed.kill()
    with pytest.raises(TimeoutException, match="sandbox was killed or reached its end of life"):
        handle.wait()
    assert not doomed.is_running()
