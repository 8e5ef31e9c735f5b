"""Streaming to agents and preview ports: bodies flow both ways as they come.

Nothing is buffered whole: a 1 GiB tar or a command that prints for half an
hour passes through in chunks. The caller's credentials never travel on; the
agent gets its own token. When the caller goes away, the upstream connection
is closed too, so the agent sees the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from sandbox_operator.gateway import metrics

log = logging.getLogger("sandbox_gateway.proxy")

CHUNK = 1 << 16
# Bodies this small (by their Content-Length) are read whole and sent in one
# write with their headers: most calls are small, and a write per part is a
# good share of their cost. Anything larger streams.
SMALL = 1 << 16
# Hop-by-hop headers (RFC 9110 7.6.1) and the caller's credentials.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
_CREDENTIALS = {"authorization", "cookie", "x-sandbox-authorization"}


class UpstreamError(Exception):
    """The agent or the preview port could not be reached."""


def forwarded_headers(headers: Mapping[str, str], drop: Iterable[str] = ()) -> CIMultiDict[str]:
    skip = _HOP | _CREDENTIALS | {h.lower() for h in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in skip:
            out.add(key, value)
    return out


async def _body(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


class Upstreams:
    """One pooled HTTP client for every agent and preview port."""

    def __init__(self, connect_seconds: float) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=64, keepalive_timeout=30),
            # Commands stream for as long as they run: no total, no read timeout.
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_seconds, sock_read=None),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        await self.session.close()

    async def forward(
        self,
        request: web.Request,
        url: str,
        *,
        query: Mapping[str, str] | None = None,
        headers: CIMultiDict[str] | None = None,
        method: str | None = None,
        extra_response_headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        """Send `request` (its method, headers and streamed body) to `url`, and
        stream the answer back. UpstreamError when the upstream cannot be reached."""
        outgoing = headers if headers is not None else forwarded_headers(request.headers)
        length = request.content_length
        data: bytes | AsyncIterator[bytes] | None = None
        if request.body_exists:
            if length is not None and length <= SMALL:
                data = await request.read()
            else:
                data = _body(request)
                if length is not None:
                    outgoing["Content-Length"] = str(length)
        try:
            upstream = await self.session.request(
                method or request.method,
                url,
                params=query if query is not None else request.query,
                headers=outgoing,
                data=data,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            metrics.UPSTREAM_ERRORS.inc()
            raise UpstreamError(f"{url.split('?')[0]} could not be reached: {exc}") from exc
        response: web.StreamResponse | None = None
        try:
            answer_headers = forwarded_headers(upstream.headers)
            answer_headers.update(extra_response_headers or {})
            if upstream.content_length is not None and upstream.content_length <= SMALL:
                body = await upstream.read()
                return web.Response(status=upstream.status, headers=answer_headers, body=body)
            response = web.StreamResponse(status=upstream.status, headers=answer_headers)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                try:
                    await response.write(chunk)
                except ConnectionResetError:
                    return response  # the caller left: nothing broke upstream
            with contextlib.suppress(ConnectionResetError):  # the caller left before the end
                await response.write_eof()
            return response
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            metrics.UPSTREAM_ERRORS.inc()
            if response is None or not response.prepared:
                raise UpstreamError(f"{url.split('?')[0]} broke off: {exc}") from exc
            # Once the headers are out the stream can only be cut, which the
            # caller sees (an incomplete chunked body) and may reattach from its
            # cursor. An agent restart does this: worth a line, not a traceback.
            log.warning("upstream %s broke off mid-answer: %s", url.split("?")[0], exc)
            if request.transport is not None:
                request.transport.abort()
            return response
        finally:
            # On cancellation (the caller left) the connection is closed, not reused,
            # so the upstream sees the disconnect.
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    async def websocket(
        self, request: web.Request, url: str, headers: CIMultiDict[str]
    ) -> web.WebSocketResponse:
        """Join the caller's WebSocket to one opened to `url`, message for message."""
        protocols = [
            p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p
        ]
        for name in ("Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Extensions"):
            headers.popall(name, None)
        try:
            upstream = await self.session.ws_connect(
                url, headers=headers, protocols=protocols, autoping=False
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            metrics.UPSTREAM_ERRORS.inc()
            raise UpstreamError(f"{url} could not be reached: {exc}") from exc
        downstream = web.WebSocketResponse(
            protocols=[upstream.protocol] if upstream.protocol else (), autoping=False
        )
        await downstream.prepare(request)

        async def pump(
            source: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
            sink: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
        ) -> None:
            async for message in source:
                if message.type == aiohttp.WSMsgType.TEXT:
                    await sink.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    await sink.send_bytes(message.data)
                elif message.type == aiohttp.WSMsgType.PING:
                    await sink.ping(message.data)
                elif message.type == aiohttp.WSMsgType.PONG:
                    await sink.pong(message.data)
                else:
                    break
            await sink.close()

        tasks = [
            asyncio.create_task(pump(upstream, downstream)),
            asyncio.create_task(pump(downstream, upstream)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await upstream.close()
            await downstream.close()
        return downstream
