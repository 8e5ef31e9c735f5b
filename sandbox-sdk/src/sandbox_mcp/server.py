"""The MCP server: tools over stdio (the kubeconfig's credentials) or streamable
HTTP (each caller's own bearer token, checked before any MCP message is read)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext

from sandbox_mcp import tools
from sandbox_mcp.sessions import Caller, Session, identity_of
from sandbox_mcp.settings import Settings
from sandbox_sdk import AsyncSandbox, AsyncSandboxClient, __version__
from sandbox_sdk.config import ConnectionOptions
from sandbox_sdk.errors import (
    Forbidden,
    NotFound,
    NotReady,
    Paused,
    SandboxError,
    Unauthorized,
)

log = logging.getLogger("sandbox_mcp")
SESSION_HEADER = "x-sandbox-session"
MCP_SESSION_HEADER = "mcp-session-id"
INSTRUCTIONS = (
    "Tools of an isolated Linux sandbox that belongs to this conversation: its files"
    " (paths relative to the workspace; the user's uploads are in ./user-uploads/) and"
    " shell commands. Files and installed packages persist for the whole session. A"
    " command whose call was cut off (a lost connection, a restarted server) runs on:"
    " sandbox_list_commands finds it and sandbox_command_output re-attaches to it, so"
    " check there before running it again."
)


@dataclass
class App:
    """What every request of one server shares: settings and live sessions."""

    settings: Settings
    # (caller identity, session key) -> its Session
    sessions: dict[tuple[str, str], Session] = field(default_factory=dict)
    # stdio: the one caller; http: none (each request brings its own)
    local: Caller | None = None

    def session(self, caller: Caller, key: str) -> Session:
        found = self.sessions.get((caller.identity, key))
        if found is None:
            uploads = self.settings.uploads if self.local is not None else ()
            found = Session(key, caller, self.settings, uploads)
            self.sessions[(caller.identity, key)] = found
        else:
            found.caller = caller  # the same identity, maybe with a newer token
        return found

    async def end(self, key: tuple[str, str]) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            await session.end()


def _result(text: str, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=error)


def _progress_requested(ctx: ServerRequestContext[Any, Any]) -> bool:
    meta: Any = ctx.meta or {}
    return meta.get("progress_token") is not None or meta.get("progressToken") is not None


def _reporter(ctx: ServerRequestContext[Any, Any]) -> tools.Progress | None:
    """The call's progress notifications, when the client asked for them: one
    running total (the protocol wants it to grow) over the wait for the
    sandbox and the command's output."""
    if not _progress_requested(ctx):
        return None
    total = 0.0

    async def report(advance: float, text: str) -> None:
        nonlocal total
        total += max(advance, 0.001)
        await ctx.session.report_progress(total, None, text)

    return report


def session_of(app: App, ctx: ServerRequestContext[Any, Any]) -> Session:
    """The request's session: stdio's one; over HTTP the caller's, keyed by
    `X-Sandbox-Session` (a key the client keeps, to resume later), else the
    MCP session id, else (stateless protocol versions) one per caller."""
    if app.local is not None:
        return app.session(app.local, app.settings.session or "")
    request = ctx.request
    caller = request.scope.get("state", {}).get("sandbox_caller") if request is not None else None
    if not isinstance(caller, Caller):
        raise tools.ToolFailure("forbidden", "no credentials reached the tool call")
    headers = request.headers if request is not None else {}
    key = headers.get(SESSION_HEADER) or headers.get(MCP_SESSION_HEADER) or "default"
    return app.session(caller, key)


async def _on_sandbox(
    name: str, sandbox: AsyncSandbox, args: dict[str, Any], progress: tools.Progress | None
) -> types.CallToolResult:
    if name == "sandbox_snapshot":
        snap = await sandbox.snapshot(args.get("tag"), description=args.get("description"))
        return _result(f"snapshot {snap.metadata.name} is ready")
    if name == "sandbox_restore":
        # Not there: say so now, rather than wait for a restore that cannot start.
        await sandbox.client.get_snapshot(str(args["snapshot"]), namespace=sandbox.namespace)
        await sandbox.restore(str(args["snapshot"]))
        return _result(f"the workspace is restored from {args['snapshot']}")
    if name == "sandbox_run_code":
        reply = await tools.run_code(sandbox, args)
        images = [types.ImageContent(data=data, mime_type=mime) for mime, data in reply.images]
        return types.CallToolResult(
            content=[types.TextContent(text=reply.text), *images], is_error=reply.failed
        )
    return _result(await tools.call(name, sandbox, args, progress))


