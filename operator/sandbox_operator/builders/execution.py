"""Pure builders for Executions: the agent request, the one-shot sandbox, the status.

Nothing here performs I/O, so every decision about what an Execution looks
like is testable without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandbox_operator.api.common import API_VERSION, parse_duration
from sandbox_operator.api.execution import (
    TERMINAL_PHASES,
    ExecutionCondition,
    ExecutionPhase,
    ExecutionReason,
    ExecutionSpec,
    ExecutionStatus,
)
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, merge, progress
from sandbox_operator.clock import iso
from sandbox_operator.resources import (
    EXECUTION_ANNOTATION,
    LABEL_EXECUTION_UID,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)

R = ExecutionReason

JSON = dict[str, Any]


def one_shot_name(execution: str, uid: str) -> str:
    """A valid Sandbox name (lowercase, starts with a letter, <= 50) unique to the Execution."""
    base = re.sub(r"[^a-z0-9-]+", "-", execution.lower())[:36].strip("-")
    if not base or not base[0].isalpha():
        base = f"x{base}"[:36].rstrip("-")
    return f"{base}-{uid.replace('-', '')[:8]}"


def build_one_shot_sandbox(meta: JSON, template: SandboxSpec) -> JSON:
    """The disposable Sandbox of an Execution with an inline template, owned by it
    so that the garbage collector removes it even if the operator never gets to."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Sandbox",
        "metadata": {
            "name": one_shot_name(meta["name"], meta["uid"]),
            "namespace": meta["namespace"],
            # The UID, not the name: label values are at most 63 characters.
            "labels": {LABEL_EXECUTION_UID: meta["uid"], LABEL_MANAGED_BY: MANAGED_BY},
            "annotations": {EXECUTION_ANNOTATION: meta["name"]},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "Execution",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": template.to_wire(),
    }


def agent_request(spec: ExecutionSpec, uid: str, env: dict[str, str]) -> JSON:
    """The agent's ExecRequest. The Execution's UID is the idempotency key: however
    often this request is sent, the agent runs the command at most once."""
    request: JSON = {
        "idempotencyKey": uid,
        "timeoutSeconds": parse_duration(spec.timeout).total_seconds(),
        "env": env,
    }
    if spec.command is not None:
        request["argv"] = list(spec.command)
    else:
        request["command"] = spec.script
    if spec.working_dir:
        request["cwd"] = spec.working_dir
    if spec.stdin is not None:
        request["stdin"] = spec.stdin
    if spec.combined_output:
        request["combinedOutput"] = True
    return request


@dataclass(frozen=True)
class Outcome:
    phase: ExecutionPhase
    reason: str
    message: str = ""


def outcome_of(record: JSON) -> Outcome | None:
    """How an agent execution ended; None while it runs."""
    status = record.get("status")
    error = record.get("error") or {}
    if status == "running":
        return None
    if status == "timed_out":
        return Outcome(
            ExecutionPhase.TIMED_OUT,
            R.TIMED_OUT,
            f"killed after the {record.get('timeoutSeconds', 0):g}s timeout",
        )
    if status == "cancelled":
        return Outcome(ExecutionPhase.CANCELLED, R.CANCELLED, "cancelled while running")
    if status == "lost":
        return Outcome(
            ExecutionPhase.FAILED,
            R.LOST,
            "the sandbox's runner went away while the command ran; the outcome is unknown "
            f"and the command is not run again ({error.get('message', 'no detail')})",
        )
    if status == "failed":
        return Outcome(
            ExecutionPhase.FAILED, R.START_FAILED, str(error.get("message", "did not start"))
        )
    if record.get("oomKilled"):
        return Outcome(ExecutionPhase.FAILED, R.OOM_KILLED, "killed by the out-of-memory killer")
    if record.get("signalName"):
        return Outcome(
            ExecutionPhase.FAILED, R.SIGNALED, f"killed by signal {record['signalName']}"
        )
    code = record.get("exitCode")
    if code == 0:
        return Outcome(ExecutionPhase.SUCCEEDED, R.SUCCEEDED)
    return Outcome(ExecutionPhase.FAILED, R.NON_ZERO_EXIT, f"exited with code {code}")


