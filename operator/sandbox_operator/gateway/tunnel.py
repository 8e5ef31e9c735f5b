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
CHUNK = 1 << 16
# The caller's bytes waiting for the upstream to take them: past HIGH the caller
# is not read until they are down to the transport's own low-water mark.
HIGH = 1 << 20
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

    def __init__(self, upstream: asyncio.StreamWriter, caller: asyncio.BaseTransport) -> None:
        self.upstream = upstream
        self.caller = caller
        self.ended = asyncio.Event()
        self._resuming: asyncio.Task[None] | None = None

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self.upstream.is_closing():
            self.ended.set()
            return True, b""
        self.upstream.write(data)
        if self._resuming is None and self.upstream.transport.get_write_buffer_size() > HIGH:
            self.caller.pause_reading()  # type: ignore[attr-defined]
            self._resuming = asyncio.get_running_loop().create_task(self._resume())
        return False, b""

    async def _resume(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.upstream.drain()
        self._resuming = None
        if not self.caller.is_closing():
            self.caller.resume_reading()  # type: ignore[attr-defined]

    def feed_eof(self) -> None:
        self.ended.set()

    def close(self) -> None:
        if self._resuming is not None:
            self._resuming.cancel()


async def open_upstream(
    url: str,
    request: web.Request,
    headers: CIMultiDict[str],
    *,
    connect_seconds: float,
    answer_seconds: float,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, CIMultiDict[str]]:
    """Send the caller's upgrade to `url` (http only: agents and preview ports are
    plain HTTP inside the cluster) with `headers`; the connection and the 101's
    headers. Refused when the answer is not a 101; OSError/TimeoutError/ValueError
    when nothing usable came back."""
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
    async with asyncio.timeout(connect_seconds):
        reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or 80, limit=MAX_HEAD
        )
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        async with asyncio.timeout(answer_seconds):
            head = await reader.readuntil(b"\r\n\r\n")
            status, answer = _parse_head(head)
            if status != 101:
                raise Refused(status, answer.get("Content-Type"), await _refusal(reader, answer))
        if answer.get("Upgrade", "").lower() != "websocket":
            raise ValueError("the upstream's 101 does not upgrade to websocket")
        return reader, writer, answer
    except BaseException:
        writer.close()
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


async def _refusal(reader: asyncio.StreamReader, answer: CIMultiDict[str]) -> bytes:
    """A refusal's body when it says its length and that is small; else nothing."""
    length = answer.get("Content-Length", "")
    if not length.isdigit() or int(length) > MAX_REFUSAL:
        return b""
    with contextlib.suppress(asyncio.IncompleteReadError):
        return await reader.readexactly(int(length))
    return b""


async def join(
    request: web.Request,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    answer: CIMultiDict[str],
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
        inbound = _Inbound(writer, caller)
        request.protocol.set_parser(inbound)  # type: ignore[arg-type]
        outbound = asyncio.get_running_loop().create_task(_outbound(reader, response))
        left = asyncio.get_running_loop().create_task(inbound.ended.wait())
        try:
            await asyncio.wait((outbound, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            inbound.close()
            for task in (outbound, left):
                task.cancel()
            for task in (outbound, left):
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await task
        return response
    finally:
        writer.close()


async def _outbound(reader: asyncio.StreamReader, response: web.StreamResponse) -> None:
    """The upstream's bytes to the caller, waiting for the caller to take them."""
    while data := await reader.read(CHUNK):
        await response.write(data)
