"""A Sandbox's status from what was observed: one pure function per condition,
the phase derived from the Ready condition, the whole status as a model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sandbox_operator.api.sandbox import (
    SandboxCondition,
    SandboxPhase,
    SandboxReason,
    SandboxStatus,
)
from sandbox_operator.builders.conditions import FALSE, TRUE, UNKNOWN, Cond, merge, progress
from sandbox_operator.clock import iso, parse_time
from sandbox_operator.identity import AGENT_CONTAINER, SANDBOX_CONTAINER

JSON = dict[str, Any]
C = SandboxCondition
R = SandboxReason

_IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"}
_PYTHON_HINT = "the runtime image must provide python3 >= 3.9 on PATH"
# The scheduler's message for a pod whose Immediate-binding claim is not bound yet.
UNBOUND_CLAIM_MESSAGE = "unbound immediate PersistentVolumeClaims"


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from, read by the controller beforehand."""

    generation: int
    paused: bool
    deleting: bool
    ephemeral: bool
    pod: JSON | None
    # The workspace claim, when the controller has it (None: not read or absent).
    claim: JSON | None = None
    # Why the claim is not bound, when known (a missing StorageClass, a
    # provisioning error): the newest Warning the cluster recorded on it.
    claim_problem: str | None = None
    invalid: str | None = None
    # The API server refused a child (quota, admission, missing ServiceAccount...).
    refused: str | None = None
    # No room in a quota: a SandboxQuota of the namespace, or a ResourceQuota that
    # refused the pod or the claim (the refusal's message).
    quota: str | None = None
    # Waiting for something outside the sandbox before anything is created (its
    # template): (reason, message).
    held: tuple[str, str] | None = None
    # WorkspaceRestored, when the workspace comes from a Snapshot.
    restore: Cond | None = None
    # The pod is kept stopped while the workspace is restored or rolled back.
    holding: bool = False
    # The pod is not created before the claim is bound (see the controller).
    awaiting_claim: bool = False
    # Why spec.files is not in the workspace yet (the agent's answer), when writing failed.
    files_problem: str | None = None
    # MemoryKept (pauseMode Memory), as the controller's memory step found it.
    memory: Cond | None = None


