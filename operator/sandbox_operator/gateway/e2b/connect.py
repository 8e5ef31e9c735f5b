"""Connect RPC with the JSON codec, as E2B's daemon protocol uses it.

Unary calls: a POST of `application/json`, answered with the message as JSON,
or an error as `{"code": "<connect code>", "message"}` with the code's HTTP
status. Server streams: the request is `application/connect+json` with one
enveloped message; the answer is 200 with enveloped messages (1 flag byte,
4 bytes of big-endian length, JSON), ended by an end-of-stream envelope
(flag 0x02) whose JSON holds the error, if any. Flag 0x01 marks a
gzip-compressed envelope (`Connect-Content-Encoding: gzip`); a unary body with
`Content-Encoding: gzip` is inflated by the HTTP server before it is read.
Client streams (process.Process/StreamInput) send any number of enveloped
messages and get the server-stream answer shape: one message, then the
end-of-stream envelope.
"""

from __future__ import annotations

import asyncio
import json
import struct
import zlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sandbox_operator.gateway.e2b.core import whole

JSON = dict[str, Any]
UNARY = "application/json"
STREAM = "application/connect+json"
COMPRESSED = 0x01
END_STREAM = 0x02
# The largest request message read (file contents travel over HTTP /files).
MAX_MESSAGE = 16 << 20
# How long a unary or server-stream request's body may take to arrive (the
# listener's app holds the gateway's head_seconds): a caller that announces a
# body and sends none must not hold a connection and a handler for ever.
BODY_SECONDS = web.AppKey("e2b_body_seconds", float)
DEFAULT_BODY_SECONDS = 10.0

# Connect's error codes and the HTTP status a unary error answers with.
STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}
# From an HTTP status the agent answered with to the nearest Connect code.
FROM_HTTP = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    409: "already_exists",
    410: "not_found",
    413: "resource_exhausted",
    422: "invalid_argument",
    429: "resource_exhausted",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}


class ConnectError(Exception):
    """A Connect error: `code` one of STATUS's keys."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        assert code in STATUS, code
        super().__init__(message)
        self.code, self.message = code, message
        # The HTTP status of a unary answer: the code's, unless one says better.
        self.status = status or STATUS[code]

    @classmethod
    def from_http(cls, status: int, message: str) -> ConnectError:
        return cls(FROM_HTTP.get(status, "internal" if status >= 500 else "unknown"), message)

    def json(self) -> JSON:
        return {"code": self.code, "message": self.message}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.json()), content_type=UNARY)


def envelope(message: JSON, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.json()} if error is not None else {}, END_STREAM)


def _decode(data: bytes) -> JSON:
    try:
        message = json.loads(data) if data.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise ConnectError("invalid_argument", f"the message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return message


async def read_request(request: web.Request) -> tuple[JSON, bool]:
    """The request's message, and whether the call is a server stream."""
    kind = request.content_type
    if kind not in (UNARY, STREAM):
        raise ConnectError("invalid_argument", f"content type {kind!r}: use {UNARY} or {STREAM}")
    if request.content_length is not None and request.content_length > MAX_MESSAGE + 5:
        raise ConnectError("resource_exhausted", f"a message is at most {MAX_MESSAGE} bytes")
    try:
        # A body sent with Content-Encoding: gzip comes inflated (by the server,
        # in bounded chunks), so this bounds the message itself.
        async with asyncio.timeout(request.app.get(BODY_SECONDS, DEFAULT_BODY_SECONDS)):
            body = await _read_body(request, MAX_MESSAGE + 5)
    except RequestPayloadError as exc:
        raise ConnectError("invalid_argument", f"the body could not be read: {exc}") from None
    except TimeoutError:
        # 408, as the gateway answers a body that does not come (a Connect client
        # reads the code).
        raise ConnectError("deadline_exceeded", "the body did not arrive in time", 408) from None
    if kind == UNARY:
        return _decode(body), False
    if len(body) < 5:
        raise ConnectError("invalid_argument", "a stream request holds one enveloped message")
    flags, length = struct.unpack(">BI", body[:5])
    if length != len(body) - 5 or flags & END_STREAM:
        raise ConnectError("invalid_argument", "a stream request holds one enveloped message")
    data = body[5:]
    if flags & COMPRESSED:
        data = _gunzip(data)
    return _decode(data), True


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes (a read returns what has arrived so
    far, so one read is not the body)."""
    body = bytearray()
    while chunk := await request.content.read(65536):
        body += chunk
        if len(body) > limit:
            raise ConnectError("resource_exhausted", f"a message is at most {MAX_MESSAGE} bytes")
    return bytes(body)


def _gunzip(data: bytes) -> bytes:
    """Decompressed, never past MAX_MESSAGE (a small bomb must not fill memory)."""
    inflate = zlib.decompressobj(wbits=31)
    try:
        out = inflate.decompress(data, MAX_MESSAGE + 1)
    except zlib.error as exc:
        raise ConnectError(
            "invalid_argument", f"a compressed message did not decompress: {exc}"
        ) from exc
    if len(out) > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"a message is at most {MAX_MESSAGE} bytes")
    if not inflate.eof:
        raise ConnectError("invalid_argument", "a compressed message is cut short")
    return out


async def read_stream(request: web.Request, idle: float | None = None) -> AsyncIterator[JSON]:
    """The messages of a client stream, as they arrive (the request must be
    `application/connect+json`); ends at the end of the body. With `idle`, each
    message must arrive within that many seconds of the one before: a stream
    that sends nothing must not hold a handler and its connections for ever."""
    if request.content_type != STREAM:
        raise ConnectError("invalid_argument", f"a client stream is sent as {STREAM}")
    while True:
        head = b""
        try:
            async with asyncio.timeout(idle):
                head = await request.content.readexactly(5)
                flags, length = struct.unpack(">BI", head)
                if length > MAX_MESSAGE:
                    raise ConnectError(
                        "resource_exhausted", f"a message is at most {MAX_MESSAGE} bytes"
                    )
                data = await request.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            if head or exc.partial:
                raise ConnectError("invalid_argument", "the stream ends inside a message") from exc
            return
        except TimeoutError:
            raise ConnectError(
                "deadline_exceeded",
                f"no message for {idle:g} s: a client stream sends keepalive events to stay open",
            ) from None
        if flags & END_STREAM:
            return
        yield _decode(_gunzip(data) if flags & COMPRESSED else data)


def unary(message: JSON) -> web.Response:
    return web.Response(text=json.dumps(message), content_type=UNARY)


async def open_stream(request: web.Request) -> web.StreamResponse:
    """The answer of a server stream, headers sent: write `envelope(...)`s, then
    `end_stream(...)`, then write_eof."""
    response = web.StreamResponse(status=200, headers={"Content-Type": STREAM})
    await response.prepare(request)
    return response


async def stream_error(request: web.Request, error: ConnectError) -> web.StreamResponse:
    """A server stream that ends at once with `error` (Connect answers streams with
    200 and puts the error in the end-of-stream envelope)."""
    response = await open_stream(request)
    await response.write(end_stream(error))
    await response.write_eof()
    return response


def timeout_seconds(request: web.Request) -> float | None:
    """The call's deadline (`Connect-Timeout-Ms`), or None."""
    value = whole(request.headers.get("Connect-Timeout-Ms", ""), 10)
    return None if value is None else value / 1000
