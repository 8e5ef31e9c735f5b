"""HTTP API: a Starlette app built from one route table (OPS).

The same table drives routing and the OpenAPI document (openapi.py), so the
published contract is the code. Handlers are thin: validate, call
executions/files, encode with msgspec.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import os
import signal as _signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import __version__, archive, files, metrics, models, patch
from .config import Settings
from .errors import ApiError, bad_request
from .executions import Execution, ExecutionManager, rfc3339, stream_events
from .paths import Workspace
from .runner_client import RunnerClient

JSON = "application/json"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
OCTET = "application/octet-stream"
TAR = "application/x-tar"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
T = TypeVar("T")
_encode = msgspec.json.Encoder().encode


# -- state ------------------------------------------------------------------


class AgentState:
    def __init__(self, settings: Settings, token: bytes) -> None:
        self.settings = settings
        self.token = token
        self.workspace = Workspace(settings.workspace)
        self.runner = RunnerClient(settings.socket_path)
        self.started = time.time()
        self.last_activity = self.started
        self.executions = ExecutionManager(settings, self.runner, self.touch)
        self.runner.on_change.append(self._runner_changed)
        # Executions stopped by a quiesce, and the timer that resumes them even
        # when the caller (the operator) never comes back to say so.
        self.quiesced: list[Execution] = []
        self.resume_at: float | None = None
        self.resume_timer: asyncio.TimerHandle | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()

    def touch(self) -> None:
        self.last_activity = time.time()

    def _runner_changed(self) -> None:
        metrics.RUNNER_CONNECTED.set(1 if self.runner.connected else 0)

    def quiesce(self, seconds: float) -> list[Execution]:
        """SIGSTOP every running execution's process group until `resume` or
        `seconds` from now. Refuses (503) when the runner cannot relay signals:
        a snapshot taken then would not be the consistent one asked for."""
        running = [ex for ex in self.executions.records.values() if ex.finished is None]
        if running and not self.runner.connected:
            raise ApiError(
                503,
                "runner_unavailable",
                "cannot pause running executions: the runner is not connected",
            )
        for ex in running:
            if ex not in self.quiesced:
                self.runner.signal(ex.channel, _signal.SIGSTOP)
                self.quiesced.append(ex)
        if self.resume_timer is not None:
            self.resume_timer.cancel()
        self.resumed.clear()
        self.resume_at = time.time() + seconds
        self.resume_timer = asyncio.get_running_loop().call_later(seconds, self.resume)
        return list(self.quiesced)

    def resume(self) -> int:
        """SIGCONT what `quiesce` stopped; idempotent."""
        if self.resume_timer is not None:
            self.resume_timer.cancel()
            self.resume_timer = None
        self.resume_at = None
        self.resumed.set()
        resumed = 0
        for ex in self.quiesced:
            if ex.finished is None:
                self.runner.signal(ex.channel, _signal.SIGCONT)
                resumed += 1
        self.quiesced = []
        return resumed


def state_of(request: Request) -> AgentState:
    st: AgentState = request.app.state.agent
    return st


# -- auth ---------------------------------------------------------------------


def token_matches(header: bytes | None, token: bytes) -> bool:
    """Constant-time check of an Authorization header against the token."""
    if not header or header[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(header[7:].strip(), token)


class AuthMiddleware:
    """Bearer token on every path except liveness/readiness (fail closed)."""

    def __init__(
        self, app: ASGIApp, token: bytes, metrics_auth: bool, token_file: str = ""
    ) -> None:
        self.app = app
        self.token = token
        self.public = PUBLIC_PATHS | (frozenset() if metrics_auth else frozenset({"/metrics"}))
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
        if scope["type"] == "http" and scope["path"] not in self.public:
            header = None
            for k, v in scope["headers"]:
                if k == b"authorization":
                    header = v
                    break
            if not token_matches(header, self.token) and not (
                header and self._reloaded() and token_matches(header, self.token)
            ):
                body = _encode(
                    models.ErrorBody(
                        error=models.ErrorDetail(
                            code="unauthorized",
                            message="missing or invalid bearer token"
                            if header
                            else "missing bearer token",
                        )
                    )
                )
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", JSON.encode()),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="sandbox-agent"'),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


# -- helpers ----------------------------------------------------------------


def ok(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(obj), status, headers, media_type=JSON)


async def read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isdigit():
            raise bad_request("invalid_request", "invalid Content-Length")
        if int(cl) > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
            parts.append(chunk)
    except ClientDisconnect:
        raise bad_request("client_disconnected", "client went away") from None
    return b"".join(parts)


async def body_as(request: Request, typ: type[T]) -> T:
    raw = await read_body(request, state_of(request).settings.max_body_bytes)
    if not raw.strip():
        raise bad_request("invalid_request", "a JSON request body is required")
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise bad_request("invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad_request("invalid_json", f"malformed JSON: {exc}") from None


async def optional_body_as(request: Request, typ: type[T], default: Callable[[], T]) -> T:
    """A body whose every field has a default: an empty body means `default()`."""
    raw = await read_body(request, state_of(request).settings.max_body_bytes)
    if not raw.strip():
        return default()
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise bad_request("invalid_request", str(exc)) from None


def q_str(request: Request, name: str, default: str | None = None) -> str:
    v = request.query_params.get(name, default)
    if v is None:
        raise bad_request("invalid_request", f"query parameter {name!r} is required")
    return v


def q_int(
    request: Request, name: str, default: int | None, lo: int = 0, hi: int = 1 << 62
) -> int | None:
    v = request.query_params.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise bad_request("invalid_request", f"{name} must be an integer") from None
    if not lo <= n <= hi:
        raise bad_request("invalid_request", f"{name} must be between {lo} and {hi}")
    return n


def q_bool(request: Request, name: str, default: bool) -> bool:
    v = request.query_params.get(name)
    if v is None or v == "":
        return default
    if v.lower() in ("1", "true", "yes"):
        return True
    if v.lower() in ("0", "false", "no"):
        return False
    raise bad_request("invalid_request", f"{name} must be true or false")


def q_float(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    v = request.query_params.get(name)
    if v is None or v == "":
        return default
    try:
        n = float(v)
    except ValueError:
        raise bad_request("invalid_request", f"{name} must be a number") from None
    if not lo <= n <= hi:
        raise bad_request("invalid_request", f"{name} must be between {lo:g} and {hi:g}")
    return n


def b64(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("invalid_request", f"{what} is not valid base64") from None


def file_op(op: str) -> None:
    metrics.FILE_OPS.labels(op, "ok").inc()


# -- health, info, metrics ----------------------------------------------------


async def healthz(request: Request) -> Response:
    return ok(models.Health(status="ok"))


async def readyz(request: Request) -> Response:
    st = state_of(request)
    if st.runner.connected and await st.runner.ping(wait=1.0):
        info = st.runner.info or {}
        return ok(models.Readiness(status="ready", runner_version=info.get("version")))
    reason = "runner_not_connected" if not st.runner.connected else "runner_not_answering"
    return ok(
        models.Readiness(
            status="not_ready",
            reason=reason,
            message=st.runner.last_error or "the runner did not answer a ping within 1s",
        ),
        503,
    )


async def info(request: Request) -> Response:
    st = state_of(request)
    ri = st.runner.info or {}
    now = time.time()
    return ok(
        models.Info(
            version=__version__,
            runner_version=ri.get("version"),
            runner_connected=st.runner.connected,
            runner_uid=ri.get("uid"),
            runner_python=ri.get("python"),
            last_activity=rfc3339(st.last_activity),
            active_executions=st.executions.active,
            started_at=rfc3339(st.started),
            uptime_seconds=round(now - st.started, 3),
            workspace=st.workspace.root,
        )
    )


async def metrics_endpoint(request: Request) -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    from .openapi import document

    return Response(_encode(document()), media_type=JSON)


async def workspace_sync(request: Request) -> Response:
    st = state_of(request)
    st.touch()
    return ok(await asyncio.to_thread(files.sync, st.workspace))


async def workspace_quiesce(request: Request) -> Response:
    """Stop running executions' writes, then flush: the state a snapshot should
    capture. Not activity: the operator calls it, not the user."""
    st = state_of(request)
    req = await optional_body_as(request, models.QuiesceRequest, models.QuiesceRequest)
    stopped = st.quiesce(req.seconds)
    synced = await asyncio.to_thread(files.sync, st.workspace)
    return ok(
        models.QuiesceResult(
            quiesced=[ex.id for ex in stopped],
            resume_at=rfc3339(st.resume_at) if st.resume_at else None,
            synced=synced.synced,
            duration_seconds=synced.duration_seconds,
        )
    )


# Requests that would change the workspace. While it is quiesced they wait for
# the resume (bounded by the quiesce's own timer) instead of writing into the
# snapshot being cut; reads, signals and stdin go through.
_WRITE_PATHS = frozenset({"/v1/executions", "/v1/executions/stream"})
_READ_ONLY_POSTS = frozenset({"/v1/files/search", "/v1/files/find"})


def _writes(op: Op) -> bool:
    if op.method not in ("POST", "PUT", "DELETE", "PATCH"):
        return False
    if op.path in _WRITE_PATHS:
        return True
    return op.path.startswith("/v1/files/") and op.path not in _READ_ONLY_POSTS


def _wait_while_quiesced(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def gated(request: Request) -> Response:
        await state_of(request).resumed.wait()
        return await handler(request)

    return gated


async def workspace_resume(request: Request) -> Response:
    st = state_of(request)
    st.resume()
    return ok(models.QuiesceResult(quiesced=[], resume_at=None, synced=False, duration_seconds=0))


# -- exec -------------------------------------------------------------------


def _prepare(
    st: AgentState, req: models.ExecRequest, request: Request
) -> tuple[list[str], str, bytes | None]:
    header_key = request.headers.get("idempotency-key")
    if header_key is not None:
        if not 0 < len(header_key) <= 256:
            raise bad_request("invalid_request", "Idempotency-Key must be 1..256 characters")
        if req.idempotency_key is not None and req.idempotency_key != header_key:
            raise bad_request("invalid_request", "Idempotency-Key header and body disagree")
        req.idempotency_key = header_key
    if (req.command is None) == (req.argv is None):
        raise bad_request("invalid_request", "give exactly one of 'command' and 'argv'")
    argv = (
        [st.settings.shell, "-c", req.command] if req.command is not None else list(req.argv or [])
    )
    if any("\0" in a for a in argv) or not argv[0]:
        raise bad_request("invalid_request", "arguments must be non-empty and contain no NUL")
    for k, v in req.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise bad_request("invalid_request", f"invalid environment variable name {k[:100]!r}")
    cwd = st.workspace.clean(req.cwd)
    replay = req.idempotency_key is not None and req.idempotency_key in st.executions.by_key
    # A replay must find its execution even if the command removed its cwd.
    # The root needs no check (the hot path: most commands run there).
    if cwd != "." and not replay and not os.path.isdir(st.workspace.resolve(cwd)):
        raise ApiError(400, "invalid_cwd", f"cwd {req.cwd!r} is not a directory in the workspace")
    if req.stdin is not None and req.stdin_base64 is not None:
        raise bad_request("invalid_request", "give at most one of 'stdin' and 'stdinBase64'")
    stdin = (
        req.stdin.encode("utf-8", "surrogateescape")
        if req.stdin is not None
        else b64(req.stdin_base64, "stdinBase64")
        if req.stdin_base64 is not None
        else None
    )
    return argv, cwd, stdin


async def exec_create(request: Request) -> Response:
    st = state_of(request)
    req = await body_as(request, models.ExecRequest)
    argv, cwd, stdin = _prepare(st, req, request)
    st.touch()
    ex, replayed = st.executions.submit(req, argv, cwd, stdin)
    headers = {"Location": f"/v1/executions/{ex.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    if req.background:
        return ok(ex.view(output=False), 200 if replayed else 202, headers)
    await ex.done.wait()
    st.touch()
    return ok(ex.view(output=True), 200, headers)


def _wants_sse(request: Request) -> bool:
    return SSE in request.headers.get("accept", "")


def _event_stream(
    events: AsyncIterator[models.StreamEvent], sse: bool, headers: dict[str, str]
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for ev in events:
            data = _encode(ev)
            yield (
                (b"event: " + ev.type.encode() + b"\ndata: " + data + b"\n\n")
                if sse
                else data + b"\n"
            )

    headers = {**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type=SSE if sse else NDJSON, headers=headers)


async def exec_stream(request: Request) -> Response:
    st = state_of(request)
    req = await body_as(request, models.ExecRequest)
    argv, cwd, stdin = _prepare(st, req, request)
    st.touch()
    ex, _replayed = st.executions.submit(req, argv, cwd, stdin)
    b64_out = request.query_params.get("encoding") == "base64"
    headers = {"Location": f"/v1/executions/{ex.id}", "X-Execution-Id": ex.id}
    return _event_stream(
        stream_events(ex, 0, b64_out, started_event=True), _wants_sse(request), headers
    )


async def exec_list(request: Request) -> Response:
    st = state_of(request)
    status = request.query_params.get("status")
    items = [
        ex.view(output=False)
        for ex in st.executions.records.values()
        if status is None or ex.status == status
    ]
    return ok(models.ExecutionList(executions=items))


async def exec_get(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    wait = q_float(request, "waitSeconds", 0.0, 0.0, 600.0)
    if wait and ex.finished is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ex.done.wait(), wait)
    return ok(ex.view(output=q_bool(request, "output", True)))


async def exec_delete(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    st.executions.remove(ex)
    return Response(status_code=204)


async def exec_output(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    cursor = q_int(request, "cursor", 0) or 0
    max_bytes = q_int(request, "maxBytes", 1 << 20, 1, 16 << 20) or 1 << 20
    wait = q_float(request, "waitSeconds", 0.0, 0.0, 60.0)
    b64_out = request.query_params.get("encoding") == "base64"
    st.touch()
    chunks = ex.read_log(cursor, max_bytes)
    deadline = time.monotonic() + wait
    while not chunks and ex.finished is None and (left := deadline - time.monotonic()) > 0:
        # Long poll: the reattaching client waits for new output or the end
        # (other changes, like the start, do not end the wait).
        await ex.wait_change(left)
        chunks = ex.read_log(cursor, max_bytes)
    if chunks:
        cursor = chunks[-1].cursor
    return ok(
        models.OutputPage(
            chunks=[ex.chunk_view(c, b64_out) for c in chunks],
            cursor=cursor,
            finished=ex.finished is not None and cursor >= ex.log_size,
            status=ex.status,
            log_truncated=ex.log_truncated,
        )
    )


async def exec_attach(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    cursor = q_int(request, "cursor", 0) or 0
    ex.read_log(cursor, 1)  # validate the cursor before the 200 goes out
    st.touch()
    b64_out = request.query_params.get("encoding") == "base64"
    return _event_stream(
        stream_events(ex, cursor, b64_out, started_event=True),
        _wants_sse(request),
        {"X-Execution-Id": ex.id},
    )


async def exec_stdin(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    req = await body_as(request, models.StdinRequest)
    if req.data and req.data_base64 is not None:
        raise bad_request("invalid_request", "give at most one of 'data' and 'dataBase64'")
    data = (
        b64(req.data_base64, "dataBase64")
        if req.data_base64 is not None
        else req.data.encode("utf-8", "surrogateescape")
    )
    st.touch()
    ex.write_stdin(data, req.close)
    return ok(models.StdinResult(bytes=len(data), stdin_open=ex.stdin_open))


def _parse_signal(value: str | int) -> int:
    if isinstance(value, int):
        sig = value
    else:
        name = value.strip().upper()
        if name.isdigit():
            sig = int(name)
        else:
            if not name.startswith("SIG"):
                name = "SIG" + name
            try:
                sig = _signal.Signals[name].value
            except KeyError:
                raise bad_request("invalid_signal", f"unknown signal {value!r}") from None
    if sig not in {s.value for s in _signal.Signals} or sig == 0:
        raise bad_request("invalid_signal", f"unknown signal {value!r}")
    return sig


async def exec_signal(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    req = await body_as(request, models.SignalRequest)
    sig = _parse_signal(req.signal)
    st.touch()
    ex.send_signal(sig)
    return ok(ex.view(output=False))


async def exec_cancel(request: Request) -> Response:
    st = state_of(request)
    ex = st.executions.get(request.path_params["id"])
    req = await optional_body_as(request, models.CancelRequest, models.CancelRequest)
    st.touch()
    if ex.finished is None:
        ex.cancel(req.grace_seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ex.done.wait(), req.grace_seconds + st.settings.kill_grace + 1.0)
    return ok(ex.view(output=False))


# -- files ------------------------------------------------------------------


async def file_read(request: Request) -> Response:
    st = state_of(request)
    s = st.settings
    rel = q_str(request, "path")
    offset = q_int(request, "offset", None)
    length = q_int(request, "length", None)
    start_line = q_int(request, "startLine", None, 1)
    line_count = q_int(request, "lineCount", None, 0)
    if (offset is not None or length is not None) and (
        start_line is not None or line_count is not None
    ):
        raise bad_request("invalid_request", "use either a byte range or a line range, not both")
    st.touch()
    fd, size = await asyncio.to_thread(files.open_for_read, st.workspace, rel)
    headers = {"X-File-Size": str(size)}
    if start_line is not None or line_count is not None:
        try:
            # line ranges are assembled in memory: a tighter cap than streamed reads
            data = await asyncio.to_thread(
                files.read_lines, fd, start_line or 1, line_count, min(s.max_read_bytes, 64 << 20)
            )
        finally:
            os.close(fd)
        metrics.FILE_BYTES.labels("out").inc(len(data))
        file_op("read")
        return Response(data, media_type=OCTET, headers=headers)
    start = min(offset or 0, size)
    end = size if length is None else min(size, start + length)
    if end - start > s.max_read_bytes:
        os.close(fd)
        raise ApiError(413, "read_too_large", f"reads are limited to {s.max_read_bytes} bytes")
    headers["Content-Length"] = str(end - start)
    headers["X-Range"] = f"{start}-{end}"
    if end - start <= 1 << 20:
        try:
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        metrics.FILE_BYTES.labels("out").inc(len(data))
        file_op("read")
        return Response(data, media_type=OCTET, headers=headers)

    async def chunks() -> AsyncIterator[bytes]:
        pos = start
        try:
            while pos < end:
                data = await asyncio.to_thread(os.pread, fd, min(4 << 20, end - pos), pos)
                if not data:
                    break  # file shrank: the client sees a short body
                pos += len(data)
                metrics.FILE_BYTES.labels("out").inc(len(data))
                yield data
        finally:
            os.close(fd)

    file_op("read")
    return StreamingResponse(chunks(), media_type=OCTET, headers=headers)


async def _spool_upload(
    request: Request, sink: Callable[[list[bytes]], Awaitable[None]], limit: int
) -> int:
    """Stream the body to ``sink`` in batches of >= 4 MiB (as chunk lists: the
    sink writes them with writev, so the body is never joined in memory)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, "body_too_large", f"uploads are limited to {limit} bytes")
    total = 0
    pending: list[bytes] = []
    pending_len = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, "body_too_large", f"uploads are limited to {limit} bytes")
            if chunk:
                pending.append(chunk)
                pending_len += len(chunk)
            if pending_len >= 4 << 20:
                await sink(pending)
                pending, pending_len = [], 0
    except ClientDisconnect:
        raise bad_request("client_disconnected", "client went away during the upload") from None
    if pending:
        await sink(pending)
    metrics.FILE_BYTES.labels("in").inc(total)
    return total


