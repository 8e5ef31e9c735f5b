"""Start and Connect: E2B's process event streams on the agent's executions
and terminals.

A command (Start without `pty`) is one agent call, `POST executions/stream`:
its events (started with the pid, output as base64, finished) become E2B's
StartEvent, DataEvents and EndEvent. A pty is an agent terminal: created, then
its output read by cursor (long polls). Connect attaches to either from the
current end of its output: E2B's daemon sends what a process writes after
the attach, not before, and so does this; a process that already ended gets
its start and end events.

The call's deadline (`Connect-Timeout-Ms`) is the process's lifetime, as in
E2B's daemon: the execution's timeout, and for a terminal the time it may
spend with nobody attached (the agent's idle timeout, which runs from its
creation as long as no WebSocket attaches: this stream reads by polling).
When it passes, the Start stream ends with `deadline_exceeded`. Between
events the stream sends keepalives (`Keepalive-Ping-Interval`), and it ends
when its caller left or its sandbox went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from sandbox_operator.gateway.agent_table import AgentErrorCode
from sandbox_operator.gateway.e2b import connect
from sandbox_operator.gateway.e2b import process_wire as wire
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Target, whole
from sandbox_operator.gateway.e2b.process_wire import RUNNING, Proc

JSON = dict[str, Any]
T = TypeVar("T")

# How often a stream looks at its caller and its sandbox while it waits.
TICK = 1.0
# E2B's daemon's keepalive interval when the caller names none (seconds).
DEFAULT_KEEPALIVE = 90.0
# A caller that takes nothing of the stream this long has gone.
SEND_TIMEOUT = 120.0
# One agent event (an output chunk of up to 1 MiB, base64) at most.
MAX_LINE = 4 << 20
# A pty's output per long poll, and how long one waits.
PTY_PAGE = 256 << 10
PTY_POLL = 20.0
# A process without a deadline: the agent's longest timeout (it names it when
# this is more).
FOREVER = 30 * 86400.0
# The agent's terminals wait at most this long for an attachment.
MAX_IDLE = 604800.0
# How long to wait for the runner to name the pid of a command it started.
PID_WAIT = 10.0
# A process that died of SIGTERM (or an unexplained SIGKILL, or with the
# runner) may have died with its sandbox: how long to watch for the sandbox
# going away before reporting the death as the process's own.
LEAVING_WAIT = 2.0
# After a command's last event, how long and how much of the rest of the
# agent's stream (the end of its chunked body, which comes at once) is read so
# that the connection goes back to the pool.
DRAIN_SECONDS = 2.0
DRAIN_BYTES = 64 << 10


class Processes(Protocol):
    """What the streams use of the process service (process.Processes)."""

    adapter: Adapter

    async def call(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        missing_ok: bool = False,
    ) -> Any: ...

    async def open(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
    ) -> aiohttp.ClientResponse: ...

    async def find(
        self, target: Target, selector: wire.Selector, *, ended: bool = False
    ) -> Proc: ...


class CallerGone(Exception):
    """The caller left: nobody to answer."""


class Lines:
    """The JSON lines of an agent's event stream (ndjson)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self.content = content
        self.buffer = bytearray()
        self.eof = False

    async def next(self) -> JSON | None:
        """The next event, or None at the end of the stream."""
        while True:
            end = self.buffer.find(b"\n")
            if end < 0 and self.eof:
                end = len(self.buffer)
                if not self.buffer.strip():
                    return None
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                if line.strip():
                    return _event(line)
                continue
            try:
                chunk = await self.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                raise ConnectError(
                    "unavailable", f"the sandbox's event stream broke: {exc}"
                ) from exc
            if not chunk:
                self.eof = True
            self.buffer += chunk
            if len(self.buffer) > MAX_LINE:
                raise ConnectError("internal", "the sandbox's agent sent an oversized event")


def _event(line: bytes) -> JSON:
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ConnectError("internal", f"the sandbox's agent sent a bad event: {exc}") from exc
    if not isinstance(event, dict):
        raise ConnectError("internal", "the sandbox's agent sent a bad event")
    return event


