"""E2B's `process.Process` service (Connect RPC, JSON) on the sandbox's agent.

    Start (stream)        a command: an agent execution (POST executions/stream);
                          with `pty`: an agent terminal (POST terminals)
    Connect (stream)      attach by pid or tag: the execution's event stream, or
                          the terminal's output, from the moment of attaching
    List                  running executions and terminals
    SendInput, StreamInput   an execution's stdin, a terminal's input
    SendSignal            SIGKILL / SIGTERM (a terminal's SIGKILL deletes it)
    CloseStdin            an execution's stdin
    Update                a terminal's size

Nothing is kept in the gateway (its replicas share no state): an E2B pid is
the process's real pid in the sandbox container, which the agent records on
executions and terminals, and a tag travels in the recorded command line
(process_wire.launch). Every call that names a process finds it by asking the
agent. The streams are in process_stream.py, the messages in process_wire.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from sandbox_operator.gateway.e2b import connect, core
from sandbox_operator.gateway.e2b import process_wire as wire
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, DataHandler, E2BError, Endpoint, Target
from sandbox_operator.gateway.e2b.process_stream import Streams
from sandbox_operator.gateway.e2b.process_wire import Proc, proc_of

JSON = dict[str, Any]

# An agent's answer read into memory at most (a list of 1000 records is ~1 MiB).
MAX_ANSWER = 32 << 20
# Input bytes per agent call (its JSON bodies are at most 8 MiB; base64 grows 4/3).
INPUT_PIECE = 4 << 20
# How long a SIGKILL waits for the agent to see the process end, so that the
# pid is gone when the call returns (the agent's kill grace is 5 s).
KILL_WAIT = 6.0


def from_e2b(exc: E2BError) -> ConnectError:
    """An adapter error (the sandbox unreachable) as a Connect error."""
    return ConnectError.from_http(exc.status, exc.message)


Unary = Callable[[web.Request, Target, JSON], Awaitable[JSON]]


def unary(method: Unary) -> DataHandler:
    """A unary Connect method: the message in, the answer or a Connect error out."""

    @functools.wraps(method)
    async def handler(request: web.Request, target: Target, params: dict[str, str]) -> web.Response:
        try:
            message, streaming = await connect.read_request(request)
            if streaming:
                raise ConnectError("invalid_argument", f"a unary call is sent as {connect.UNARY}")
            return connect.unary(await method(request, target, message))
        except ConnectError as exc:
            return exc.response()
        except E2BError as exc:
            return from_e2b(exc).response()
        except (aiohttp.ClientError, OSError) as exc:  # a connection broke off
            return ConnectError("unavailable", f"the call broke off: {exc}").response()

    return handler


class Processes:
    """The process service of one gateway (stateless: every call asks the agent)."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.streams = Streams(self)

    def endpoints(self) -> list[Endpoint]:
        methods: dict[str, DataHandler] = {
            "Start": self.streams.start,
            "Connect": self.streams.connect,
            "List": unary(self.list),
            "SendInput": unary(self.send_input),
            "StreamInput": self.stream_input,
            "SendSignal": unary(self.send_signal),
            "CloseStdin": unary(self.close_stdin),
            "Update": unary(self.update),
        }
        return [
            Endpoint(core.ENVD_PORT, "POST", rf"/process\.Process/{name}", handler)
            for name, handler in methods.items()
        ]

    # -- the agent -------------------------------------------------------------------

    async def call(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        missing_ok: bool = False,
    ) -> Any:
        """An agent call's JSON answer (None for 204, and for 404 with
        `missing_ok`); an error answer raises its Connect error."""
        async with await self.adapter.agent(
            target, method, path, params=params, json_body=body
        ) as resp:
            data = parse_json(await read_body(resp, target), resp.status)
        if resp.status == 404 and missing_ok:
            return None
        if resp.status >= 400:
            raise wire.agent_error(resp.status, data)
        return data

    async def open(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
    ) -> aiohttp.ClientResponse:
        """An agent call whose answer is a stream: the response, for the caller to
        read and release; an error answer raises its Connect error."""
        resp = await self.adapter.agent(target, method, path, params=params, json_body=body)
        if resp.status < 400:
            return resp
        async with resp:
            data = parse_json(await read_body(resp, target), resp.status)
        raise wire.agent_error(resp.status, data)

    async def procs(self, target: Target, *, finished: bool = False) -> list[Proc]:
        """The sandbox's processes: running executions and terminals; with
        `finished`, the ended ones the agent still remembers too."""
        params = None if finished else {"status": "running"}
        execs, terms = await asyncio.gather(
            self.call(target, "GET", "executions", params=params),
            self.call(target, "GET", "terminals"),
        )
        found = [proc_of("execution", r) for r in _records(execs, "executions")]
        found += [proc_of("terminal", r) for r in _records(terms, "terminals")]
        return [p for p in found if p is not None and (finished or p.running)]

    async def find(self, target: Target, selector: wire.Selector, *, ended: bool = False) -> Proc:
        """The running process `selector` names; with `ended`, else the latest
        ended one. not_found when there is none (as E2B's daemon says it)."""
        live = [p for p in await self.procs(target) if _matches(p, selector)]
        if live:
            return live[-1]
        if ended:
            old = [p for p in await self.procs(target, finished=True) if _matches(p, selector)]
            if old:
                return max(old, key=lambda p: str(p.record.get("createdAt", "")))
        raise ConnectError("not_found", f"process with {selector} not found")

    # -- unary methods -----------------------------------------------------------------

    async def list(self, request: web.Request, target: Target, msg: JSON) -> JSON:
        workspace = target.route.workspace
        procs = await self.procs(target)
        return {"processes": [wire.process_info(p.argv, p.cwd, p.pid, workspace) for p in procs]}

    async def send_input(self, request: web.Request, target: Target, msg: JSON) -> JSON:
        selector = wire.parse_selector(msg)
        kind, data = wire.parse_input(msg.get("input"))
        await self.write(target, await self.find(target, selector), kind, data)
        return {}

    async def write(self, target: Target, proc: Proc, kind: str, data: bytes) -> None:
        """Input to a process: stdin of a command, keys of a pty."""
        if (kind == "pty") != proc.pty:
            raise ConnectError(
                "failed_precondition",
                f"process {proc.pid} "
                + ("has a pty: send its input as pty" if proc.pty else "has no pty: send stdin"),
            )
        path = f"{proc.kind}s/{proc.id}/" + ("input" if proc.pty else "stdin")
        for at in range(0, max(len(data), 1), INPUT_PIECE):
            piece = base64.b64encode(data[at : at + INPUT_PIECE]).decode()
            await self.call(target, "POST", path, body={"dataBase64": piece})

    async def stream_input(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        """A client stream: a start event naming the process, then input events
        (and keepalives), each forwarded as it arrives; one empty answer."""
        error: ConnectError | None = None
        try:
            proc: Proc | None = None
            idle = self.adapter.gateway.settings.idle_seconds
            async for msg in connect.read_stream(request, idle):
                event = msg.get("event", msg)
                if not isinstance(event, dict):
                    raise wire.invalid("event must be an object")
                if event.get("start") is not None:
                    start = event["start"]
                    if not isinstance(start, dict):
                        raise wire.invalid("start must be an object")
                    proc = await self.find(target, wire.parse_selector(start))
                elif event.get("data") is not None:
                    data = event["data"]
                    if not isinstance(data, dict):
                        raise wire.invalid("data must be an object")
                    if proc is None:
                        raise wire.invalid("the stream must start with a start event")
                    kind, payload = wire.parse_input(data.get("input"))
                    await self.write(target, proc, kind, payload)
                elif event.get("keepalive") is None:
                    raise ConnectError("unimplemented", "an event is start, data or keepalive")
        except ConnectError as exc:
            error = exc
        except E2BError as exc:
            error = from_e2b(exc)
        except (aiohttp.ClientError, OSError) as exc:  # a connection broke off
            error = ConnectError("unavailable", f"the call broke off: {exc}")
        response = await connect.open_stream(request)
        with contextlib.suppress(ConnectionResetError):  # the caller left: nobody to tell
            if error is None:
                await response.write(connect.envelope({}))
            await response.write(connect.end_stream(error))
            await response.write_eof()
        return response

    async def send_signal(self, request: web.Request, target: Target, msg: JSON) -> JSON:
        selector = wire.parse_selector(msg)
        name = wire.parse_signal(msg.get("signal", "SIGNAL_UNSPECIFIED"))
        proc = await self.find(target, selector)
        if proc.pty and name == "KILL":
            # The agent's terminal signals go to the foreground job, as keys do;
            # its program dies with the terminal.
            await self.call(target, "DELETE", f"terminals/{proc.id}", missing_ok=True)
            return {}
        await self.call(target, "POST", f"{proc.kind}s/{proc.id}/signal", body={"signal": name})
        if name == "KILL":
            # Return once the process is gone, so its pid no longer answers.
            params = {"waitSeconds": f"{KILL_WAIT:g}", "output": "false"}
            await self.call(target, "GET", f"executions/{proc.id}", params=params, missing_ok=True)
        return {}

    async def close_stdin(self, request: web.Request, target: Target, msg: JSON) -> JSON:
        proc = await self.find(target, wire.parse_selector(msg))
        if proc.pty:
            raise ConnectError(
                "failed_precondition",
                "a pty has no stdin to close: send Ctrl-D (0x04) as its input instead",
            )
        try:
            await self.call(target, "POST", f"executions/{proc.id}/stdin", body={"close": True})
        except ConnectError as exc:
            if exc.code != "failed_precondition":  # already closed: nothing to do
                raise
        return {}

    async def update(self, request: web.Request, target: Target, msg: JSON) -> JSON:
        selector = wire.parse_selector(msg)
        pty = wire.parse_pty(msg.get("pty"))
        proc = await self.find(target, selector)
        if pty is None:
            return {}
        if not proc.pty:
            raise ConnectError("failed_precondition", f"process {proc.pid} has no pty to resize")
        body = {"cols": pty.cols, "rows": pty.rows}
        await self.call(target, "POST", f"terminals/{proc.id}/resize", body=body)
        return {}


def _records(answer: Any, key: str) -> list[Any]:
    items = answer.get(key) if isinstance(answer, dict) else None
    return items if isinstance(items, list) else []


def _matches(proc: Proc, selector: wire.Selector) -> bool:
    if selector.pid is not None:
        return proc.pid == selector.pid
    return proc.tag is not None and proc.tag == selector.tag


async def read_body(resp: aiohttp.ClientResponse, target: Target) -> bytes:
    """An agent answer's body, bounded."""
    if resp.content_length is not None and resp.content_length > MAX_ANSWER:
        raise ConnectError("internal", "the sandbox's agent answered too much")
    body = bytearray()
    try:
        while chunk := await resp.content.read(1 << 16):
            body += chunk
            if len(body) > MAX_ANSWER:
                raise ConnectError("internal", "the sandbox's agent answered too much")
    except (aiohttp.ClientError, OSError) as exc:
        raise ConnectError("unavailable", f"the sandbox {target.id} broke off: {exc}") from exc
    return bytes(body)


def parse_json(body: bytes, status: int) -> Any:
    """An answer's JSON: None when empty; an error answer that is not JSON is
    still an error (its status says which)."""
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        if status >= 400:
            return None
        raise ConnectError("internal", f"the sandbox's agent answered no JSON: {exc}") from exc
