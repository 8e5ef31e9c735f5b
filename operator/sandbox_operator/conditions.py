"""Sandbox conditions and phase computed from observed state. Pure functions.

Reasons are part of the API: users and scripts match on them, so they are
stable CamelCase words listed here, and messages carry the detail.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sandbox_operator.builders.sandbox import AGENT_CONTAINER, SANDBOX_CONTAINER

JSON = dict[str, Any]

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# Phases (the human column).
PENDING = "Pending"
STARTING = "Starting"
RUNNING = "Running"
PAUSED = "Paused"
FAILED = "Failed"
TERMINATING = "Terminating"
RESTORING = "Restoring"

# Reasons.
REASON_READY = "SandboxReady"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_CREATE_FAILED = "CreateFailed"
REASON_PAUSED = "Paused"
REASON_PAUSING = "Pausing"
REASON_NOT_PAUSED = "NotPaused"
REASON_POD_MISSING = "PodMissing"
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_SCHEDULED = "Scheduled"
REASON_POD_PENDING = "PodPending"
REASON_AGENT_READY = "AgentReady"
REASON_AGENT_NOT_READY = "AgentNotReady"
REASON_RUNTIME_RUNNING = "RuntimeRunning"
REASON_RUNTIME_STARTING = "RuntimeStarting"
REASON_RUNTIME_NO_PYTHON = "RuntimeMissingPython"
REASON_RUNTIME_FAILED = "RuntimeFailed"
REASON_IMAGE_PULL = "ImagePullFailed"
REASON_POD_FAILED = "PodFailed"
REASON_TERMINATING = "Terminating"
REASON_CLAIM_BOUND = "ClaimBound"
REASON_CLAIM_PENDING = "ClaimPending"
REASON_EPHEMERAL = "Ephemeral"
REASON_NO_POD = "NoPod"
# WorkspaceRestored (only when spec.workspace.fromSnapshot is set).
REASON_RESTORED = "Restored"
REASON_RESTORING = "Restoring"
REASON_ROLLING_BACK = "RollingBack"
REASON_SNAPSHOT_NOT_READY = "SnapshotNotReady"
REASON_SNAPSHOT_FAILED = "SnapshotFailed"

_IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"}
_PYTHON_HINT = "the runtime image must provide python3 >= 3.9 on PATH"


@dataclass(frozen=True)
class Cond:
    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from, read by the handler beforehand."""

    generation: int
    paused: bool
    deleting: bool
    ephemeral: bool
    pod: JSON | None
    invalid: str | None = None
    # The API server refused a child (quota, admission, missing ServiceAccount...).
    create_error: str | None = None
    # WorkspaceRestored, when the workspace comes from a Snapshot.
    restore: Cond | None = None
    # The pod is kept stopped while the workspace is restored or rolled back.
    holding: bool = False


def find(status: JSON, kind: str) -> JSON | None:
    """The condition of type `kind` in an object's status (a pod's or one of ours)."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            result: JSON = cond
            return result
    return None


def _pod_condition(pod: JSON, kind: str) -> JSON | None:
    return find(pod.get("status") or {}, kind)


# The scheduler's message for a pod whose Immediate-binding claim is not bound yet.
UNBOUND_CLAIM_MESSAGE = "unbound immediate PersistentVolumeClaims"


def stuck_on_unbound_claim(pod: JSON, now: datetime, patience: timedelta) -> bool:
    """The scheduler gave up on the pod because its claim was not bound yet, longer
    than `patience` ago. The scheduler requeues such pods when the claim binds,
    but can miss that event (the binder writes volumeName and the Bound phase in
    two updates) and then waits up to five minutes before it looks again."""
    scheduled = _pod_condition(pod, "PodScheduled") or {}
    message = str(scheduled.get("message", ""))
    since = scheduled.get("lastTransitionTime")
    if scheduled.get("status") != "False" or UNBOUND_CLAIM_MESSAGE not in message or not since:
        return False
    return now - datetime.fromisoformat(str(since).replace("Z", "+00:00")) > patience


def container_status(pod: JSON, name: str) -> JSON | None:
    status = pod.get("status", {})
    for key in ("containerStatuses", "initContainerStatuses"):
        for item in status.get(key, []) or []:
            if item.get("name") == name:
                result: JSON = item
                return result
    return None


def _runtime_condition(pod: JSON) -> Cond:
    """Is the user's runtime container up, and if not, why (in plain words)?"""
    status = container_status(pod, SANDBOX_CONTAINER)
    if status is None:
        return Cond(
            "RuntimeReady", FALSE, REASON_RUNTIME_STARTING, "waiting for the agent to start"
        )
    state = status.get("state", {})
    if "running" in state:
        return Cond("RuntimeReady", TRUE, REASON_RUNTIME_RUNNING)
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or (status.get("lastState") or {}).get("terminated") or {}
    reason = waiting.get("reason") or terminated.get("reason") or ""
    message = " ".join(
        part for part in (waiting.get("message"), terminated.get("message")) if part
    ).strip()
    text = f"{reason} {message}".lower()
    if reason in _IMAGE_PULL_REASONS:
        return Cond("RuntimeReady", FALSE, REASON_IMAGE_PULL, message or reason)
    if "python3" in text and ("not found" in text or "no such file" in text):
        return Cond("RuntimeReady", FALSE, REASON_RUNTIME_NO_PYTHON, f"{_PYTHON_HINT}: {message}")
    if "python" in text and "too old" in text:
        return Cond("RuntimeReady", FALSE, REASON_RUNTIME_NO_PYTHON, f"{_PYTHON_HINT}: {message}")
    if reason in (
        "CrashLoopBackOff",
        "RunContainerError",
        "CreateContainerError",
        "StartError",
    ) or (terminated and status.get("restartCount", 0) > 0):
        detail = message or reason
        return Cond("RuntimeReady", FALSE, REASON_RUNTIME_FAILED, f"{detail}; {_PYTHON_HINT}")
    return Cond("RuntimeReady", FALSE, REASON_RUNTIME_STARTING, message or reason or "starting")


