"""The probes (the kubelet calls them without a token); never user activity."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import models
from .routing import Args
from .state import state_of
from .web import ok


async def healthz(request: Request, args: Args) -> Response:
    """Liveness: 200 while the process is up"""
    return ok(models.Health(status="ok"))


async def readyz(request: Request, args: Args) -> Response:
    """Readiness: 200 only when the runner answers"""
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