async def call_tool(
    app: App, ctx: ServerRequestContext[Any, Any], name: str, args: dict[str, Any]
) -> types.CallToolResult:
    try:
        # Before anything is done: a call the schema does not allow is refused
        # whole, naming the argument, rather than half-run or run on a default.
        tools.check(name, args)
        session = session_of(app, ctx)
        progress = _reporter(ctx)
        if name == "sandbox_create":
            sandbox = await session.create(
                args.get("runtime"), args.get("image"), args.get("from_snapshot"), progress
            )
            return _result(f"sandbox {sandbox.name} is ready")
        if name == "sandbox_destroy":
            gone = await session.destroy()
            return _result(f"destroyed {gone}" if gone else "this session had no sandbox")
        for attempt in (1, 2):
            sandbox = await session.sandbox(progress)
            try:
                return await _on_sandbox(name, sandbox, args, progress)
            except (Paused, NotReady, NotFound) as exc:
                # Refused before anything ran: the sandbox was paused (its idle
                # policy), is restarting or is gone; find it again, once.
                missing_file = isinstance(exc, NotFound) and exc.code != "sandbox_not_found"
                if attempt == 2 or missing_file:
                    raise
                session.stale()
        raise AssertionError("unreachable")
    except tools.ToolFailure as exc:
        return _result(exc.text(), error=True)
    except SandboxError as exc:
        return _result(tools.failure(exc).text(), error=True)
    except Exception as exc:  # a broken tool must not break the session
        log.exception("tool %s failed", name)
        return _result(f"error: {type(exc).__name__}: {exc}", error=True)