async def file_write_raw(request: Request) -> Response:
    st = state_of(request)
    rel = q_str(request, "path")
    mode_s = request.query_params.get("mode")
    if mode_s is not None and not (mode_s.isdigit() and set(mode_s) <= set("01234567")):
        raise bad_request("invalid_request", "mode must be octal, e.g. 0644")
    if mode_s is not None and int(mode_s, 8) > 0o7777:
        raise bad_request("invalid_request", "mode must be at most 07777")
    parents = q_bool(request, "parents", True)
    st.touch()
    w = await asyncio.to_thread(
        files.AtomicWriter, st.workspace, rel, files.parse_mode(mode_s), parents
    )
    try:
        await _spool_upload(
            request, lambda b: asyncio.to_thread(w.write_chunks, b), st.settings.max_upload_bytes
        )
        result = await asyncio.to_thread(w.commit)
    except BaseException:
        w.abort()
        raise
    file_op("write")
    return ok(result)


async def file_write_json(request: Request) -> Response:
    st = state_of(request)
    req = await body_as(request, models.WriteRequest)
    if req.content is not None and req.content_base64 is not None:
        raise bad_request("invalid_request", "give at most one of 'content' and 'contentBase64'")
    data = (
        b64(req.content_base64, "contentBase64")
        if req.content_base64 is not None
        else (req.content or "").encode("utf-8", "surrogateescape")
    )
    st.touch()
    result = await asyncio.to_thread(
        files.write_bytes, st.workspace, req.path, data, files.parse_mode(req.mode), req.parents
    )
    metrics.FILE_BYTES.labels("in").inc(len(data))
    file_op("write")
    return ok(result)


