"""Terminals: programs on a pseudo-terminal in a sandbox (`sandbox.terminals`),
read and typed into by HTTP requests or attached over a WebSocket."""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sandbox_sdk import _lazy
from sandbox_sdk.errors import NotFound, SandboxError, ServerError, Timeout, from_response
from sandbox_sdk.models.agent_codes import AgentErrorCode

if TYPE_CHECKING:
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk._async.websocket import AsyncWebSocket
    from sandbox_sdk.models import agent
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")

JSON = dict[str, Any]


class AsyncTerminals:
    """Programs on a pseudo-terminal in the sandbox (a shell by default): they
    outlive the connection that made them, and their output is kept (1 MiB
    each) for whoever reads it next."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    async def create(
        self,
        command: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        cwd: str = ".",
        env: Mapping[str, str] | None = None,
        cols: int = 80,
        rows: int = 24,
        idle_timeout: float | None = None,
    ) -> AsyncTerminal:
        """Start `command` (a shell command line), or `argv`, or else the sandbox
        user's login shell, on a `cols` x `rows` terminal. It ends when it exits,
        on `kill()`, or after `idle_timeout` seconds with nobody attached."""
        body: JSON = {"cwd": cwd, "cols": cols, "rows": rows, "env": dict(env or {})}
        if command is not None:
            body["command"] = command
        if argv is not None:
            body["argv"] = list(argv)
        if idle_timeout is not None:
            body["idleTimeoutSeconds"] = idle_timeout
        answer = await self.sandbox._request("POST", "terminals", json_body=body, idempotent=False)
        made = agent.Terminal.model_validate(answer.json())
        return AsyncTerminal(self.sandbox, made.id)

    async def list(self) -> builtins.list[agent.Terminal]:
        """Terminals running now and those that ended lately."""
        answer = await self.sandbox._request("GET", "terminals")
        return agent.TerminalList.model_validate(answer.json()).terminals

    def get(self, terminal_id: str) -> AsyncTerminal:
        """A handle on an existing terminal (reading from the oldest output kept)."""
        return AsyncTerminal(self.sandbox, terminal_id)


class AsyncTerminal:
    """One terminal: type into it, read what it shows, resize, signal, kill.

    `read()` returns output from `cursor` on and moves `cursor` past it, so a
    handle reads each byte once; `cursor = 0` reads again from the oldest kept.
    """

    def __init__(self, sandbox: AsyncSandbox, terminal_id: str) -> None:
        self.sandbox = sandbox
        self.id = terminal_id
        self.cursor = 0
        self.status = "running"
        self.exit_code: int | None = None

    def __repr__(self) -> str:
        return f"<Terminal {self.id} in {self.sandbox.name}>"

    @property
    def _tail(self) -> str:
        return f"terminals/{self.id}"

    async def info(self) -> agent.Terminal:
        answer = await self.sandbox._request("GET", self._tail)
        return agent.Terminal.model_validate(answer.json())

    async def send(self, data: str | bytes) -> None:
        """Keys as typed: "ls\\r" runs ls in a shell, "\\x03" is Ctrl-C."""
        raw = data.encode() if isinstance(data, str) else data
        body = {"dataBase64": base64.b64encode(raw).decode()}
        await self.sandbox._request("POST", f"{self._tail}/input", json_body=body, idempotent=False)

    async def resize(self, cols: int, rows: int) -> None:
        await self.sandbox._request(
            "POST", f"{self._tail}/resize", json_body={"cols": cols, "rows": rows}
        )

    async def signal(self, signal: str = "INT") -> None:
        """To the terminal's foreground job, as a key would (INT: Ctrl-C)."""
        await self.sandbox._request(
            "POST", f"{self._tail}/signal", json_body={"signal": signal}, idempotent=False
        )

    async def read(self, *, wait: float = 10.0, max_bytes: int | None = None) -> bytes:
        """Output after `cursor`, waiting up to `wait` seconds (at most 60) for
        some; b"" when there is none yet, or none any more (see `status`)."""
        params = {"cursor": str(self.cursor), "waitSeconds": str(min(wait, 60.0))}
        if max_bytes:
            params["maxBytes"] = str(max_bytes)
        answer = await self.sandbox._request(
            "GET", f"{self._tail}/output", params=params, timeout=wait + 60
        )
        page = agent.TerminalOutput.model_validate(answer.json())
        self.cursor = page.next_cursor
        self.status, self.exit_code = page.status, page.exit_code
        return base64.b64decode(page.data_base64)

    async def read_until(self, pattern: str | bytes, *, timeout: float = 30.0) -> bytes:
        """Read until the output read so far (by this call) contains `pattern`;
        Timeout when it has not after `timeout` seconds or the terminal ended."""
        want = pattern.encode() if isinstance(pattern, str) else pattern
        seen = b""
        deadline = time.monotonic() + timeout
        while want not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            chunk = await self.read(wait=min(left, 10.0))
            seen += chunk
            if not chunk and self.status != "running":
                break
        if want not in seen:
            raise Timeout(f"terminal {self.id}: {want!r} not seen; last output {seen[-200:]!r}")
        return seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output as it comes, until the terminal ends."""
        while True:
            chunk = await self.read(wait=30.0)
            if chunk:
                yield chunk
            elif self.status != "running":
                return

    async def wait(self, timeout: float | None = None) -> agent.Terminal:
        """Until the terminal's program ends (its output is read meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status == "running":
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"terminal {self.id} still running after {timeout}s")
            await self.read(wait=min(left, 30.0))
        return await self.info()

    async def attach(self, cursor: int | None = None) -> AsyncTerminalSession:
        """Join the terminal over a WebSocket: keys go out as they are sent and
        output comes as the program writes it, with no request per key and no
        polling (what `kubectl sandbox shell` uses). Its output is replayed
        from `cursor` (by default this handle's `cursor`, which the session
        moves on as it reads: after a dropped connection, `attach()` again
        shows what was missed, as far as the 1 MiB kept reaches back).

        Every way the SDK reaches the gateway carries the WebSocket, the API
        server's service proxy included. Where something in between does not
        (a proxy or Ingress in front of `gateway_url` that drops the upgrade),
        the session falls back to the plain HTTP operations (`transport` is
        then "http": a request per send, output by long poll). NotFound for a
        terminal that does not exist; Forbidden without `create sandboxes/exec`.
        """
        if cursor is not None:
            self.cursor = cursor
        try:
            ws = await self.sandbox._websocket(f"{self._tail}/attach", {"cursor": str(self.cursor)})
        except SandboxError as exc:
            if exc.code != AgentErrorCode.WEBSOCKET_REQUIRED:
                raise
            session = AsyncTerminalSession(self, None)
            session.info = await self.info()  # NotFound here, as over the WebSocket
            self.status, self.exit_code = session.info.status, session.info.exit_code
            return session
        session = AsyncTerminalSession(self, ws)
        try:
            await session._attached()
        except BaseException:
            await session.aclose()
            raise
        return session

    async def kill(self) -> None:
        """End its program (and what that started) and forget the terminal."""
        with contextlib.suppress(NotFound):  # gone already
            await self.sandbox._request("DELETE", self._tail)
        self.status = "exited"


