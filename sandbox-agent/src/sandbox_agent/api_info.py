"""What the agent knows about itself: info, metrics, the API document (not activity)."""

from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from . import __version__, metrics, models
from .routing import Args
from .state import state_of
from .web import JSON, ok


async def info(request: Request, args: Args) -> Response:
    """Version, runner state and activity (not itself activity)"""
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
            last_activity=models.rfc3339(st.last_activity),
            active_executions=st.executions.active,
            started_at=models.rfc3339(st.started),
            uptime_seconds=round(now - st.started, 3),
            workspace=st.workspace.root,
            workspace_usage=workspace_usage(st.workspace.root),
            runtime_restart_requested=st.restart.requested,
            runtime_restart=st.restart.request,
            environment_hash=st.environment.hash,
            default_timeout_seconds=st.settings.default_timeout,
            max_timeout_seconds=st.settings.max_timeout,
        )
    )


def workspace_usage(root: str) -> models.WorkspaceUsage | None:
    """How full the workspace's filesystem is (the operator reports a full one)."""
    try:
        fs = os.statvfs(root)
    except OSError:
        return None
    return models.WorkspaceUsage(
        total_bytes=fs.f_blocks * fs.f_frsize,
        used_bytes=(fs.f_blocks - fs.f_bfree) * fs.f_frsize,
        available_bytes=fs.f_bavail * fs.f_frsize,
    )


async def metrics_text(request: Request, args: Args) -> Response:
    """Prometheus metrics"""
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request, args: Args) -> Response:
    """This document"""
    return Response(state_of(request).openapi, media_type=JSON)