async def file_stat(request: Request) -> Response:
    st = state_of(request)
    rel = q_str(request, "path")
    st.touch()
    result = await asyncio.to_thread(files.stat, st.workspace, rel)
    file_op("stat")
    return ok(result)


async def file_list(request: Request) -> Response:
    st = state_of(request)
    rel = q_str(request, "path", ".")
    depth = q_int(request, "depth", 1, 1, 64) or 1
    hidden = q_bool(request, "hidden", True)
    st.touch()
    result = await asyncio.to_thread(
        files.list_dir, st.workspace, rel, depth, hidden, st.settings.list_max_entries
    )
    file_op("list")
    return ok(result)


def _json_file_op(
    op: str, typ: type[Any], fn: Callable[[AgentState, Any], Any]
) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        st = state_of(request)
        req = await body_as(request, typ)
        st.touch()
        result = await asyncio.to_thread(fn, st, req)
        file_op(op)
        return ok(result)

    handler.__name__ = f"file_{op}"
    return handler


file_mkdir = _json_file_op("mkdir", models.MkdirRequest, lambda st, r: files.mkdir(st.workspace, r))
file_remove = _json_file_op(
    "remove", models.RemoveRequest, lambda st, r: files.remove(st.workspace, r)
)
file_move = _json_file_op("move", models.MoveRequest, lambda st, r: files.move(st.workspace, r))
file_search = _json_file_op(
    "search", models.SearchRequest, lambda st, r: files.search(st.workspace, r, st.settings)
)
file_find = _json_file_op(
    "find", models.FindRequest, lambda st, r: files.find(st.workspace, r, st.settings)
)
file_patch = _json_file_op(
    "patch",
    models.PatchRequest,
    lambda st, r: patch.apply(st.workspace, r, st.settings.search_max_file_bytes * 8),
)
file_replace = _json_file_op(
    "replace", models.ReplaceRequest, lambda st, r: files.replace(st.workspace, r, st.settings)
)


