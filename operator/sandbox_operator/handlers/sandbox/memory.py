"""Pauses that keep memory (`lifecycle.pauseMode: Memory`, docs/pause-memory.md).

A pause deletes the pod. With Memory, the pod is first saved whole by the
checkpointd of its node, and the deletion waits for that: a save that fails
leaves the pod running, the pause waiting and MemoryKept saying why (a pod
is never deleted without its image when Memory was asked). The resumed pod
names the image and runs on its node; once it is ready, its agent tells
whether it came back from the image (it started before the pod was made) or
started afresh (the image was missing, incomplete or from another runsc
build), and the image is dropped.

`condition` is pure; `before_pod` (the save), `after_ready` (the verdict)
and `drop` act. A restored pod names the pod it carries on in
`status.processesFrom`, which Executions running at the pause follow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import kopf

from sandbox_operator import metrics
from sandbox_operator.agent_client import AgentError
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import (
    MemoryImage,
    PauseMode,
    SandboxCondition,
    SandboxPhase,
    SandboxReason,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, find
from sandbox_operator.checkpointd import CheckpointError
from sandbox_operator.clock import iso, parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.pod import PodAction, PodDecision
from sandbox_operator.handlers.sandbox.status import Blocked
from sandbox_operator.handlers.sandbox.view import SandboxView

R = SandboxReason
JSON = dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What the memory step decided for this pass."""

    decision: PodDecision
    # Status fields (model field names) to set.
    fields: JSON
    # MemoryKept, when this pass has something new to say (None: as computed
    # from the status by `condition`).
    said: Cond | None = None
    # A save failed: the sandbox runs on, not paused, until the next try.
    waiting: bool = False


@dataclass(frozen=True)
class Settled:
    """A resumed pod's verdict: MemoryKept, and the status fields (model field
    names) it sets."""

    said: Cond
    fields: JSON


def wants_memory(spec: SandboxSpec) -> bool:
    return spec.lifecycle.pause_mode is PauseMode.MEMORY


def check_runtime(spec: SandboxSpec, classes: list[str]) -> None:
    """A runtime class whose pods checkpointd cannot save is an invalid spec."""
    if wants_memory(spec) and spec.runtime_class_name not in classes:
        raise Blocked(
            R.INVALID_SPEC.value,
            f"lifecycle.pauseMode: Memory needs a runtime class that can save a pod"
            f" ({', '.join(classes) or 'none is configured'}: the operator's"
            f" memory_pause_runtime_classes), not {spec.runtime_class_name}",
            permanent=True,
        )


def running_on(pod: JSON | None) -> str | None:
    """The node of a pod whose processes are worth saving: running and served."""
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    if status.get("phase") != "Running":
        return None
    node = spec.get("nodeName")
    return str(node) if node else None


def condition(spec: SandboxSpec, status: SandboxStatus, said: Cond | None) -> Cond | None:
    """MemoryKept for this pass. Pure.

    Absent without pauseMode Memory. What this pass said (a save, a failure, a
    resume's verdict) wins; otherwise an image held says so, and a verdict
    stays until the next pause says something else."""
    if not wants_memory(spec):
        return None
    if said is not None:
        return said
    image = status.memory
    if image is not None:
        return saved(image)
    old = find(status.conditions, SandboxCondition.MEMORY_KEPT)
    if old is None:
        return None
    return Cond(SandboxCondition.MEMORY_KEPT, old.status, old.reason, old.message or "")


def saved(image: MemoryImage) -> Cond:
    mib = image.bytes / (1 << 20)
    return Cond(
        SandboxCondition.MEMORY_KEPT,
        TRUE,
        R.CHECKPOINTED,
        f"processes and memory saved on node {image.node} ({mib:.0f} MiB) at"
        f" {image.taken_at}; the resume restores them there",
    )


def lost(why: str) -> Cond:
    return Cond(SandboxCondition.MEMORY_KEPT, FALSE, R.MEMORY_LOST, why)


async def before_pod(
    ctx: OperatorContext,
    view: SandboxView,
    pod: JSON | None,
    decision: PodDecision,
    now: datetime,
    logger: kopf.Logger,
    *,
    rolling_back: bool = False,
) -> Outcome:
    """The memory step of a pass, before the pod decision is carried out: save
    the pod a pause is about to delete; give up an image whose node cannot run
    the resumed pod, or whose workspace is being rolled back to a Snapshot."""
    spec, old = view.valid_spec, view.old
    keep = Outcome(decision, {})
    if not wants_memory(spec):
        if old.memory is not None:
            # The mode was switched off while paused: the image is of no use.
            await drop(ctx, view.served_by.namespace, old.memory, logger)
            return Outcome(decision, {"memory": None})
        return keep
    check_runtime(spec, ctx.settings.memory_pause_runtime_classes)
    if old.memory is not None and rolling_back:
        # The image's open files expect the workspace it was taken with.
        await drop(ctx, view.served_by.namespace, old.memory, logger)
        why = (
            "the workspace was rolled back to a Snapshot while the sandbox was paused: the"
            " saved processes and memory were dropped; the resume starts from the workspace"
        )
        ctx.event(view.body, "warn", reason=R.MEMORY_LOST, message=why)
        return Outcome(decision, {"memory": None}, lost(why))
    if decision.action is PodAction.DELETE and view.paused and pod is not None:
        return await _save(ctx, view, pod, decision, now, logger)
    if old.memory is not None and pod is not None and not view.paused:
        return _pinned_too_long(ctx, view, pod, decision, now)
    return keep


