"""The E2B process service's pure parts: its messages checked (a hostile caller
gets invalid_argument, never a crash), the working directory and the launcher
that carries what the agent does not record, E2B's end events, and the
Connect codec's bounds."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import signal
import subprocess
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sandbox_operator.gateway.e2b import connect
from sandbox_operator.gateway.e2b import process_wire as wire
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.process_stream import Lines, give_back

WS = "/home/user"


def code_of(fn: Any, *args: Any) -> str:
    with pytest.raises(ConnectError) as caught:
        fn(*args)
    return caught.value.code


# -- StartRequest ----------------------------------------------------------------------


def test_start_as_the_sdks_send_it() -> None:
    spec = wire.parse_start(
        {
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": False,
        }
    )
    assert spec == wire.StartSpec(
        "/bin/bash", ["-l", "-c", "echo hi"], {"A": "1"}, None, None, None, False
    )
    # Older SDKs send no stdin field: the daemon keeps stdin open then.
    assert wire.parse_start({"process": {"cmd": "cat"}}).stdin is True
    pty = wire.parse_start(
        {
            "process": {"cmd": "/bin/bash", "args": ["-i", "-l"]},
            "pty": {"size": {"cols": 80, "rows": "24"}},
        }
    )
    assert (pty.pty, pty.stdin) == (wire.Pty(80, 24), False)
    assert wire.parse_start({"process": {"cmd": "x"}, "tag": ""}).tag is None
    assert wire.parse_start({"process": {"cmd": "x"}, "tag": "web"}).tag == "web"


@pytest.mark.parametrize(
    "msg",
    [
        {},
        {"process": "ls"},
        {"process": {"cmd": ""}},
        {"process": {"cmd": 1}},
        {"process": {"cmd": "a\0b"}},
        {"process": {"cmd": "ls", "args": "-l"}},
        {"process": {"cmd": "ls", "args": [1]}},
        {"process": {"cmd": "ls", "args": ["x"] * (wire.MAX_ARGS + 1)}},
        {"process": {"cmd": "ls", "envs": ["A=1"]}},
        {"process": {"cmd": "ls", "envs": {"A=B": "1"}}},
        {"process": {"cmd": "ls", "envs": {"": "1"}}},
        {"process": {"cmd": "ls", "envs": {"A": 1}}},
        {"process": {"cmd": "ls", "cwd": 5}},
        {"process": {"cmd": "ls"}, "stdin": "yes"},
        {"process": {"cmd": "ls"}, "tag": 3},
        {"process": {"cmd": "ls"}, "tag": "t" * (wire.MAX_TAG_CHARS + 1)},
        {"process": {"cmd": "ls"}, "pty": {"size": {"cols": 0, "rows": 24}}},
        {"process": {"cmd": "ls"}, "pty": {"size": {"cols": 80, "rows": 1001}}},
        {"process": {"cmd": "ls"}, "pty": {"size": {"cols": -1, "rows": 24}}},
        {"process": {"cmd": "ls"}, "pty": {"size": {"cols": True, "rows": 24}}},
        {"process": {"cmd": "ls"}, "pty": []},
        {
            "process": {"cmd": "x" * (wire.MAX_PTY_ARG_CHARS + 1)},
            "pty": {"size": {"cols": 1, "rows": 1}},
        },
    ],
)
def test_bad_start_requests(msg: dict[str, Any]) -> None:
    assert code_of(wire.parse_start, msg) == "invalid_argument"


# -- selectors, input, signals, users ----------------------------------------------------


def test_selectors() -> None:
    assert wire.parse_selector({"process": {"pid": 42}}) == wire.Selector(pid=42)
    assert wire.parse_selector({"process": {"pid": "4294967295"}}) == wire.Selector(
        pid=(1 << 32) - 1
    )
    assert wire.parse_selector({"process": {"tag": "web"}}) == wire.Selector(tag="web")
    assert str(wire.Selector(pid=7)) == "pid 7"
    bad: Any
    for bad in (
        {},
        {"process": {}},
        {"process": {"pid": 1, "tag": "x"}},
        {"process": {"pid": -1}},
        {"process": {"pid": 1 << 32}},
        {"process": {"pid": "12a"}},
        {"process": {"pid": 1.5}},
        {"process": {"pid": False}},
        {"process": {"tag": ["x"]}},
        {"process": 3},
    ):
        assert code_of(wire.parse_selector, bad) == "invalid_argument", bad


def test_input_bytes_in_either_base64_alphabet() -> None:
    assert wire.parse_input({"stdin": "aGk="}) == ("stdin", b"hi")
    assert wire.parse_input({"pty": "aGk"}) == ("pty", b"hi")
    assert wire.parse_input({"stdin": "_-8="}) == ("stdin", b"\xff\xef")
    assert wire.parse_input({"stdin": "/+8"}) == ("stdin", b"\xff\xef")
    assert wire.parse_input({"stdin": ""}) == ("stdin", b"")
    for bad in (
        None,
        {},
        {"stdin": "aGk=", "pty": "aGk="},
        {"stdin": "a b"},
        {"stdin": 5},
        {"pty": "a"},
    ):
        assert code_of(wire.parse_input, bad) == "invalid_argument", bad


def test_signals() -> None:
    assert wire.parse_signal("SIGNAL_SIGKILL") == "KILL"
    assert wire.parse_signal(9) == "KILL"
    assert wire.parse_signal("15") == "TERM"
    assert code_of(wire.parse_signal, "SIGNAL_UNSPECIFIED") == "unimplemented"
    assert code_of(wire.parse_signal, 2) == "unimplemented"
    # Not a name of the enum at all: the message does not decode.
    for name in ("SIGSTOP", "SIGNAL_SIGSTOP", "sigkill", "²", ""):
        assert code_of(wire.parse_signal, name) == "invalid_argument", name
    assert code_of(wire.parse_signal, None) == "invalid_argument"
    assert code_of(wire.parse_signal, True) == "invalid_argument"


def basic(text: str) -> str:
    import base64

    return "Basic " + base64.b64encode(text.encode()).decode()


def test_users() -> None:
    wire.check_user(None)
    wire.check_user(basic("user:"))
    wire.check_user("Bearer something")  # not a user at all
    assert code_of(wire.check_user, basic("root:")) == "permission_denied"
    with pytest.raises(ConnectError, match="root is not available"):
        wire.check_user(basic("root:"))
    assert code_of(wire.check_user, basic("alice:")) == "unauthenticated"
    assert code_of(wire.check_user, "Basic !!!") == "unauthenticated"
    assert wire.user_of(basic(":")) is None


# -- the working directory and the launcher ----------------------------------------------


@pytest.mark.parametrize(
    ("cwd", "expected"),
    [
        (None, (".", None)),
        ("", (".", None)),
        ("~", (".", None)),
        ("~/", (".", None)),
        ("~/src/app", ("src/app", None)),
        ("src", ("src", None)),
        ("./src/../lib/", ("lib", None)),
        (WS, (".", None)),
        (f"{WS}/src", ("src", None)),
        (f"{WS}//src/.", ("src", None)),
        (f"{WS}/../user/src", ("src", None)),
        ("..", (".", "/home")),
        ("../../..", (".", "/")),
        ("/", (".", "/")),
        ("//tmp", (".", "/tmp")),
        ("/tmp/x", (".", "/tmp/x")),
        (f"{WS}x", (".", f"{WS}x")),
    ],
)
def test_cwd(cwd: str | None, expected: tuple[str, str | None]) -> None:
    assert wire.resolve_cwd(cwd, WS) == expected


def test_cwd_refused() -> None:
    assert code_of(wire.resolve_cwd, "~alice/x", WS) == "invalid_argument"
    assert code_of(wire.resolve_cwd, "/" + "d" * wire.MAX_CWD_CHARS, WS) == "invalid_argument"
    # A workspace at the root holds every directory.
    assert wire.resolve_cwd("/tmp", "/") == ("tmp", None)


def test_the_launcher_carries_cwd_and_tag_and_only_when_needed() -> None:
    argv = ["/bin/bash", "-l", "-c", "echo hi"]
    assert wire.launch(argv, None, None) == argv
    assert wire.unwrap(argv) == (argv, None, None)
    for outside, tag in (("/tmp", None), (None, "web"), ("/", "t")):
        launched = wire.launch(argv, outside, tag)
        assert launched[: len(wire.LAUNCHER_HEAD)] == wire.LAUNCHER_HEAD
        assert wire.unwrap(launched) == (argv, outside, tag)
    # An argv that only looks like the launcher's head is taken as it is.
    assert wire.unwrap([*wire.LAUNCHER_HEAD, "/tmp"]) == ([*wire.LAUNCHER_HEAD, "/tmp"], None, None)


def test_the_launcher_runs(tmp_path: Any) -> None:
    launched = wire.launch(["sh", "-c", 'echo "$PWD $$ $#"', "x", "a", "b"], str(tmp_path), "t")
    done = subprocess.run(launched, capture_output=True, text=True, check=True)
    assert done.stdout.split()[0] == str(tmp_path)
    assert done.stdout.split()[2] == "2"
    missing = subprocess.run(
        wire.launch(["true"], str(tmp_path / "nope"), None), capture_output=True, text=True
    )
    assert missing.returncode == 1
    assert "nope" in missing.stderr


# -- events --------------------------------------------------------------------------------


def test_end_events_as_e2bs_daemon_reports_them() -> None:
    assert wire.end_event(0, None) == {
        "event": {"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}
    }
    assert wire.end_event(3, None)["event"]["end"]["error"] == "exit status 3"
    killed = wire.end_event(None, signal.SIGKILL)["event"]["end"]
    assert killed == {
        "exitCode": -1,
        "exited": False,
        "status": "signal: killed",
        "error": "signal: killed",
    }
    assert wire.signal_name(signal.SIGTERM) == "terminated"
    assert wire.signal_name(signal.SIGSEGV) == "segmentation fault"
    assert wire.signal_name(200) == "signal 200"
    assert wire.start_event(7) == {"event": {"start": {"pid": 7}}}
    assert wire.data_event("stdout", "aGk=") == {"event": {"data": {"stdout": "aGk="}}}


def test_execution_ends() -> None:
    def end(record: dict[str, Any], own: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = wire.execution_end(record, own_deadline=own)["event"]["end"]
        return out

    assert end({"status": "completed", "exitCode": 2})["exitCode"] == 2
    assert end({"status": "completed", "signal": 9})["status"] == "signal: killed"
    assert end({"status": "cancelled"})["status"] == "signal: killed"
    assert end({"status": "timed_out"}, own=False)["status"] == "signal: killed"
    with pytest.raises(ConnectError) as caught:
        end({"status": "timed_out"})
    assert caught.value.code == "deadline_exceeded"
    with pytest.raises(ConnectError) as caught:
        end({"status": "failed", "error": {"code": "spawn_failed", "message": "No such file"}})
    assert caught.value.code == "invalid_argument"
    assert "No such file" in caught.value.message
    lost = end({"status": "lost", "error": {"code": "runner_lost", "message": "gone"}})
    assert (lost["exitCode"], lost["error"]) == (-1, "runner_lost: gone")


def test_terminal_ends_and_shutdown_signs() -> None:
    assert wire.terminal_end({"status": "exited", "exitCode": 0})["event"]["end"]["exitCode"] == 0
    assert wire.terminal_end({"status": "exited", "signal": 1})["event"]["end"]["status"] == (
        "signal: hangup"
    )
    assert (
        "idle" in wire.terminal_end({"status": "lost", "message": "idle"})["event"]["end"]["error"]
    )
    assert wire.may_be_shutdown({"status": "completed", "signal": 15})
    assert wire.may_be_shutdown({"status": "lost"})
    assert wire.may_be_shutdown({"status": "completed", "signal": 9, "oomKilled": True})
    assert not wire.may_be_shutdown({"status": "completed", "signal": 9, "oomKilled": False})
    assert not wire.may_be_shutdown({"status": "completed", "exitCode": 1})


def test_process_info_and_records() -> None:
    plain = wire.proc_of(
        "execution",
        {
            "id": "ex-1",
            "pid": 12,
            "status": "running",
            "argv": ["/bin/bash", "-l", "-c", "x"],
            "cwd": "src",
        },
    )
    assert plain is not None
    assert plain.running
    assert not plain.pty
    assert plain.tag is None
    assert wire.process_info(plain.argv, plain.cwd, plain.pid, WS) == {
        "config": {"cmd": "/bin/bash", "args": ["-l", "-c", "x"], "envs": {}, "cwd": f"{WS}/src"},
        "pid": 12,
    }
    launched = wire.launch(["/bin/sleep", "9"], "/tmp", "web")
    term = wire.proc_of(
        "terminal", {"id": "term-1", "pid": 13, "status": "exited", "argv": launched}
    )
    assert term is not None
    assert term.pty
    assert not term.running
    assert term.tag == "web"
    assert wire.process_info(term.argv, term.cwd, term.pid, WS) == {
        "config": {"cmd": "/bin/sleep", "args": ["9"], "envs": {}, "cwd": "/tmp"},
        "pid": 13,
        "tag": "web",
    }
    shell = wire.proc_of("terminal", {"id": "t", "pid": 5, "status": "running", "command": "top"})
    assert shell is not None
    assert shell.argv == ["/bin/sh", "-c", "top"]
    assert shell.cwd == "."
    bad: Any
    for bad in (
        None,
        [],
        {"id": "x"},
        {"id": "x", "pid": None},
        {"id": 1, "pid": 2},
        {"id": "x", "pid": True},
    ):
        assert wire.proc_of("execution", bad) is None


def test_agent_errors() -> None:
    error = wire.agent_error(
        400, {"error": {"code": "timeout_too_large", "message": "m", "details": {"maximum": 3600}}}
    )
    assert (error.code, error.agent_code, error.details) == (
        "invalid_argument",
        "timeout_too_large",
        {"maximum": 3600},
    )
    assert (
        wire.agent_error(409, {"error": {"code": "not_running", "message": "m"}}).code
        == "not_found"
    )
    assert wire.agent_error(409, {"error": {"code": "stdin_closed"}}).code == "failed_precondition"
    assert wire.agent_error(429, None).code == "resource_exhausted"
    assert wire.agent_error(503, "<html>").code == "unavailable"
    assert wire.agent_error(500, None).code == "internal"


# -- the codec -----------------------------------------------------------------------------


def test_gzip_is_bounded() -> None:
    assert connect._gunzip(gzip.compress(b'{"a": 1}')) == b'{"a": 1}'
    bomb = gzip.compress(b"\0" * (connect.MAX_MESSAGE + 1))
    assert code_of(connect._gunzip, bomb) == "resource_exhausted"
    assert code_of(connect._gunzip, b"not gzip") == "invalid_argument"
    assert code_of(connect._gunzip, gzip.compress(b"x" * 1000)[:20]) == "invalid_argument"


# -- the agent's connection ------------------------------------------------------------


def test_a_commands_stream_read_to_its_end_gives_the_connection_back() -> None:
    """After a command's last event the rest of the agent's stream is read, so the
    next command reuses the connection; a stream left before its end is closed."""
    peers: list[int] = []  # the client's port of each request

    async def stream(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"type": "started"}\n{"type": "finished"}\n')
        await asyncio.sleep(0.05)  # the end of the body comes on its own
        with contextlib.suppress(ConnectionResetError):  # the client left before it
            await response.write_eof()
        return response

    async def command(session: aiohttp.ClientSession, url: str, *, to_the_end: bool) -> None:
        resp = await session.post(url)
        try:
            lines = Lines(resp.content)
            assert await lines.next() == {"type": "started"}
            assert await lines.next() == {"type": "finished"}
            if to_the_end:
                await give_back(resp)
        finally:
            resp.release()

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/executions/stream", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/v1/executions/stream"
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    await command(session, url, to_the_end=True)
                assert len(set(peers)) == 1, peers  # one connection for the three
                await command(session, url, to_the_end=False)  # left early: closed
                await command(session, url, to_the_end=True)
                assert peers[4] != peers[3], peers  # so this one needed a new one
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
