"""A small HTTP/1.1 client on one socket, for `exec`'s one-request path
(`sandbox_sdk._oneshot`) alone.

The standard library's `http.client` imports the email package to parse
headers: about 20 ms of every `kubectl sandbox exec`. The peers here are the
API server and the gateway, and the requests are few: a JSON body out;
a JSON answer or a stream of JSON lines back, sized by Content-Length or
chunked. That is all this speaks; anything it does not understand raises
`ProtocolError` (the caller hands the command to the full client).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

MAX_LINE = 65536  # a status or header line
MAX_HEADERS = 100


class ProtocolError(OSError):
    """An answer this client does not read (or a broken one)."""


class Response:
    """Status, headers (names lower-cased) and the body, read once."""

    def __init__(self, status: int, headers: dict[str, str], source: Connection) -> None:
        self.status = status
        self.headers = headers
        self._source = source
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if status in (204, 304):
            chunked, length = False, "0"
        if chunked:
            self._left: int | None = None
        elif length is not None and length.isdigit():
            self._left = int(length)
        else:
            raise ProtocolError("an answer without Content-Length or chunked encoding")
        self._chunked = chunked

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives."""
        source = self._source
        if not self._chunked:
            left = self._left or 0
            while left > 0:
                data = source.read_some(left)
                left -= len(data)
                yield data
            return
        while True:
            size_line = source.readline().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError as exc:
                raise ProtocolError(f"a bad chunk size {size_line[:20]!r}") from exc
            if size == 0:
                while source.readline() not in (b"\r\n", b"\n"):  # trailers, then the end
                    pass
                return
            yield source.read_exactly(size)
            source.read_exactly(2)  # the CRLF after each chunk

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def lines(self) -> Iterator[bytes]:
        """The body line by line (the last one without its newline, if any)."""
        pending = b""
        for data in self.chunks():
            pending += data
            *complete, pending = pending.split(b"\n")
            yield from complete
        if pending:
            yield pending


class Connection:
    """One kept-alive connection to `host:port` (TLS with `context`)."""

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext | None, timeout: float
    ) -> None:
        self.host, self.port, self.context, self.timeout = host, port, context, timeout
        self._sock: socket.socket | None = None
        self._buffer = b""

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def settimeout(self, seconds: float) -> None:
        if self._sock is not None:
            self._sock.settimeout(seconds)

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            self._sock, self._buffer = sock, b""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        self._sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        while True:
            status, answer = self._head()
            if status >= 200:  # 1xx (100 Continue) come before the answer
                return Response(status, answer, self)

    def _head(self) -> tuple[int, dict[str, str]]:
        parts = self.readline().split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {b' '.join(parts)[:80]!r}")
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            line = self.readline()
            if line in (b"\r\n", b"\n"):
                return int(parts[1]), headers
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ProtocolError(f"a bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        raise ProtocolError(f"more than {MAX_HEADERS} headers")

    def _fill(self) -> None:
        assert self._sock is not None
        data = self._sock.recv(65536)
        if not data:
            raise ProtocolError("the connection closed in the middle of an answer")
        self._buffer += data

    def readline(self) -> bytes:
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE:
                raise ProtocolError("a line longer than 64 KiB")
            self._fill()
        line, self._buffer = self._buffer[: end + 1], self._buffer[end + 1 :]
        return line

    def read_some(self, most: int) -> bytes:
        if not self._buffer:
            self._fill()
        data, self._buffer = self._buffer[:most], self._buffer[most:]
        return data

    def read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            self._fill()
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data