async def _save(
    ctx: OperatorContext,
    view: SandboxView,
    pod: JSON,
    decision: PodDecision,
    now: datetime,
    logger: kopf.Logger,
) -> Outcome:
    old = view.old
    uid = str(pod["metadata"]["uid"])
    if old.memory is not None and old.memory.pod_uid == uid:
        return Outcome(decision, {})  # saved by an earlier pass; deleting it now
    node = running_on(pod)
    namespace = view.served_by.namespace
    if node is None or old.phase != SandboxPhase.RUNNING:
        # Nothing ran that a save could keep (a pod that never served).
        said = lost("the pod was not running when the sandbox paused: only its workspace is kept")
        return Outcome(decision, {"memory": None}, said)
    try:
        # Taken before, its answer lost (an operator restart in between)? The
        # pod is stopped for good then, and its image is the only way back.
        image = await ctx.checkpoints.describe(node, namespace, uid)
        if image is None:
            logger.info("saving the pod's processes and memory on node %s", node)
            began = time.monotonic()
            image = await ctx.checkpoints.take(node, namespace, uid)
            metrics.MEMORY_SAVES.labels("ok").inc()
            logger.info("saved %d bytes in %.2fs", image.bytes, time.monotonic() - began)
    except CheckpointError as exc:
        metrics.MEMORY_SAVES.labels(exc.reason).inc()
        message = f"the pause waits and the sandbox runs on: {exc}"
        ctx.event_once(view.body, "warn", reason=exc.reason, message=message, key=str(exc))
        said = Cond(SandboxCondition.MEMORY_KEPT, FALSE, exc.reason, message)
        return Outcome(PodDecision(PodAction.KEEP), {}, said, waiting=True)
    memory = MemoryImage(
        key=image.key, node=node, pod_uid=uid, bytes=image.bytes, taken_at=iso(now)
    )
    ctx.event(view.body, "info", reason=R.CHECKPOINTED, message=saved(memory).message)
    return Outcome(decision, {"memory": memory}, saved(memory))


def _pinned_too_long(
    ctx: OperatorContext, view: SandboxView, pod: JSON, decision: PodDecision, now: datetime
) -> Outcome:
    """A resumed pod that has waited unscheduled on the image's node past the
    patience: the node is gone or full. The sandbox starts elsewhere from its
    workspace."""
    memory = view.old.memory
    assert memory is not None
    if (pod.get("spec") or {}).get("nodeName"):
        return Outcome(decision, {})
    created = parse_time(str(pod["metadata"]["creationTimestamp"]))
    if now - created <= parse_duration(ctx.settings.memory_node_patience):
        return Outcome(decision, {})
    why = (
        f"the resumed pod could not run on node {memory.node}, which holds the memory image,"
        f" for {ctx.settings.memory_node_patience}: starting from the workspace elsewhere"
    )
    ctx.event(view.body, "warn", reason=R.MEMORY_LOST, message=why)
    return Outcome(PodDecision(PodAction.REPLACE, why), {"memory": None}, lost(why))


async def after_ready(
    ctx: OperatorContext,
    view: SandboxView,
    pod: JSON | None,
    status: SandboxStatus,
    logger: kopf.Logger,
) -> Settled | None:
    """Once the resumed pod of an image is ready: did it come back from it? The
    image is dropped then, `status.memory` cleared and, for a restore,
    `status.processesFrom` set. None while there is nothing to settle (or the
    agent did not answer: next pass)."""
    memory = view.old.memory
    if memory is None or view.paused or pod is None or status.phase != SandboxPhase.RUNNING:
        return None
    if status.pod_uid == memory.pod_uid or not status.agent_endpoint:
        return None  # the saved pod itself, still being deleted
    token = await ctx.agent_token(view.body)
    if not token:
        return None
    try:
        info = await ctx.agents.info(status.agent_endpoint, token)
    except AgentError as exc:
        logger.warning("agent info failed while checking a restore: %s", exc)
        return None
    created = parse_time(str(pod["metadata"]["creationTimestamp"]))
    restored = info.started_at is not None and info.started_at < created
    if restored:
        said = Cond(
            SandboxCondition.MEMORY_KEPT,
            TRUE,
            R.MEMORY_RESTORED,
            f"processes and memory restored from the image taken at {memory.taken_at}",
        )
        ctx.event(view.body, "info", reason=R.MEMORY_RESTORED, message=said.message)
    else:
        said = lost(
            f"the resumed pod started afresh from the workspace: the image {memory.key} on node"
            f" {memory.node} could not be restored (missing, incomplete, or written by another"
            " runsc build); running processes and memory were lost"
        )
        ctx.event(view.body, "warn", reason=R.MEMORY_LOST, message=said.message)
    metrics.MEMORY_RESUMES.labels("restored" if restored else "lost").inc()
    await drop(ctx, view.served_by.namespace, memory, logger)
    return Settled(said, {"memory": None, "processes_from": memory.pod_uid if restored else None})


async def drop(
    ctx: OperatorContext, namespace: str, memory: MemoryImage, logger: kopf.Logger
) -> None:
    """Delete an image that is no longer needed; one that cannot be deleted now
    is left to the node (logged): it holds disk, nothing else."""
    try:
        await ctx.checkpoints.drop(memory.node, namespace, memory.key)
    except CheckpointError as exc:
        logger.warning("memory image %s on node %s left in place: %s", memory.key, memory.node, exc)
