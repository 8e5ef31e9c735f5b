"""The gateway's HTTP surface.

    /v1/namespaces/{ns}/sandboxes/{name}/executions...   the agent's exec API
    /v1/namespaces/{ns}/sandboxes/{name}/files...        the agent's files API
    /v1/namespaces/{ns}/sandboxes/{name}/info            the agent's info
    /v1/namespaces/{ns}/sandboxes/{name}/tokens          POST: mint a scoped token
    /v1/namespaces/{ns}/sandboxes/{name}/urls            POST: sign a download URL
    /v1/namespaces/{ns}/sandboxes/{name}/download        GET with a signature: file or tar
    /v1/namespaces/{ns}/sandboxes/{name}/ports/{port}/.. an exposed port (HTTP, WebSocket)
    {port}-{name}-{ns}.{preview_domain}/..               the same, by host

Each request is looked up in the route table (404 if no such sandbox),
authenticated and authorized (401/403), sent to a sandbox that is ready
(resumed first when its idle policy paused it; 409 when its spec pauses it,
503 with its own reason while it is not ready) and streamed. Errors are JSON
in the agent's shape: `{"error": {"code", "message"}}`; the agent's own
errors pass through unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from sandbox_operator.clock import iso, iso_precise
from sandbox_operator.gateway import metrics
from sandbox_operator.gateway.access import Access, Caller, Denied, Operation
from sandbox_operator.gateway.config import GatewaySettings
from sandbox_operator.gateway.proxy import UpstreamError, Upstreams, forwarded_headers
from sandbox_operator.gateway.signing import Claims, Keys, SigningError
from sandbox_operator.gateway.table import Route, RouteTable
from sandbox_operator.kube import Api, KubeError
from sandbox_operator.resources import RESUME_ANNOTATION, SANDBOXES

JSON = dict[str, Any]
log = logging.getLogger("sandbox_gateway")

PREFIX = "/v1/namespaces/{namespace}/sandboxes/{name}"
PREVIEW_COOKIE = "sandbox-preview"
# The caller's token when the request comes through the API server's service
# proxy, which takes the Authorization header for itself (kubectl's path from
# a laptop): the same bearer token, in a header the API server passes on.
PROXIED_AUTHORIZATION = "X-Sandbox-Authorization"
# Read-only operations that the agent serves as POST (a body carries the query).
_READ_POSTS = {"files/search", "files/find"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Refusal(Exception):
    """An answer the gateway gives itself: status, machine-readable code, message."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = json.dumps({"error": {"code": code, "message": message}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def credentials(request: web.Request) -> str | None:
    return request.headers.get(PROXIED_AUTHORIZATION) or request.headers.get("Authorization")


def operation_of(method: str, tail: str) -> Operation | None:
    """Which permission an agent call needs; None for what the gateway does not expose
    (workspace control and the environment are the operator's)."""
    first = tail.split("/", 1)[0]
    if first == "executions":
        return Operation.EXEC
    if first == "files":
        if method in ("GET", "HEAD") or tail in _READ_POSTS:
            return Operation.FILES_READ
        return Operation.FILES_WRITE
    if tail == "info" and method == "GET":
        return Operation.VIEW
    return None


def preview_host(label: str, exists: Callable[[str, str], bool]) -> tuple[str, str, int] | None:
    """(namespace, name, port) of a preview host's first label `{port}-{name}-{namespace}`.
    Both names may hold dashes: each split is tried against the sandboxes that exist."""
    port, _, rest = label.partition("-")
    if not port.isdigit():
        return None
    parts = rest.split("-")
    for cut in range(1, len(parts)):
        namespace, name = "-".join(parts[cut:]), "-".join(parts[:cut])
        if exists(namespace, name):
            return namespace, name, int(port)
    return None


