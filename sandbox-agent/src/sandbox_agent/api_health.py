"""The probes (the kubelet calls them without a token); never user activity."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from . import models
from .routing import Args
from .state import AgentState, state_of
from .web import ok

MAX_PROBE_WAITS = 8


async def healthz(request: Request, args: Args) -> Response:
    """Liveness: 200 while the process is up"""
    return ok(models.Health(status="ok"))


async def readyz(request: Request, args: Args) -> Response:
    """Readiness: 200 only when the runner answers

    With waitSeconds, a runner that has not connected yet is waited for (the
    runner starts once the agent has placed it, so the first probe would
    otherwise fail at every pod start). The answer comes within waitSeconds
    plus a quarter second (one second at the least).
    """
    st = state_of(request)
    wait = args.need("waitSeconds", float)
    if st.probe_waits >= MAX_PROBE_WAITS:
        wait = 0.0  # enough probes wait already (the kubelet sends one at a time)
    st.probe_waits += 1
    try:
        return await _readiness(st, wait)
    finally:
        st.probe_waits -= 1


async def _readiness(st: AgentState, wait: float) -> Response:
    deadline = time.monotonic() + wait
    # Unauthenticated: the messages are fixed sentences, never the runner's
    # error text (which names sockets and paths inside the pod).
    if st.restart.request is not None:
        return _not_ready("runtime_restart_pending", "the sandbox container is to be restarted")
    if not await st.runner.wait_connected(wait):
        return _not_ready("runner_not_connected", "no runner is connected")
    # A runner that just connected answers at once; one that is connected but
    # silent gets the usual second, or what is left of the wait.
    ping_wait = 1.0 if wait == 0 else min(1.0, max(0.25, deadline - time.monotonic()))
    if await st.runner.ping(wait=ping_wait):
        info = st.runner.info or {}
        return ok(models.Readiness(status="ready", runner_version=info.get("version")))
    if not st.runner.connected:
        return _not_ready("runner_not_connected", "no runner is connected")
    return _not_ready(
        "runner_not_answering", f"the runner did not answer a ping within {ping_wait:g}s"
    )


def _not_ready(reason: str, message: str) -> Response:
    return ok(models.Readiness(status="not_ready", reason=reason, message=message), 503)


async def runtime_liveness(request: Request, args: Args) -> Response:
    """Liveness of the sandbox container: 503 once it must be restarted

    The agent cannot kill the sandbox container's processes itself. When the
    runner does not confirm a kill (timeout, cancel, signal KILL) within
    SANDBOX_AGENT_KILL_GRACE, or answers no ping for
    SANDBOX_AGENT_RUNNER_STALL_SECONDS while commands run, this answers 503
    with the reason; a liveness probe of the sandbox container on this path
    makes the kubelet restart it, and the runner's death (PID 1) ends every
    process in it. It answers 200 again as soon as that runner's connection
    closes or another runner connects, so a restarted container is never
    failed for the old one's sake.
    """
    restart = state_of(request).restart.request
    if restart is None:
        return ok(models.RuntimeLiveness(status="ok"))
    return ok(
        models.RuntimeLiveness(
            status="restart_requested",
            reason=restart.reason,
            message=restart.message,
            since=restart.since,
            executions=restart.executions,
        ),
        503,
    )
