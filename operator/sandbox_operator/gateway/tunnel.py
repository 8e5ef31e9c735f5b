"""WebSockets through the gateway: the handshake forwarded, then bytes both ways.

The gateway decides who may open a WebSocket (the request's checks in app.py)
and where it goes; after the upstream's 101 it has nothing more to decide, so
it reads no frame: the caller's opening handshake goes on with its own key,
subprotocols and extensions, the upstream's answer (accept key, the chosen
subprotocol and extensions) comes back, and from then on the bytes of each
side are written to the other as they arrive. A keystroke costs the gateway
one read and one write each way instead of parsing, unmasking, masking and
framing the message again (a terminal's echo: see docs/benchmarks.md), and the
two ends may agree on anything RFC 6455 allows, compression included.

The caller's credentials never travel on (the agent gets its own token, a
preview port nothing of the gateway's). An upstream that refuses the upgrade
is answered as the gateway answers any call: a 4xx with its own body passed
on (the agent's errors are JSON already), anything else 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from urllib.parse import urlsplit

from aiohttp import web
from multidict import CIMultiDict

# What of the caller's handshake the upstream needs to answer it, and what of the
# upstream's answer the caller needs to check it and to speak what was agreed.
HANDSHAKE = (
    "Sec-WebSocket-Key",
    "Sec-WebSocket-Version",
    "Sec-WebSocket-Protocol",
    "Sec-WebSocket-Extensions",
)
ANSWER = ("Sec-WebSocket-Accept", "Sec-WebSocket-Protocol", "Sec-WebSocket-Extensions")
# The upstream's answer head (status line and headers), and the body of a refusal.
MAX_HEAD = 64 << 10
MAX_REFUSAL = 64 << 10
# The caller's bytes waiting for the upstream to take them: past HIGH the caller
# is not read until they are down to the transport's own low-water mark.
HIGH = 1 << 20
# The upstream's bytes waiting for the caller: past HIGH the upstream is not read
# until the caller's buffer is down to LOW (looked at every RESUME_POLL seconds).
LOW = 1 << 16
RESUME_POLL = 0.005
# A request target as it may appear in a request line: the gateway built it from
# a checked path and the raw query the caller sent, but a line is a line.
_TARGET = re.compile(r"/[\x21-\x7e]*")


class Refused(Exception):
    """The upstream answered the upgrade with something other than 101."""

    def __init__(self, status: int, content_type: str | None, body: bytes) -> None:
        super().__init__(f"the upstream answered {status} to the WebSocket handshake")
        self.status, self.content_type, self.body = status, content_type, body


class _Inbound:
    """What aiohttp calls with the caller's bytes once the connection is upgraded
    (`RequestHandler.set_parser`, the hook its own WebSockets use): each piece is
    written to the upstream, and the caller's reading pauses while the upstream
    is behind."""

    def __init__(self, upstream: Upstream, caller: asyncio.BaseTransport) -> None:
        self.upstream = upstream
        self.caller = caller
        self.ended = asyncio.Event()
        self._resuming: asyncio.Task[None] | None = None

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        transport = self.upstream.transport
        if transport is None or transport.is_closing():
            self.ended.set()
            return True, b""
        transport.write(data)
        if self._resuming is None and transport.get_write_buffer_size() > HIGH:
            self.caller.pause_reading()  # type: ignore[attr-defined]
            self._resuming = asyncio.get_running_loop().create_task(self._resume())
        return False, b""

    async def _resume(self) -> None:
        await self.upstream.drained()
        self._resuming = None
        if not self.caller.is_closing():
            self.caller.resume_reading()  # type: ignore[attr-defined]

    def feed_eof(self) -> None:
        self.ended.set()

    def close(self) -> None:
        if self._resuming is not None:
            self._resuming.cancel()


class Upstream(asyncio.Protocol):
    """The connection to the upstream: its answer to the handshake is read here,
    then (`relay`) every byte it sends is written to the caller's transport from
    this callback, with no task, buffer or response object between them (a
    keystroke's echo crosses here once per key). Reading pauses while the
    caller is behind."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = bytearray()  # before the relay starts
        self.eof = False
        self.ended = asyncio.Event()  # the upstream closed
        self.caller: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False  # the upstream's writing, by its transport
        self._held = False  # reading paused before the relay began
        self._drain: asyncio.Future[None] | None = None
        self._resuming: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.caller is not None:
            self._relay(data)
            return
        self.received += data
        if len(self.received) > MAX_HEAD + MAX_REFUSAL and self.transport is not None:
            # More than a handshake's answer: the rest waits for the relay (a
            # terminal's replay can come right behind the 101).
            self._held = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake()
        self.ended.set()
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        """Once what the caller sent has gone to the upstream, down to its low mark."""
        if self._paused:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def head(self) -> bytes:
        """The answer's status line and headers (ValueError past MAX_HEAD, EOFError
        when the upstream closes first)."""
        while (end := self.received.find(b"\r\n\r\n")) < 0:
            if len(self.received) > MAX_HEAD:
                raise ValueError(f"the upstream's answer head is longer than {MAX_HEAD} bytes")
            if self.eof:
                raise EOFError("the upstream closed before it answered")
            await self._more()
        head = bytes(self.received[: end + 4])
        del self.received[: end + 4]
        return head

    async def exactly(self, size: int) -> bytes:
        """The next `size` bytes, or what came before the upstream closed."""
        while len(self.received) < size and not self.eof:
            await self._more()
        data = bytes(self.received[:size])
        del self.received[:size]
        return data

    def relay(self, caller: asyncio.Transport) -> None:
        """From now on the upstream's bytes go to `caller` as they come."""
        self.caller = caller
        if self.received:
            data = bytes(self.received)
            self.received.clear()
            self._relay(data)
        if self._held:
            self._held = False
            if self._resuming is None and self.transport is not None:
                self.transport.resume_reading()  # else _resume does, once the caller took it

    def _relay(self, data: bytes) -> None:
        caller = self.caller
        assert caller is not None
        if caller.is_closing():
            return
        caller.write(data)
        if self._resuming is None and caller.get_write_buffer_size() > HIGH:
            assert self.transport is not None
            self.transport.pause_reading()
            self._resuming = asyncio.get_running_loop().create_task(self._resume(caller))

    async def _resume(self, caller: asyncio.Transport) -> None:
        # The caller's transport belongs to aiohttp's protocol, whose drain
        # signal is not ours to take: its buffer is looked at until it is low
        # (only while a caller is more than HIGH behind).
        while caller.get_write_buffer_size() > LOW and not caller.is_closing():  # noqa: ASYNC110
            await asyncio.sleep(RESUME_POLL)
        self._resuming = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def close(self) -> None:
        if self._resuming is not None:
            self._resuming.cancel()
        if self.transport is not None:
            self.transport.close()


async def open_upstream(
    url: str,
    request: web.Request,
    headers: CIMultiDict[str],
    *,
    connect_seconds: float,
    answer_seconds: float,
) -> tuple[Upstream, CIMultiDict[str]]:
    """Send the caller's upgrade to `url` (http only: agents and preview ports are
    plain HTTP inside the cluster) with `headers`; the connection and the 101's
    headers. Refused when the answer is not a 101; OSError/TimeoutError/ValueError/
    EOFError when nothing usable came back."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http URL: {url}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not _TARGET.fullmatch(target):
        raise ValueError("the request target holds characters a request line cannot")
    outgoing = CIMultiDict(headers)
    for name in HANDSHAKE:
        outgoing.popall(name, None)
        for value in request.headers.getall(name, ()):
            outgoing.add(name, value)
    lines = [f"GET {target} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += ["Connection: Upgrade", "Upgrade: websocket"]
    lines += [f"{name}: {value}" for name, value in outgoing.items()]
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(connect_seconds):
        _, upstream = await loop.create_connection(Upstream, parts.hostname, parts.port or 80)
    try:
        assert upstream.transport is not None
        upstream.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        async with asyncio.timeout(answer_seconds):
            status, answer = _parse_head(await upstream.head())
            if status != 101:
                raise Refused(status, answer.get("Content-Type"), await _refusal(upstream, answer))
        if answer.get("Upgrade", "").lower() != "websocket":
            raise ValueError("the upstream's 101 does not upgrade to websocket")
        return upstream, answer
    except BaseException:
        upstream.close()
        raise


def _parse_head(head: bytes) -> tuple[int, CIMultiDict[str]]:
    status_line, *rest = head.decode("latin-1").split("\r\n")
    version, _, tail = status_line.partition(" ")
    code = tail[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
    answer: CIMultiDict[str] = CIMultiDict()
    for line in rest:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"a malformed header line: {line[:80]!r}")
            answer.add(name.strip(), value.strip())
    return int(code), answer


async def _refusal(upstream: Upstream, answer: CIMultiDict[str]) -> bytes:
    """A refusal's body when it says its length and that is small; else nothing."""
    length = answer.get("Content-Length", "")
    if not length.isdigit() or int(length) > MAX_REFUSAL:
        return b""
    body = await upstream.exactly(int(length))
    return body if len(body) == int(length) else b""


async def join(
    request: web.Request, upstream: Upstream, answer: CIMultiDict[str]
) -> web.StreamResponse:
    """Answer the caller's handshake with the upstream's 101, then pass bytes
    both ways until either side ends; the other is closed then."""
    headers = CIMultiDict({"Upgrade": "websocket", "Connection": "Upgrade"})
    for name in ANSWER:
        for value in answer.getall(name, ()):
            headers.add(name, value)
    response = web.StreamResponse(status=101, reason="Switching Protocols", headers=headers)
    response.force_close()  # the connection is the WebSocket's now, never reused
    caller = request.transport
    try:
        await response.prepare(request)
        if caller is None or caller.is_closing():
            return response
        inbound = _Inbound(upstream, caller)
        request.protocol.set_parser(inbound)  # type: ignore[arg-type]
        upstream.relay(caller)
        loop = asyncio.get_running_loop()
        ended = (loop.create_task(upstream.ended.wait()), loop.create_task(inbound.ended.wait()))
        try:
            await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        finally:
            inbound.close()
            for task in ended:
                task.cancel()
            for task in ended:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return response
    finally:
        upstream.close()