def build(app: App) -> Server[App]:
    @contextlib.asynccontextmanager
    async def lifespan(_: Server[App]) -> AsyncIterator[App]:
        yield app

    listing = types.ListToolsResult(
        tools=[
            types.Tool(
                name=t.name,
                description=t.description,
                input_schema=t.schema,
                annotations=types.ToolAnnotations(
                    read_only_hint=t.read_only,
                    destructive_hint=t.name
                    in ("sandbox_delete_file", "sandbox_destroy", "sandbox_restore"),
                    open_world_hint=False,
                ),
            )
            for t in tools.TOOLS
        ]
    )

    async def list_tools(
        ctx: ServerRequestContext[App, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return listing

    async def on_call(
        ctx: ServerRequestContext[App, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        return await call_tool(ctx.lifespan_context, ctx, params.name, dict(params.arguments or {}))

    return Server(
        "sandbox-mcp",
        version=__version__,
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=on_call,
    )


# -- stdio -----------------------------------------------------------------------


async def serve_stdio(settings: Settings) -> None:
    from mcp.server.stdio import stdio_server

    client = AsyncSandboxClient.from_options(settings.connection())
    try:
        identity = await identity_of(client)
    except SandboxError as exc:
        log.warning(
            "who the kubeconfig's user is stays unknown (%s): sessions keyed by key only", exc
        )
        identity = ""
    key = settings.session or f"stdio-{time.time_ns()}"
    app = App(dataclasses.replace(settings, session=key), local=Caller(client, identity))
    server = build(app)
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        with anyio.CancelScope(shield=True):
            for k in list(app.sessions):
                await app.end(k)
            await client.aclose()


# -- streamable HTTP -------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]
REVIEW_SECONDS = 60.0
MAX_CALLERS = 512


class Callers:
    """Caller clients by token: the token's review (who it is) is cached for a
    minute, the client (its connections) while it is in use."""

    def __init__(self, settings: Settings, api_server: str, ca_file: str | None) -> None:
        self.settings = settings
        # Each caller's client: this API server, the caller's own token.
        self.options = ConnectionOptions(
            namespace=settings.namespace,
            api_server=api_server,
            ca_file=ca_file,
            gateway_url=settings.gateway_url,
        )
        self.known: dict[str, tuple[float, Caller]] = {}

    async def get(self, token: str, namespace: str | None) -> Caller:
        digest = hashlib.sha256(f"{namespace}\0{token}".encode()).hexdigest()
        cached = self.known.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        client = (
            cached[1].client
            if cached is not None
            else AsyncSandboxClient.from_options(
                dataclasses.replace(
                    self.options, namespace=namespace or self.options.namespace, token=token
                )
            )
        )
        try:
            identity = await identity_of(client)
        except BaseException:
            await client.aclose()
            self.known.pop(digest, None)
            raise
        caller = Caller(client, identity)
        self.known[digest] = (time.monotonic() + REVIEW_SECONDS, caller)
        while len(self.known) > MAX_CALLERS:
            oldest = min(self.known, key=lambda k: self.known[k][0])
            await self.known.pop(oldest)[1].client.aclose()
        return caller


async def _json(
    send: Send, status: int, payload: dict[str, Any], extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _reply(
    send: Send, status: int, message: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """An error in the gateway's shape: {"error": {"code", "message"}}."""
    reason = {400: "invalid", 401: "unauthorized", 403: "forbidden", 404: "not_found"}
    error = {"code": reason.get(status, "error"), "message": message}
    await _json(send, status, {"error": error}, extra)


class HttpFront:
    """The ASGI app in front of the MCP transport: authentication (401 without
    a token the API server accepts), the end of MCP sessions (DELETE, or idle
    for `session_idle_seconds`), uploads and a health probe."""

    def __init__(self, app: App, callers: Callers, mcp: ASGI) -> None:
        self.app = app
        self.callers = callers
        self.mcp = mcp
        # MCP session id -> (last request, the sessions it used)
        self.live: dict[str, tuple[float, set[tuple[str, str]]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.mcp(scope, receive, send)
            return
        path = scope.get("path", "")
        if path == "/healthz":
            await _json(send, 200, {"status": "ok"})
            return
        if path.rstrip("/") not in ("/mcp", "/uploads"):
            await _reply(send, 404, "not found: the MCP endpoint is /mcp")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            await _reply(
                send,
                401,
                "a Kubernetes bearer token is required",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        try:
            caller = await self.callers.get(token.strip(), headers.get("x-sandbox-namespace"))
        except (Unauthorized, Forbidden) as exc:
            await _reply(
                send,
                403 if isinstance(exc, Forbidden) else 401,
                f"the token was not accepted: {exc}",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        except SandboxError as exc:
            await _reply(send, 502, f"the API server could not review the token: {exc}")
            return
        scope.setdefault("state", {})["sandbox_caller"] = caller
        if path == "/uploads" and scope["method"] == "PUT":
            await self._upload(scope, receive, send, caller, headers)
            return
        mcp_session = headers.get(MCP_SESSION_HEADER)
        key = headers.get(SESSION_HEADER) or mcp_session or "default"
        if mcp_session:
            _, used = self.live.get(mcp_session, (0.0, set()))
            used.add((caller.identity, key))
            self.live[mcp_session] = (time.monotonic(), used)
        await self.mcp(scope, receive, send)
        if mcp_session and scope["method"] == "DELETE":
            await self._ended(mcp_session)
        elif mcp_session in self.live:
            # A long command is activity until it ends, as for the transport.
            self.live[mcp_session] = (time.monotonic(), self.live[mcp_session][1])

    async def _upload(
        self, scope: Scope, receive: Receive, send: Send, caller: Caller, headers: dict[str, str]
    ) -> None:
        """PUT /uploads?name=FILE: the body lands in ./user-uploads/FILE of the
        session's sandbox (the session by X-Sandbox-Session or Mcp-Session-Id)."""
        from urllib.parse import parse_qs

        name = (parse_qs(scope.get("query_string", b"").decode()).get("name") or [""])[0]
        key = headers.get(SESSION_HEADER) or headers.get(MCP_SESSION_HEADER)
        if not name or not key:
            await _reply(
                send,
                400,
                "PUT /uploads?name=FILE with an X-Sandbox-Session or Mcp-Session-Id header",
            )
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            path = await self.app.session(caller, key).upload(name, body)
        except SandboxError as exc:
            await _reply(send, exc.status or 502, str(exc))
            return
        await _json(send, 200, {"path": path})

    async def _ended(self, mcp_session: str) -> None:
        _, used = self.live.pop(mcp_session, (0.0, set()))
        still = set().union(*(u for _, u in self.live.values())) if self.live else set()
        for key in used - still:
            await self.app.end(key)

    async def reap(self) -> None:
        """MCP sessions idle past the transport's own timeout are over."""
        idle = self.app.settings.session_idle_seconds
        while True:
            await anyio.sleep(min(30.0, idle / 4))
            now = time.monotonic()
            for sid in [s for s, (last, _) in self.live.items() if now - last > idle]:
                await self._ended(sid)


def http_app(settings: Settings, api_server: str, ca_file: str | None) -> Any:
    """The Starlette app of the HTTP transport: /mcp, /uploads, /healthz."""
    from mcp.server.streamable_http_manager import (
        StreamableHTTPASGIApp,
        StreamableHTTPSessionManager,
    )
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.routing import Mount

    app = App(settings)
    server = build(app)
    manager = StreamableHTTPSessionManager(
        app=server,
        session_idle_timeout=settings.session_idle_seconds,
        # Callers come through Services and Ingresses under any host name; the
        # bearer token, not the Host header, is what admits them.
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    front = HttpFront(app, Callers(settings, api_server, ca_file), StreamableHTTPASGIApp(manager))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with manager.run(), anyio.create_task_group() as tasks:
            tasks.start_soon(front.reap)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    for key in list(app.sessions):
                        await app.end(key)

    return Starlette(routes=[Mount("/", app=front)], lifespan=lifespan)
