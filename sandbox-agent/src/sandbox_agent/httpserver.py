"""A small HTTP/1.1 ASGI server (httptools parser, uvloop when available).

Why not uvicorn: measured on this workload, uvicorn hands request bodies to
the app in 64 KiB steps with a pause/resume of the socket for each, which
caps uploads at roughly a third of a plain disk copy, and its per-request
machinery is a noticeable share of a ``true`` round trip. This server buffers
request bodies in multi-MiB steps, writes small responses in one syscall,
and does only what the agent needs: keep-alive, pipelining (serially),
chunked request and response bodies, lazy ``100-continue``, HEAD, header
size limits and idle/header timeouts. uvicorn stays usable as a fallback
(SANDBOX_AGENT_SERVER=uvicorn).

Code inside the sandbox shares the pod's network namespace, so everything
here is bounded before authentication: the number of connections, the
requests parsed ahead of the one running (a client that pipelines without
reading answers is no longer read from), the answers waiting in the send
buffer (the next request starts only once it drained), and the body buffered
for an app that has not asked for it yet.

A connection is trusted once one of its requests carried the token (the auth
middleware says so through the ``sandbox_agent.authenticated`` scope
extension). Connections that never were cannot cost a trusted one or a probe
its slot: at the cap they are the first to go (those from inside the pod
first, then the oldest), and the body of a request answered before auth is
drained for at most ``PRE_AUTH_DISCARD_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools
import msgspec

from . import errors, websocket

log = logging.getLogger("sandbox_agent.http")

ASGIApp = Callable[..., Any]
Message = dict[str, Any]


def _error(code: errors.Code, message: str) -> bytes:
    return msgspec.json.encode(errors.error_body(code, message))


_INTERNAL_ERROR = _error("internal_error", "internal error")

MAX_HEADER_BYTES = 64 * 1024
BODY_HIGH_WATER = 8 << 20  # stop reading the socket while this much body is unread
IDLE_TIMEOUT = 75.0  # keep-alive connections with no request in flight
HEADER_TIMEOUT = 30.0  # a started request must finish its headers in this time
SEND_TIMEOUT = 120.0  # a client that reads nothing of its answers this long is dropped
MAX_DISCARD = 16 << 20  # unread request body we drain to keep a connection alive
# Streamed body bytes held for the end of a loop turn before they are written anyway.
PENDING_MAX = 64 << 10
# The same before authentication: a refused caller's body is drained briefly
# (closing at once could reset the connection before the 401 is read).
PRE_AUTH_MAX_DISCARD = 1 << 20
PRE_AUTH_DISCARD_TIMEOUT = 2.0
AUTHENTICATED = "sandbox_agent.authenticated"  # ASGI scope extension
MAX_PIPELINE = 8  # requests parsed and waiting behind the running one
# Bytes handed to the parser at once. httptools cannot stop in the middle of
# a buffer, so a small step bounds how many pipelined requests one feed can
# queue before the limit above is checked again (1 KiB of the smallest
# request is ~60 of them). A body the app is reading goes in larger steps.
FEED_STEP = 1 << 10
BODY_FEED_STEP = 64 << 10
PRE_READ_BODY = 64 << 10  # body buffered before the app asks for it (e.g. before auth)
MAX_CONNECTIONS = 128
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


class _Cycle:
    """One request/response exchange."""

    __slots__ = (
        "body",
        "body_done",
        "body_len",
        "body_returned",
        "chunked",
        "complete",
        "continue_needed",
        "disconnected",
        "head",
        "keep_alive",
        "proto",
        "receiving",
        "resp_headers",
        "response_done",
        "response_started",
        "scope",
        "status",
        "task",
        "waiter",
    )

    def __init__(self, proto: HttpProtocol, scope: Message, keep_alive: bool, expect: bool) -> None:
        self.proto = proto
        self.scope = scope
        self.body: deque[bytes] = deque()  # chunks as received
        self.body_len = 0
        self.body_done = False
        self.body_returned = False
        self.receiving = False  # the app asked for the body (it passed auth)
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.keep_alive = keep_alive
        self.continue_needed = expect
        self.head = scope["method"] == "HEAD"
        self.response_started = False
        self.response_done = False
        self.chunked = False
        self.complete = False
        self.status = 0
        self.resp_headers: list[tuple[bytes, bytes]] = []
        self.task: asyncio.Task[None] | None = None  # the app's, once it runs

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def receive(self) -> Message:
        if not self.receiving:
            self.receiving = True
            self.proto.unblock()
        if self.continue_needed and not self.body_done and not self.disconnected:
            self.continue_needed = False
            self.proto.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.body_returned:
            # ASGI: after the whole body, receive() blocks until disconnect
            # (or until the response is done, which ends the exchange).
            while not self.disconnected and not self.response_done:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
                self.waiter = None
            return {"type": "http.disconnect"}
        while not self.body and not self.body_done and not self.disconnected:
            self.waiter = asyncio.get_running_loop().create_future()
            self.proto.unblock()
            await self.waiter
            self.waiter = None
        if not self.body:  # disconnected, or an empty body
            if self.disconnected:
                return {"type": "http.disconnect"}
            self.body_returned = True
            return {"type": "http.request", "body": b"", "more_body": False}
        # One received chunk per message: large bodies are never joined here
        # (uploads hand the chunks to writev), small ones are a single chunk.
        data = self.body.popleft()
        self.body_len -= len(data)
        self.proto.unblock()
        last = self.body_done and not self.body
        if last:
            self.body_returned = True
        return {"type": "http.request", "body": data, "more_body": not last}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("response already started")
            self.response_started = True
            self.status = int(message["status"])
            self.resp_headers = list(message.get("headers", ()))
            return
        if kind != "http.response.body":
            return
        if not self.response_started or self.response_done:
            raise RuntimeError("body sent before start or after end")
        if self.disconnected:
            return
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        head = bytearray()
        if not self.complete:
            self.complete = True  # headers go out with the first body message
            head += _status_line(self.status)
            has_length = False
            for name, value in self.resp_headers:
                lname = name.lower()
                if lname == b"content-length":
                    has_length = True
                elif lname == b"connection" and value.lower() == b"close":
                    self.keep_alive = False
                head += name + b": " + value + b"\r\n"
            if not has_length and self.status not in (204, 304) and self.status >= 200:
                if more:
                    self.chunked = True
                    head += b"transfer-encoding: chunked\r\n"
                else:
                    head += b"content-length: %d\r\n" % len(body)
            if not self.keep_alive:
                head += b"connection: close\r\n"
            head += b"\r\n"
        tail = b""
        if self.head:
            body = b""
        elif self.chunked and body:
            head += b"%x\r\n" % len(body)
            tail = b"\r\n"
        if not more:
            if self.chunked and not self.head:
                tail += b"0\r\n\r\n"
            self.response_done = True
        proto = self.proto
        if len(body) <= 65536:
            # One write (one syscall) for the common small response.
            out = bytes(head) + body + tail if head or tail else body
            if out and more:
                # A piece of a stream goes out at the end of this loop turn, with
                # what else the app sends in it: an event stream's last event and
                # its end in one write, which the client reads at once (and the
                # gateway passes on as one).
                proto.write_soon(out)
            elif out:
                proto.write(out)
        else:
            if head:
                proto.write(bytes(head))
            proto.write(body)  # large bodies are not copied into the header buffer
            if tail:
                proto.write(tail)
        if self.response_done:
            self.wake()
            self.proto.cycle_done(self)
        else:
            await self.proto.drain()


class HttpProtocol(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.parsing: _Cycle | None = None  # request whose bytes are arriving
        self.running: _Cycle | None = None  # request whose app is running
        self.queue: deque[_Cycle] = deque()
        # Received bytes not parsed yet because the connection is blocked
        # (see _blocked): at most one read's worth, since reading is paused.
        self.backlog: bytes | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.send_timer: asyncio.TimerHandle | None = None
        self.discarding: _Cycle | None = None
        # Pieces of a streamed body waiting for the end of the loop turn (write_soon).
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.flush_handle: asyncio.Handle | None = None
        self.discarded = 0
        self.closed = False
        self.last_active = self.opened = self.loop.time()
        # One request carried the token; until then the connection is the
        # first to go at the cap (Server.admit).
        self.trusted = False
        # Its peer is this pod: loopback, or the address it connected to (code
        # in the sandbox). The gateway, the operator and the kubelet are not.
        self.from_pod = False
        self.extensions = {AUTHENTICATED: self.authenticated}
        self.ws: websocket.WebSocketSession | None = None  # once upgraded

    # -- transport callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.server.admit(self):
            # Over the cap with nothing idle to evict: refuse without reading.
            body = _error("too_many_connections", "too many connections")
            transport.write(  # type: ignore[attr-defined]
                _status_line(503)
                + b"content-type: application/json\r\nconnection: close\r\n"
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
            self.closed = True
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        sock = transport.get_extra_info("sockname")
        self.local = (sock[0], sock[1]) if isinstance(sock, tuple) else None
        self.from_pod = _from_pod(self.client, self.local)
        s = transport.get_extra_info("socket")
        if s is not None:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm(IDLE_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.backlog = None
        self.server.connections.discard(self)
        self._disarm()
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None
        for cycle in (self.running, self.parsing, *self.queue):
            if cycle is not None:
                cycle.disconnected = True
                cycle.wake()
        cycle = self.running
        if cycle is not None and cycle.task is not None and cycle.response_started:
            # A streamed answer whose client left: its producer stops now, not
            # at its next event (a command can be silent for an hour). This is
            # how apps learn of it (ASGI 2.4: nobody waits on receive() for it).
            cycle.task.cancel()
        if self.ws is not None:
            self.ws.disconnected()
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        if self.ws is not None:
            self.ws.feed(data)
            return
        if self.backlog is not None:
            # A read that raced our pause: keep it behind the backlog. Reading
            # is paused, so this happens at most once per block.
            self.backlog += data
            if len(self.backlog) > MAX_HEADER_BYTES + BODY_HIGH_WATER:
                self.close()
            return
        self._feed(memoryview(data))

    def _feed(self, view: memoryview) -> None:
        pos, end = 0, len(view)
        while pos < end and not self.closed:
            if self._blocked():
                self.backlog = bytes(view[pos:])
                self.pause_reading()
                return
            cycle = self.parsing
            receiving = cycle is not None and cycle is self.running and cycle.receiving
            step = BODY_FEED_STEP if receiving else FEED_STEP
            try:
                self.parser.feed_data(view[pos : pos + step])
            except httptools.HttpParserUpgrade as exc:
                if self.ws is None:
                    self._reject(400, "upgrades other than to a WebSocket are not supported")
                elif (rest := view[pos + int(exc.args[0] if exc.args else step) :]).nbytes:
                    self.ws.feed(bytes(rest))  # sent before our answer: kept for later
                return
            except httptools.HttpParserError as exc:
                cause = exc.__context__
                if isinstance(cause, _TooLarge):
                    self._reject(431, "request headers too large")
                else:
                    self._reject(400, "malformed HTTP request")
                return
            pos += step

    def _blocked(self) -> bool:
        """True while no more received bytes may be parsed."""
        if self.writing_paused or len(self.queue) >= MAX_PIPELINE:
            return True
        cycle = self.parsing
        if cycle is None or cycle.response_done:
            return False  # the body of an answered request is dropped as it comes
        return cycle.body_len >= self._body_limit(cycle)

    def _body_limit(self, cycle: _Cycle) -> int:
        # Only the running app that asked for its body gets the large buffer:
        # a queued request, or one whose app has not passed auth, gets little.
        return BODY_HIGH_WATER if cycle is self.running and cycle.receiving else PRE_READ_BODY

    def unblock(self) -> None:
        """Parse what was held back and read again, as far as the limits allow."""
        if self.closed or self.ws is not None:
            return  # a WebSocket session reads as its app takes messages
        if self.backlog is not None and not self._blocked():
            data, self.backlog = self.backlog, None
            self._feed(memoryview(data))
        if self.backlog is None and not self._blocked():
            self.resume_reading()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.send_timer is None:
            self.send_timer = self.loop.call_later(SEND_TIMEOUT, self._abort)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self.running is None and self.discarding is None and self.queue:
            self._next()
        else:
            self.unblock()

    # -- parser callbacks ----------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.header_bytes = 0
        self._arm(HEADER_TIMEOUT)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise _TooLarge()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES or len(self.headers) > 200:
            raise _TooLarge()
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._disarm()
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        method = self.parser.get_method().decode("ascii")
        if self.parser.should_upgrade() and websocket.is_upgrade(method, self.headers):
            self._upgrade(parsed, raw_path)
            return
        scope: Message = {
            "type": "http",
            # 2.4: a streamed answer needs no task of its own listening for the
            # disconnect (Starlette's StreamingResponse spawns one below 2.4);
            # connection_lost cancels the app instead.
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": self.parser.get_http_version(),
            "server": self.local,
            "client": self.client,
            "scheme": "http",
            "method": self.parser.get_method().decode("ascii"),
            "root_path": "",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self.headers,
            "state": dict(self.server.state),
            "extensions": self.extensions,
        }
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in self.headers)
        cycle = _Cycle(self, scope, self.parser.should_keep_alive(), expect)
        self.parsing = cycle
        if self.running is None and self.discarding is None and not self.writing_paused:
            self._start(cycle)
        else:
            self.queue.append(cycle)

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None:
            return
        if cycle.response_done:
            self.discarded += len(body)
            if self.discarded > (MAX_DISCARD if self.trusted else PRE_AUTH_MAX_DISCARD):
                self.close()
            return  # the app answered without reading; drop the rest
        cycle.body.append(body)
        cycle.body_len += len(body)
        cycle.wake()

    def _upgrade(self, parsed: Any, raw_path: bytes) -> None:
        """Hand the connection to a WebSocket session: no more HTTP on it."""
        key = dict(self.headers)[b"sec-websocket-key"]
        self.ws = session = websocket.WebSocketSession(self, key)
        scope: Message = {
            "type": "websocket",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": self.parser.get_http_version(),
            "server": self.local,
            "client": self.client,
            "scheme": "ws",
            "root_path": "",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self.headers,
            "subprotocols": websocket.subprotocols(self.headers),
            "state": dict(self.server.state),
            "extensions": {**self.extensions, websocket.DENIAL: {}},
        }
        self.loop.create_task(self._run_ws(scope, session))

    async def _run_ws(self, scope: Message, session: websocket.WebSocketSession) -> None:
        try:
            await self.app(scope, session.receive, session.send)
        except Exception:
            log.exception("unhandled error on WebSocket %s", scope.get("path"))
            if not session.accepted and not session.finished:
                body = _INTERNAL_ERROR
                await session.send({"type": "websocket.http.response.start", "status": 500})
                await session.send({"type": "websocket.http.response.body", "body": body})
        if not session.finished:
            # The app returned without closing: close for it (1000 after the
            # handshake, 403 before it, as ASGI servers do).
            await session.send({"type": "websocket.close", "code": 1000})

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response on a connection that ends with it (a refused WebSocket)."""
        head = bytearray(_status_line(status))
        for name, value in headers:
            if name.lower() not in (b"content-length", b"connection"):
                head += name + b": " + value + b"\r\n"
        head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.write(bytes(head) + body)

    def on_message_complete(self) -> None:
        cycle = self.parsing
        if cycle is not None:
            cycle.body_done = True
            cycle.wake()
        self.parsing = None
        if cycle is not None and self.discarding is cycle:
            self.discarding = None
            self.discarded = 0
            self._next()

    # -- helpers -------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self.running = cycle
        cycle.task = self.loop.create_task(self._run(cycle))

    async def _run(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            if not cycle.disconnected:
                raise  # the server is stopping
        except Exception:
            if cycle.response_done:
                # The app's error handler answered (a 500) and then re-raised,
                # as Starlette does: the exchange is complete, the connection
                # stays usable.
                log.error("error in request %s", cycle.scope.get("path"), exc_info=True)
                return
            log.exception("unhandled error in request %s", cycle.scope.get("path"))
            if not cycle.response_started and not cycle.disconnected:
                cycle.keep_alive = False
                await cycle.send(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await cycle.send({"type": "http.response.body", "body": _INTERNAL_ERROR})
                return
            self.close()
            return
        if not cycle.response_done and not cycle.disconnected:
            log.error("app returned without completing the response to %s", cycle.scope["path"])
            self.close()

    def cycle_done(self, cycle: _Cycle) -> None:
        if self.running is not cycle:
            return
        self.running = None
        self.last_active = self.loop.time()
        cycle.body.clear()  # what the app did not read is not needed any more
        cycle.body_len = 0
        if not cycle.keep_alive:
            self.close()
            return
        if not cycle.body_done:
            # Answered before the body arrived (an error, usually). Closing now
            # would reset the connection and could destroy the response in
            # flight, so read and drop the rest (bounded), then carry on.
            self.discarding = cycle
            self.unblock()
            self._arm(HEADER_TIMEOUT if self.trusted else PRE_AUTH_DISCARD_TIMEOUT)
            return
        self._next()

    def _next(self) -> None:
        if self.writing_paused:
            # The client is not reading its answers: start nothing more until
            # the send buffer drains (resume_writing calls back here).
            return
        if self.queue:
            self._start(self.queue.popleft())
        elif self.parsing is None and self.backlog is None:
            self._arm(IDLE_TIMEOUT)
        self.unblock()

    def authenticated(self) -> None:
        """Called by the auth middleware when a request carried the token."""
        self.trusted = True

    @property
    def idle(self) -> bool:
        if self.ws is not None:
            return self.ws.finished
        return self.running is None and self.parsing is None and not self.queue

    @property
    def stalled(self) -> bool:
        """Its client does not read what it is sent (or holds back what it sends)."""
        return self.writing_paused or self.backlog is not None

    def write(self, data: bytes | bytearray) -> None:
        """Write now, after what `write_soon` holds."""
        if self.pending:
            data = self._take_pending() + data
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def write_soon(self, data: bytes) -> None:
        """Write at the end of this loop turn, with what follows in the same turn
        (at once past PENDING_MAX: the transport's flow control must see it, or
        an app that sends without yielding would buffer without bound)."""
        self.pending.append(data)
        self.pending_size += len(data)
        if self.pending_size > PENDING_MAX:
            self.write(b"")
        elif self.flush_handle is None:
            self.flush_handle = self.loop.call_soon(self._flush)

    def _take_pending(self) -> bytes:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        data = b"".join(self.pending)
        self.pending.clear()
        self.pending_size = 0
        return data

    def _flush(self) -> None:
        self.flush_handle = None
        if self.pending:
            self.write(b"")

    async def drain(self) -> None:
        if self.writing_paused and not self.closed:
            self.drain_waiter = self.loop.create_future()
            await self.drain_waiter
            self.drain_waiter = None

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.pending:
            self.write(b"")
        if not self.closed and self.transport is not None:
            self.closed = True
            self.backlog = None
            self.transport.close()

    def _abort(self) -> None:
        # close() would wait for the send buffer to drain, which a client that
        # does not read never lets happen.
        if self.transport is not None:
            self.closed = True
            self.backlog = None
            self.transport.abort()

    def _reject(self, status: int, message: str) -> None:
        if self.running is None or not self.running.response_started:
            body = _error("bad_http", message)
            self.write(
                _status_line(status)
                + b"content-type: application/json\r\nconnection: close\r\n"
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
        self.close()

    def _arm(self, delay: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay, self._timeout)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timeout(self) -> None:
        if self.running is None or self.discarding is not None:
            self.close()


class _TooLarge(Exception):
    pass


def _from_pod(peer: tuple[str, int] | None, local: tuple[str, int] | None) -> bool:
    if peer is None:
        return True  # a Unix socket: on this machine
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return True
    return address.is_loopback or (local is not None and peer[0] == local[0])


def _eviction_order(conn: HttpProtocol) -> tuple[int, float] | None:
    """Which connection goes first at the cap (lowest first); None: never.

    Never-authenticated ones first (from inside the pod before the others,
    oldest connection first: a client cannot make an old connection young by
    trickling bytes), then authenticated ones that are idle or draining an
    unread body, then those whose client reads none of their answers. An
    authenticated connection with a request running stays."""
    if not conn.trusted:
        return (0 if conn.from_pod else 1, conn.opened)
    if conn.idle or conn.discarding is not None:
        return (2, conn.last_active)
    if conn.stalled:
        return (3, conn.last_active)
    return None


class Server:
    """Binds, runs the ASGI lifespan, serves until SIGTERM/SIGINT."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        max_connections: int = MAX_CONNECTIONS,
        sock: socket.socket | None = None,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.sock = sock  # already listening (see server.main), else bound here
        self.connections: set[HttpProtocol] = set()
        self.state: dict[str, Any] = {}
        self.started = False

    def admit(self, conn: HttpProtocol) -> bool:
        """Room for a new connection: at the cap one is closed for it
        (`_eviction_order`: never-authenticated first, then idle, then
        stalled); with none of those the new one is refused. The number stays
        bounded, and only requests that carried the token can hold a slot."""
        if len(self.connections) >= self.max_connections:
            ranked = [(order, c) for c in self.connections if (order := _eviction_order(c))]
            if not ranked:
                return False
            victim = min(ranked, key=lambda pair: pair[0])[1]
            self.connections.discard(victim)
            if victim.stalled:
                victim._abort()  # close() would wait for a client that does not read
            else:
                victim.close()
        self.connections.add(conn)
        return True

    async def _lifespan(self, startup_done: asyncio.Future[None], stop: asyncio.Event) -> None:
        sent_startup = False

        async def receive() -> Message:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: Message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete" and not startup_done.done():
                startup_done.set_result(None)
            elif kind == "lifespan.startup.failed" and not startup_done.done():
                startup_done.set_exception(RuntimeError(message.get("message", "startup failed")))

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            if not startup_done.done():
                startup_done.set_exception(exc)
            else:
                log.exception("lifespan failed")

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        startup: asyncio.Future[None] = loop.create_future()
        lifespan = loop.create_task(self._lifespan(startup, stop))
        await startup
        if self.sock is not None:
            server = await loop.create_server(lambda: HttpProtocol(self), sock=self.sock)
        else:
            server = await loop.create_server(
                lambda: HttpProtocol(self), self.host, self.port, reuse_address=True, backlog=1024
            )
        self.started = True
        log.info("sandbox-agent listening on http://%s:%d", self.host, self.port)
        await stop.wait()
        log.info("shutting down")
        server.close()
        for conn in list(self.connections):
            if conn.running is None:
                conn.close()
        for _ in range(50):  # let in-flight requests finish, at most 5 s
            if not any(c.running for c in self.connections):
                break
            await asyncio.sleep(0.1)
        for conn in list(self.connections):
            conn.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await lifespan


def run(
    app: ASGIApp,
    host: str,
    port: int,
    max_connections: int = MAX_CONNECTIONS,
    sock: socket.socket | None = None,
) -> bool:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    server = Server(app, host, port, max_connections, sock)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(server.serve())
    return server.started
