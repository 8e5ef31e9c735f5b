"""A WebSocket (RFC 6455) on a connection that httpx upgraded.

The opening handshake is an ordinary GET of httpx (`AsyncGateway.websocket`),
so the WebSocket takes every way the SDK has to the gateway with that way's
TLS, credentials and headers: a direct URL, the cluster DNS name, `kubectl
port-forward`, and the API server's service proxy (which passes an upgrade on
to the Service as it does any request). After the 101 answer httpcore hands
over the connection's byte stream; wsproto frames messages on it (masking,
fragments, pings, the closing handshake). No extension is offered: the
messages are keystrokes and screen output, where compressing costs time.

One task (or thread) receives while others send. In the sync twin that
needs care: a TLS connection's reads and writes must never overlap (OpenSSL
does not allow it), so every read and write holds the connection's lock, and
a read starts only once bytes are there to read (`_sync_io.readable`), which
keeps a waiting receiver from holding up a send.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import os
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpcore
import httpx
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Message, Ping, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from sandbox_sdk._async_io import Lock, interrupt, readable, reading

# Bytes asked of one read. More than httpcore reads at a time (64 KiB), so the
# first read takes, whole, what httpcore read past the handshake's head, which
# `readable` (the sync twin's wait) would not see: it looks at the socket.
READ_BYTES = 1 << 20
# A received message larger than this closes the connection (1009): the agent
# sends at most 64 KiB of output per message.
MAX_MESSAGE = 16 << 20
# How long a send may wait for the peer to take the bytes.
WRITE_TIMEOUT = 60.0
# The shortest read: an async read with a timeout of 0 would be cancelled
# before it looked at the socket at all.
MIN_READ_WAIT = 0.005
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept_key(key: str) -> str:
    """The `Sec-WebSocket-Accept` a server answers to `key`."""
    return base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()


async def handshake(
    http: httpx.AsyncClient,
    url: str,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    timeout: httpx.Timeout | None = None,
) -> AsyncWebSocket | httpx.Response:
    """Open a WebSocket to `url` with a GET of `http` that asks to upgrade: the
    WebSocket, or the answer that was not an upgrade (its body read). httpx's
    own errors (the connection failed) are raised as they are."""
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = {
        **(headers or {}),
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": key,
    }
    opening = http.stream("GET", url, params=params, headers=upgrade, timeout=timeout)
    response = await opening.__aenter__()
    accepted = response.headers.get("sec-websocket-accept") == accept_key(key)
    if response.status_code == 101 and accepted:
        return AsyncWebSocket(opening, response.extensions["network_stream"])
    try:
        if response.status_code != 101:
            await response.aread()
    finally:
        await opening.__aexit__(None, None, None)
    if response.status_code == 101:
        raise httpx.RemoteProtocolError("the WebSocket handshake's answer does not match its key")
    return response


class AsyncWebSocket:
    """Messages both ways on an upgraded connection: `send` bytes (a binary
    message) or str (text); `receive` the next one. `closed` once no more
    will come (`close_code` says how it ended: 1006 for a lost connection)."""

    def __init__(self, response: AbstractAsyncContextManager[httpx.Response], stream: Any) -> None:
        self._response = response  # open while the WebSocket is: its exit closes the socket
        self._stream = stream  # httpcore's network stream of the connection
        self._ws = Connection(ConnectionType.CLIENT)
        self._messages: collections.deque[bytes | str] = collections.deque()
        self._parts: list[bytes | str] = []
        self._size = 0
        self._lock = Lock()
        self.closed = False
        self.close_code: int | None = None
        self._released = False
        self._started = False  # a first read was made

    @property
    def buffered(self) -> bool:
        """A message was received and is waiting: `receive` returns it without I/O."""
        return bool(self._messages)

    async def send(self, message: bytes | str) -> None:
        """Send one message; ConnectionError when the connection is closed or broke."""
        if isinstance(message, str):
            await self._write(TextMessage(data=message))
        else:
            await self._write(BytesMessage(data=message))

    async def _write(self, event: Event) -> None:
        async with self._lock:
            try:
                data = self._ws.send(event)
            except LocalProtocolError:
                raise ConnectionResetError("the WebSocket is closed") from None
            try:
                await self._stream.write(data, WRITE_TIMEOUT)
            except (httpcore.NetworkError, httpcore.TimeoutException, OSError) as exc:
                raise ConnectionResetError(f"the WebSocket broke off: {exc}") from exc

    async def receive(self, timeout: float | None = None) -> bytes | str | None:
        """The next message (bytes: binary, str: text), None once the connection
        is closed; TimeoutError when none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._messages:
            if self.closed:
                return None
            left = None if deadline is None else max(MIN_READ_WAIT, deadline - time.monotonic())
            await self._fill(left)
            if not self._messages and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("no WebSocket message in time")
        return self._messages.popleft()

    async def _fill(self, timeout: float | None) -> None:
        """One read from the connection, and what wsproto makes of it."""
        # The first read goes straight to the stream: it returns what httpcore
        # read past the handshake's head first, which `readable` cannot see.
        if self._started and not await readable(self._stream, timeout):
            return
        self._started = True
        events: list[Event] = []
        async with reading(self._lock):  # wsproto's state too: a send may run meanwhile
            if self.closed:
                return
            try:
                data = await self._stream.read(READ_BYTES, timeout)
            except httpcore.TimeoutException:
                return
            except (httpcore.NetworkError, OSError):
                data = b""  # broken or closed under us: as the peer's end
            try:
                self._ws.receive_data(data or None)  # None: the end of the stream
                events = list(self._ws.events())
            except RemoteProtocolError as exc:
                hint = exc.event_hint
                code = hint.code if isinstance(hint, CloseConnection) else 1002
                events = [CloseConnection(code=code)]
        for event in events:
            if isinstance(event, Message):
                self._parts.append(event.data)
                self._size += len(event.data)
                if self._size > MAX_MESSAGE:
                    await self._end(1009)
                    return
                if event.message_finished:
                    parts, self._parts, self._size = self._parts, [], 0
                    if isinstance(event, TextMessage):
                        self._messages.append("".join(p for p in parts if isinstance(p, str)))
                    else:
                        self._messages.append(b"".join(p for p in parts if isinstance(p, bytes)))
            elif isinstance(event, Ping):
                with contextlib.suppress(ConnectionError):
                    await self._write(event.response())
            elif isinstance(event, CloseConnection):
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(ConnectionError):
                        await self._write(event.response())
                    self.closed, self.close_code = True, event.code
                else:  # the stream ended, or the peer broke the protocol (then: our close)
                    await self._end(event.code)

    async def _end(self, code: int) -> None:
        """Close with `code` because of what the peer sent."""
        if self._ws.state is ConnectionState.OPEN:
            with contextlib.suppress(ConnectionError):
                await self._write(CloseConnection(code=code))
        self.closed, self.close_code = True, code

    async def aclose(self) -> None:
        """Close the WebSocket (a closing handshake when it is still open) and its
        connection. A receive waiting in another task or thread returns None."""
        if self._released:
            return
        self._released = True
        if self._ws.state is ConnectionState.OPEN:
            with contextlib.suppress(ConnectionError):
                await self._write(CloseConnection(code=1000))
        self.closed = True
        self.close_code = self.close_code or 1000
        interrupt(self._stream)  # a receiver waiting for bytes wakes up, and lets go of the lock
        async with self._lock:
            await self._release()

    async def _release(self) -> None:
        with contextlib.suppress(httpx.HTTPError, httpcore.NetworkError, OSError):
            await self._response.__aexit__(None, None, None)
