"""The sandbox's pod: what to do with it (a pure decision), and doing it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import kopf

from sandbox_operator import identity, metrics
from sandbox_operator.api.sandbox import (
    MemoryImage,
    SandboxCondition,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders.conditions import FALSE, find
from sandbox_operator.clock import parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.view import SandboxView
from sandbox_operator.handlers.sandbox.workspace import ClaimState, ours_or_refuse
from sandbox_operator.indexes import pod_essentials
from sandbox_operator.kube import newest_warning
from sandbox_operator.resources import (
    POD_SPEC_ANNOTATION,
    PODS,
)

JSON = dict[str, Any]


# How long a pod may wait unscheduled on a claim that is bound before it is
# replaced (see sandbox_status.stuck_on_unbound_claim).
UNBOUND_CLAIM_PATIENCE = timedelta(seconds=15)


class PodAction(Enum):
    KEEP = "keep"
    CREATE = "create"
    DELETE = "delete"  # stop it (pause, rollback)
    REPLACE = "replace"  # delete it; the next pass creates the new one
    ADOPT = "adopt"  # keep it, and record what it was built from (an older operator's pod)


@dataclass(frozen=True)
class PodDecision:
    action: PodAction
    # Why, in words for the PodReplaced Event (REPLACE only).
    why: str = ""


def decide_pod(
    pod: JSON | None,
    spec: SandboxSpec,
    *,
    paused: bool,
    hold: bool,
    claim: ClaimState,
    status: SandboxStatus,
    now: datetime,
    agent_patience: timedelta,
) -> PodDecision:
    """What to do with the pod, from what was observed. Pure."""
    if paused or hold:
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            return PodDecision(PodAction.DELETE)
        return PodDecision(PodAction.KEEP)
    if pod is None:
        return PodDecision(PodAction.KEEP if claim.wait else PodAction.CREATE)
    if pod["metadata"].get("deletionTimestamp"):
        return PodDecision(PodAction.KEEP)  # going away; recreated once gone
    changed = build.changed_fields(pod, spec)
    if changed is None:
        return PodDecision(
            PodAction.REPLACE, "the sandbox spec changed (a pod of an older operator)"
        )
    if changed:
        fields = ", ".join(f"spec.{name}" for name in changed)
        return PodDecision(PodAction.REPLACE, f"{fields} changed, which needs a new pod")
    if sandbox_status.pod_ended(pod):
        return PodDecision(PodAction.REPLACE, sandbox_status.describe_pod_end(pod))
    if sandbox_status.claim_phase(claim.claim) == "Bound" and sandbox_status.stuck_on_unbound_claim(
        pod, now, UNBOUND_CLAIM_PATIENCE
    ):
        return PodDecision(
            PodAction.REPLACE, "the scheduler did not retry after the workspace claim was bound"
        )
    stalled = agent_stalled(pod, status, now, agent_patience)
    if stalled:
        return PodDecision(PodAction.REPLACE, stalled)
    if POD_SPEC_ANNOTATION not in (pod["metadata"].get("annotations") or {}):
        return PodDecision(PodAction.ADOPT)
    return PodDecision(PodAction.KEEP)


def agent_unready_since(pod: JSON, status: SandboxStatus) -> datetime | None:
    """Since when the agent of a pod that was serving has not been ready while its
    runtime container runs (None: it is ready, or the pod never served, or the
    runtime container is not running)."""
    if status.ready_pod_uid != pod["metadata"].get("uid"):
        return None
    agent = sandbox_status.container_status(pod, identity.AGENT_CONTAINER) or {}
    runtime = sandbox_status.container_status(pod, identity.SANDBOX_CONTAINER) or {}
    if agent.get("ready") or "running" not in (runtime.get("state") or {}):
        return None
    cond = find(status.conditions, SandboxCondition.AGENT_READY)
    if cond is None or cond.status != FALSE or not cond.last_transition_time:
        return None
    return parse_time(cond.last_transition_time)


def agent_stalled(
    pod: JSON, status: SandboxStatus, now: datetime, patience: timedelta
) -> str | None:
    """Why a pod that was serving must be replaced: its agent has not been ready for
    longer than `patience` while the runtime container runs (a wedged agent or
    runner that the kubelet's probes did not cure). Only for a pod that was
    Ready before, so a pod that never gets ready is not replaced in a loop."""
    since = agent_unready_since(pod, status)
    if since is None or now - since <= patience:
        return None
    stalled = now - since
    return (
        f"the agent has not been ready for {int(stalled.total_seconds())}s"
        " (commands cannot be run or stopped); the workspace is kept"
    )


async def ensure_pod(
    ctx: OperatorContext,
    view: SandboxView,
    pod: JSON | None,
    decision: PodDecision,
    logger: kopf.Logger,
    *,
    memory: MemoryImage | None = None,
) -> JSON | None:
    """Carry out `decision` (for a runnable view: its spec is valid); a pod it
    creates is restored from `memory` when given. Returns the pod as it now
    stands (None if absent)."""
    body, spec, ref = view.body, view.valid_spec, view.served_by
    path = PODS.path(ref.namespace)
    action = decision.action
    if pod is not None and _must_be_ours(pod, ref):
        ours_or_refuse("Pod", pod, ref)
    if action is PodAction.KEEP:
        return pod
    if action is PodAction.CREATE:
        desired = build.desired_pod(ref, spec, ctx.settings, memory)
        created = await ctx.kube.create(path, desired)
        if created is None:  # a namesake exists that our view has not caught up with
            namesake = await ctx.kube.get(f"{path}/{desired['metadata']['name']}")
            if namesake is not None and _must_be_ours(namesake, ref):
                ours_or_refuse("Pod", namesake, ref)
            return namesake
        ctx.created_pods[(ref.namespace, ref.name)] = pod_essentials(created)
        return created
    assert pod is not None
    name = pod["metadata"]["name"]
    if action is PodAction.ADOPT:
        annotations = {POD_SPEC_ANNOTATION: build.stamp_annotation(spec)}
        return await ctx.kube.patch(f"{path}/{name}", {"metadata": {"annotations": annotations}})
    await ctx.kube.delete(f"{path}/{name}", uid=pod["metadata"]["uid"])
    if action is PodAction.DELETE:
        if view.paused:
            ctx.event(body, "info", reason="Paused", message="pod deleted, workspace kept")
        else:
            ctx.event(body, "info", reason="Restoring", message="pod stopped for a rollback")
        return pod
    logger.info("replacing pod: %s", decision.why)
    message = f"replacing the pod: {decision.why}; running commands were stopped"
    ctx.event(body, "warn", reason="PodReplaced", message=message)
    metrics.POD_RECREATIONS.inc()
    return pod


def _must_be_ours(pod: JSON, ref: identity.SandboxRef) -> bool:
    """A pod on its way out is waited for as it is, unless an earlier namesake left
    it: then the wait is reported as that (not as this Sandbox's pod ending)."""
    return not pod["metadata"].get("deletionTimestamp") or identity.left_by_namesake(pod, ref)


async def with_eviction(ctx: OperatorContext, pod: JSON | None) -> JSON | None:
    """`pod`, with the kubelet's eviction reason in its status when it ended evicted.

    The kubelet records an eviction in an Event first; the pod's own status can
    end as Succeeded (its containers exited cleanly when told to stop) before
    the Evicted phase and reason land, and the pod is replaced at once."""
    if pod is None or not sandbox_status.pod_ended(pod):
        return pod
    if sandbox_status.describe_pod_end(pod).startswith("evicted"):
        return pod
    meta = pod["metadata"]
    selector = f"involvedObject.uid={meta['uid']},reason=Evicted"
    found = await newest_warning(ctx.kube, meta["namespace"], selector)
    if found is None:
        return pod
    status = {**pod["status"], "reason": "Evicted", "message": found.get("message", "")}
    return {**pod, "status": status}
