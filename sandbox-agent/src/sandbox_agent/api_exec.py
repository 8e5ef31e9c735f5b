"""Executions over HTTP: validate, hand to the ExecutionManager, encode."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from starlette.requests import Request
from starlette.responses import Response

from . import models
from .errors import Invalid, NotFound
from .executions import Execution, stream_events
from .paths import Workspace
from .routing import Args
from .state import AgentState, state_of
from .web import body_as, event_stream, ok, one_of, optional_body_as


def _prepare(
    st: AgentState, req: models.ExecRequest, request: Request
) -> tuple[list[str], str, bytes | None]:
    header_key = request.headers.get("idempotency-key")
    if header_key is not None:
        if not 0 < len(header_key) <= 256:
            raise Invalid("invalid_request", "Idempotency-Key must be 1..256 characters")
        if req.idempotency_key is not None and req.idempotency_key != header_key:
            raise Invalid("invalid_request", "Idempotency-Key header and body disagree")
        req.idempotency_key = header_key
    if (req.command is None) == (req.argv is None):
        raise Invalid("invalid_request", "give exactly one of 'command' and 'argv'")
    argv = (
        [st.settings.shell, "-c", req.command] if req.command is not None else list(req.argv or [])
    )
    if any("\0" in a for a in argv) or not argv[0]:
        raise Invalid("invalid_request", "arguments must be non-empty and contain no NUL")
    for k, v in req.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise Invalid("invalid_request", f"invalid environment variable name {k[:100]!r}")
    replay = req.idempotency_key is not None and req.idempotency_key in st.executions.by_key
    # A replay must find its execution even if the command removed its cwd.
    cwd = checked_cwd(st.workspace, req.cwd, exists=not replay)
    stdin = one_of(req.stdin, req.stdin_base64, ("stdin", "stdinBase64"))
    return argv, cwd, stdin


def checked_cwd(ws: Workspace, rel: str, *, exists: bool = True) -> str:
    """A command's working directory, normalised; with `exists`, one that is a
    directory of the workspace (400 invalid_cwd). The root needs no check (the
    hot path: most commands run there)."""
    cwd = ws.clean(rel)
    if exists and cwd != "." and not _is_dir(ws, cwd):
        raise Invalid("invalid_cwd", f"cwd {rel!r} is not a directory in the workspace")
    return cwd


def _is_dir(ws: Workspace, rel: str) -> bool:
    try:
        fd, _ = ws.open_dir(rel)
    except (OSError, Invalid, NotFound):
        return False
    os.close(fd)
    return True


async def _submit(request: Request) -> tuple[models.ExecRequest, Execution, bool]:
    """Start the command of the request body (or find it by idempotency key)."""
    st = state_of(request)
    req = await body_as(request, models.ExecRequest)
    argv, cwd, stdin = _prepare(st, req, request)
    st.touch()
    ex, replayed = st.executions.submit(req, argv, cwd, stdin)
    return req, ex, replayed


async def exec_create(request: Request, args: Args) -> Response:
    """Run a command; waits for the exit unless background (202)

    Output order: within one stream, bytes come exactly in the order the
    command wrote them. Between stdout and stderr (two pipes) the order, and
    so the cursor, is the order in which the runner read them: writes a few
    milliseconds apart or closer may appear in either order. With
    `combinedOutput: true` stderr is the same pipe as stdout: one stream
    (reported as stdout, stderr stays empty) in exactly the order the writes
    reached it.
    """
    req, ex, replayed = await _submit(request)
    headers = {"Location": f"/v1/executions/{ex.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    if req.background:
        return ok(ex.view(output=False), 200 if replayed else 202, headers)
    async with ex.answer():
        await ex.done.wait()
        state_of(request).touch()
        return ok(ex.view(output=True), 200, headers)


async def exec_stream(request: Request, args: Args) -> Response:
    """Run a command and stream events (ndjson, or SSE with Accept: text/event-stream)

    Output events follow the order described for POST /v1/executions: exact
    within a stream, approximate between stdout and stderr, exact for
    everything with `combinedOutput: true`. The first event, `started`,
    carries the execution with its `pid` (null only when the command did not
    start: `finished` with status `failed` follows).
    """
    _req, ex, _replayed = await _submit(request)
    b64_out = args.get("encoding", str) == "base64"
    headers = {"Location": f"/v1/executions/{ex.id}", "X-Execution-Id": ex.id}
    return event_stream(stream_events(ex, 0, b64_out, started_event=True), request, headers)


async def exec_list(request: Request, args: Args) -> Response:
    """List executions (without output)"""
    st = state_of(request)
    status = args.get("status", str)
    items = [
        ex.view(output=False)
        for ex in st.executions.records.values()
        if status is None or ex.status == status
    ]
    return ok(models.ExecutionList(executions=items))


async def exec_get(request: Request, args: Args) -> Response:
    """One execution, with captured output tails"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    wait = args.need("waitSeconds", float)
    if not wait or ex.finished is not None:
        return ok(ex.view(output=args.need("output", bool)))
    # Waiting for the exit: the tails are kept until the answer is built (only
    # running records are protected, so the protected ones stay few).
    async with ex.answer():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await ex.done.wait()
        return ok(ex.view(output=args.need("output", bool)))


