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
    stats = await st.runner.cgroup_stats()
    now = time.time()
    return ok(
        models.Info(
            version=__version__,
            runner_version=ri.get("version"),
            runner_connected=st.runner.connected,
            runner_uid=ri.get("uid"),
            runner_python=ri.get("python"),
            last_activity=models.rfc3339(st.last_activity),
            active_executions=st.executions.active + st.contexts.busy,
            started_at=models.rfc3339(st.started),
            uptime_seconds=round(now - st.started, 3),
            workspace=st.workspace.root,
            workspace_usage=workspace_usage(st.workspace.root),
            limits=_limits(stats),
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


def _limits(stats: dict[str, object] | None) -> models.SandboxLimits | None:
    """The runner's cgroup counters, each kept only when it has the right type
    (the runner runs as the sandbox's user: its word is checked, not trusted)."""
    if stats is None:
        return None

    def whole(key: str) -> int | None:
        value = stats.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    seconds = stats.get("cpuThrottledSeconds")
    return models.SandboxLimits(
        pids_current=whole("pidsCurrent"),
        pids_limit=whole("pidsLimit"),
        pids_refused=whole("pidsRefused"),
        cpu_periods=whole("cpuPeriods"),
        cpu_throttled_periods=whole("cpuThrottledPeriods"),
        cpu_throttled_seconds=(
            float(seconds)
            if isinstance(seconds, int | float) and not isinstance(seconds, bool)
            else None
        ),
    )


async def metrics_text(request: Request, args: Args) -> Response:
    """Prometheus metrics"""
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request, args: Args) -> Response:
    """This document"""
    return Response(state_of(request).openapi, media_type=JSON)
