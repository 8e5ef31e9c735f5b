"""Terminals: a real pty in the runner, attached over a real WebSocket."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from conftest import Sandbox, rss_kib, wait_until

PROMPT = "ready> "
WAIT_FOR_SIGINT = (
    "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT]);"
    " print('armed', flush=True); signal.sigwait([signal.SIGINT]); print('got SIGINT')"
)


def _create(sandbox: Sandbox, expect: int = 201, **body: Any) -> dict[str, Any]:
    r = sandbox.client.post("/v1/terminals", json=body)
    assert r.status_code == expect, r.text
    result: dict[str, Any] = r.json()
    return result


def _shell(sandbox: Sandbox, **body: Any) -> dict[str, Any]:
    """bash without startup files and a prompt that is easy to wait for."""
    env = {"PS1": PROMPT, **body.pop("env", {})}
    return _create(sandbox, argv=["bash", "--norc", "--noprofile", "-i"], env=env, **body)


class Attached:
    """One WebSocket attachment: output collected as it comes, control events apart."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.output = bytearray()
        self.events: list[dict[str, Any]] = []

    async def pump(self, until: Callable[[], bool], seconds: float = 15.0) -> None:
        deadline = time.monotonic() + seconds
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out; output so far: {bytes(self.output)[-2000:]!r}, events"
                    f" {self.events}"
                )
            try:
                msg = await self.ws.receive(timeout=left)
            except TimeoutError:
                continue
            if msg.type == aiohttp.WSMsgType.BINARY:
                self.output += msg.data
            elif msg.type == aiohttp.WSMsgType.TEXT:
                self.events.append(json.loads(msg.data))
            else:
                return

    async def expect(self, pattern: str, seconds: float = 15.0) -> None:
        start = len(self.output)
        regex = re.compile(pattern.encode(), re.DOTALL)
        await self.pump(lambda: regex.search(bytes(self.output[start:])) is not None, seconds)

    async def type(self, text: str) -> None:
        await self.ws.send_bytes(text.encode())

    async def control(self, **msg: Any) -> None:
        await self.ws.send_str(json.dumps(msg))


def attach(
    sandbox: Sandbox,
    term_id: str,
    scenario: Callable[[Attached], Awaitable[Any]],
    cursor: int | None = None,
) -> Any:
    async def run() -> Any:
        params = {} if cursor is None else {"cursor": str(cursor)}
        headers = {"Authorization": f"Bearer {sandbox.token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"{sandbox.base_url}/v1/terminals/{term_id}/attach",
                headers=headers,
                params=params,
            ) as ws,
        ):
            first = await ws.receive(timeout=10)
            assert first.type == aiohttp.WSMsgType.TEXT, first
            attached = Attached(ws)
            attached.events.append(json.loads(first.data))
            assert attached.events[0]["type"] == "attached", attached.events
            return await scenario(attached)

    return asyncio.run(run())


def test_a_shell_on_a_pty_sizes_interrupts_and_keeps_state(sandbox: Sandbox) -> None:
    term = _shell(sandbox, cols=100, rows=30)
    assert term["status"] == "running" and term["pid"], term

    async def scenario(t: Attached) -> None:
        await t.expect(re.escape(PROMPT))
        await t.type("stty size; tty\r")
        await t.expect(r"30 100\r\n/dev/pts/")
        await t.control(type="resize", cols=120, rows=40)
        await t.type("stty size\r")
        await t.expect(r"40 120")
        # Ctrl-C reaches the foreground job, not the shell.
        # "sleeping" once sh is the foreground job (the echo shows "sle%sing").
        await t.type("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 100'\r")
        await t.expect("sleeping")
        await t.type("\x03")
        await t.expect(re.escape(PROMPT))
        await t.type("echo alive-$((40+2))\r")
        await t.expect("alive-42")
        # A REPL keeps its state between sends.
        await t.type("python3 -q\r")
        await t.expect(">>> ")
        await t.type("x = 41\r")
        await t.expect(">>> ")
        await t.type("print(x + 1)\r")
        await t.expect(r"42\r\n>>> ")
        await t.type("exit()\r")
        await t.expect(re.escape(PROMPT))
        # A signal from the control side reaches the foreground job too (SIGINT
        # is blocked before "armed" is printed: the one sent after it is taken).
        await t.type(f"python3 -c {WAIT_FOR_SIGINT!r}\r")
        await t.expect(r"\rarmed\r\n")  # its output, not the echo of the command line
        await t.control(type="signal", signal="INT")
        await t.expect(r"got SIGINT\r\n")
        await t.type("exit 3\r")
        await t.pump(lambda: any(e["type"] == "exit" for e in t.events))

    attach(sandbox, term["id"], scenario)
    ended = sandbox.client.get(f"/v1/terminals/{term['id']}").json()
    assert ended["status"] == "exited" and ended["exitCode"] == 3, ended


