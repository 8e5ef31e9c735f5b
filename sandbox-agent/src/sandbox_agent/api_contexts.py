"""Code contexts over HTTP: run code in a kernel whose state survives, and
manage the contexts (create, list, interrupt, restart, delete)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from . import models
from .api_exec import checked_cwd
from .contexts import Context
from .routing import Args
from .state import state_of
from .web import body_as, event_stream, ok


async def code_run(request: Request, args: Args) -> Response:
    """Run code in a context and stream its events (ndjson, or SSE with Accept: text/event-stream)

    Without contextId the code runs in the language's default context
    (`default-python`), started on first use. Events come as the kernel
    produces them: `started`; `stdout`/`stderr` text; `result` (display data,
    and the value of the last expression with isMain) with every MIME type
    the object offers; at most one `error` (name, value, traceback); then
    `finished` with the status and the execution count. Variables, imports
    and definitions stay for the next run in the same context.
    """
    st = state_of(request)
    req = await body_as(request, models.CodeRequest)
    if req.context_id is not None:
        ctx = st.contexts.get(req.context_id)
    else:
        ctx = await st.contexts.default(req.language)
    st.touch()
    events = st.contexts.run(ctx, req.code, req.timeout_seconds, req.env)
    # The first event before the 200: a refusal (busy, no kernel) is a status.
    first = await anext(events)
    return event_stream(_chain(first, events), request, {"X-Context-Id": ctx.id})


async def _chain(
    first: models.CodeEvent, rest: AsyncGenerator[models.CodeEvent, None]
) -> AsyncGenerator[models.CodeEvent, None]:
    async with contextlib.aclosing(rest):  # see web.Stream
        yield first
        async for event in rest:
            yield event


async def context_create(request: Request, args: Args) -> Response:
    """Start a code context: a kernel of its own (state shared by its runs only)"""
    st = state_of(request)
    req = await body_as(request, models.ContextRequest)
    ctx = await st.contexts.create(req, checked_cwd(st.workspace, req.cwd))
    return ok(ctx.view(), 201)


async def context_list(request: Request, args: Args) -> Response:
    """Code contexts"""
    st = state_of(request)
    return ok(models.ContextList(contexts=[c.view() for c in st.contexts.contexts.values()]))


async def context_get(request: Request, args: Args) -> Response:
    """One code context"""
    return ok(_context(request, args).view())


async def context_delete(request: Request, args: Args) -> Response:
    """Stop a context's kernel and forget the context (a run in progress ends, aborted)"""
    st = state_of(request)
    st.contexts.remove(_context(request, args))
    return Response(status_code=204)


async def context_restart(request: Request, args: Args) -> Response:
    """Start a context's kernel again: its state is gone (a run in progress ends, aborted)"""
    st = state_of(request)
    ctx = _context(request, args)
    st.touch()
    await st.contexts.restart(ctx)
    return ok(ctx.view())


async def context_interrupt(request: Request, args: Args) -> Response:
    """Interrupt the run in progress (KeyboardInterrupt in the kernel; its state stays)"""
    st = state_of(request)
    ctx = _context(request, args)
    st.touch()
    st.contexts.interrupt(ctx)
    return ok(ctx.view())


def _context(request: Request, args: Args) -> Context:
    return state_of(request).contexts.get(args.need("id", str))
