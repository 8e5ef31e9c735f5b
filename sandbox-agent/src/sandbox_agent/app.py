"""The HTTP edge: a Starlette app built from the route table.

This is where the web meets the domain: each ``Op`` becomes a route whose
parameters are parsed as declared, domain errors become HTTP statuses
(``STATUS``, the one mapping), and the auth middleware wraps it all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import cast

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp
from starlette.websockets import WebSocket, WebSocketState

from . import errors, metrics, openapi
from .auth import AuthMiddleware
from .config import Settings
from .routes import OPS
from .routing import Attach, Handler, Op, parse_args, public_paths
from .state import AgentState, state_of
from .web import JSON, encode

# Domain error kind -> HTTP status. Kinds not listed (none today) are 500s.
STATUS: dict[type[errors.AgentError], int] = {
    errors.Invalid: 400,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.Gone: 410,
    errors.TooLarge: 413,
    errors.Busy: 429,
    errors.IOFailure: 500,
    errors.Unavailable: 503,
    errors.NoSpace: 507,
}


def status_of(exc: errors.AgentError) -> int:
    for kind, status in STATUS.items():
        if isinstance(exc, kind):
            return status
    return 500


def endpoint(op: Op) -> list[BaseRoute]:
    """The Starlette route of one operation: parameters first, then the handler."""
    if op.websocket:
        return websocket_endpoint(op)
    handler = cast(Handler, op.handler)

    async def call(request: Request) -> Response:
        args = parse_args(op.params, request)
        if op.writes:
            # A write waits while the workspace is quiesced (bounded by the
            # quiesce's own timer) instead of landing in the snapshot being cut.
            await state_of(request).quiesce.wait_resumed()
        return await handler(request, args)

    return [Route(op.path, call, methods=[op.method], name=op.handler.__name__)]


def websocket_endpoint(op: Op) -> list[BaseRoute]:
    """A WebSocket operation: an error before the handshake is answered as HTTP
    (status and error body, as every other operation), one after it closes the
    WebSocket with its message; a plain GET is told to upgrade (426)."""
    attach = cast(Attach, op.handler)

    async def session(ws: WebSocket) -> None:
        try:
            await attach(ws, parse_args(op.params, ws))
        except errors.AgentError as exc:
            if ws.application_state is WebSocketState.CONNECTING:
                answer = Response(encode(exc.body()), status_of(exc), media_type=JSON)
                try:
                    await ws.send_denial_response(answer)
                except RuntimeError:  # a server without the denial extension
                    await ws.close(code=1008, reason=exc.message[:120])
            elif ws.application_state is WebSocketState.CONNECTED:
                await ws.close(code=1011, reason=exc.message[:120])

    async def plain(request: Request) -> Response:
        error = errors.error_body("websocket_required", f"{op.path} is a WebSocket")
        return Response(encode(error), 426, {"Upgrade": "websocket"}, media_type=JSON)

    name = op.handler.__name__
    return [WebSocketRoute(op.path, session, name=name), Route(op.path, plain, methods=["GET"])]


async def _agent_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.AgentError)
    if request.url.path.startswith("/v1/files"):
        metrics.FILE_OPS.labels(request.url.path.rsplit("/", 1)[-1], "error").inc()
    return Response(encode(exc.body()), status_of(exc), media_type=JSON)


_HTTP_CODES: dict[int, errors.Code] = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    return Response(
        encode(errors.error_body(code, str(exc.detail))),
        exc.status_code,
        headers=exc.headers,
        media_type=JSON,
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    return Response(
        encode(errors.error_body("internal_error", type(exc).__name__)),
        500,
        media_type=JSON,
    )


def build_app(settings: Settings, token: bytes, ops: tuple[Op, ...] = OPS) -> ASGIApp:
    state = AgentState(settings)
    state.openapi = encode(openapi.document(ops))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.executions.restore()
        state.runner.start()
        state.terminals.start()
        watch = asyncio.get_running_loop().create_task(state.executions.watch_runner())
        # A streamed answer runs in an anyio task group (Starlette under ASGI
        # 2.3), whose first use imports anyio's asyncio backend: 11-16 ms of
        # CPU, up to 100 ms under a 250m CPU limit. Paid here, before the
        # pod is Ready, not by a sandbox's first streamed command (an E2B
        # command is one): docs/benchmarks.md, "E2B's SDK against ours".
        async with anyio.create_task_group():
            pass
        yield
        watch.cancel()
        state.polled.close()
        await state.terminals.stop()
        await state.contexts.stop()
        state.executions.fail_all_running()
        await state.runner.stop()
        state.executions.journal.close()

    app = Starlette(
        routes=[route for op in ops for route in endpoint(op)],
        exception_handlers={
            errors.AgentError: _agent_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.agent = state
    public = public_paths(ops, metrics_auth=settings.metrics_auth)
    return AuthMiddleware(app, token, public, settings.token_file)