def test_detach_and_attach_again_replays_from_a_cursor(sandbox: Sandbox) -> None:
    term = _shell(sandbox)

    async def first(t: Attached) -> int:
        await t.expect(re.escape(PROMPT))
        await t.type("echo first-$((1+1))\r")
        await t.expect("first-2.*" + re.escape(PROMPT))
        return int(t.events[0]["cursor"]) + len(t.output)

    cursor = attach(sandbox, term["id"], first)
    # Detached: the shell lives on and its output is kept.
    r = sandbox.client.post(f"/v1/terminals/{term['id']}/input", json={"data": "echo second\r"})
    assert r.status_code == 204, r.text
    wait_until(
        lambda: (
            sandbox.client.get(f"/v1/terminals/{term['id']}").json()["outputCursor"]
            > cursor + len("echo second\r\n")
        )
    )
    replay = attach(sandbox, term["id"], lambda t: t.expect("second\r\n"), cursor=0)
    assert replay is None

    async def since(t: Attached) -> bytes:
        await t.expect(re.escape(PROMPT))
        return bytes(t.output)

    missed = attach(sandbox, term["id"], since, cursor=cursor)
    assert b"first-2" not in missed and b"second" in missed, missed
    r = sandbox.client.delete(f"/v1/terminals/{term['id']}")
    assert r.status_code == 204, r.text
    assert sandbox.client.get(f"/v1/terminals/{term['id']}").status_code == 404


def test_output_and_input_over_plain_http(sandbox: Sandbox) -> None:
    term = _shell(sandbox)
    url = f"/v1/terminals/{term['id']}"
    r = sandbox.client.post(
        f"{url}/input", json={"dataBase64": base64.b64encode(b"echo hi-$((2*3))\r").decode()}
    )
    assert r.status_code == 204, r.text
    seen = b""
    cursor = 0
    deadline = time.monotonic() + 15
    while b"hi-6" not in seen and time.monotonic() < deadline:
        page = sandbox.client.get(
            f"{url}/output", params={"cursor": cursor, "waitSeconds": 5}
        ).json()
        assert page["cursor"] == cursor and page["dropped"] == 0, page
        seen += base64.b64decode(page["dataBase64"])
        cursor = page["nextCursor"]
    assert b"hi-6" in seen, seen
    r = sandbox.client.post(f"{url}/resize", json={"cols": 0, "rows": 10})
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.post(f"{url}/signal", json={"signal": "NOPE"})
    assert sandbox.error(r, 400) == "invalid_signal"
    sandbox.client.delete(url)


def test_errors_are_clear_and_a_websocket_needs_the_token(sandbox: Sandbox) -> None:
    assert sandbox.error(sandbox.client.get("/v1/terminals/term-nope"), 404) == "terminal_not_found"
    r = sandbox.client.post("/v1/terminals", json={"command": "true", "argv": ["true"]})
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.post("/v1/terminals", json={"cwd": "../etc"})
    assert sandbox.error(r, 400) == "path_traversal"
    r = sandbox.client.post("/v1/terminals", json={"argv": ["/no/such/program"]})
    assert sandbox.error(r, 400) == "spawn_failed"
    term = _shell(sandbox)
    plain = sandbox.client.get(f"/v1/terminals/{term['id']}/attach")
    assert sandbox.error(plain, 426) == "websocket_required"

    async def handshake(headers: dict[str, str], name: str, cursor: int = 0) -> int:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(
                    f"{sandbox.base_url}/v1/terminals/{name}/attach",
                    headers=headers,
                    params={"cursor": str(cursor)},
                ):
                    return 101
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    assert asyncio.run(handshake({}, term["id"])) == 401
    wrong = {"Authorization": "Bearer " + "x" * 43}
    assert asyncio.run(handshake(wrong, term["id"])) == 401
    ok = {"Authorization": f"Bearer {sandbox.token}"}
    assert asyncio.run(handshake(ok, "term-nope")) == 404
    assert asyncio.run(handshake(ok, term["id"], cursor=10**9)) == 400
    assert asyncio.run(handshake(ok, term["id"])) == 101

    async def bad_control(t: Attached) -> None:
        await t.control(type="resize", cols=5000, rows=1)
        await t.control(type="teleport")
        await t.ws.send_str("not json")
        await t.pump(lambda: sum(e["type"] == "error" for e in t.events) >= 3)
        await t.type("echo still-$((3*3))\r")  # the attachment works on
        await t.expect("still-9")

    attach(sandbox, term["id"], bad_control)
    sandbox.client.delete(f"/v1/terminals/{term['id']}")


