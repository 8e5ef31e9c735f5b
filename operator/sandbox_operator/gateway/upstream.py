"""A lean HTTP/1.1 client for the gateway's calls whose body is in hand.

Most calls through the gateway carry a small body or none (a command, a code
cell, a path) and get a small answer or an event stream. aiohttp's client
cost the gateway 0.3-0.4 ms of CPU per such call (a request object, a URL,
merged headers, a response object, a stream reader, timers): about half of
what forwarding a call costs it, measured on a `run_code`'s shape. This
client writes the request head and body in one write on a kept-alive
connection and parses the answer with httptools (llhttp, as the agent's own
server does), handing the body on as it arrives.

It takes the calls proxy.py has read whole (<= proxy.SMALL) or that have no
body, except HEAD (whose answer announces a body it does not send: only the
request says so, and this parser reads answers alone). Streamed uploads keep
aiohttp's client.

An `Answer` offers what proxy.py reads of aiohttp's ClientResponse: status,
headers, content_length, content.iter_any() / at_eof(), read(), release(),
close(). A connection goes back to its pool only after a complete answer
that lets it stay open; any other end closes it, which is how the agent
learns that its caller left.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Mapping

import httptools
from multidict import CIMultiDict
from yarl import URL

# An answer's head (status line and headers), at most.
MAX_HEAD = 64 << 10
# Body bytes received and not yet taken: past this the connection is not read
# until they are (a caller that reads slowly slows its upstream, not our memory).
HIGH = 1 << 20
# The most handed on at once: a bulk copy takes its turn (proxy.Fairness) per
# piece, so a piece is what it may send while a short call waits (aiohttp's
# reader hands on what one read brought: up to 256 KiB with uvloop).
PIECE = 1 << 18
# Idle connections to one upstream kept, and for how long: under the agent's
# own idle timeout (75 s), so the gateway never writes to one the agent closed.
KEEP = 16
KEEP_SECONDS = 30.0
# What the upstream must not get from us: the body is whole, so nothing waits
# for a 100 Continue, and the gateway sets the framing itself.
_DROP = {"expect", "content-length", "transfer-encoding", "host", "connection"}


class BrokenAnswer(ConnectionResetError):
    """The upstream's answer is not HTTP/1.1 this client can read, or it broke off."""


class _Connection(asyncio.Protocol):
    """One connection to an upstream, and the answer being read on it."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.informational = False  # a 1xx answer, before the real one
        self.header_list: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.body: collections.deque[bytes] = collections.deque()
        self.offset = 0  # into body[0]: what of it was handed on
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None  # lost, or an answer we cannot read
        # While kept idle: its pool's way to let go of it when it closes or
        # has waited KEEP_SECONDS (a pod that went away never says so).
        self.expiry: asyncio.TimerHandle | None = None
        self.on_idle_end: Callable[[_Connection], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.complete:
            # Bytes nobody asked for (on an idle connection, or after an answer):
            # the connection cannot be trusted with another request.
            self._fail(BrokenAnswer("the upstream sent bytes outside an answer"))
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(BrokenAnswer(f"the upstream's answer is not valid HTTP/1.1: {exc}"))

    def eof_received(self) -> bool:
        return False  # close: connection_lost ends what is in progress

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = BrokenAnswer(
                "the upstream closed the connection"
                + ("" if exc is None else f": {exc}")
                + ("" if self.complete else " before its answer ended")
            )
        self.keep_alive = False
        if self.head is not None and not self.head.done():
            self.head.set_exception(self.error)
        self._wake()
        if self.on_idle_end is not None:
            self.on_idle_end(self)

    # -- httptools callbacks ---------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD:
            raise BrokenAnswer(f"the upstream's answer head is longer than {MAX_HEAD} bytes")
        self.header_list.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        if self.status == 101:
            raise BrokenAnswer("the upstream switched protocols unasked")
        if 100 <= self.status < 200:
            # 100 Continue, 103 Early Hints: the answer is still to come.
            self.informational = True
            self.header_list, self.head_bytes = [], 0
            return
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > HIGH and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self.parser is not None
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- the exchange ----------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[None]:
        """Write a request; the future resolves once the answer's head is in."""
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.head = asyncio.get_running_loop().create_future()
        self.status, self.head_bytes, self.buffered = 0, 0, 0
        self.informational = False
        self.header_list = []
        self.body.clear()
        self.offset = 0
        self.complete = self.keep_alive = False
        self.transport.write(request)
        return self.head

    def take(self) -> bytes:
        """What has arrived, up to PIECE bytes (a long read is handed on in
        pieces from an offset into it, never copied again for each)."""
        first = self.body[0]
        if not self.offset and len(first) >= PIECE // 2 and len(first) <= PIECE:
            # A long read as it came: no copy (the common case of a download).
            self.body.popleft()
            self._taken(len(first))
            return first
        pieces: list[memoryview] = []
        size = 0
        while self.body and size < PIECE:
            view = memoryview(self.body[0])[self.offset :]
            n = min(len(view), PIECE - size)
            pieces.append(view[:n])
            size += n
            if n == len(view):
                self.body.popleft()
                self.offset = 0
            else:
                self.offset += n
        self._taken(size)
        return b"".join(pieces)

    def _taken(self, size: int) -> None:
        self.buffered -= size
        if self._paused and self.buffered <= HIGH // 2 and self.transport is not None:
            self._paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    async def more(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.keep_alive = False
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        self._wake()
        self.close()

    @property
    def usable(self) -> bool:
        return self.error is None and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Body:
    """`Answer.content`: the body as it arrives (aiohttp's StreamReader's shape)."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    async def iter_any(self) -> AsyncIterator[bytes]:
        c = self._connection
        while True:
            if c.body:
                yield c.take()
            elif c.complete:
                return
            elif c.error is not None:
                raise c.error
            else:
                await c.more()

    def at_eof(self) -> bool:
        return self._connection.complete and not self._connection.body


class Answer:
    """An upstream's answer: its head at once, its body as it comes."""

    def __init__(self, pool: Pool, connection: _Connection, upstream: _Upstream) -> None:
        self._pool = pool
        self._connection = connection
        self._upstream = upstream
        self._done = False
        self.status = connection.status
        # As aiohttp's parser decodes them, so both clients pass on the same text.
        self.headers: CIMultiDict[str] = CIMultiDict(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
            for name, value in connection.header_list
        )
        self.content = _Body(connection)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length", "")
        return int(value) if value.isdigit() else None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.content.iter_any()])

    def release(self) -> None:
        """Done with the answer: its connection is kept if the answer was whole."""
        if not self._done:
            self._done = True
            self._pool.put(self._connection, self._upstream)

    def close(self) -> None:
        """Done before the answer ended: the connection goes (the upstream sees it)."""
        if not self._done:
            self._done = True
            self._pool.drop(self._connection, self._upstream)


