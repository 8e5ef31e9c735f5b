"""WebSocket connections of the HTTP server (httpserver.py), as the ASGI websocket protocol.

The server hands a connection here once a GET asked to upgrade; wsproto
parses and builds the frames (masking, fragments, control frames), this
module speaks ASGI to the app: the handshake answer (101) goes out on
``websocket.accept``, an app that refuses before it (the auth middleware, an
unknown terminal) answers with a plain HTTP response (the ASGI denial
extension), and ``websocket.close`` after it ends the connection.

Bounded like the rest of the server: a message is at most
``MAX_MESSAGE`` bytes (larger ones close the connection with 1009), and the
socket is not read while more than ``INCOMING_HIGH`` bytes of received
messages wait for the app; what the app sends waits for the client to drain
(a client that reads nothing is dropped by the server's send timeout).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections import deque
from typing import Any, Protocol

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Message, Ping, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

MAX_MESSAGE = 1 << 20
INCOMING_HIGH = 2 << 20
INCOMING_LOW = 256 << 10
# Bytes a client may send before the app accepts (it should send none).
MAX_EARLY = 64 << 10
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
DENIAL = "websocket.http.response"  # the ASGI extension name

ASGIMessage = dict[str, Any]


class Transport(Protocol):
    """What a session needs of its HTTP connection (httpserver.HttpProtocol)."""

    def write(self, data: bytes | bytearray) -> None: ...
    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def is_upgrade(method: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """A WebSocket opening handshake (RFC 6455 4.2.1) this server takes on."""
    if method != "GET":
        return False
    found = dict(headers)  # names are lower case (the server's parser)
    return (
        b"websocket" in found.get(b"upgrade", b"").lower()
        and b"upgrade" in found.get(b"connection", b"").lower()
        and found.get(b"sec-websocket-version") == b"13"
        and len(found.get(b"sec-websocket-key", b"")) == 24
    )


def accept_key(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


def subprotocols(headers: list[tuple[bytes, bytes]]) -> list[str]:
    return [
        p.strip()
        for name, value in headers
        if name == b"sec-websocket-protocol"
        for p in value.decode("latin-1").split(",")
        if p.strip()
    ]


class WebSocketSession:
    """One upgraded connection; `receive` and `send` are the app's ASGI callables."""

    def __init__(self, transport: Transport, key: bytes) -> None:
        self.transport = transport
        self.key = key
        self.ws = Connection(ConnectionType.SERVER)
        self.incoming: deque[ASGIMessage] = deque([{"type": "websocket.connect"}])
        self.incoming_bytes = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.early = bytearray()  # received before the app accepted
        self.accepted = False
        self.finished = False  # closed, refused, or the client went away
        self.parts: list[bytes | str] = []  # the fragments of a message being received
        self.parts_size = 0
        self.denial: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.denial_body = bytearray()

    # -- from the client ------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.finished:
            return
        if not self.accepted:
            self.early += data
            if len(self.early) > MAX_EARLY:
                self._gone(1009)
                self.transport.close()
            return
        try:
            self.ws.receive_data(data)
            for event in self.ws.events():
                self._event(event)
        except RemoteProtocolError:
            self._close(1002, "protocol error")
        if self.incoming_bytes > INCOMING_HIGH and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _event(self, event: Any) -> None:
        if isinstance(event, Message):
            self.parts.append(event.data)
            self.parts_size += len(event.data)
            if self.parts_size > MAX_MESSAGE:
                self._close(1009, f"messages are at most {MAX_MESSAGE} bytes")
                return
            if event.message_finished:
                self._message(event)
        elif isinstance(event, Ping):
            self.transport.write(self.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            if self.ws.state is ConnectionState.REMOTE_CLOSING:
                self.transport.write(self.ws.send(event.response()))
            self._gone(event.code)
            self.transport.close()

    def _message(self, event: Message[Any]) -> None:
        parts, self.parts, self.parts_size = self.parts, [], 0
        if isinstance(event, TextMessage):
            text = "".join(p for p in parts if isinstance(p, str))
            self.incoming.append({"type": "websocket.receive", "text": text})
            self.incoming_bytes += len(text)
        else:
            data = b"".join(p for p in parts if isinstance(p, bytes))
            self.incoming.append({"type": "websocket.receive", "bytes": data})
            self.incoming_bytes += len(data)

    def disconnected(self) -> None:
        """The connection is gone (the server's connection_lost)."""
        self._gone(1006)

    def _gone(self, code: int) -> None:
        if not self.finished:
            self.finished = True
            self.incoming.append({"type": "websocket.disconnect", "code": code})
            self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> ASGIMessage:
        while not self.incoming:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        message = self.incoming.popleft()
        self.incoming_bytes -= len(message.get("bytes") or message.get("text") or "")
        if self.paused and self.incoming_bytes < INCOMING_LOW:
            self.paused = False
            self.transport.resume_reading()
        return message

    # -- from the app -----------------------------------------------------------------

    async def send(self, message: ASGIMessage) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            self._accept(message)
        elif kind == "websocket.send":
            if not self.accepted:
                raise RuntimeError("websocket.send before the handshake")
            if self.finished:
                # The client went away: an OSError, which Starlette turns into
                # WebSocketDisconnect (what the app expects), as ASGI servers do.
                raise ConnectionResetError("the WebSocket is closed")
            data, text = message.get("bytes"), message.get("text")
            event = BytesMessage(data=data) if data is not None else TextMessage(data=text or "")
            self.transport.write(self.ws.send(event))
            await self.transport.drain()
        elif kind == "websocket.close":
            if not self.accepted:
                self._deny(403, [], b"")
            else:
                self._close(int(message.get("code") or 1000), str(message.get("reason") or ""))
        elif kind == "websocket.http.response.start":
            if self.accepted:
                raise RuntimeError("a denial response after the handshake")
            self.denial = (int(message["status"]), list(message.get("headers") or ()))
        elif kind == "websocket.http.response.body":
            self.denial_body += message.get("body", b"")
            if not message.get("more_body") and self.denial is not None:
                self._deny(*self.denial, bytes(self.denial_body))

    def _accept(self, message: ASGIMessage) -> None:
        if self.accepted or self.finished:
            return
        head = bytearray(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        )
        head += b"sec-websocket-accept: " + accept_key(self.key) + b"\r\n"
        if message.get("subprotocol"):
            head += b"sec-websocket-protocol: " + str(message["subprotocol"]).encode() + b"\r\n"
        for name, value in message.get("headers") or ():
            head += name + b": " + value + b"\r\n"
        self.transport.write(bytes(head) + b"\r\n")
        self.accepted = True
        early, self.early = bytes(self.early), bytearray()
        if early:
            self.feed(early)

    def _deny(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A plain HTTP answer instead of the handshake; the connection ends with it."""
        self.transport.respond(status, headers, body)
        self._gone(1006)
        self.transport.close()

    def _close(self, code: int, reason: str) -> None:
        if not self.finished:
            with contextlib.suppress(LocalProtocolError):  # a close is under way already
                self.transport.write(self.ws.send(CloseConnection(code=code, reason=reason)))
            self._gone(code)
        self.transport.close()