def test_limits_idle_timeout_and_a_flood_nobody_reads(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(max_terminals=2, terminal_buffer_bytes=64 << 10)
    first = _shell(sb)
    flood = _create(sb, command="yes 0123456789abcdef0123456789abcdef")
    r = sb.client.post("/v1/terminals", json={})
    assert sb.error(r, 429) == "too_many_terminals"
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    time.sleep(3)  # ~ hundreds of MiB through a 64 KiB ring
    view = sb.client.get(f"/v1/terminals/{flood['id']}").json()
    assert view["outputCursor"] > 4 * (64 << 10), view
    assert view["outputCursor"] - view["outputStart"] <= 64 << 10, view
    grown = rss_kib(sb.agent.pid) - before
    assert grown < 32 << 10, f"agent RSS grew {grown} KiB under a flood nobody read"

    async def far_behind(t: Attached) -> None:
        await t.pump(lambda: len(t.output) > 1000)

    lagging = attach(sb, flood["id"], far_behind, cursor=0)
    assert lagging is None
    assert sb.client.delete(f"/v1/terminals/{flood['id']}").status_code == 204
    # Room again; an idle timeout ends a terminal nobody attaches to.
    short = _shell(sb, idleTimeoutSeconds=0.5)
    done = wait_until(
        lambda: (
            (t := sb.client.get(f"/v1/terminals/{short['id']}").json())["status"] != "running" and t
        ),
        10,
    )
    assert done["status"] == "exited" and done["signal"] == 9, done
    assert "idleTimeoutSeconds" in done["message"], done
    sb.client.delete(f"/v1/terminals/{first['id']}")


@pytest.mark.parametrize("cursor", [0, 10**9])
def test_a_cursor_past_the_end_is_refused(sandbox: Sandbox, cursor: int) -> None:
    term = _shell(sandbox)
    url = f"/v1/terminals/{term['id']}/output"
    r = sandbox.client.get(url, params={"cursor": cursor, "waitSeconds": 30})
    if cursor:
        assert sandbox.error(r, 400) == "invalid_cursor"
    else:
        assert r.status_code == 200, r.text
    sandbox.client.delete(f"/v1/terminals/{term['id']}")


def test_quiesce_stops_a_terminals_jobs_too(sandbox: Sandbox, wsdir: str) -> None:
    """A snapshot's quiesce reaches what runs on a terminal, also a job the shell
    put in a process group of its own, and lets it go on afterwards."""
    term = _shell(sandbox)
    path = sandbox.workspace / wsdir / "job.log"
    job = f"(while true; do echo x >> {wsdir}/job.log; sleep 0.02; done) &\r"
    r = sandbox.client.post(f"/v1/terminals/{term['id']}/input", json={"data": job})
    assert r.status_code == 204, r.text
    wait_until(lambda: path.exists() and path.stat().st_size > 10)
    r = sandbox.client.post("/v1/workspace/quiesce", json={"seconds": 30})
    assert r.status_code == 200, r.text
    assert term["id"] in r.json()["quiesced"], r.json()
    time.sleep(0.2)
    before = path.stat().st_size
    time.sleep(0.6)
    assert path.stat().st_size == before, "the job wrote while quiesced"
    assert sandbox.client.post("/v1/workspace/resume").status_code == 200
    wait_until(lambda: path.stat().st_size > before)
    sandbox.client.delete(f"/v1/terminals/{term['id']}")


def test_viewers_that_leave_mid_flood_leave_no_error(fresh: Callable[..., Sandbox]) -> None:
    """A viewer that goes away while output is being sent to it detaches quietly:
    no error in the agent's log, and the terminal goes on."""
    sb = fresh()
    flood = _create(sb, command="yes 0123456789abcdef")

    async def leave(t: Attached) -> None:
        await t.pump(lambda: len(t.output) > 100_000)
        await t.ws.close()

    for _ in range(5):
        attach(sb, flood["id"], leave)
    time.sleep(0.5)
    assert "Traceback" not in sb.agent_log(), sb.agent_log()
    assert sb.client.get(f"/v1/terminals/{flood['id']}").json()["status"] == "running"
    sb.client.delete(f"/v1/terminals/{flood['id']}")