def _workspace_condition(observed: Observed) -> Cond:
    """Judged through the pod, not by reading the claim: a scheduled pod has its
    claims bound, and an unbound claim shows in the scheduler's message. This
    saves an API read per reconciliation and per Sandbox."""
    if observed.ephemeral:
        return Cond("WorkspaceReady", TRUE, REASON_EPHEMERAL, "emptyDir workspace")
    if observed.pod is None:
        return Cond("WorkspaceReady", UNKNOWN, REASON_NO_POD, "no pod mounts the claim now")
    scheduled = _pod_condition(observed.pod, "PodScheduled") or {}
    if scheduled.get("status") == TRUE:
        return Cond("WorkspaceReady", TRUE, REASON_CLAIM_BOUND)
    message = scheduled.get("message", "")
    if "PersistentVolumeClaim" in message:
        return Cond("WorkspaceReady", FALSE, REASON_CLAIM_PENDING, message)
    return Cond(
        "WorkspaceReady", UNKNOWN, REASON_CLAIM_PENDING, "waiting for the pod to be scheduled"
    )


def compute(observed: Observed) -> tuple[str, list[Cond]]:
    """(phase, conditions) for a Sandbox in the observed situation."""
    phase, conds = _compute(observed)
    if observed.restore is not None and not observed.invalid:
        conds.insert(1, observed.restore)
    return phase, conds


def _compute(observed: Observed) -> tuple[str, list[Cond]]:
    if observed.invalid:
        bad = Cond("Ready", FALSE, REASON_INVALID_SPEC, observed.invalid)
        return FAILED, [bad]
    if observed.create_error:
        return PENDING, [Cond("Ready", FALSE, REASON_CREATE_FAILED, observed.create_error)]

    conds = [_workspace_condition(observed)]
    pod = observed.pod
    if observed.deleting:
        conds.append(Cond("Ready", FALSE, REASON_TERMINATING, "the sandbox is being deleted"))
        return TERMINATING, conds
    if observed.paused:
        if pod is None:
            conds += [
                Cond("Paused", TRUE, REASON_PAUSED, "pod deleted, workspace kept"),
                Cond("Ready", FALSE, REASON_PAUSED, "the sandbox is paused"),
            ]
            return PAUSED, conds
        conds += [
            Cond("Paused", FALSE, REASON_PAUSING, "waiting for the pod to go"),
            Cond("Ready", FALSE, REASON_PAUSING, "the sandbox is pausing"),
        ]
        return PAUSED, conds
    conds.append(Cond("Paused", FALSE, REASON_NOT_PAUSED))

    if observed.holding:
        message = observed.restore.message if observed.restore else "restoring the workspace"
        conds.append(Cond("Ready", FALSE, REASON_RESTORING, message))
        return RESTORING, conds

    if pod is None:
        conds.append(Cond("Ready", FALSE, REASON_POD_MISSING, "creating the pod"))
        return PENDING, conds

    scheduled = _pod_condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == TRUE:
        conds.append(Cond("PodScheduled", TRUE, REASON_SCHEDULED))
    elif scheduled and scheduled.get("reason") == "Unschedulable":
        message = scheduled.get("message", "")
        conds.append(Cond("PodScheduled", FALSE, REASON_UNSCHEDULABLE, message))
        conds.append(Cond("Ready", FALSE, REASON_UNSCHEDULABLE, message))
        return PENDING, conds
    else:
        conds.append(Cond("PodScheduled", FALSE, REASON_POD_PENDING, "waiting for a node"))
        conds.append(Cond("Ready", FALSE, REASON_POD_PENDING, "waiting for a node"))
        return PENDING, conds

    if pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
        message = pod.get("status", {}).get("message") or pod["status"].get("reason") or "pod ended"
        conds.append(Cond("Ready", FALSE, REASON_POD_FAILED, f"{message}; recreating"))
        return STARTING, conds

    agent = container_status(pod, AGENT_CONTAINER)
    if agent and agent.get("ready"):
        conds.append(Cond("AgentReady", TRUE, REASON_AGENT_READY))
    else:
        conds.append(Cond("AgentReady", FALSE, REASON_AGENT_NOT_READY, "agent or runner not ready"))

    runtime = _runtime_condition(pod)
    conds.append(runtime)
    ready = _pod_condition(pod, "Ready")
    if runtime.reason in (REASON_RUNTIME_NO_PYTHON, REASON_RUNTIME_FAILED, REASON_IMAGE_PULL):
        conds.append(Cond("Ready", FALSE, runtime.reason, runtime.message))
        return FAILED, conds
    if ready and ready.get("status") == TRUE and agent and agent.get("ready"):
        conds.append(Cond("Ready", TRUE, REASON_READY, "agent and runner are serving"))
        return RUNNING, conds
    conds.append(Cond("Ready", FALSE, REASON_AGENT_NOT_READY, "waiting for agent and runner"))
    return STARTING, conds


def merge(
    previous: Iterable[JSON], current: Iterable[Cond], generation: int, now: str
) -> list[JSON]:
    """metav1.Condition dicts; lastTransitionTime moves only when the status flips."""
    before = {c.get("type"): c for c in previous}
    merged = []
    for cond in current:
        old = before.get(cond.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == cond.status else None
        merged.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return merged