def tail(text: str | None, limit: int) -> tuple[str | None, bool]:
    """The last `limit` bytes of UTF-8 text (never a broken character), and whether cut."""
    if text is None:
        return None, False
    raw = text.encode()
    if len(raw) <= limit:
        return text, False
    return raw[len(raw) - limit :].decode(errors="ignore"), True


def format_duration(seconds: float) -> str:
    """Compact and human: 12ms, 1.5s, 2m3s, 1h2m."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m"


def record_fields(record: JSON, tail_bytes: int) -> JSON:
    """Status fields (by model field name) from an agent execution record, output
    bounded to `tail_bytes`."""
    stdout, stdout_cut = tail(record.get("stdout"), tail_bytes)
    stderr, stderr_cut = tail(record.get("stderr"), tail_bytes)
    fields: JSON = {
        "agent_execution_id": record.get("id"),
        "exit_code": record.get("exitCode"),
        "signal": record.get("signalName"),
        "stdout": stdout,
        "stderr": stderr,
        "stdout_truncated": stdout_cut or bool(record.get("stdoutTruncated")),
        "stderr_truncated": stderr_cut or bool(record.get("stderrTruncated")),
        "stdout_bytes": record.get("stdoutBytes"),
        "stderr_bytes": record.get("stderrBytes"),
    }
    duration = record.get("durationSeconds")
    if duration is not None:
        fields["duration"] = format_duration(float(duration))
    return fields


# -- status: one function per condition ----------------------------------------


def _done(status: ExecutionStatus) -> bool:
    return status.phase in TERMINAL_PHASES


def scheduled(status: ExecutionStatus) -> Cond:
    """Holds a slot and was started (the pod is recorded before the command is sent)."""
    if status.pod_uid:
        return Cond(ExecutionCondition.SCHEDULED, TRUE, R.STARTED)
    return Cond(
        ExecutionCondition.SCHEDULED, FALSE, status.reason or R.QUEUED, status.message or ""
    )


def complete(status: ExecutionStatus) -> Cond:
    """True on every outcome (the reason says which), so `kubectl wait
    --for=condition=Complete` returns whatever the end."""
    if _done(status):
        return Cond(ExecutionCondition.COMPLETE, TRUE, status.reason or "", status.message or "")
    return Cond(ExecutionCondition.COMPLETE, FALSE, status.phase or ExecutionPhase.QUEUED)


def succeeded(status: ExecutionStatus) -> Cond | None:
    """Only once complete."""
    if not _done(status):
        return None
    ok = status.phase == ExecutionPhase.SUCCEEDED
    return Cond(
        ExecutionCondition.SUCCEEDED,
        TRUE if ok else FALSE,
        status.reason or "",
        status.message or "",
    )


def ready(status: ExecutionStatus) -> Cond:
    """True once the command succeeded; False with the waiting or final reason."""
    if status.phase == ExecutionPhase.SUCCEEDED:
        return Cond(ExecutionCondition.READY, TRUE, R.SUCCEEDED, status.message or "")
    reason = status.reason or status.phase or ExecutionPhase.QUEUED
    return Cond(ExecutionCondition.READY, FALSE, reason, status.message or "")


def build_status(
    old: ExecutionStatus, changes: JSON, generation: int, now: datetime
) -> ExecutionStatus:
    """The whole status after `changes` (by field name; None clears a field),
    conditions included. The phase is the Execution's recorded state, and the
    conditions follow from it."""
    status = old.evolve(**changes, observed_generation=generation)
    cond = ready(status)
    conds: dict[str, Cond | None] = {
        ExecutionCondition.READY: cond,
        ExecutionCondition.SCHEDULED: scheduled(status),
        ExecutionCondition.COMPLETE: complete(status),
        ExecutionCondition.SUCCEEDED: succeeded(status),
        # A final failure is Stalled: nothing changes it but a new Execution.
        **progress(cond, stalled=_done(status)),
    }
    return status.evolve(conditions=merge(old.conditions, conds, generation, iso(now)))


def terminal(status: ExecutionStatus) -> bool:
    return _done(status)