def pod_condition(pod: JSON, kind: str) -> JSON | None:
    """A condition of a pod (a plain dict, as the API server sends it)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            result: JSON = cond
            return result
    return None


def container_status(pod: JSON, name: str) -> JSON | None:
    status = pod.get("status", {})
    for key in ("containerStatuses", "initContainerStatuses"):
        for item in status.get(key, []) or []:
            if item.get("name") == name:
                result: JSON = item
                return result
    return None


def pod_ended(pod: JSON) -> bool:
    return pod.get("status", {}).get("phase") in ("Failed", "Succeeded")


def unbound_claim_since(pod: JSON) -> datetime | None:
    """Since when the scheduler has left the pod waiting for its claim to be bound
    (None: it is not). The scheduler requeues such pods when the claim binds,
    but can miss that event (the binder writes volumeName and the Bound phase in
    two updates) and then waits up to five minutes before it looks again."""
    scheduled = pod_condition(pod, "PodScheduled") or {}
    message = str(scheduled.get("message", ""))
    since = scheduled.get("lastTransitionTime")
    if scheduled.get("status") != "False" or UNBOUND_CLAIM_MESSAGE not in message or not since:
        return None
    return parse_time(str(since))


def stuck_on_unbound_claim(pod: JSON, now: datetime, patience: timedelta) -> bool:
    """The pod has waited for its claim longer than `patience` (`unbound_claim_since`).
    Only worth acting on once the claim is in fact bound (the controller checks)."""
    since = unbound_claim_since(pod)
    return since is not None and now - since > patience


def claim_phase(claim: JSON | None) -> str | None:
    return ((claim or {}).get("status") or {}).get("phase")


# -- one function per condition ---------------------------------------------------
# Each returns None where its condition does not apply (see api.sandbox.SandboxCondition).


def _runs_pod(o: Observed) -> bool:
    """A pod is meant to run now (and one exists)."""
    return (
        o.invalid is None
        and o.refused is None
        and o.quota is None
        and o.held is None
        and not o.paused
        and not o.deleting
        and not o.holding
        and o.pod is not None
    )


def _scheduled(o: Observed) -> bool:
    return _runs_pod(o) and (pod_condition(o.pod or {}, "PodScheduled") or {}).get("status") == TRUE


def workspace_ready(o: Observed) -> Cond | None:
    """Judged through the pod while one is scheduled (its claims are bound then),
    else through the claim itself."""
    if o.invalid is not None or o.quota is not None or o.held is not None:
        return None
    if o.ephemeral:
        return Cond(C.WORKSPACE_READY, TRUE, R.EPHEMERAL, "emptyDir workspace")
    scheduled = pod_condition(o.pod, "PodScheduled") if o.pod is not None else None
    if scheduled and scheduled.get("status") == TRUE:
        return Cond(C.WORKSPACE_READY, TRUE, R.CLAIM_BOUND)
    phase = claim_phase(o.claim)
    if phase == "Bound":
        return Cond(C.WORKSPACE_READY, TRUE, R.CLAIM_BOUND)
    if phase == "Lost":
        return Cond(
            C.WORKSPACE_READY, FALSE, R.CLAIM_LOST, "the claim's volume is gone (phase Lost)"
        )
    if o.claim is not None:
        name = o.claim["metadata"]["name"]
        why = o.claim_problem or "waiting for a volume to be provisioned and bound"
        return Cond(C.WORKSPACE_READY, FALSE, R.CLAIM_PENDING, f"claim {name} is {phase}: {why}")
    message = str((scheduled or {}).get("message", ""))
    if "PersistentVolumeClaim" in message:
        return Cond(C.WORKSPACE_READY, FALSE, R.CLAIM_PENDING, message)
    return Cond(C.WORKSPACE_READY, UNKNOWN, R.NO_POD, "the claim has not been seen yet")


def workspace_restored(o: Observed) -> Cond | None:
    return o.restore if o.invalid is None else None


def paused(o: Observed) -> Cond | None:
    if o.invalid is not None or o.refused is not None or o.quota is not None or o.held:
        return None
    if not o.paused:
        return Cond(C.PAUSED, FALSE, R.NOT_PAUSED)
    if o.pod is None:
        return Cond(C.PAUSED, TRUE, R.PAUSED, "pod deleted, workspace kept")
    return Cond(C.PAUSED, FALSE, R.PAUSING, "waiting for the pod to go")


def pod_scheduled(o: Observed) -> Cond | None:
    if not _runs_pod(o):
        return None
    scheduled = pod_condition(o.pod or {}, "PodScheduled") or {}
    if scheduled.get("status") == TRUE:
        return Cond(C.POD_SCHEDULED, TRUE, R.SCHEDULED)
    if scheduled.get("reason") == "Unschedulable":
        return Cond(C.POD_SCHEDULED, FALSE, R.UNSCHEDULABLE, str(scheduled.get("message", "")))
    return Cond(C.POD_SCHEDULED, FALSE, R.POD_PENDING, "waiting for a node")


def agent_ready(o: Observed) -> Cond | None:
    if not _scheduled(o) or pod_ended(o.pod or {}):
        return None
    agent = container_status(o.pod or {}, AGENT_CONTAINER)
    if agent and agent.get("ready"):
        return Cond(C.AGENT_READY, TRUE, R.AGENT_READY)
    return Cond(C.AGENT_READY, FALSE, R.AGENT_NOT_READY, "agent or runner not ready")


def runtime_ready(o: Observed) -> Cond | None:
    """Is the user's runtime container up, and if not, why (in plain words)?"""
    if not _scheduled(o) or pod_ended(o.pod or {}):
        return None
    status = container_status(o.pod or {}, SANDBOX_CONTAINER)
    if status is None:
        return Cond(C.RUNTIME_READY, FALSE, R.RUNTIME_STARTING, "waiting for the agent to start")
    state = status.get("state", {})
    if "running" in state:
        return Cond(C.RUNTIME_READY, TRUE, R.RUNTIME_RUNNING)
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or (status.get("lastState") or {}).get("terminated") or {}
    reason = waiting.get("reason") or terminated.get("reason") or ""
    message = " ".join(
        part for part in (waiting.get("message"), terminated.get("message")) if part
    ).strip()
    text = f"{reason} {message}".lower()
    if reason in _IMAGE_PULL_REASONS:
        return Cond(C.RUNTIME_READY, FALSE, R.IMAGE_PULL, message or reason)
    if "python3" in text and ("not found" in text or "no such file" in text):
        return Cond(C.RUNTIME_READY, FALSE, R.RUNTIME_NO_PYTHON, f"{_PYTHON_HINT}: {message}")
    if "python" in text and "too old" in text:
        return Cond(C.RUNTIME_READY, FALSE, R.RUNTIME_NO_PYTHON, f"{_PYTHON_HINT}: {message}")
    if reason in (
        "CrashLoopBackOff",
        "RunContainerError",
        "CreateContainerError",
        "StartError",
    ) or (terminated and status.get("restartCount", 0) > 0):
        detail = message or reason
        return Cond(C.RUNTIME_READY, FALSE, R.RUNTIME_FAILED, f"{detail}; {_PYTHON_HINT}")
    return Cond(C.RUNTIME_READY, FALSE, R.RUNTIME_STARTING, message or reason or "starting")