async def give_back(resp: aiohttp.ClientResponse) -> None:
    """Read the rest of an agent stream whose last event was read: released
    before its end, the connection would be closed, and the next command would
    pay for a new one, in the gateway and in the agent. A stream that does not
    end at once is left as it was (the caller's release closes it)."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
        async with asyncio.timeout(DRAIN_SECONDS):
            left = DRAIN_BYTES
            while left > 0 and (chunk := await resp.content.readany()):
                left -= len(chunk)


def keepalive_of(request: web.Request) -> float:
    value = whole(request.headers.get("Keepalive-Ping-Interval", ""), 6)
    if value is None:
        return DEFAULT_KEEPALIVE
    return float(min(max(value, 1), 3600))


class Outbox:
    """The answer of one stream: its events, keepalives while nothing happens,
    and the checks that end it (deadline, caller gone, sandbox gone)."""

    def __init__(self, request: web.Request, target: Target, service: Processes) -> None:
        self.request, self.target, self.service = request, target, service
        self.lifetime = connect.timeout_seconds(request) or None
        now = time.monotonic()
        self.deadline = now + self.lifetime if self.lifetime else None
        self.keepalive = keepalive_of(request)
        self.next_keepalive = now + self.keepalive
        self.response: web.StreamResponse | None = None

    async def send(self, message: JSON) -> None:
        await self._write(connect.envelope(message))
        self.next_keepalive = time.monotonic() + self.keepalive

    async def _write(self, data: bytes) -> None:
        if self.response is None:
            self.response = await connect.open_stream(self.request)
        try:
            async with asyncio.timeout(SEND_TIMEOUT):
                await self.response.write(data)
        except (TimeoutError, ConnectionResetError) as exc:
            raise CallerGone() from exc

    async def close(self, error: ConnectError | None) -> web.StreamResponse:
        try:
            await self._write(connect.end_stream(error))
            assert self.response is not None
            await self.response.write_eof()
        except (CallerGone, ConnectionResetError):
            pass
        return self.response or web.Response(status=499)

    async def until(self, work: Awaitable[T]) -> T:
        """`work`'s result, keeping the stream alive and checked meanwhile."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                now = time.monotonic()
                wait = min(TICK, self.next_keepalive - now)
                if self.deadline is not None:
                    wait = min(wait, self.deadline - now)
                done, _ = await asyncio.wait({task}, timeout=max(wait, 0))
                if task in done:
                    return task.result()
                self.check()
                if time.monotonic() >= self.next_keepalive:
                    await self.send(wire.KEEPALIVE)
        finally:
            if not task.done():
                task.cancel()

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise ConnectError(
                "deadline_exceeded", "the call's timeout (Connect-Timeout-Ms) passed"
            )
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise CallerGone()
        route = self.service.adapter.gateway.table.get(self.target.namespace, self.target.id)
        if route is None or route.uid != self.target.route.uid or route.deleting or route.paused:
            raise ConnectError(
                "unavailable",
                f"the connection to sandbox {self.target.id} ended before the stream completed",
            )


Body = Callable[[Outbox, JSON], Awaitable[None]]


