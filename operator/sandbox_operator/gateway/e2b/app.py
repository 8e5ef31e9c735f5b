"""The E2B listener: which plane a request is for, and which handler serves it.

A request is for the data plane when it names a sandbox: by the headers the
SDKs send when `E2B_SANDBOX_URL` is set (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`)
or by its host, `{port}-{id}.{e2b_domain}`. Everything else is the control
plane. Each part of the adapter lists its endpoints (`routes.Endpoint`); the
data plane's handlers get the sandbox resolved and authenticated (core.Target).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from sandbox_operator.gateway.e2b import connect, core
from sandbox_operator.gateway.e2b.control import Control
from sandbox_operator.gateway.e2b.core import (
    CONTROL,
    Adapter,
    ControlHandler,
    DataHandler,
    E2BError,
    Endpoint,
    Target,
)
from sandbox_operator.gateway.e2b.files import Files
from sandbox_operator.gateway.e2b.filesystem import Filesystem
from sandbox_operator.gateway.e2b.interpreter import Interpreter
from sandbox_operator.gateway.e2b.process import Processes

log = logging.getLogger("sandbox_gateway.e2b")


class E2BApp:
    def __init__(self, adapter: Adapter, endpoints: Iterable[Endpoint]) -> None:
        self.adapter = adapter
        self.endpoints = list(endpoints)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.errors], client_max_size=1 << 20)
        app[connect.BODY_SECONDS] = self.adapter.gateway.settings.head_seconds
        app.router.add_route("*", "/{path:.*}", self.dispatch)
        return app

    @web.middleware
    async def errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # The connection guard's deadlines wait while a request is served (as in
        # the gateway's own middleware): a command's or a watch's stream, or a
        # large transfer, outlasts them (the agent bounds those).
        guard = self.adapter.gateway.guard
        guard.started(request.protocol)
        try:
            return await handler(request)
        except E2BError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return E2BError(exc.status, exc.reason).response()
        finally:
            guard.ended(request.protocol)

    def _sandbox(self, request: web.Request) -> tuple[str, int] | None:
        """(sandbox ID, port) a data-plane request names, or None."""
        sandbox_id = request.headers.get(core.SANDBOX_ID_HEADER)
        if sandbox_id is not None:
            number = core.whole(
                request.headers.get(core.SANDBOX_PORT_HEADER, str(core.ENVD_PORT)).strip(), 5
            )
            if number is None or not 0 < number < 65536:
                raise E2BError(400, f"{core.SANDBOX_PORT_HEADER} must be a port number")
            return sandbox_id, number
        domain = self.adapter.gateway.settings.e2b_domain
        host = (request.host or "").split(":", 1)[0].lower()
        if domain and host.endswith("." + domain.lower()):
            port, _, sandbox_id = host[: -len(domain) - 1].partition("-")
            number = core.whole(port, 5)
            if number is not None and 0 < number < 65536 and sandbox_id:
                return sandbox_id, number
        return None

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.raw_path.partition("?")[0] != path:
            # Percent-encoding (or a segment it hides): no route of E2B's needs
            # it, and a route is matched on the path as sent, or not at all.
            raise E2BError(400, "the request path must be sent as is, without percent-encoding")
        named = self._sandbox(request)
        port = CONTROL if named is None else named[1]
        for endpoint in self.endpoints:
            if endpoint.port != port:
                continue
            params = endpoint.match(request.method, path)
            if params is None:
                continue
            if named is None:
                handler: ControlHandler = endpoint.handler  # type: ignore[assignment]
                return await handler(request, params)
            token = request.headers.get(core.ACCESS_TOKEN_HEADER) or request.headers.get(
                core.TRAFFIC_TOKEN_HEADER
            )
            if not token and endpoint.signed is not None and "signature" in request.query:
                target = await endpoint.signed(request, named[0])
            else:
                target = await self.adapter.target(named[0], token)
            serve: DataHandler = endpoint.handler  # type: ignore[assignment]
            return await serve(request, target, params)
        if named is not None and port not in (core.ENVD_PORT, core.INTERPRETER_PORT):
            raise E2BError(404, f"port {port} of sandbox {named[0]} is not served here")
        raise E2BError(404, f"{request.method} {path} is not served by the E2B adapter")


async def health(request: web.Request, target: Target, params: dict[str, str]) -> web.Response:
    """The daemon's health: 204 while the sandbox is running (a sandbox that is not
    running got core.not_running on the way here)."""
    return web.Response(status=204)


def endpoints(adapter: Adapter) -> list[Endpoint]:
    """Every endpoint of the adapter, from its parts (each part is a class made
    with the adapter, whose `endpoints()` lists its own)."""
    return [
        Endpoint(core.ENVD_PORT, "GET", "/health", health),
        *Control(adapter).endpoints(),
        *Interpreter(adapter).endpoints(),
        *Processes(adapter).endpoints(),
        *Filesystem(adapter).endpoints(),
        *Files(adapter).endpoints(),
    ]


def build(adapter: Adapter) -> web.Application:
    return E2BApp(adapter, endpoints(adapter)).app()