def ready(o: Observed, others: Mapping[str, Cond | None]) -> Cond:
    """Always present: the one condition `kubectl wait` and scripts look at."""

    def no(reason: str, message: str) -> Cond:
        return Cond(C.READY, FALSE, reason, message)

    if o.invalid is not None:
        return no(R.INVALID_SPEC, o.invalid)
    if o.refused is not None:
        return no(R.CREATE_FAILED, o.refused)
    if o.quota is not None and not o.deleting:
        return no(R.QUOTA_EXCEEDED, o.quota)
    if o.held is not None and not o.deleting:
        return no(*o.held)
    if o.deleting:
        return no(R.TERMINATING, "the sandbox is being deleted")
    if o.paused:
        if o.pod is None:
            return no(R.PAUSED, "the sandbox is paused")
        return no(R.PAUSING, "the sandbox is pausing")
    if o.holding:
        return no(R.RESTORING, o.restore.message if o.restore else "restoring the workspace")
    workspace = others.get(C.WORKSPACE_READY)
    if o.pod is None:
        if o.awaiting_claim and workspace is not None and workspace.status != TRUE:
            return no(R.WORKSPACE_PENDING, workspace.message)
        return no(R.POD_MISSING, "creating the pod")
    scheduled = others.get(C.POD_SCHEDULED)
    if scheduled is not None and scheduled.status != TRUE:
        return no(scheduled.reason, scheduled.message)
    pod = o.pod
    if pod_ended(pod):
        return no(R.POD_FAILED, f"{describe_pod_end(pod)}; recreating")
    if pod["metadata"].get("deletionTimestamp"):
        # Its containers stay ready through the grace period: a command sent now
        # would run in a pod that is going away (a resume that finds the pod of
        # the pause still stopping, a replaced or evicted pod).
        return no(R.POD_TERMINATING, "the pod is stopping; a new one follows")
    runtime = others.get(C.RUNTIME_READY)
    if runtime is not None and runtime.reason in (
        R.RUNTIME_NO_PYTHON,
        R.RUNTIME_FAILED,
        R.IMAGE_PULL,
    ):
        return no(runtime.reason, runtime.message)
    agent = others.get(C.AGENT_READY)
    pod_ready = (pod_condition(pod, "Ready") or {}).get("status") == TRUE
    if pod_ready and agent is not None and agent.status == TRUE:
        if o.files_problem is not None:
            return no(R.FILES_NOT_WRITTEN, o.files_problem)
        return Cond(C.READY, TRUE, R.READY, "agent and runner are serving")
    return no(R.AGENT_NOT_READY, "waiting for agent and runner")


def describe_pod_end(pod: JSON) -> str:
    """Why a pod ended, in words: an eviction says so and why (the kubelet's message),
    whatever phase the pod ended in."""
    status = pod.get("status") or {}
    disruption = pod_condition(pod, "DisruptionTarget") or {}
    message = status.get("message") or disruption.get("message") or ""
    if status.get("reason") == "Evicted" or disruption.get("reason") == "TerminationByKubelet":
        return f"evicted by the kubelet: {message or 'no reason given'}"
    phase = status.get("phase") or "ended"
    detail = message or status.get("reason") or ""
    return f"pod {phase}: {detail}" if detail else f"pod {phase}"


MIB = 2**20
# Set by the lifecycle pass from the agent's report, not by compute(): merge()
# keeps them through the passes that do not ask the agent.
REPORTED = frozenset({C.WORKSPACE_FULL, C.PID_LIMIT_REACHED, C.CPU_THROTTLED})
# CpuThrottled comes at this share of CFS periods throttled between two looks
# and goes below the second: a sandbox working near its limit does not flap.
CPU_THROTTLED_SET = 0.5
CPU_THROTTLED_CLEAR = 0.1
# Fewer periods than this between two looks: it barely ran, so it is not throttled.
CPU_MIN_PERIODS = 10