class Streams:
    def __init__(self, service: Processes) -> None:
        self.service = service

    async def start(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        return await self._serve(request, target, self._start)

    async def connect(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        return await self._serve(request, target, self._connect)

    async def _serve(self, request: web.Request, target: Target, body: Body) -> web.StreamResponse:
        out = Outbox(request, target, self.service)
        error: ConnectError | None = None
        try:
            message, streaming = await connect.read_request(request)
            if not streaming:
                return ConnectError(
                    "invalid_argument", f"a server stream is called with {connect.STREAM}"
                ).response()
            await body(out, message)
        except ConnectError as exc:
            error = exc
        except E2BError as exc:
            error = ConnectError.from_http(exc.status, exc.message)
        except CallerGone:
            return out.response or web.Response(status=499)
        except (aiohttp.ClientError, OSError) as exc:
            error = ConnectError("unavailable", f"the sandbox {target.id} broke off: {exc}")
        return await out.close(error)

    # -- Start -------------------------------------------------------------------------

    async def _start(self, out: Outbox, msg: JSON) -> None:
        spec = wire.parse_start(msg)
        wire.check_user(out.request.headers.get("Authorization"))
        rel, outside = wire.resolve_cwd(spec.cwd, out.target.route.workspace)
        argv = [spec.cmd, *spec.args]
        try:
            if spec.pty is not None:
                await self._start_pty(out, spec, argv, rel, outside)
            else:
                await self._start_command(out, spec, argv, rel, outside)
        except wire.AgentError as exc:
            if exc.agent_code == AgentErrorCode.INVALID_CWD:  # say it with the caller's own path
                raise wire.invalid(f"cwd '{spec.cwd}' does not exist") from exc
            raise

    async def _start_command(
        self, out: Outbox, spec: wire.StartSpec, argv: list[str], rel: str, outside: str | None
    ) -> None:
        body: JSON = {
            "argv": wire.launch(argv, outside, spec.tag),
            "env": spec.envs,
            "cwd": rel,
            "stdinOpen": spec.stdin,
            "background": True,
            "timeoutSeconds": out.lifetime or FOREVER,
        }
        resp = await self._open_command(out.target, body, argv, spec.tag)
        try:
            lines = Lines(resp.content)
            first = await out.until(lines.next())
            record = first.get("execution") if first and first.get("type") == "started" else None
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise self._broken(out)
            pid = record.get("pid")
            if isinstance(pid, bool) or not isinstance(pid, int):
                pid = await self._pid_of(out, record["id"])
            await out.send(wire.start_event(pid))
            await self._pump_command(out, lines, own_deadline=True)
            await give_back(resp)
        finally:
            resp.release()

    async def _open_command(
        self, target: Target, body: JSON, argv: list[str], tag: str | None
    ) -> aiohttp.ClientResponse:
        """The agent's event stream of a new command. Two refusals are answered
        once: a timeout over the agent's maximum (its maximum then), and a
        working directory in the workspace reached through a symlink that
        leaves it (the launcher changes to it then)."""
        for attempt in range(3):
            try:
                return await self.service.open(
                    target, "POST", "executions/stream", params={"encoding": "base64"}, body=body
                )
            except wire.AgentError as exc:
                maximum, code = exc.details.get("maximum"), exc.agent_code
                if attempt == 2:
                    raise
                if code == AgentErrorCode.TIMEOUT_TOO_LARGE and isinstance(maximum, int | float):
                    if isinstance(maximum, bool) or maximum <= 0:
                        raise
                    body = {**body, "timeoutSeconds": maximum}
                elif code == AgentErrorCode.PATH_ESCAPE and body["cwd"] != ".":
                    outside = wire.absolute_cwd(body["cwd"], target.route.workspace)
                    body = {**body, "cwd": ".", "argv": wire.launch(argv, outside, tag)}
                else:
                    raise
        raise AssertionError("unreachable")

    async def _pid_of(self, out: Outbox, execution: str) -> int:
        """The pid of a command the agent's started event did not name yet (an
        agent that announces commands before the runner spawned them)."""
        deadline = time.monotonic() + PID_WAIT
        pause = 0.001  # the runner names it within a millisecond or two
        while time.monotonic() < deadline:
            record = await out.until(
                self.service.call(
                    out.target, "GET", f"executions/{execution}", params={"output": "false"}
                )
            )
            pid = record.get("pid") if isinstance(record, dict) else None
            if isinstance(pid, int) and not isinstance(pid, bool):
                return pid
            if isinstance(record, dict) and record.get("status") not in RUNNING:
                wire.execution_end(record, own_deadline=True)  # raises why it did not start
                break
            await out.until(asyncio.sleep(pause))
            pause = min(pause * 2, 0.1)
        raise ConnectError("unavailable", "the sandbox did not report the process's start")

    async def _pump_command(self, out: Outbox, lines: Lines, *, own_deadline: bool) -> None:
        while True:
            event = await out.until(lines.next())
            if event is None:
                raise self._broken(out)
            kind = event.get("type")
            if kind == "output":
                data, stream = event.get("dataBase64"), event.get("stream")
                if isinstance(data, str) and data and stream in ("stdout", "stderr"):
                    await out.send(wire.data_event(stream, data))
            elif kind == "finished":
                record = event.get("execution")
                record = record if isinstance(record, dict) else {}
                end = wire.execution_end(record, own_deadline=own_deadline)
                if wire.may_be_shutdown(record) and await self._leaving(out):
                    raise self._broken(out)
                await out.send(end)
                return

    async def _leaving(self, out: Outbox) -> bool:
        """Whether the sandbox is going away: its processes die with it, which
        E2B's SDKs must hear as the sandbox's end, not as the process's."""
        return await self.service.adapter.leaving(out.target, LEAVING_WAIT)

    @staticmethod
    def _broken(out: Outbox) -> ConnectError:
        return ConnectError(
            "unavailable",
            f"the connection to sandbox {out.target.id} ended before the stream completed",
        )

    async def _start_pty(
        self, out: Outbox, spec: wire.StartSpec, argv: list[str], rel: str, outside: str | None
    ) -> None:
        assert spec.pty is not None
        body: JSON = {
            "argv": wire.launch(argv, outside, spec.tag),
            "env": spec.envs,
            "cwd": rel,
            "cols": spec.pty.cols,
            "rows": spec.pty.rows,
            # The process's lifetime (0: none); see the module's docstring.
            "idleTimeoutSeconds": min(out.lifetime, MAX_IDLE) if out.lifetime else 0,
        }
        try:
            term = await self.service.call(out.target, "POST", "terminals", body=body)
        except wire.AgentError as exc:
            if exc.agent_code != AgentErrorCode.PATH_ESCAPE or rel == ".":
                raise
            outside = wire.absolute_cwd(rel, out.target.route.workspace)
            body = {**body, "cwd": ".", "argv": wire.launch(argv, outside, spec.tag)}
            term = await self.service.call(out.target, "POST", "terminals", body=body)
        term = term if isinstance(term, dict) else {}
        pid, term_id = term.get("pid"), term.get("id")
        if isinstance(pid, bool) or not isinstance(pid, int) or not isinstance(term_id, str):
            raise ConnectError("internal", "the sandbox's agent did not name the terminal's pid")
        await out.send(wire.start_event(pid))
        try:
            await self._pump_pty(out, term_id, 0)
        except ConnectError as exc:
            if exc.code == "deadline_exceeded":
                # Its lifetime is over: end it now, not at the agent's next sweep
                # (which ends it anyway when this fails).
                with contextlib.suppress(ConnectError, E2BError):
                    await self.service.call(
                        out.target, "DELETE", f"terminals/{term_id}", missing_ok=True
                    )
            raise

    async def _pump_pty(self, out: Outbox, term_id: str, cursor: int) -> None:
        while True:
            params = {
                "cursor": str(cursor),
                "waitSeconds": f"{PTY_POLL:g}",
                "maxBytes": str(PTY_PAGE),
            }
            page = await out.until(
                self.service.call(
                    out.target, "GET", f"terminals/{term_id}/output", params=params, missing_ok=True
                )
            )
            if page is None:
                # Deleted (SendSignal SIGKILL does that): its program was killed.
                await out.send(wire.end_event(None, signal.SIGKILL))
                return
            data, after = page.get("dataBase64"), page.get("nextCursor")
            if not isinstance(after, int) or isinstance(after, bool) or after < cursor:
                raise ConnectError("internal", "the sandbox's agent sent a bad output page")
            if isinstance(data, str) and data:
                await out.send(wire.data_event("pty", data))
            elif page.get("status") not in RUNNING:
                if wire.may_be_shutdown(page) and await self._leaving(out):
                    raise self._broken(out)
                await out.send(wire.terminal_end(page))
                return
            cursor = after

    # -- Connect -----------------------------------------------------------------------

    async def _connect(self, out: Outbox, msg: JSON) -> None:
        proc = await self.service.find(out.target, wire.parse_selector(msg), ended=True)
        if not proc.running:
            await out.send(wire.start_event(proc.pid))
            if proc.pty:
                await out.send(wire.terminal_end(proc.record))
            else:
                await out.send(wire.execution_end(proc.record, own_deadline=False))
            return
        cursor = proc.record.get("outputCursor")
        if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
            cursor = 0
        if proc.pty:
            await out.send(wire.start_event(proc.pid))
            await self._pump_pty(out, proc.id, cursor)
            return
        await self._attach_command(out, proc, cursor)

    async def _attach_command(self, out: Outbox, proc: Proc, cursor: int) -> None:
        params = {"cursor": str(cursor), "encoding": "base64"}
        resp = await self.service.open(
            out.target, "GET", f"executions/{proc.id}/stream", params=params
        )
        try:
            lines = Lines(resp.content)
            first = await out.until(lines.next())
            if not first or first.get("type") != "started":
                raise self._broken(out)
            await out.send(wire.start_event(proc.pid))
            await self._pump_command(out, lines, own_deadline=False)
            await give_back(resp)
        finally:
            resp.release()
