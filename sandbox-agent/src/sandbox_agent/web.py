"""Request bodies in, JSON out: the small helpers every API module uses.

Bodies are read with a hard cap before they are parsed, and every way a body
can be wrong becomes an ``Invalid``/``TooLarge`` with a stable code.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from . import models
from .errors import Invalid, TooLarge
from .state import state_of

JSON = "application/json"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
OCTET = "application/octet-stream"
TAR = "application/x-tar"
T = TypeVar("T")
encode = msgspec.json.Encoder().encode


def ok(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(obj), status, headers, media_type=JSON)


async def _chunks(request: Request, limit: int, what: str) -> AsyncIterator[bytes]:
    """The body as it arrives, refused (413) as soon as it passes ``limit`` bytes."""
    cl = request.headers.get("content-length")
    if cl is not None and not cl.isdigit():
        raise Invalid("invalid_request", "invalid Content-Length")
    total = 0 if cl is None else int(cl)
    if total > limit:
        raise TooLarge("body_too_large", f"{what} exceeds {limit} bytes")
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise TooLarge("body_too_large", f"{what} exceeds {limit} bytes")
            if chunk:
                yield chunk
    except ClientDisconnect:
        raise Invalid("client_disconnected", f"client went away during the {what}") from None


async def read_body(request: Request, limit: int) -> bytes:
    return b"".join([chunk async for chunk in _chunks(request, limit, "request body")])


async def body_as(request: Request, typ: type[T]) -> T:
    raw = await read_body(request, state_of(request).settings.max_body_bytes)
    if not raw.strip():
        raise Invalid("invalid_request", "a JSON request body is required")
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise Invalid("invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise Invalid("invalid_json", f"malformed JSON: {exc}") from None


async def optional_body_as(request: Request, typ: type[T], default: Callable[[], T]) -> T:
    """A body whose every field has a default: an empty body means `default()`."""
    raw = await read_body(request, state_of(request).settings.max_body_bytes)
    if not raw.strip():
        return default()
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise Invalid("invalid_request", str(exc)) from None


async def spool_upload(
    request: Request, sink: Callable[[list[bytes]], Awaitable[None]], limit: int
) -> int:
    """Stream the body to ``sink`` in batches of >= 4 MiB (as chunk lists: the
    sink writes them with writev, so the body is never joined in memory)."""
    total = 0
    pending: list[bytes] = []
    pending_len = 0
    async for chunk in _chunks(request, limit, "upload"):
        total += len(chunk)
        pending.append(chunk)
        pending_len += len(chunk)
        if pending_len >= 4 << 20:
            await sink(pending)
            pending, pending_len = [], 0
    if pending:
        await sink(pending)
    return total


def one_of(text: str | None, b64: str | None, names: tuple[str, str]) -> bytes | None:
    """The bytes of a text-or-base64 field pair; giving both is a 400."""
    if text is not None and b64 is not None:
        raise Invalid("invalid_request", f"give at most one of {names[0]!r} and {names[1]!r}")
    if b64 is not None:
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise Invalid("invalid_request", f"{names[1]} is not valid base64") from None
    return None if text is None else text.encode("utf-8", "surrogateescape")


class Stream(StreamingResponse):
    """A streamed answer whose producer is closed however the stream ends.

    Starlette leaves the body generator suspended when the client leaves while
    a chunk is being sent (the server cancels the task there, outside the
    generator); its ``finally`` (a watch's inotify descriptor, a file's
    descriptor, an archive's producer thread) would then wait for the garbage
    collector. Each producer that wraps another closes it too (aclosing).
    """

    body_iterator: AsyncGenerator[bytes, None]

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)

    async def stream_response(self, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().stream_response(send)


Event = models.StreamEvent | models.WatchEvent | models.CodeEvent


def event_stream(
    events: AsyncGenerator[Event, None], request: Request, headers: dict[str, str]
) -> Stream:
    """ndjson, or SSE when the client asks for text/event-stream."""
    sse = SSE in request.headers.get("accept", "")

    async def body() -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(events):
            async for ev in events:
                data = encode(ev)
                yield (
                    (b"event: " + ev.type.encode() + b"\ndata: " + data + b"\n\n")
                    if sse
                    else data + b"\n"
                )

    headers = {**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return Stream(body(), media_type=SSE if sse else NDJSON, headers=headers)