class Gateway:
    def __init__(self, settings: GatewaySettings, kube: Api, table: RouteTable, keys: Keys) -> None:
        self.settings = settings
        self.kube = kube
        self.table = table
        self.keys = keys
        self.access = Access(
            kube,
            keys,
            settings.token_review_seconds,
            settings.access_review_seconds,
            settings.cache_entries,
        )
        self.upstreams = Upstreams(settings.agent_connect_seconds)

    def app(self) -> web.Application:
        # Bodies the gateway reads itself (token and URL requests) are small; proxied
        # bodies stream past it and are bounded by the agent.
        app = web.Application(middlewares=[self.errors, self.by_host], client_max_size=1 << 20)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_post(PREFIX + "/tokens", self.mint_token)
        app.router.add_post(PREFIX + "/urls", self.sign_url)
        app.router.add_get(PREFIX + "/download", self.download)
        app.router.add_route("*", PREFIX + "/ports/{port:[0-9]+}{rest:(/.*)?}", self.preview)
        app.router.add_route("*", PREFIX + "/{tail:.+}", self.agent)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _: web.Application) -> None:
        await self.upstreams.close()

    # -- plumbing -------------------------------------------------------------------

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal as JSON; nothing a caller sends becomes a 500."""
        started = time.perf_counter()
        operation = request.match_info.route.name or "other"
        status = 500
        metrics.IN_FLIGHT.inc()
        try:
            response = await handler(request)
            status = response.status
            return response
        except Refusal as exc:
            status = exc.status
            return error(exc.status, exc.code, exc.message, exc.headers)
        except Denied as exc:
            status = exc.status
            return error(exc.status, exc.code, exc.message)
        except UpstreamError as exc:
            status = 502
            return error(502, "sandbox_unreachable", str(exc))
        except web.HTTPException as exc:
            status = exc.status
            if exc.status >= 400:
                return error(
                    exc.status, "not_found" if exc.status == 404 else "bad_request", exc.reason
                )
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(request.get("operation", operation), str(status)).inc()
            metrics.REQUEST_SECONDS.labels(request.get("operation", operation)).observe(
                time.perf_counter() - started
            )

    @web.middleware
    async def by_host(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """`{port}-{name}-{namespace}.{domain}` reaches a preview port by host."""
        domain = self.settings.preview_domain
        host = (request.host or "").split(":", 1)[0].lower()
        if domain and host.endswith("." + domain.lower()):
            label = host[: -len(domain) - 1]
            found = self._preview_host(label)
            if found is None:
                raise Refusal(404, "not_found", f"no sandbox port is served at {host}")
            route, port = found
            return await self._preview(request, route, port, request.path)
        return await handler(request)

    def _preview_host(self, label: str) -> tuple[Route, int] | None:
        found = preview_host(label, lambda ns, name: self.table.get(ns, name) is not None)
        if found is None:
            return None
        namespace, name, port = found
        route = self.table.get(namespace, name)
        return (route, port) if route is not None else None

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.table.synced
        metrics.ROUTES.set(len(self.table.routes))
        return web.json_response(
            {"status": "ok" if ready else "syncing", "routes": len(self.table.routes)},
            status=200 if ready else 503,
        )

    def _route(self, request: web.Request) -> Route:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        route = self.table.get(namespace, name)
        if route is None:
            raise Refusal(404, "sandbox_not_found", f"no sandbox {name} in namespace {namespace}")
        return route

    async def _authorized(self, request: web.Request, route: Route, operation: Operation) -> Caller:
        request["operation"] = operation.value
        caller = await self.access.caller(credentials(request))
        await self.access.check(caller, operation, route)
        return caller

    async def _serving(self, route: Route) -> tuple[Route, str]:
        """The route of a sandbox ready for calls, and its agent token: resumed first
        when its idle policy paused it, waited for (bounded) while it starts."""
        if route.pool or route.claimed_by:
            # A warm member is for whoever claims it next: nobody may leave files
            # or processes in it first. A claimed one is reached by its claimer's name.
            where = f"waits in SandboxPool {route.pool}" if route.pool else "serves another Sandbox"
            raise Refusal(
                409,
                "pool_member",
                f"sandbox {route.name} is a pool member and {where}: create a Sandbox with"
                " spec.poolRef to claim one, and use that Sandbox's name",
            )
        if route.paused_by_spec:
            raise Refusal(
                409,
                "sandbox_paused",
                f"sandbox {route.name} is paused by its spec (spec.paused: true)",
            )
        if route.paused:
            await self._resume(route)
        wait = self.settings.resume_wait_seconds if route.paused or not route.ready else 0
        current = await self.table.wait(
            route.namespace,
            route.name,
            lambda r: (
                r is None or r.uid != route.uid or (r.ready and self.table.token(r) is not None)
            ),
            wait,
        )
        if current is None or current.uid != route.uid:
            raise Refusal(404, "sandbox_not_found", f"sandbox {route.name} was deleted")
        token = self.table.token(current)
        if not current.ready or not current.endpoint or token is None:
            reason = current.reason or "NotReady"
            raise Refusal(
                503,
                "sandbox_not_ready",
                f"sandbox {route.name} is not ready ({reason}): {current.message}",
                {"Retry-After": "2"},
            )
        return current, token

    async def _resume(self, route: Route) -> None:
        """Ask the operator to resume it, as the Execution path does (an annotation,
        never a spec change: the spec belongs to whoever applied it)."""
        metrics.RESUMES.inc()
        moment = iso_precise(datetime.now(UTC))
        try:
            await self.kube.patch(
                SANDBOXES.path(route.namespace, route.name),
                {"metadata": {"annotations": {RESUME_ANNOTATION: moment}}},
            )
        except KubeError as exc:
            raise Refusal(503, "resume_failed", f"could not resume the sandbox: {exc}") from exc

    # -- the agent's API --------------------------------------------------------------

    async def agent(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        operation = operation_of(request.method, tail)
        if operation is None:
            raise Refusal(404, "not_found", f"{request.method} {tail} is not served by the gateway")
        route = self._route(request)
        await self._authorized(request, route, operation)
        route, token = await self._serving(route)
        headers = forwarded_headers(request.headers)
        headers["Authorization"] = f"Bearer {token}"
        return await self.upstreams.forward(request, f"{route.endpoint}/v1/{tail}", headers=headers)

    # -- scoped tokens and signed URLs -------------------------------------------------

    async def _json(self, request: web.Request) -> JSON:
        try:
            body = await request.json()
        except ValueError as exc:
            raise Refusal(400, "invalid_request", "the body must be a JSON object") from exc
        if not isinstance(body, dict):
            raise Refusal(400, "invalid_request", "the body must be a JSON object")
        return body

    def _ttl(self, body: JSON) -> int:
        ttl = body.get("ttlSeconds", 600)
        if not isinstance(ttl, int) or not 1 <= ttl <= self.settings.max_token_seconds:
            raise Refusal(
                400,
                "invalid_request",
                f"ttlSeconds must be a whole number from 1 to {self.settings.max_token_seconds}",
            )
        return ttl

    async def mint_token(self, request: web.Request) -> web.Response:
        """A token for callers without Kubernetes credentials (a browser, an AI tool):
        bound to this Sandbox object, to the operations asked for (each of which the
        minting caller must hold) and to an expiry."""
        request["operation"] = "mint_token"
        route = self._route(request)
        body = await self._json(request)
        names = body.get("operations")
        known = {op.value: op for op in Operation}
        if not isinstance(names, list) or not names or not all(n in known for n in names):
            raise Refusal(
                400, "invalid_request", f"operations: a non-empty list of {sorted(known)}"
            )
        ttl = self._ttl(body)
        caller = await self.access.caller(credentials(request))
        if caller.scope is not None:
            raise Refusal(403, "forbidden", "a scoped token cannot mint tokens")
        for name in names:
            await self.access.check(caller, known[name], route)
        expires = int(time.time()) + ttl
        claims = Claims(route.namespace, route.name, route.uid, tuple(sorted(set(names))), expires)
        try:
            token = self.keys.mint_token(claims)
        except SigningError as exc:
            raise Refusal(503, "no_signing_key", str(exc)) from exc
        return web.json_response(
            {"token": token, "operations": list(claims.operations), "expiresAt": iso(_at(expires))},
            status=201,
        )

    async def sign_url(self, request: web.Request) -> web.Response:
        """A URL that downloads one file (or a directory, as tar) without credentials."""
        request["operation"] = "sign_url"
        route = self._route(request)
        body = await self._json(request)
        path = body.get("path")
        if not isinstance(path, str) or not path or len(path) > 4096:
            raise Refusal(400, "invalid_request", "path: a path in the workspace")
        ttl = self._ttl(body)
        await self._authorized(request, route, Operation.FILES_READ)
        expires = int(time.time()) + ttl
        try:
            query = self.keys.sign_url("GET", route.namespace, route.name, route.uid, path, expires)
        except SigningError as exc:
            raise Refusal(503, "no_signing_key", str(exc)) from exc
        relative = f"/v1/namespaces/{route.namespace}/sandboxes/{route.name}/download?" + urlencode(
            {"path": path, **query}
        )
        return web.json_response(
            {
                "url": f"{request.scheme}://{request.host}{relative}",
                "path": relative,
                "expiresAt": iso(_at(expires)),
            },
            status=201,
        )

    async def download(self, request: web.Request) -> web.StreamResponse:
        request["operation"] = "download"
        route = self._route(request)
        path = request.query.get("path", "")
        try:
            self.keys.verify_url(
                "GET", route.namespace, route.name, route.uid, path, dict(request.query)
            )
        except SigningError as exc:
            raise Refusal(403, "invalid_signature", str(exc)) from exc
        route, token = await self._serving(route)
        headers = forwarded_headers(request.headers, drop=("range",))
        headers["Authorization"] = f"Bearer {token}"
        stat = await self.upstreams.session.get(
            f"{route.endpoint}/v1/files/stat", params={"path": path}, headers=headers
        )
        async with stat:
            if stat.status != 200:
                return web.Response(
                    status=stat.status, body=await stat.read(), content_type="application/json"
                )
            kind = (await stat.json()).get("type")
        base = path.rstrip("/").rsplit("/", 1)[-1] or "workspace"
        if kind == "directory":
            url, filename = f"{route.endpoint}/v1/files/archive", f"{base}.tar"
        else:
            url, filename = f"{route.endpoint}/v1/files/content", base
        return await self.upstreams.forward(
            request,
            url,
            query={"path": path},
            headers=headers,
            extra_response_headers={
                "Content-Disposition": f'attachment; filename="{_quoted(filename)}"'
            },
        )

    # -- preview ports ----------------------------------------------------------------

    async def preview(self, request: web.Request) -> web.StreamResponse:
        route = self._route(request)
        return await self._preview(
            request, route, int(request.match_info["port"]), request.match_info["rest"] or "/"
        )

    async def _preview(
        self, request: web.Request, route: Route, number: int, rest: str
    ) -> web.StreamResponse:
        request["operation"] = "preview"
        port = route.ports.get(number)
        if port is None:
            raise Refusal(
                404, "port_not_exposed", f"port {number} is not in spec.network.exposedPorts"
            )
        query = dict(request.query)
        if not port.public:
            token = query.pop("token", None)
            if token:
                # A link with a scoped token: check it, keep it in a cookie, drop it from the URL.
                caller = await self.access.caller(f"Bearer {token}")
                await self.access.check(caller, Operation.PORTS, route)
                location = request.path + (f"?{urlencode(query)}" if query else "")
                raise web.HTTPFound(location, headers={"Set-Cookie": self._cookie(request, token)})
            cookie = request.cookies.get(PREVIEW_COOKIE)
            authorization = credentials(request) or (f"Bearer {cookie}" if cookie else None)
            caller = await self.access.caller(authorization)
            await self.access.check(caller, Operation.PORTS, route)
        route, _ = await self._serving(route)
        url = f"http://{route.pod_ip}:{number}{rest}"
        headers = forwarded_headers(request.headers)
        headers["X-Forwarded-Host"] = request.host
        headers["X-Forwarded-Proto"] = request.scheme
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self.upstreams.websocket(request, url, headers)
        return await self.upstreams.forward(request, url, query=query, headers=headers)

    def _cookie(self, request: web.Request, token: str) -> str:
        path = request.path.split("/ports/")[0] + "/ports/" if "/ports/" in request.path else "/"
        secure = "; Secure" if request.scheme == "https" else ""
        return f"{PREVIEW_COOKIE}={token}; Path={path}; HttpOnly; SameSite=Lax{secure}"


def _at(epoch: int) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _quoted(name: str) -> str:
    return name.replace("\\", "_").replace('"', "_")
