"""What reaches a running sandbox through its agent, without a new pod: the
environment of commands started from now on, and spec.files."""

from __future__ import annotations

import json
from typing import Any

from sandbox_operator import envvars, identity, metrics
from sandbox_operator.agent_client import AgentError, environment_hash
from sandbox_operator.api.sandbox import SandboxStatus
from sandbox_operator.builders import sandbox as build
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.view import SandboxView

JSON = dict[str, Any]


def _pod_env(pod: JSON) -> list[JSON]:
    """The user's variables the pod was started with (not the operator's own)."""
    container: JSON = next(
        (c for c in pod["spec"]["containers"] if c["name"] == identity.SANDBOX_CONTAINER), {}
    )
    own = {"HOME", "SANDBOX_RUNNER_SOCKET"}
    return [var for var in container.get("env") or [] if var.get("name") not in own]


async def sync_environment(
    ctx: OperatorContext, view: SandboxView, pod: JSON | None, endpoint: str | None
) -> None:
    """Give commands started from now on the spec's env, without a new pod.

    The pod keeps the env it started with; when the spec's differs, the agent
    gets an overlay (the whole env, and the names to drop) that it applies to
    each new command. What the agent holds is compared by digest; a spec back at
    the pod's env means no overlay, and one given earlier is taken back."""
    body, spec = view.body, view.valid_spec
    if pod is None or not endpoint:
        return
    # By the Sandbox that owns the pod: a claimer starts from what its pool
    # member's passes gave that agent, and asks the agent only if its env differs
    # (a claim without env of its own makes no agent call before it is Ready).
    key = (view.served_by.namespace, view.served_by.uid)
    wanted = [var.to_wire() for var in spec.env]
    base = _pod_env(pod)
    # Secrets are read once per change of the spec's env, like the kubelet reads
    # them once per container start.
    applied = (pod["metadata"]["uid"], json.dumps(wanted, sort_keys=True))
    if ctx.environments.get(key) == applied:
        return
    env: dict[str, str] = {}
    unset: list[str] = []
    if wanted != base:
        try:
            env = await envvars.resolve(ctx.kube, view.ref.namespace, spec.env)
        except envvars.MissingSecret as exc:
            ctx.event(body, "warn", reason="EnvironmentPending", message=str(exc))
            return
        unset = sorted({var["name"] for var in base} - env.keys())
    digest = environment_hash(env, unset)
    token = await ctx.agent_token(body)
    if not token:
        return
    try:
        info = await ctx.agents.info(endpoint, token)
        if info.environment_hash != digest:
            await ctx.agents.set_environment(endpoint, token, env, unset)
            ctx.event(
                body,
                "info",
                reason="EnvironmentUpdated",
                message="commands started from now on get the new env (running ones keep theirs)",
            )
    except AgentError as exc:
        metrics.AGENT_ERRORS.inc()
        if exc.status in (401, 403):
            ctx.drop_token(body)
        return  # the next pass tries again
    ctx.environments[key] = applied


async def sync_files(
    ctx: OperatorContext, view: SandboxView, status: SandboxStatus
) -> tuple[str | None, str | None]:
    """Write spec.files into the workspace unless `status` says they are there:
    (the digest now written, None) or (the one before, why writing failed).

    Written before the Sandbox is Ready, so the first command finds them; a
    claimed pool member gets its claimer's files this way too."""
    body, spec = view.body, view.valid_spec
    wanted = build.files_digest(spec, status.pod_uid)
    if wanted is None:
        return None, None  # no files (or no longer any: the written ones stay)
    if wanted == status.files_written or not status.agent_endpoint:
        return status.files_written, None
    token = await ctx.agent_token(body)
    if not token:
        return status.files_written, "waiting for the agent's token to write spec.files"
    for file in spec.files:
        try:
            await ctx.agents.write_file(
                status.agent_endpoint, token, file.path, file.content.encode(), file.mode
            )
        except AgentError as exc:
            metrics.AGENT_ERRORS.inc()
            if exc.status in (401, 403):
                ctx.drop_token(body)
            return status.files_written, f"writing spec.files {file.path!r} failed: {exc}"
    return wanted, None
