"""The gateway's HTTP surface.

    /v1/namespaces/{ns}/sandboxes/{name}/executions...   the agent's exec API
    /v1/namespaces/{ns}/sandboxes/{name}/files...        the agent's files API
    /v1/namespaces/{ns}/sandboxes/{name}/info            the agent's info
    /v1/namespaces/{ns}/sandboxes/{name}/tokens          POST: mint a scoped token
    /v1/namespaces/{ns}/sandboxes/{name}/urls            POST: sign a download URL
    /v1/namespaces/{ns}/sandboxes/{name}/download        GET with a signature: file or tar
    /v1/namespaces/{ns}/sandboxes/{name}/ports/{port}/.. an exposed port (HTTP, WebSocket)
    {port}-{name}-{ns}.{preview_domain}/..               the same, by host

Every request goes through the same steps, in this order (docs/security.md):
its path must be canonical (400, canonical.py); an agent call must be an
operation of the agent's generated table (404, operations.py); the caller is
authenticated (401) and authorized for the sandbox's namespace and name
(403), decided alike whether the sandbox exists, and only then is it looked
up (404); it is sent to a sandbox that is ready (resumed first when its idle
policy paused it; 409 when its spec pauses it, 503 with its own reason while
it is not ready) and streamed. Errors are JSON in the agent's shape:
`{"error": {"code", "message"}}`; the agent's own errors pass through
unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote, urlencode

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import MultiDict

from sandbox_operator.clock import iso, iso_precise
from sandbox_operator.gateway import canonical, metrics
from sandbox_operator.gateway.access import Access, Caller, Denied, Operation
from sandbox_operator.gateway.agent_table import OPERATIONS
from sandbox_operator.gateway.config import GatewaySettings
from sandbox_operator.gateway.connections import Guard, Limits
from sandbox_operator.gateway.operations import AgentOperation, find
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
# What a signed URL may name: a workspace path as the agent takes it.
MAX_URL_PATH = 4096
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


def agent_operation(method: str, tail: str) -> AgentOperation | None:
    """The agent operation a gateway path names (`tail`: after the sandbox's
    prefix), or None when the gateway does not forward it."""
    return find(OPERATIONS, method, f"/v1/{tail}")


def workspace_path_problem(path: str) -> str | None:
    """Why `path` cannot name anything in the workspace, or None. The agent
    decides what exists; this refuses at minting what it would refuse anyway."""
    if not path or len(path) > MAX_URL_PATH:
        return f"path: a path in the workspace (1 to {MAX_URL_PATH} characters)"
    if "\\" in path or any(c < " " or c == "\x7f" or "\ud800" <= c <= "\udfff" for c in path):
        return "path: control characters, lone surrogates and backslashes are not allowed"
    layers = [path]
    while len(layers) < 4 and unquote(layers[-1]) != layers[-1]:
        layers.append(unquote(layers[-1]))
    for layer in layers:
        if layer.startswith("/"):
            return "path: relative to the workspace ('.' is its root), not absolute"
        if ".." in layer.split("/"):
            return "path: '..' is not allowed"
    return None


def preview_host(label: str, exists: Callable[[str, str], bool]) -> tuple[str, str, int] | None:
    """(namespace, name, port) of a preview host's first label `{port}-{name}-{namespace}`.
    Both names may hold dashes: each split is tried against the sandboxes that
    exist. A label that more than one split resolves names nothing: otherwise a
    sandbox `my` in namespace `box-team` would take `my-box` of `team`'s links."""
    port, _, rest = label.partition("-")
    if not re.fullmatch(r"[0-9]{1,5}", port):
        return None
    parts = rest.split("-")
    found = [
        ("-".join(parts[cut:]), "-".join(parts[:cut]))
        for cut in range(1, len(parts))
        if exists("-".join(parts[cut:]), "-".join(parts[:cut]))
    ]
    if len(found) != 1:
        return None
    namespace, name = found[0]
    return namespace, name, int(port)


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
        self.upstreams = Upstreams(
            settings.agent_connect_seconds, settings.head_seconds, settings.max_connections
        )
        self.guard = Guard(
            Limits(
                head_seconds=settings.head_seconds,
                idle_seconds=settings.idle_seconds,
                per_client=settings.connections_per_client,
                total=settings.max_connections,
            )
        )
        # Set on SIGTERM (__main__): not ready, and no connection kept alive.
        self.draining = False

    def app(self) -> web.Application:
        # Bodies the gateway reads itself (token and URL requests) are small; proxied
        # bodies stream past it and are bounded by the agent.
        app = web.Application(
            middlewares=[self.errors, self.canonical, self.by_host], client_max_size=1 << 20
        )
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
        self.guard.started(request.protocol)
        try:
            response = await handler(request)
            status = response.status
            if self.draining:
                # Keep-alive callers reconnect, through a Service that no longer
                # sends them here (after a streamed answer too: aiohttp reads
                # the flag when the answer ends).
                response.force_close()
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
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the caller left
        except Exception:
            # A bug of ours: logged with its traceback, answered in the usual shape.
            log.exception("%s %s failed", request.method, request.path)
            return error(500, "internal_error", "the gateway failed to handle the request")
        finally:
            self.guard.ended(request.protocol)
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(request.get("operation", operation), str(status)).inc()
            metrics.REQUEST_SECONDS.labels(request.get("operation", operation)).observe(
                time.perf_counter() - started
            )

    @web.middleware
    async def canonical(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Nothing is decided on a path that is not canonical: refused, not fixed."""
        try:
            canonical.check(
                request.raw_path.split("?", 1)[0],
                preview_host=self._preview_label(request) is not None,
            )
        except canonical.NotCanonical as exc:
            raise Refusal(400, "non_canonical_path", str(exc)) from exc
        return await handler(request)

    def _preview_label(self, request: web.Request) -> str | None:
        """The first label of a preview host (`{port}-{name}-{namespace}`), or None."""
        domain = self.settings.preview_domain
        host = (request.host or "").split(":", 1)[0].lower()
        if domain and host.endswith("." + domain.lower()):
            return host[: -len(domain) - 1]
        return None

    @web.middleware
    async def by_host(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """`{port}-{name}-{namespace}.{domain}` reaches a preview port by host."""
        label = self._preview_label(request)
        if label is None:
            return await handler(request)
        namespace, name, port = self._preview_host(label)
        rest = request.raw_path.split("?", 1)[0]
        return await self._preview(request, namespace, name, port, rest, by_host=True)

    def _preview_host(self, label: str) -> tuple[str, str, int]:
        found = preview_host(label, lambda ns, name: self.table.get(ns, name) is not None)
        if found is None:
            # Nothing to look up by: decided as for a sandbox that does not exist.
            return "", "", 0
        return found

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.table.synced and not self.draining
        state = "draining" if self.draining else "ok" if ready else "syncing"
        metrics.ROUTES.set(len(self.table.routes))
        return web.json_response(
            {"status": state, "routes": len(self.table.routes)}, status=200 if ready else 503
        )

    async def _authorized(self, request: web.Request, operation: Operation) -> Route:
        """Authenticate (401), authorize on the namespace and name (403), then look
        the sandbox up (404): in this order, so an unauthenticated or unauthorized
        caller learns nothing about what exists."""
        request["operation"] = operation.value
        caller = await self.access.caller(credentials(request))
        return await self._permitted(caller, request, operation)

    async def _permitted(self, caller: Caller, request: web.Request, operation: Operation) -> Route:
        """The sandbox the request names, once `caller` may do `operation` on it."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        route = self.table.get(namespace, name)
        await self.access.check(
            caller, operation, namespace, name, route.uid if route is not None else None
        )
        if route is None:
            raise Refusal(404, "sandbox_not_found", f"no sandbox {name} in namespace {namespace}")
        return route

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
        found = agent_operation(request.method, tail)
        if found is None:
            raise Refusal(404, "not_found", f"{request.method} {tail} is not served by the gateway")
        route = await self._authorized(request, found.operation)
        route, token = await self._serving(route)
        headers = forwarded_headers(request.headers)
        headers["Authorization"] = f"Bearer {token}"
        url = f"{route.endpoint}/v1/{tail}"
        if found.websocket:
            if request.headers.get("Upgrade", "").lower() != "websocket":
                raise Refusal(426, "websocket_required", f"{tail} is a WebSocket")
            raw = request.rel_url.raw_query_string  # as sent: it goes on a request line
            return await self.upstreams.websocket(request, f"{url}?{raw}" if raw else url, headers)
        return await self.upstreams.forward(
            request, url, headers=headers, events=found.streams, agent=True
        )

    # -- scoped tokens and signed URLs -------------------------------------------------

    async def _json(self, request: web.Request) -> JSON:
        """A small JSON object body, read within the head deadline (a caller that
        announces a body and sends nothing must not hold the connection)."""
        try:
            async with asyncio.timeout(self.settings.head_seconds):
                body = await request.json()
        except TimeoutError as exc:
            raise Refusal(408, "body_timeout", "the body did not arrive in time") from exc
        except RequestPayloadError as exc:  # a Content-Encoding that does not decode
            raise Refusal(400, "invalid_request", f"the body could not be read: {exc}") from None
        except (ValueError, RecursionError) as exc:
            raise Refusal(400, "invalid_request", "the body must be a JSON object") from exc
        if not isinstance(body, dict):
            raise Refusal(400, "invalid_request", "the body must be a JSON object")
        return body

    def _ttl(self, body: JSON) -> int:
        ttl = body.get("ttlSeconds", 600)
        limit = self.settings.max_token_seconds
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= limit:
            raise Refusal(
                400, "invalid_request", f"ttlSeconds must be a whole number from 1 to {limit}"
            )
        return ttl

    async def mint_token(self, request: web.Request) -> web.Response:
        """A token for callers without Kubernetes credentials (a browser, an AI tool):
        bound to this Sandbox object, to the operations asked for (each of which the
        minting caller must hold) and to an expiry no later than the minter's own."""
        request["operation"] = "mint_token"
        caller = await self.access.caller(credentials(request))
        body = await self._json(request)
        names = body.get("operations")
        known = {op.value: op for op in Operation}
        if (
            not isinstance(names, list)
            or not names
            or not all(isinstance(n, str) and n in known for n in names)
        ):
            raise Refusal(
                400, "invalid_request", f"operations: a non-empty list of {sorted(known)}"
            )
        ttl = self._ttl(body)
        if caller.scope is not None:
            raise Refusal(403, "forbidden", "a scoped token cannot mint tokens")
        for name in names:
            route = await self._permitted(caller, request, known[name])
        expires = caller.lifetime(ttl, time.time())
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
        """A URL that downloads one file (or a directory, as tar) without credentials,
        valid no longer than the credential that signed it."""
        request["operation"] = "sign_url"
        caller = await self.access.caller(credentials(request))
        body = await self._json(request)
        path = body.get("path")
        if not isinstance(path, str):
            raise Refusal(400, "invalid_request", "path: a path in the workspace")
        problem = workspace_path_problem(path)
        if problem is not None:
            raise Refusal(400, "invalid_request", problem)
        ttl = self._ttl(body)
        route = await self._permitted(caller, request, Operation.FILES_READ)
        expires = caller.lifetime(ttl, time.time())
        try:
            query = self.keys.sign_url("GET", route.namespace, route.name, route.uid, path, expires)
        except SigningError as exc:
            raise Refusal(503, "no_signing_key", str(exc)) from exc
        relative = f"/v1/namespaces/{route.namespace}/sandboxes/{route.name}/download?" + urlencode(
            {"path": path, **query}
        )
        # On the external URL when one is configured: the address this request came
        # by may be the API server's proxy or a name only pods resolve. `external`
        # tells clients that reached the gateway by another way that `url` is usable.
        external = self.settings.external_url
        base = external.rstrip("/") if external else f"{request.scheme}://{request.host}"
        return web.json_response(
            {
                "url": base + relative,
                "path": relative,
                "expiresAt": iso(_at(expires)),
                "external": external is not None,
            },
            status=201,
        )

    async def download(self, request: web.Request) -> web.StreamResponse:
        """A signed URL: a file, or a directory as tar (a symlink as what it names).
        A URL that does not verify is 401, as any credential the gateway cannot
        accept; for a sandbox that does not exist it is refused the same way."""
        request["operation"] = "download"
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        route = self.table.get(namespace, name)
        path = request.query.get("path", "")
        try:
            uid = route.uid if route is not None else ""  # fails as a wrong signature does
            self.keys.verify_url("GET", namespace, name, uid, path, dict(request.query))
        except SigningError as exc:
            raise Refusal(401, "invalid_signature", str(exc)) from exc
        assert route is not None
        route, token = await self._serving(route)
        headers = forwarded_headers(request.headers, drop=("range",))
        headers["Authorization"] = f"Bearer {token}"
        try:
            stat = await self.upstreams.session.get(
                f"{route.endpoint}/v1/files/stat",
                params={"path": path, "follow": "true"},
                headers=headers,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamError(f"{route.endpoint} could not be reached: {exc}") from exc
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
            extra_response_headers={"Content-Disposition": attachment(filename)},
            agent=True,
        )

    # -- preview ports ----------------------------------------------------------------

    async def preview(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        prefix = f"{PREFIX}/ports/{{port}}".format_map(info)
        # The rest as sent (canonical, checked): the sandbox's server reads it, not us.
        rest = request.raw_path.split("?", 1)[0][len(prefix) :] or "/"
        return await self._preview(
            request, info["namespace"], info["name"], int(info["port"]), rest
        )

    async def _preview(
        self,
        request: web.Request,
        namespace: str,
        name: str,
        number: int,
        rest: str,
        *,
        by_host: bool = False,
    ) -> web.StreamResponse:
        """A public port is open to anyone; for any other request (a private port,
        or one that names nothing) the caller is authenticated and authorized
        before anything is told about the sandbox and its ports."""
        request["operation"] = "preview"
        route = self.table.get(namespace, name)
        port = None
        if route is not None and number != self.settings.agent_port:
            port = route.ports.get(number)  # never the agent's own port
        query: MultiDict[str] = MultiDict(request.query)
        # A link's token is the gateway's: never passed on, not even to a public port.
        token = next(iter(query.popall("token", [])), None)
        if port is None or not port.public:
            if token is not None and not Keys.is_scoped(token):
                raise Refusal(
                    401, "invalid_token", "?token= takes a scoped token (POST .../tokens)"
                )
            cookie = request.cookies.get(PREVIEW_COOKIE)
            authorization = (
                f"Bearer {token}"
                if token is not None
                else credentials(request) or (f"Bearer {cookie}" if cookie else None)
            )
            caller = await self.access.caller(authorization)
            try:
                await self.access.check(
                    caller, Operation.PORTS, namespace, name, route.uid if route else None
                )
            except Denied as exc:
                if by_host:  # the host may name nothing: say nothing of what it could be
                    raise Denied(exc.status, exc.code, "not allowed to reach this host") from exc
                raise
            if route is None:
                raise Refusal(
                    404, "sandbox_not_found", f"no sandbox {name} in namespace {namespace}"
                )
            if port is None:
                raise Refusal(
                    404, "port_not_exposed", f"port {number} is not in spec.network.exposedPorts"
                )
            if token is not None:
                # A link with a scoped token: checked, kept in a cookie, dropped from the URL.
                location = request.raw_path.split("?", 1)[0]
                if query:
                    location += "?" + urlencode(list(query.items()))
                cookie_path = (
                    "/" if by_host else f"{PREFIX}/ports/".format(namespace=namespace, name=name)
                )
                raise web.HTTPFound(
                    location, headers={"Set-Cookie": self._cookie(request, token, cookie_path)}
                )
        assert route is not None
        route, _ = await self._serving(route)
        url = f"http://{route.pod_ip}:{number}{rest}"
        headers = forwarded_headers(request.headers)
        headers["X-Forwarded-Host"] = request.host
        headers["X-Forwarded-Proto"] = request.scheme
        if request.remote:
            headers["X-Forwarded-For"] = request.remote
        if request.headers.get("Upgrade", "").lower() == "websocket":
            # Its query too (a socket.io client's `?EIO=4&transport=websocket`), but a token.
            if token is None:
                wanted = request.rel_url.raw_query_string
            else:
                wanted = urlencode(list(query.items()), quote_via=quote)
            return await self.upstreams.websocket(
                request, f"{url}?{wanted}" if wanted else url, headers
            )
        return await self.upstreams.forward(request, url, query=query, headers=headers)

    def _cookie(self, request: web.Request, token: str, path: str) -> str:
        secure = "; Secure" if request.scheme == "https" else ""
        return f"{PREVIEW_COOKIE}={token}; Path={path}; HttpOnly; SameSite=Lax{secure}"


def _at(epoch: int) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def attachment(filename: str) -> str:
    """Content-Disposition for a download: an ASCII fallback name and the exact
    one percent-encoded (RFC 6266/5987), so no byte of a file name can end the
    header or start another."""
    fallback = "".join(c if " " <= c < "\x7f" and c not in '"\\;' else "_" for c in filename)
    exact = quote(filename.encode("utf-8", "surrogateescape"), safe="")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{exact}"
