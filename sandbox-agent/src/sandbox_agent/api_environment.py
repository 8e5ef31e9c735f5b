"""The environment overlay for new commands (see environment.py); not user activity."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from . import models
from .routing import Args
from .state import state_of
from .web import body_as, ok


async def environment_get(request: Request, args: Args) -> Response:
    """The environment overlay applied to commands started from now on"""
    return ok(state_of(request).environment.view())


async def environment_put(request: Request, args: Args) -> Response:
    """Replace the environment overlay (the whole of it: not a merge)

    Every command started afterwards gets the runner's own environment, minus
    `unset`, plus `env`, plus the request's own `env` (which wins). Running
    commands keep theirs. The overlay survives an agent restart (it is kept in
    SANDBOX_AGENT_LOG_DIR), not the pod. Answers the stored overlay and its hash.
    """
    st = state_of(request)
    req = await body_as(request, models.EnvironmentRequest)
    async with st.environment.writing:
        await asyncio.to_thread(st.environment.replace, req.env, req.unset)
        return ok(st.environment.view())
