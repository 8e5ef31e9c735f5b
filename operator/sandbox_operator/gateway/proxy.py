"""Streaming to agents and preview ports: bodies flow both ways as they come.

Nothing is buffered whole: a 1 GiB tar or a command that prints for half an
hour passes through in chunks. The caller's credentials never travel on; the
agent gets its own token. When the caller goes away, the upstream connection
is closed too, so the agent sees the disconnect.

An event stream (ndjson or SSE: an execution's output, a directory watch)
passes through event by event, never held back, and never ends silently: when
the agent's stream breaks off, ends before its `finished` event, or the
gateway shuts down, the caller gets a last `interrupted` event (reattach from
the last cursor; a watch is opened again) instead of a cut that looks like an
end. A watch that ends because its caller left ends without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from sandbox_operator.gateway import metrics, tunnel
from sandbox_operator.gateway import upstream as lean

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
# What the caller says of the path to it: only the gateway may say that.
_FORWARDING = {"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"}
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
# An event longer than this is passed on as it comes, unaligned (the agent's
# events are far smaller: output is sent in bounded pieces).
MAX_EVENT = 16 << 20


# Bulk bodies give way to short calls: while one is between its request and
# its answer, a bulk copy waits before each chunk (up to YIELD_SECONDS) so that
# this process and the agent spend the CPU on the short call. A call is short
# for its first SHORT_SECONDS; one that waits longer (a command that runs for
# a minute) no longer holds bulk copies back.
YIELD_SECONDS = 0.002
SHORT_SECONDS = 0.25


# An upstream's answer: aiohttp's, or the lean client's (upstream.py) for calls
# to agents whose body is in hand.
Answer = aiohttp.ClientResponse | lean.Answer


class UpstreamError(Exception):
    """The agent or the preview port could not be reached."""


class Fairness:
    """Short calls in flight, and the wait a bulk copy makes for them. On 2 cores a
    1 GiB download through a replica multiplied a `true`'s latency through it by
    7.6; the copy is what has to yield (the event loop is fair, the CPU is not)."""

    def __init__(self) -> None:
        self.short = 0
        self._clear = asyncio.Event()
        self._clear.set()

    def begin(self) -> Callable[[], None]:
        """A short call starts; the function returned ends it (again: nothing)."""
        self.short += 1
        self._clear.clear()
        handle = asyncio.get_running_loop().call_later(SHORT_SECONDS, lambda: end())
        done = False

        def end() -> None:
            nonlocal done
            if done:
                return
            done = True
            handle.cancel()
            self.short -= 1
            if not self.short:
                self._clear.set()

        return end

    async def turn(self) -> None:
        """Before a bulk chunk: let short calls in flight go first, for a moment."""
        if self.short:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(YIELD_SECONDS):
                    await self._clear.wait()


def forwarded_headers(headers: Mapping[str, str], drop: Iterable[str] = ()) -> CIMultiDict[str]:
    skip = _HOP | _CREDENTIALS | _FORWARDING | {h.lower() for h in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in skip:
            out.add(key, value)
    return out


# The content codings aiohttp's server decodes before a handler reads the body
# (aiohttp.http_parser); any other is passed on as it came, with the body.
DECODED = frozenset({"gzip", "deflate", "br", "zstd"})


def decoded(request: web.Request) -> bool:
    """May the body this request's handler reads be decoded from what the caller
    sent? With several Content-Encoding headers, aiohttp's two parsers decode by
    different ones: any that it decodes counts."""
    codings = request.headers.getall("Content-Encoding", [])
    return any(c.isascii() and c.lower() in DECODED for c in codings)


def _undecodable(exc: BaseException) -> bool:
    """Did sending fail because the caller's body did not decode? aiohttp wraps
    what the body's iterator raised in its own connection error."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes can loop
        if seen is None:
            return False
        if isinstance(seen, RequestPayloadError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _body(request: web.Request, fair: Fairness) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK):
        await fair.turn()
        yield chunk