# The status the agent's HTTP operations answer with for a refusal that an
# attachment reports as an event (which carries the code only); 400 otherwise.
_ATTACH_REFUSALS: dict[str, int] = {
    AgentErrorCode.TERMINAL_ENDED: 409,
    AgentErrorCode.TERMINAL_BACKLOGGED: 429,
    AgentErrorCode.RUNNER_UNAVAILABLE: 503,
}


class AsyncTerminalSession:
    """A terminal attached over a WebSocket (`terminal.attach()`), a context
    manager: `send` keys, `read` output, `resize`, `signal` the foreground
    job; `close()` detaches (the program goes on).

    `read()` returns output in order and moves the terminal handle's `cursor`
    past it; `dropped` counts bytes that were lost (output that outran the
    1 MiB the agent keeps while this session did not read). When the program
    ends, `read()` returns b"" and `ended` is true; `wait()` gives its exit
    code. A lost connection raises ServerError (code `attachment_lost`) from
    `read()` once the output received before it is read, and from `send()`:
    `terminal.attach()` again goes on from where reading stopped. The agent's
    refusal of a key or a control message (the terminal cannot take input
    that fast, an unknown signal) is raised by the next `read()`. One task
    (or thread, with the sync client) may read while others send.
    """

    def __init__(self, terminal: AsyncTerminal, ws: AsyncWebSocket | None) -> None:
        self.terminal = terminal
        self.transport = "websocket" if ws is not None else "http"
        self.dropped = 0
        # The terminal as the agent last described it (at attaching, at its end).
        self.info: agent.Terminal | None = None
        self._ws = ws
        self._chunks: collections.deque[tuple[int, bytes]] = collections.deque()
        self._next = terminal.cursor  # where the next output message starts
        self._ended = False
        self._lost: SandboxError | None = None

    def __repr__(self) -> str:
        return f"<TerminalSession {self.terminal.id} over {self.transport}>"

    async def __aenter__(self) -> AsyncTerminalSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def ended(self) -> bool:
        """The program ended and all of its output was read."""
        if self._ws is None:
            return self.terminal.status != "running"
        return self._ended and not self._chunks

    def _gone(self, why: str) -> SandboxError:
        return ServerError(
            f"the attachment to terminal {self.terminal.id} was lost ({why}); the terminal goes"
            f" on: attach() again to read on from cursor {self.terminal.cursor}",
            code="attachment_lost",
            details={"reason": why},
        )

    async def _attached(self) -> None:
        """The agent's first message: where the replay starts."""
        assert self._ws is not None
        try:
            first = await self._ws.receive(timeout=self.terminal.sandbox.client.gateway.timeout)
        except TimeoutError:
            raise self._gone("no answer after the handshake") from None
        event = json.loads(first) if isinstance(first, str) else None
        if not isinstance(event, dict) or event.get("type") != "attached":
            raise self._gone(f"the agent's first message was {str(first)[:100]!r}")
        self.dropped = int(event.get("dropped") or 0)
        self.terminal.cursor = self._next = int(event["cursor"])
        self._describe(event.get("terminal"))

    def _describe(self, view: Any) -> None:
        if isinstance(view, dict):
            self.info = agent.Terminal.model_validate(view)
            self.terminal.status, self.terminal.exit_code = self.info.status, self.info.exit_code

    async def _receive(self, wait: float) -> None:
        """Messages until some output came (and what came with it), the terminal
        ended, the connection closed, or `wait` seconds passed."""
        assert self._ws is not None
        deadline = time.monotonic() + wait
        while not self._ended and self._lost is None:
            if self._chunks and not self._ws.buffered:
                return
            try:
                message = await self._ws.receive(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return
            if message is None:
                self._lost = self._gone(f"the connection closed, {self._ws.close_code}")
                return
            if isinstance(message, bytes):
                self._chunks.append((self._next, message))
                self._next += len(message)
                continue
            event = json.loads(message)
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "dropped":
                self.dropped += int(event.get("bytes") or 0)
                self._next = int(event.get("cursor") or self._next)
            elif kind == "exit":
                self._describe(event.get("terminal"))
                self._ended = True
            elif kind == "error":
                code = str(event.get("code") or "")
                body = {"error": {"code": code, "message": event.get("message")}}
                raise from_response(_ATTACH_REFUSALS.get(code, 400), body, str(event))

    async def read(self, *, wait: float = 10.0, max_bytes: int | None = None) -> bytes:
        """Output not read yet, waiting up to `wait` seconds for some; b"" when
        there is none yet, or none any more (`ended`)."""
        if self._ws is None:
            return await self.terminal.read(wait=min(wait, 60.0), max_bytes=max_bytes)
        if not self._chunks:
            await self._receive(wait)
        if not self._chunks and self._lost is not None:
            raise self._lost
        out = bytearray()
        while self._chunks and (max_bytes is None or len(out) < max_bytes):
            start, data = self._chunks.popleft()
            if max_bytes is not None and len(out) + len(data) > max_bytes:
                taken = max_bytes - len(out)
                self._chunks.appendleft((start + taken, data[taken:]))
                data = data[:taken]
            out += data
            self.terminal.cursor = start + len(data)
        return bytes(out)

    async def read_until(self, pattern: str | bytes, *, timeout: float = 30.0) -> bytes:
        """Read until the output read so far (by this call) contains `pattern`;
        Timeout when it has not after `timeout` seconds or the terminal ended."""
        want = pattern.encode() if isinstance(pattern, str) else pattern
        seen = b""
        deadline = time.monotonic() + timeout
        while want not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            chunk = await self.read(wait=min(left, 10.0))
            seen += chunk
            if not chunk and self.ended:
                break
        if want not in seen:
            raise Timeout(
                f"terminal {self.terminal.id}: {want!r} not seen; last output {seen[-200:]!r}"
            )
        return seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output as it comes, until the terminal ends."""
        while True:
            chunk = await self.read(wait=30.0)
            if chunk:
                yield chunk
            elif self.ended:
                return

    async def _control(self, message: bytes | str) -> None:
        assert self._ws is not None
        try:
            await self._ws.send(message)
        except ConnectionError as exc:
            raise self._gone(str(exc)) from exc

    async def send(self, data: str | bytes) -> None:
        """Keys as typed: "ls\\r" runs ls in a shell, "\\x03" is Ctrl-C."""
        if self._ws is None:
            await self.terminal.send(data)
        else:
            await self._control(data.encode() if isinstance(data, str) else data)

    async def resize(self, cols: int, rows: int) -> None:
        """The terminal's window size (its foreground job gets SIGWINCH)."""
        if self._ws is None:
            await self.terminal.resize(cols, rows)
        else:
            await self._control(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def signal(self, signal: str = "INT") -> None:
        """To the terminal's foreground job, as a key would (INT: Ctrl-C)."""
        if self._ws is None:
            await self.terminal.signal(signal)
        else:
            await self._control(json.dumps({"type": "signal", "signal": signal}))

    async def wait(self, timeout: float | None = None) -> agent.Terminal:
        """Until the program ends (output not read yet is skipped); the terminal
        as it ended (`exit_code`, `signal`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"terminal {self.terminal.id} still running after {timeout}s")
            await self.read(wait=min(left, 30.0))
        if self.info is None or self.info.status == "running":
            self.info = await self.terminal.info()
        return self.info

    async def aclose(self) -> None:
        """Detach (the program goes on; `terminal.attach()` joins it again)."""
        if self._ws is not None:
            await self._ws.aclose()