def _require_dir(real: str, rel: str) -> None:
    if not os.path.isdir(real):
        with files.os_errors(rel):
            os.stat(real)
        raise bad_request("not_a_directory", f"not a directory: {rel}")


async def archive_download(request: Request) -> Response:
    st = state_of(request)
    rel = q_str(request, "path", ".")
    gz = q_bool(request, "gzip", False)
    st.touch()
    # Validate before the 200 goes out; errors inside the stream can only cut it short.
    real = st.workspace.resolve(rel)
    await asyncio.to_thread(_require_dir, real, rel)
    stream = await asyncio.to_thread(archive.TarStream, st.workspace, rel, gz)

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = await asyncio.to_thread(stream.next_chunk)
                if chunk is None:
                    return
                metrics.FILE_BYTES.labels("out").inc(len(chunk))
                yield chunk
        finally:
            stream.close()  # also on a client disconnect: the producer thread ends

    file_op("archive_download")
    name = os.path.basename(real) or "workspace"
    return StreamingResponse(
        body(),
        media_type="application/gzip" if gz else TAR,
        headers={"Content-Disposition": f'attachment; filename="{name}.tar{".gz" if gz else ""}"'},
    )


async def archive_upload(request: Request) -> Response:
    st = state_of(request)
    rel = q_str(request, "path", ".")
    st.workspace.resolve(rel)
    st.touch()
    with tempfile.TemporaryFile(prefix="sandbox-agent-upload-") as spool:

        async def sink(chunks: list[bytes]) -> None:
            await asyncio.to_thread(spool.writelines, chunks)

        await _spool_upload(request, sink, st.settings.max_upload_bytes)
        spool.seek(0)
        result = await asyncio.to_thread(archive.extract, st.workspace, rel, spool, st.settings)
    file_op("archive_upload")
    return ok(result)


