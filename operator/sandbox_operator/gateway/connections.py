"""Connection limits: no caller holds the gateway's sockets for free.

Each replica has a bounded number of open files. A connection that sends
nothing, or trickles a request head a byte at a time, costs one without ever
reaching a handler, and no handler timeout sees it. So the listener is wrapped:

- a connection must complete a request head within `head_seconds` of opening
  and within `idle_seconds` of its previous answer, or it is closed;
- at most `per_client` connections from one address, `total` in all; past
  either the connection gets a 503 and is closed (the API server's proxy
  counts as one client: keep `per_client` above its concurrency).

The request middleware tells the guard when a request starts and ends, so a
long stream or an upload in progress is never cut by these deadlines (the
agent bounds those).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox_operator.gateway import metrics


@dataclass(frozen=True)
class Limits:
    head_seconds: float
    idle_seconds: float
    per_client: int
    total: int


@dataclass
class _Connection:
    transport: Any  # asyncio's or uvloop's
    client: str
    deadline: asyncio.TimerHandle | None = None
    requests: int = 0


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"code": "too_many_connections", "message": message}}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nRetry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """Counts and deadlines per connection, keyed by the protocol object that
    serves it (what `request.protocol` is in a handler)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.connections: dict[Any, _Connection] = {}
        self.per_client: Counter[str] = Counter()

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server` around aiohttp's."""
        return lambda: _Guarded(self, make())

    # -- connection events --------------------------------------------------------

    def opened(self, inner: Any, transport: Any) -> bool:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if len(self.connections) >= self.limits.total:
            return self._refuse(transport, "the gateway holds as many connections as it may")
        if self.per_client[client] >= self.limits.per_client:
            return self._refuse(transport, f"too many connections from {client}")
        self.per_client[client] += 1
        connection = _Connection(transport, client)
        self.connections[inner] = connection
        metrics.CONNECTIONS_OPENED.inc()
        metrics.CONNECTIONS.set(len(self.connections))
        self._arm(connection, self.limits.head_seconds)
        return True

    def closed(self, inner: Any) -> None:
        connection = self.connections.pop(inner, None)
        if connection is None:
            return
        if connection.deadline is not None:
            connection.deadline.cancel()
        self.per_client[connection.client] -= 1
        if self.per_client[connection.client] <= 0:
            del self.per_client[connection.client]
        metrics.CONNECTIONS.set(len(self.connections))

    # -- requests (from the middleware) -----------------------------------------------

    def started(self, inner: Any) -> None:
        connection = self.connections.get(inner)
        if connection is not None:
            connection.requests += 1
            if connection.deadline is not None:
                connection.deadline.cancel()
                connection.deadline = None

    def ended(self, inner: Any) -> None:
        connection = self.connections.get(inner)
        if connection is not None:
            connection.requests -= 1
            if connection.requests == 0:
                self._arm(connection, self.limits.idle_seconds)

    # -- inside -----------------------------------------------------------------------

    def _arm(self, connection: _Connection, seconds: float) -> None:
        if connection.deadline is not None:
            connection.deadline.cancel()
        loop = asyncio.get_running_loop()
        connection.deadline = loop.call_later(seconds, self._expire, connection)

    def _expire(self, connection: _Connection) -> None:
        connection.deadline = None
        if connection.requests == 0:
            metrics.CONNECTIONS_CLOSED.labels("deadline").inc()
            connection.transport.close()

    def _refuse(self, transport: Any, message: str) -> bool:
        metrics.CONNECTIONS_CLOSED.labels("limit").inc()
        transport.write(_refusal(message))
        transport.close()
        return False


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol, with the guard told when its connection opens and closes."""

    def __init__(self, guard: Guard, inner: Any) -> None:
        self.guard = guard
        self.inner = inner
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport instances, but behave as one)
        self.admitted = self.guard.opened(self.inner, transport)
        if self.admitted:
            self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.guard.closed(self.inner)
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return bool(self.inner.eof_received()) if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()
