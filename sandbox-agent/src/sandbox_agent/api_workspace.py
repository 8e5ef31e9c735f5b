"""Workspace-wide operations: flush, and quiesce/resume around a volume snapshot."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from . import files, models
from .routing import Args
from .state import state_of
from .web import ok, optional_body_as


async def workspace_sync(request: Request, args: Args) -> Response:
    """Flush the workspace to disk (sync)"""
    st = state_of(request)
    st.touch()
    return ok(await asyncio.to_thread(files.sync, st.workspace))


async def workspace_quiesce(request: Request, args: Args) -> Response:
    """Stop (SIGSTOP) running executions until resume or `seconds`, then sync

    New commands and file writes wait meanwhile. This is the state a volume
    snapshot should capture. Not activity: the operator calls it, not the user.
    """
    st = state_of(request)
    req = await optional_body_as(request, models.QuiesceRequest, models.QuiesceRequest)
    stopped = st.quiesce.stop(req.seconds)
    synced = await asyncio.to_thread(files.sync, st.workspace)
    resume_at = st.quiesce.resume_at
    return ok(
        models.QuiesceResult(
            quiesced=[ex.id for ex in stopped],
            resume_at=models.rfc3339(resume_at) if resume_at else None,
            synced=synced.synced,
            duration_seconds=synced.duration_seconds,
        )
    )


async def workspace_resume(request: Request, args: Args) -> Response:
    """Continue (SIGCONT) what quiesce stopped; idempotent"""
    state_of(request).quiesce.resume()
    return ok(models.QuiesceResult(quiesced=[], resume_at=None, synced=False, duration_seconds=0))