async def exec_delete(request: Request, args: Args) -> Response:
    """Forget a finished execution and its log"""
    st = state_of(request)
    st.executions.remove(st.executions.get(args.need("id", str)))
    return Response(status_code=204)


async def exec_output(request: Request, args: Args) -> Response:
    """Output from a cursor (long poll with waitSeconds)"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    cursor = args.need("cursor", int)
    max_bytes = args.need("maxBytes", int)
    b64_out = args.get("encoding", str) == "base64"
    st.touch()
    chunks = ex.read_log(cursor, max_bytes)
    deadline = time.monotonic() + args.need("waitSeconds", float)
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


async def exec_attach(request: Request, args: Args) -> Response:
    """Reattach: stream events from a cursor until the exit"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    cursor = args.need("cursor", int)
    ex.read_log(cursor, 1)  # validate the cursor before the 200 goes out
    st.touch()
    b64_out = args.get("encoding", str) == "base64"
    return event_stream(
        stream_events(ex, cursor, b64_out, started_event=True), request, {"X-Execution-Id": ex.id}
    )


async def exec_stdin(request: Request, args: Args) -> Response:
    """Write to (and optionally close) stdin"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    req = await body_as(request, models.StdinRequest)
    # `data` defaults to "": only a non-empty one competes with dataBase64.
    data = one_of(req.data or None, req.data_base64, ("data", "dataBase64")) or b""
    st.touch()
    ex.write_stdin(data, req.close)
    return ok(models.StdinResult(bytes=len(data), stdin_open=ex.stdin_open))


def parse_signal(value: str | int) -> int:
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
                sig = signal.Signals[name].value
            except KeyError:
                raise Invalid("invalid_signal", f"unknown signal {value!r}") from None
    if sig not in {s.value for s in signal.Signals} or sig == 0:
        raise Invalid("invalid_signal", f"unknown signal {value!r}")
    return sig


async def exec_signal(request: Request, args: Args) -> Response:
    """Signal the process group"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    req = await body_as(request, models.SignalRequest)
    sig = parse_signal(req.signal)
    st.touch()
    ex.send_signal(sig)
    return ok(ex.view(output=False))


async def exec_cancel(request: Request, args: Args) -> Response:
    """Cancel: SIGTERM + grace + SIGKILL (or SIGKILL) to the group; waits for the end"""
    st = state_of(request)
    ex = st.executions.get(args.need("id", str))
    req = await optional_body_as(request, models.CancelRequest, models.CancelRequest)
    st.touch()
    if ex.finished is None:
        ex.cancel(req.grace_seconds)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(req.grace_seconds + st.settings.kill_grace + 1.0):
                await ex.done.wait()
    return ok(ex.view(output=False))