# -- route table ------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # "string" | "integer" | "boolean" | "number"
    description: str
    required: bool = False
    location: str = "query"
    enum: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    handler: Callable[[Request], Awaitable[Response]]
    summary: str
    tag: str
    body: Any = None  # msgspec type, "binary", or None
    responses: dict[int, Any] = field(default_factory=dict)  # status -> type|"binary"|"events"|None
    params: tuple[Param, ...] = ()
    public: bool = False


PATH_PARAM = Param("id", "string", "Execution id", required=True, location="path")
PATH_Q = Param("path", "string", "Path relative to the workspace", required=True)
ENC = Param("encoding", "string", "Output encoding in JSON", enum=("utf-8", "base64"))

OPS: tuple[Op, ...] = (
    Op(
        "GET",
        "/healthz",
        healthz,
        "Liveness: 200 while the process is up",
        "health",
        responses={200: models.Health},
        public=True,
    ),
    Op(
        "GET",
        "/readyz",
        readyz,
        "Readiness: 200 only when the runner answers",
        "health",
        responses={200: models.Readiness, 503: models.Readiness},
        public=True,
    ),
    Op(
        "GET",
        "/metrics",
        metrics_endpoint,
        "Prometheus metrics",
        "info",
        responses={200: "prometheus"},
    ),
    Op("GET", "/openapi.json", openapi_json, "This document", "info", responses={200: "object"}),
    Op(
        "GET",
        "/v1/info",
        info,
        "Version, runner state and activity (not itself activity)",
        "info",
        responses={200: models.Info},
    ),
    Op(
        "POST",
        "/v1/workspace/sync",
        workspace_sync,
        "Flush the workspace to disk (sync)",
        "info",
        responses={200: models.SyncResult},
    ),
    Op(
        "POST",
        "/v1/workspace/quiesce",
        workspace_quiesce,
        "Stop (SIGSTOP) running executions until resume or `seconds`, then sync;"
        " new commands and file writes wait meanwhile",
        "info",
        body=models.QuiesceRequest,
        responses={200: models.QuiesceResult, 400: models.ErrorBody, 503: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/workspace/resume",
        workspace_resume,
        "Continue (SIGCONT) what quiesce stopped; idempotent",
        "info",
        responses={200: models.QuiesceResult},
    ),
    Op(
        "POST",
        "/v1/executions",
        exec_create,
        "Run a command; waits for the exit unless background (202)",
        "exec",
        body=models.ExecRequest,
        responses={
            200: models.Execution,
            202: models.Execution,
            409: models.ErrorBody,
            413: models.ErrorBody,
            429: models.ErrorBody,
            503: models.ErrorBody,
        },
    ),
    Op(
        "POST",
        "/v1/executions/stream",
        exec_stream,
        "Run a command and stream events (ndjson, or SSE with Accept: text/event-stream)",
        "exec",
        body=models.ExecRequest,
        params=(ENC,),
        responses={
            200: "events",
            409: models.ErrorBody,
            413: models.ErrorBody,
            429: models.ErrorBody,
            503: models.ErrorBody,
        },
    ),
    Op(
        "GET",
        "/v1/executions",
        exec_list,
        "List executions (without output)",
        "exec",
        params=(
            Param(
                "status",
                "string",
                "Only this status",
                enum=("running", "completed", "timed_out", "cancelled", "failed", "lost"),
            ),
        ),
        responses={200: models.ExecutionList},
    ),
    Op(
        "GET",
        "/v1/executions/{id}",
        exec_get,
        "One execution, with captured output tails",
        "exec",
        params=(
            PATH_PARAM,
            Param("output", "boolean", "Include stdout/stderr (default true)"),
            Param(
                "waitSeconds", "number", "Wait up to this long for the exit", minimum=0, maximum=600
            ),
        ),
        responses={200: models.Execution, 404: models.ErrorBody},
    ),
    Op(
        "DELETE",
        "/v1/executions/{id}",
        exec_delete,
        "Forget a finished execution and its log",
        "exec",
        params=(PATH_PARAM,),
        responses={204: None, 404: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "GET",
        "/v1/executions/{id}/output",
        exec_output,
        "Output from a cursor (long poll with waitSeconds)",
        "exec",
        params=(
            PATH_PARAM,
            Param("cursor", "integer", "From outputCursor / a previous page", minimum=0),
            Param("maxBytes", "integer", "Page size", minimum=1, maximum=16 << 20),
            Param("waitSeconds", "number", "Wait for new output", minimum=0, maximum=60),
            ENC,
        ),
        responses={
            200: models.OutputPage,
            400: models.ErrorBody,
            404: models.ErrorBody,
            410: models.ErrorBody,
        },
    ),
    Op(
        "GET",
        "/v1/executions/{id}/stream",
        exec_attach,
        "Reattach: stream events from a cursor until the exit",
        "exec",
        params=(PATH_PARAM, Param("cursor", "integer", "Start here", minimum=0), ENC),
        responses={
            200: "events",
            400: models.ErrorBody,
            404: models.ErrorBody,
            410: models.ErrorBody,
        },
    ),
    Op(
        "POST",
        "/v1/executions/{id}/stdin",
        exec_stdin,
        "Write to (and optionally close) stdin",
        "exec",
        body=models.StdinRequest,
        params=(PATH_PARAM,),
        responses={200: models.StdinResult, 404: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/executions/{id}/signal",
        exec_signal,
        "Signal the process group",
        "exec",
        body=models.SignalRequest,
        params=(PATH_PARAM,),
        responses={200: models.Execution, 404: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/executions/{id}/cancel",
        exec_cancel,
        "Cancel: SIGTERM + grace + SIGKILL (or SIGKILL) to the group; waits for the end",
        "exec",
        body=models.CancelRequest,
        params=(PATH_PARAM,),
        responses={200: models.Execution, 404: models.ErrorBody},
    ),
    Op(
        "GET",
        "/v1/files/content",
        file_read,
        "Read a file (whole, byte range or line range)",
        "files",
        params=(
            PATH_Q,
            Param("offset", "integer", "First byte", minimum=0),
            Param("length", "integer", "Number of bytes", minimum=0),
            Param("startLine", "integer", "First line (1-based)", minimum=1),
            Param("lineCount", "integer", "Number of lines", minimum=0),
        ),
        responses={
            200: "binary",
            400: models.ErrorBody,
            403: models.ErrorBody,
            404: models.ErrorBody,
            413: models.ErrorBody,
        },
    ),
    Op(
        "PUT",
        "/v1/files/content",
        file_write_raw,
        "Write a file atomically from the raw body",
        "files",
        body="binary",
        params=(
            PATH_Q,
            Param("mode", "string", "Octal permission bits, e.g. 0644"),
            Param("parents", "boolean", "Create missing parent directories (default true)"),
        ),
        responses={
            200: models.FileInfo,
            400: models.ErrorBody,
            403: models.ErrorBody,
            404: models.ErrorBody,
            413: models.ErrorBody,
        },
    ),
    Op(
        "POST",
        "/v1/files/write",
        file_write_json,
        "Write a file atomically from JSON",
        "files",
        body=models.WriteRequest,
        responses={
            200: models.FileInfo,
            400: models.ErrorBody,
            403: models.ErrorBody,
            404: models.ErrorBody,
        },
    ),
    Op(
        "GET",
        "/v1/files/stat",
        file_stat,
        "Stat a path (symlinks not followed)",
        "files",
        params=(PATH_Q,),
        responses={200: models.FileInfo, 403: models.ErrorBody, 404: models.ErrorBody},
    ),
    Op(
        "GET",
        "/v1/files/list",
        file_list,
        "List a directory",
        "files",
        params=(
            Param("path", "string", "Directory (default '.')"),
            Param("depth", "integer", "Levels to descend (default 1)", minimum=1, maximum=64),
            Param("hidden", "boolean", "Include dot files (default true)"),
        ),
        responses={
            200: models.FileList,
            400: models.ErrorBody,
            403: models.ErrorBody,
            404: models.ErrorBody,
        },
    ),
    Op(
        "POST",
        "/v1/files/mkdir",
        file_mkdir,
        "Create a directory",
        "files",
        body=models.MkdirRequest,
        responses={200: models.FileInfo, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/remove",
        file_remove,
        "Remove a file, link or directory",
        "files",
        body=models.RemoveRequest,
        responses={200: models.Removed, 404: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/move",
        file_move,
        "Move / rename",
        "files",
        body=models.MoveRequest,
        responses={200: models.FileInfo, 404: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/search",
        file_search,
        "Search file contents by regex",
        "files",
        body=models.SearchRequest,
        responses={200: models.SearchResult, 400: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/find",
        file_find,
        "Find paths by glob",
        "files",
        body=models.FindRequest,
        responses={200: models.FindResult, 400: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/patch",
        file_patch,
        "Apply a unified diff (all or nothing)",
        "files",
        body=models.PatchRequest,
        responses={200: models.PatchResult, 400: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "POST",
        "/v1/files/replace",
        file_replace,
        "Find and replace in one file",
        "files",
        body=models.ReplaceRequest,
        responses={200: models.ReplaceResult, 400: models.ErrorBody, 409: models.ErrorBody},
    ),
    Op(
        "GET",
        "/v1/files/archive",
        archive_download,
        "Download a directory as tar (or tar.gz)",
        "files",
        params=(
            Param("path", "string", "Directory (default '.')"),
            Param("gzip", "boolean", "gzip the tar"),
        ),
        responses={200: "tar", 400: models.ErrorBody, 404: models.ErrorBody},
    ),
    Op(
        "PUT",
        "/v1/files/archive",
        archive_upload,
        "Upload a tar (optionally gzip/bz2/xz) and extract it into a directory",
        "files",
        body="tar",
        params=(Param("path", "string", "Destination directory (default '.')"),),
        responses={200: models.ArchiveResult, 400: models.ErrorBody, 413: models.ErrorBody},
    ),
)


# -- errors and assembly ----------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if request.url.path.startswith("/v1/files"):
        metrics.FILE_OPS.labels(request.url.path.rsplit("/", 1)[-1], "error").inc()
    return Response(_encode(exc.body()), exc.status, media_type=JSON)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return Response(
        _encode({"error": {"code": code, "message": str(exc.detail)}}),
        exc.status_code,
        headers=exc.headers,
        media_type=JSON,
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    return Response(
        _encode({"error": {"code": "internal_error", "message": type(exc).__name__}}),
        500,
        media_type=JSON,
    )


def build_app(settings: Settings, token: bytes) -> ASGIApp:
    state = AgentState(settings, token)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.executions.restore()
        state.runner.start()
        yield
        state.executions.fail_all_running()
        await state.runner.stop()
        state.executions.journal.close()

    app = Starlette(
        routes=[
            Route(
                op.path,
                _wait_while_quiesced(op.handler) if _writes(op) else op.handler,
                methods=[op.method],
            )
            for op in OPS
        ],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.agent = state
    return AuthMiddleware(app, token, settings.metrics_auth, settings.token_file)