class Upstreams:
    """One pooled HTTP client for every agent and preview port."""

    def __init__(
        self, connect_seconds: float, body_seconds: float = 10.0, total: int = 16_000
    ) -> None:
        self.connect_seconds = connect_seconds
        self.body_seconds = body_seconds
        # Event streams being passed on, so shutdown can end each with a last event.
        self.streams: set[asyncio.Task[object]] = set()
        self.closing = False
        self.fair = Fairness()
        self.session = aiohttp.ClientSession(
            # At most 64 at once to one sandbox; in all, as many as the gateway
            # takes client connections (`total`): a pool smaller than that would
            # let one tenant's long streams fill it and make every other
            # tenant's calls wait for a slot (and fail after connect_seconds).
            connector=aiohttp.TCPConnector(limit=total, limit_per_host=64, keepalive_timeout=30),
            # Commands stream for as long as they run: no total, no read timeout.
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_seconds, sock_read=None),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self.lean = lean.Pool(connect_seconds)

    async def close(self) -> None:
        self.lean.close()
        await self.session.close()

    def interrupt_streams(self) -> None:
        """Shutdown: every event stream ends now, with an `interrupted` event."""
        self.closing = True
        for task in list(self.streams):
            task.cancel()

    async def forward(
        self,
        request: web.Request,
        url: str,
        *,
        query: Mapping[str, str] | None = None,
        headers: CIMultiDict[str] | None = None,
        method: str | None = None,
        extra_response_headers: Mapping[str, str] | None = None,
        events: bool = False,
        agent: bool = False,
    ) -> web.StreamResponse:
        """Send `request` (its method, headers and streamed body) to `url`, and
        stream the answer back. UpstreamError when the upstream cannot be reached.
        `events`: the answer is an execution's event stream (see `_events`).
        `agent`: `url` is a sandbox's agent, whose answers the lean client reads
        (a preview port's server may answer in ways only aiohttp's client takes)."""
        outgoing = headers if headers is not None else forwarded_headers(request.headers)
        length = request.content_length
        short = not request.body_exists or (length is not None and length <= SMALL)
        # Ends when the answer turns out to be a stream, or with this call.
        end_short = self.fair.begin() if short else _nothing
        try:
            return await self._forward(
                request,
                url,
                query,
                outgoing,
                method,
                extra_response_headers,
                events,
                agent,
                end_short,
            )
        finally:
            end_short()

    async def _forward(
        self,
        request: web.Request,
        url: str,
        query: Mapping[str, str] | None,
        outgoing: CIMultiDict[str],
        method: str | None,
        extra_response_headers: Mapping[str, str] | None,
        events: bool,
        agent: bool,
        end_short: Callable[[], None],
    ) -> web.StreamResponse:
        length = request.content_length
        if decoded(request):
            # aiohttp hands the body on decoded: the caller's encoding and length
            # are those of bytes that are not sent. Passed on, the agent would read
            # a decoded body cut at the encoded length, or try to decode it again.
            outgoing.popall("Content-Encoding", None)
            length = None
        data: bytes | AsyncIterator[bytes] | None = None
        if request.body_exists:
            if length is not None and length <= SMALL:
                # Read whole before anything is sent on, within a deadline: a caller
                # that announces a body and sends nothing must not hold a connection.
                try:
                    async with asyncio.timeout(self.body_seconds):
                        data = await request.read()
                except TimeoutError as exc:
                    raise web.HTTPRequestTimeout(reason="the body did not arrive in time") from exc
            else:
                data = _body(request, self.fair)
                if length is not None:
                    outgoing["Content-Length"] = str(length)
        method = method or request.method
        params = query if query is not None else request.query
        upstream: Answer
        try:
            if agent and method != "HEAD" and (data is None or isinstance(data, bytes)):
                upstream = await self.lean.request(method, url, params, outgoing, data)
            else:
                upstream = await self.session.request(
                    method, url, params=params, headers=outgoing, data=data, allow_redirects=False
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if _undecodable(exc):
                # The caller's body stopped decoding midway: its error, not the agent's.
                coding = ", ".join(request.headers.getall("Content-Encoding", []))
                why = f"the body does not decode as its Content-Encoding ({coding}) says"
                raise web.HTTPBadRequest(reason=why) from None
            metrics.UPSTREAM_ERRORS.inc()
            raise UpstreamError(f"{url.split('?')[0]} could not be reached: {exc}") from exc
        response: web.StreamResponse | None = None
        try:
            answer_headers = forwarded_headers(upstream.headers)
            answer_headers.update(extra_response_headers or {})
            if upstream.content_length is not None and upstream.content_length <= SMALL:
                body = await upstream.read()
                return web.Response(status=upstream.status, headers=answer_headers, body=body)
            end_short()  # a stream: bulk, or as long as a command runs
            kind = upstream.headers.get("Content-Type", "").split(";")[0].strip()
            events = events and upstream.status == 200 and kind in (NDJSON, SSE)
            if events and request.method != "HEAD":
                response = _HeadersWithFirstEvent(status=upstream.status, headers=answer_headers)
            else:
                response = web.StreamResponse(status=upstream.status, headers=answer_headers)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            if request.method == "HEAD":
                # Headers only: a body after them would be read as the next answer.
                with contextlib.suppress(ConnectionResetError):
                    await response.write_eof()
                return response
            if events:
                return await self._events(upstream, response, sse=kind == SSE)
            async for chunk in upstream.content.iter_any():
                await self.fair.turn()
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

    async def _events(
        self, upstream: Answer, response: web.StreamResponse, *, sse: bool
    ) -> web.StreamResponse:
        """Pass whole events on; end with `interrupted` unless the last was `finished`."""
        separator = b"\n\n" if sse else b"\n"
        pending, last = b"", b""
        reason = "upstream_ended"
        task = asyncio.current_task()
        assert task is not None
        self.streams.add(task)
        try:
            if self.closing:
                # Its answer came after shutdown began: ended at once, and said so.
                raise asyncio.CancelledError
            async for chunk in upstream.content.iter_any():
                pending += chunk
                cut = pending.rfind(separator)
                if cut < 0 and len(pending) < MAX_EVENT:
                    continue
                end = cut + len(separator) if cut >= 0 else len(pending)
                whole, pending = pending[:end], pending[end:]
                await self.fair.turn()
                last = whole.rstrip(b"\n").rsplit(separator, 1)[-1]
                try:
                    together = upstream.content.at_eof() and not pending
                    if together and _event_type(last, sse) == "finished":
                        # The last event and the end came together: passed on together.
                        await response.write_eof(whole)
                        return response
                    await response.write(whole)
                except ConnectionResetError:
                    return response  # the caller left: nothing to tell
        except asyncio.CancelledError:
            if not self.closing:
                raise  # the caller left
            reason = "gateway_shutdown"
        except (aiohttp.ClientError, OSError):
            reason = "upstream_lost"
        finally:
            self.streams.discard(task)
        if reason == "upstream_ended" and _event_type(last, sse) == "finished":
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response
        metrics.STREAMS_INTERRUPTED.labels(reason).inc()
        messages = {
            "upstream_ended": "the sandbox's stream ended before its last event",
            "upstream_lost": "the connection to the sandbox broke off",
            "gateway_shutdown": "the gateway replica is shutting down",
        }
        event = {
            "type": "interrupted",
            "error": {
                "code": reason,
                "message": f"{messages[reason]}: reattach from the last cursor"
                " (a watch: watch again)",
            },
        }
        data = json.dumps(event).encode()
        prefix = b"" if not pending else separator  # a partial event is cut off
        line = b"event: interrupted\ndata: " + data + b"\n\n" if sse else data + b"\n"
        with contextlib.suppress(ConnectionResetError):
            await response.write(prefix + line)
            await response.write_eof()
        return response

    async def websocket(
        self, request: web.Request, url: str, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        """Open the caller's WebSocket to `url` and join the two (tunnel.py)."""
        try:
            upstream, answer = await tunnel.open_upstream(
                url,
                request,
                headers,
                connect_seconds=self.connect_seconds,
                answer_seconds=self.body_seconds,
            )
        except tunnel.Refused as exc:
            if not 400 <= exc.status < 500:
                metrics.UPSTREAM_ERRORS.inc()
                raise UpstreamError(f"{url} refused the WebSocket: {exc.status}") from exc
            # The upstream said no (a terminal that does not exist, say): its
            # status and its own words when it gave them.
            if exc.body and exc.content_type:
                return web.Response(
                    status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type}
                )
            error = {
                "code": "websocket_refused",
                "message": f"the sandbox answered {exc.status} to the WebSocket handshake",
            }
            return web.json_response({"error": error}, status=exc.status)
        except (OSError, TimeoutError, ValueError, EOFError) as exc:
            metrics.UPSTREAM_ERRORS.inc()
            raise UpstreamError(f"{url.split('?')[0]} could not be reached: {exc}") from exc
        return await tunnel.join(request, upstream, answer)


class _HeadersWithFirstEvent(web.StreamResponse):
    """An event stream's answer whose headers go out with its first event, in one
    write (the agent sends them so too): a write and a wake-up of the caller less
    per call. aiohttp's plain Response does the same for its body."""

    _send_headers_immediately = False


def _nothing() -> None:
    pass


def _event_type(event: bytes, sse: bool) -> str | None:
    """The `type` of one ndjson line or SSE event (its data line), if it parses."""
    if sse:
        data = next((line[5:] for line in event.split(b"\n") if line.startswith(b"data:")), b"")
    else:
        data = event
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return str(parsed.get("type")) if isinstance(parsed, dict) else None