def workspace_full(total: int, available: int, *, was_full: bool) -> Cond | None:
    """WorkspaceFull from the workspace filesystem's size and free bytes. Pure.

    Set below 1% free (at least 1 MiB); once set, cleared only at 5% free (at
    least 4 MiB), so a workspace at the edge does not flap: each flip is a
    status write and an Event. The message names the size only, so a full
    workspace that keeps changing by a few bytes writes nothing."""
    floor = max(total // 100, MIB)
    if was_full:
        floor = max(total // 20, 4 * MIB)
    if available >= floor:
        return None
    return Cond(
        C.WORKSPACE_FULL,
        TRUE,
        R.NO_SPACE_LEFT,
        f"the {total / MIB:.0f} MiB workspace is full: writes in it fail with ENOSPC"
        " (No space left on device) until files are removed",
    )


def grown(before: int | None, after: int | None) -> int | None:
    """How much a cumulative counter grew between two looks. Pure. None when
    either look lacks it or it went down (the container restarted: its new
    cgroup counts from zero), so that look only sets a new baseline."""
    if before is None or after is None or after < before:
        return None
    return after - before


def pid_limit_reached(refused: int) -> Cond | None:
    """PidLimitReached from the forks refused since the last look. Pure. The
    message is the same every time, so a bomb that goes on writes nothing more."""
    if refused <= 0:
        return None
    return Cond(
        C.PID_LIMIT_REACHED,
        TRUE,
        R.FORK_REFUSED,
        "the pod's PID limit refused new processes (fork: Resource temporarily"
        " unavailable); the sandbox works again once its processes exit",
    )


def cpu_throttled(periods: int, throttled: int, limit: str, *, was: bool) -> Cond | None:
    """CpuThrottled from the CFS periods between two looks and how many of them
    the quota cut short. Pure. Set at CPU_THROTTLED_SET, cleared below
    CPU_THROTTLED_CLEAR; a sandbox that barely ran (fewer than CPU_MIN_PERIODS)
    is not throttled."""
    if periods < CPU_MIN_PERIODS:
        return None
    share = throttled / periods
    if share >= CPU_THROTTLED_SET or (was and share >= CPU_THROTTLED_CLEAR):
        return _cpu_cond(limit)
    return None


def _cpu_cond(limit: str) -> Cond:
    return Cond(
        C.CPU_THROTTLED,
        TRUE,
        R.CPU_LIMIT,
        f"its CPU limit ({limit}) stops it in most scheduling periods: it wants more"
        " CPU than spec.resources.cpu gives",
    )


def compute(o: Observed) -> dict[str, Cond | None]:
    """Every Sandbox condition type, in display order, for this observation."""
    others: dict[str, Cond | None] = {
        C.WORKSPACE_READY: workspace_ready(o),
        C.WORKSPACE_RESTORED: workspace_restored(o),
        C.PAUSED: paused(o),
        C.POD_SCHEDULED: pod_scheduled(o),
        C.AGENT_READY: agent_ready(o),
        C.RUNTIME_READY: runtime_ready(o),
        C.MEMORY_KEPT: o.memory,
    }
    cond = ready(o, others)
    return {**others, C.READY: cond, **progress(cond, stalled=stalled(cond), settled=settled(cond))}


# Ready reasons that no retry of the operator gets past: the spec, the image or
# the cluster's admission must change.
_STALLED = (R.INVALID_SPEC, R.CREATE_FAILED, R.RUNTIME_NO_PYTHON, R.RUNTIME_FAILED, R.IMAGE_PULL)


def stalled(ready: Cond) -> bool:
    return ready.reason in _STALLED


def settled(ready: Cond) -> bool:
    """Paused with the pod gone is where the spec asked the sandbox to be."""
    return ready.reason == R.PAUSED


_PHASES: dict[str, SandboxPhase] = {
    R.READY: SandboxPhase.RUNNING,
    R.INVALID_SPEC: SandboxPhase.FAILED,
    R.RUNTIME_NO_PYTHON: SandboxPhase.FAILED,
    R.RUNTIME_FAILED: SandboxPhase.FAILED,
    R.IMAGE_PULL: SandboxPhase.FAILED,
    R.TERMINATING: SandboxPhase.TERMINATING,
    R.PAUSED: SandboxPhase.PAUSED,
    R.PAUSING: SandboxPhase.PAUSED,
    R.RESTORING: SandboxPhase.RESTORING,
    R.POD_FAILED: SandboxPhase.STARTING,
    R.POD_TERMINATING: SandboxPhase.STARTING,
    R.AGENT_NOT_READY: SandboxPhase.STARTING,
    R.FILES_NOT_WRITTEN: SandboxPhase.STARTING,
}


def phase_of(conditions: Mapping[str, Cond | None]) -> SandboxPhase:
    """The PHASE column, from the Ready condition's reason (Pending when unlisted)."""
    cond = conditions[C.READY]
    assert cond is not None
    return _PHASES.get(cond.reason, SandboxPhase.PENDING)


def build_status(
    old: SandboxStatus, o: Observed, agent_port: int, now: datetime, **fields: Any
) -> SandboxStatus:
    """The status for this observation: computed conditions and phase, the pod's
    identity, then `fields` (by model field name; None clears one); everything
    else as it was."""
    conds = compute(o)
    meta = (o.pod or {}).get("metadata") or {}
    ip = (o.pod or {}).get("status", {}).get("podIP")
    return old.evolve(
        **{
            "phase": phase_of(conds),
            "observed_generation": o.generation,
            "conditions": merge(old.conditions, conds, o.generation, iso(now)),
            "pod_name": meta.get("name"),
            "pod_ip": ip,
            "pod_uid": meta.get("uid"),
            "agent_endpoint": f"http://{ip}:{agent_port}" if ip else None,
            **fields,
        }
    )