class _Upstream:
    """One upstream's idle connections, and its calls in flight or waiting for a
    slot (`users`: while there are any, or idle connections, it is kept)."""

    def __init__(self, limit: int) -> None:
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(limit)
        self.users = 0


class Pool:
    """Kept-alive connections to every upstream, at most `per_upstream` in use
    at once to one (as aiohttp's connector allowed): more wait for a slot."""

    def __init__(self, connect_seconds: float, per_upstream: int = 64) -> None:
        self.connect_seconds = connect_seconds
        self.per_upstream = per_upstream
        self._upstreams: dict[tuple[str, int], _Upstream] = {}

    async def request(
        self,
        method: str,
        url: str,
        query: Mapping[str, str] | None,
        headers: Mapping[str, str],
        body: bytes | None,
    ) -> Answer:
        """Send the request and wait for the answer's head. OSError (BrokenAnswer
        among them) or TimeoutError when the upstream cannot be reached or answers
        with something that is not HTTP/1.1."""
        target = URL(url)
        if query:
            target = target.extend_query(query)
        host, port = target.raw_host or "", target.port or 80
        lines = [f"{method} {target.raw_path_qs} HTTP/1.1", f"Host: {target.raw_authority}"]
        lines += [
            f"{name}: {value}" for name, value in headers.items() if name.lower() not in _DROP
        ]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        if body:
            request += body
        key = (host, port)
        upstream = self._upstreams.get(key)
        if upstream is None:
            upstream = self._upstreams[key] = _Upstream(self.per_upstream)
        upstream.users += 1
        try:
            await upstream.slots.acquire()
        except BaseException:
            self._leave(key, upstream, slot=False)
            raise
        connection: _Connection | None = None
        try:
            connection = await self._connection(key, upstream)
            await connection.send(request)
            return Answer(self, connection, upstream)
        except BaseException:
            # Cancelled (the caller left) or failed: closed, so the upstream sees it.
            if connection is not None:
                connection.close()
            self._leave(key, upstream)
            raise

    async def _connection(self, key: tuple[str, int], upstream: _Upstream) -> _Connection:
        while upstream.idle:
            connection = upstream.idle.pop()
            self._unpark(connection)
            if connection.usable:
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_seconds):
            _, connection = await loop.create_connection(lambda: _Connection(key), *key)
        return connection

    def put(self, connection: _Connection, upstream: _Upstream) -> None:
        """An answer was read to its end: its connection is kept if it may be."""
        if (
            connection.complete
            and connection.keep_alive
            and connection.usable
            and len(upstream.idle) < KEEP
            and self._upstreams.get(connection.key) is upstream
        ):
            connection.parser = None
            upstream.idle.append(connection)
            connection.on_idle_end = lambda c: self._let_go(c, upstream)
            connection.expiry = asyncio.get_running_loop().call_later(
                KEEP_SECONDS, connection.close
            )
        else:
            connection.close()
        self._leave(connection.key, upstream)

    def _unpark(self, connection: _Connection) -> None:
        connection.on_idle_end = None
        if connection.expiry is not None:
            connection.expiry.cancel()
            connection.expiry = None

    def _let_go(self, connection: _Connection, upstream: _Upstream) -> None:
        """An idle connection closed: out of its pool, and the pool's entry for
        its upstream with it when nothing else is left there."""
        self._unpark(connection)
        with contextlib.suppress(ValueError):
            upstream.idle.remove(connection)
        key = connection.key
        if not upstream.users and not upstream.idle and self._upstreams.get(key) is upstream:
            del self._upstreams[key]

    def drop(self, connection: _Connection, upstream: _Upstream) -> None:
        connection.close()
        self._leave(connection.key, upstream)

    def _leave(self, key: tuple[str, int], upstream: _Upstream, slot: bool = True) -> None:
        if slot:
            upstream.slots.release()
        upstream.users -= 1
        if not upstream.users and not upstream.idle and self._upstreams.get(key) is upstream:
            del self._upstreams[key]

    def idle(self) -> int:
        """Connections kept for the next call, to all upstreams."""
        return sum(len(upstream.idle) for upstream in self._upstreams.values())

    def close(self) -> None:
        for upstream in list(self._upstreams.values()):
            for connection in list(upstream.idle):
                connection.close()
