"""The SDK's WebSocket client (sandbox_sdk._sync.websocket, generated from the
async one) against a WebSocket server on a real socket, plain and TLS: the
handshake through httpx, a message that arrives with the handshake's answer,
one thread receiving while another sends (a TLS connection must not read and
write at once), pings, fragments, and a close that wakes a waiting receiver."""

from __future__ import annotations

import base64
import hashlib
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage

from devcluster import pki
from sandbox_sdk._sync.websocket import WebSocket, handshake

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass
class Peer:
    """A WebSocket server for one connection at a time: it answers the handshake
    (with `greeting` as a text message in the same write, when set), echoes
    binary messages, answers the text "ping" with a ping and "fragments" with
    a binary message in three frames, drops the connection on "drop", and
    notes what it saw."""

    context: ssl.SSLContext | None
    greeting: str | None = None
    pongs: int = 0
    closed_with: int | None = None
    listener: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        scheme = "https" if self.context else "http"
        return f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}/v1/attach"

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_side=True)
            with sock:
                self._session(sock)

    def _session(self, sock: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        lines = head.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        accept = base64.b64encode(
            hashlib.sha1(headers["sec-websocket-key"].encode() + _GUID).digest()
        )
        ws = Connection(ConnectionType.SERVER)
        answer = (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        if self.greeting is not None:
            answer += ws.send(TextMessage(data=self.greeting))
        sock.sendall(answer)
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, BytesMessage):
                    sock.sendall(ws.send(BytesMessage(data=event.data)))
                elif isinstance(event, TextMessage) and event.data == "ping":
                    sock.sendall(ws.send(Ping(payload=b"are you there")))
                elif isinstance(event, TextMessage) and event.data == "drop":
                    return  # the socket closes: no closing handshake, as a lost peer
                elif isinstance(event, TextMessage) and event.data == "fragments":
                    for part, last in ((b"one ", False), (b"two ", False), (b"three", True)):
                        sock.sendall(ws.send(BytesMessage(data=part, message_finished=last)))
                elif isinstance(event, Pong):
                    self.pongs += 1
                    sock.sendall(ws.send(TextMessage(data="pong seen")))
                elif isinstance(event, CloseConnection):
                    self.closed_with = event.code
                    if data:  # a closing handshake (not a dropped connection): answered
                        sock.sendall(ws.send(event.response()))
                    return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """Server and client contexts: a certificate for 127.0.0.1 and its CA."""
    made = pki.ensure_pki(Path(tmp_path_factory.mktemp("pki")))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(made.apiserver.cert, made.apiserver.key)
    return server, ssl.create_default_context(cafile=str(made.ca.cert))


@pytest.fixture(params=["plain", "tls"])
def peer_and_client(
    request: pytest.FixtureRequest, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> Iterator[tuple[Peer, httpx.Client]]:
    secure = request.param == "tls"
    peer = Peer(tls[0] if secure else None, greeting="hello")
    with httpx.Client(verify=tls[1] if secure else False, trust_env=False) as client:
        yield peer, client
    peer.close()


def _open(peer: Peer, client: httpx.Client) -> WebSocket:
    opened = handshake(client, peer.url, headers={"Authorization": "Bearer x"})
    assert isinstance(opened, WebSocket), opened
    return opened


def test_a_message_that_came_with_the_handshake_is_received(
    peer_and_client: tuple[Peer, httpx.Client],
) -> None:
    """The greeting shares a write (a TCP segment) with the 101: httpcore reads
    it with the answer's head, where a wait on the socket cannot see it."""
    ws = _open(*peer_and_client)
    try:
        assert ws.receive(timeout=10) == "hello"
    finally:
        ws.close()


def test_one_thread_receives_while_another_sends(
    peer_and_client: tuple[Peer, httpx.Client],
) -> None:
    peer, client = peer_and_client
    ws = _open(peer, client)
    received: list[bytes | str | None] = []

    def receive() -> None:
        while (message := ws.receive(timeout=30)) is not None:
            received.append(message)

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        sent = [f"key {i}".encode() * (1 + i % 50) for i in range(300)]
        for i, message in enumerate(sent):
            ws.send(message)
            if i == 150:
                ws.send("ping")  # answered with a pong by the receiving side
        ws.send("fragments")

        def all_back() -> bool:
            return b"one two three" in received and "pong seen" in received

        deadline = threading.Event()
        for _ in range(300):
            if all_back():
                break
            deadline.wait(0.1)
        assert all_back(), received[-5:]
        assert [m for m in received if isinstance(m, bytes) and m.startswith(b"key")] == sent
        assert peer.pongs == 1
        assert received[0] == "hello"
    finally:
        ws.close()  # wakes the receiver, which waits for more
        receiver.join(30)
    assert not receiver.is_alive(), "close() did not wake the receiving thread"
    assert ws.closed
    assert ws.receive(timeout=1) is None
    with pytest.raises(ConnectionError):
        ws.send(b"after the close")


def test_a_dropped_connection_ends_the_messages(
    peer_and_client: tuple[Peer, httpx.Client],
) -> None:
    """The peer goes away without a closing handshake: receive() says None and
    the close code is 1006 (abnormal)."""
    peer, client = peer_and_client
    ws = _open(peer, client)
    try:
        assert ws.receive(timeout=10) == "hello"
        ws.send("drop")
        assert ws.receive(timeout=10) is None
        assert ws.close_code == 1006
    finally:
        ws.close()
