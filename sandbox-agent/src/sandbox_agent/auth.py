"""Bearer-token authentication in front of the whole app (fail closed).

Runs before routing, so an unknown path gets 401 too and reveals nothing.
The paths that need no token come from the route table (``public_paths``).
"""

from __future__ import annotations

import hmac
import os
import time

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from . import models
from .httpserver import AUTHENTICATED
from .websocket import DENIAL

_encode = msgspec.json.Encoder().encode


def token_matches(header: bytes | None, token: bytes) -> bool:
    """Constant-time check of an Authorization header against the token."""
    if not header or header[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(header[7:].strip(), token)


class AuthMiddleware:
    """Bearer token on every path except ``public`` (liveness/readiness probes)."""

    def __init__(
        self, app: ASGIApp, token: bytes, public: frozenset[str], token_file: str = ""
    ) -> None:
        self.app = app
        self.token = token
        self.public = public
        self.token_file = token_file
        self.token_stamp = self._stamp()
        self.checked = time.monotonic()

    def _stamp(self) -> tuple[int, int, int]:
        try:
            s = os.stat(self.token_file)
        except OSError:
            return (0, 0, 0)
        return (s.st_ino, s.st_size, s.st_mtime_ns)

    def _reloaded(self) -> bool:
        """Pick up a rotated token (kubelet rewrites mounted Secrets in place).

        Checked only after a failed comparison and at most once a second, so
        wrong tokens cannot make us hammer the filesystem. An empty or missing
        file keeps the old token: never fail open.
        """
        now = time.monotonic()
        if not self.token_file or now - self.checked < 1.0:
            return False
        self.checked = now
        stamp = self._stamp()
        if stamp == self.token_stamp:
            return False
        try:
            with open(self.token_file, "rb") as f:
                token = f.read().strip()
        except OSError:
            return False
        self.token_stamp = stamp
        if len(token) < 16 or token == self.token:
            return False
        self.token = token
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = None
            for k, v in scope["headers"]:
                if k == b"authorization":
                    header = v
                    break
            public = scope["path"] in self.public
            if header is not None or not public:
                if token_matches(header, self.token) or (
                    header and self._reloaded() and token_matches(header, self.token)
                ):
                    # The connection holds its slot from now on (httpserver).
                    trust = scope.get("extensions", {}).get(AUTHENTICATED)
                    if trust is not None:
                        trust()
                elif not public:
                    message = "missing or invalid bearer token" if header else None
                    await self._refuse(scope, send, message)
                    return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, message: str | None) -> None:
        body = _encode(
            models.ErrorBody(
                error=models.ErrorDetail(
                    code="unauthorized", message=message or "missing bearer token"
                )
            )
        )
        # A WebSocket is refused with the same HTTP answer (the ASGI denial
        # extension), or closed before its handshake where a server has none.
        prefix = "http"
        if scope["type"] == "websocket":
            if DENIAL not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1008})
                return
            prefix = "websocket.http"
        await send(
            {
                "type": f"{prefix}.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="sandbox-agent"'),
                ],
            }
        )
        await send({"type": f"{prefix}.response.body", "body": body})
