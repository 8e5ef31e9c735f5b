"""Pure builders for Executions: the agent request, the one-shot sandbox, the status.

Nothing here performs I/O, so every decision about what an Execution looks
like is testable without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandbox_operator import conditions
from sandbox_operator.api.common import API_VERSION, parse_duration
from sandbox_operator.api.execution import TERMINAL_PHASES, ExecutionPhase, ExecutionSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders.sandbox import LABEL_MANAGED_BY, MANAGED_BY

JSON = dict[str, Any]

LABEL_EXECUTION = "sandbox.dev/execution"

# Stable reasons (status.reason and the conditions' reasons).
REASON_SANDBOX_NOT_FOUND = "SandboxNotFound"
REASON_SANDBOX_STARTING = "SandboxStarting"
REASON_SANDBOX_PAUSED = "SandboxPaused"
REASON_SANDBOX_RESUMING = "SandboxResuming"
REASON_SANDBOX_FAILED = "SandboxFailed"
REASON_SANDBOX_DELETED = "SandboxDeleted"
REASON_SECRET_NOT_FOUND = "SecretNotFound"
REASON_CONCURRENCY_LIMIT = "ConcurrencyLimit"
REASON_STARTED = "Started"
REASON_SUCCEEDED = "Succeeded"
REASON_NON_ZERO_EXIT = "NonZeroExit"
REASON_SIGNALED = "Signaled"
REASON_OOM_KILLED = "OOMKilled"
REASON_TIMED_OUT = "TimedOut"
REASON_CANCELLED = "Cancelled"
REASON_LOST = "Lost"
REASON_START_FAILED = "StartFailed"
REASON_INVALID_SPEC = "InvalidSpec"

CONDITION_SCHEDULED = "Scheduled"
CONDITION_COMPLETE = "Complete"
CONDITION_SUCCEEDED = "Succeeded"


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
            "labels": {LABEL_EXECUTION: meta["name"], LABEL_MANAGED_BY: MANAGED_BY},
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
            REASON_TIMED_OUT,
            f"killed after the {record.get('timeoutSeconds', 0):g}s timeout",
        )
    if status == "cancelled":
        return Outcome(ExecutionPhase.CANCELLED, REASON_CANCELLED, "cancelled while running")
    if status == "lost":
        return Outcome(
            ExecutionPhase.FAILED,
            REASON_LOST,
            "the sandbox's runner went away while the command ran; the outcome is unknown "
            f"and the command is not run again ({error.get('message', 'no detail')})",
        )
    if status == "failed":
        return Outcome(
            ExecutionPhase.FAILED, REASON_START_FAILED, str(error.get("message", "did not start"))
        )
    if record.get("oomKilled"):
        return Outcome(
            ExecutionPhase.FAILED, REASON_OOM_KILLED, "killed by the out-of-memory killer"
        )
    if record.get("signalName"):
        return Outcome(
            ExecutionPhase.FAILED, REASON_SIGNALED, f"killed by signal {record['signalName']}"
        )
    code = record.get("exitCode")
    if code == 0:
        return Outcome(ExecutionPhase.SUCCEEDED, REASON_SUCCEEDED)
    return Outcome(ExecutionPhase.FAILED, REASON_NON_ZERO_EXIT, f"exited with code {code}")


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
    """Status fields from an agent execution record, output bounded to `tail_bytes`."""
    stdout, stdout_cut = tail(record.get("stdout"), tail_bytes)
    stderr, stderr_cut = tail(record.get("stderr"), tail_bytes)
    fields: JSON = {
        "agentExecutionId": record.get("id"),
        "exitCode": record.get("exitCode"),
        "signal": record.get("signalName"),
        "stdout": stdout,
        "stderr": stderr,
        "stdoutTruncated": stdout_cut or bool(record.get("stdoutTruncated")),
        "stderrTruncated": stderr_cut or bool(record.get("stderrTruncated")),
        "stdoutBytes": record.get("stdoutBytes"),
        "stderrBytes": record.get("stderrBytes"),
    }
    duration = record.get("durationSeconds")
    if duration is not None:
        fields["duration"] = format_duration(float(duration))
    return fields


def execution_conditions(status: JSON) -> list[conditions.Cond]:
    """Scheduled (holds a slot and was started), Complete (any end; the reason says
    which, so `kubectl wait --for=condition=Complete` returns on every outcome) and,
    once complete, Succeeded."""
    phase = status.get("phase")
    reason = status.get("reason") or ""
    message = status.get("message") or ""
    started = bool(status.get("podUID"))
    done = phase in TERMINAL_PHASES
    conds = [
        conditions.Cond(
            CONDITION_SCHEDULED,
            "True" if started else "False",
            REASON_STARTED if started else reason or "Queued",
            "" if started else message,
        ),
        conditions.Cond(
            CONDITION_COMPLETE,
            "True" if done else "False",
            reason if done else str(phase or "Queued"),
            message if done else "",
        ),
    ]
    if done:
        succeeded = phase == ExecutionPhase.SUCCEEDED
        conds.append(
            conditions.Cond(CONDITION_SUCCEEDED, "True" if succeeded else "False", reason, message)
        )
    return conds


def build_status(old: JSON, changes: JSON, generation: int, now: datetime) -> JSON:
    """The whole status after `changes` (None removes a field), conditions included."""
    status = {k: v for k, v in {**old, **changes}.items() if v is not None}
    status["observedGeneration"] = generation
    status["conditions"] = conditions.merge(
        old.get("conditions", []),
        execution_conditions(status),
        generation,
        now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    return status


def terminal(status: JSON) -> bool:
    return status.get("phase") in TERMINAL_PHASES
