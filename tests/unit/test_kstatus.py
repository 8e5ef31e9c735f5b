"""kstatus conventions on every kind: Ready, observedGeneration, and Reconciling
or Stalled exactly while they hold, so that `kubectl wait --for=condition=Ready`,
Flux (kstatus) and the Argo CD health scripts agree."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from sandbox_operator.api.common import Condition
from sandbox_operator.api.execution import ExecutionStatus
from sandbox_operator.api.sandbox import SandboxStatus
from sandbox_operator.api.snapshot import SnapshotReason, SnapshotStatus
from sandbox_operator.builders import execution, sandbox_status, snapshot_status
from sandbox_operator.builders.conditions import Cond, progress

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _kstatus(conditions: list[Condition]) -> tuple[str, str | None, str | None]:
    """Ready's status, and the reasons of Reconciling and Stalled (None: absent)."""
    by_type = {c.type: c for c in conditions}
    for kind in ("Reconciling", "Stalled"):
        assert kind not in by_type or by_type[kind].status == "True", by_type[kind]
    reconciling, stalled = by_type.get("Reconciling"), by_type.get("Stalled")
    return (
        by_type["Ready"].status,
        reconciling.reason if reconciling else None,
        stalled.reason if stalled else None,
    )


def test_progress_is_abnormal_true_and_carries_readys_words() -> None:
    waiting = Cond("Ready", "False", "Starting", "pulling")
    assert progress(waiting, stalled=False) == {
        "Reconciling": Cond("Reconciling", "True", "Starting", "pulling"),
        "Stalled": None,
    }
    assert progress(waiting, stalled=True) == {
        "Reconciling": None,
        "Stalled": Cond("Stalled", "True", "Starting", "pulling"),
    }
    assert progress(waiting, stalled=False, settled=True) == {"Reconciling": None, "Stalled": None}
    ready = Cond("Ready", "True", "Ok")
    assert progress(ready, stalled=True) == {"Reconciling": None, "Stalled": None}


def _pod(*, ready: bool, sandbox_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "uid": "u"},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.9",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
            "initContainerStatuses": [{"name": "agent", "ready": ready, "state": {"running": {}}}],
            "containerStatuses": [{"name": "sandbox", "state": sandbox_state}],
        },
    }


RUNNING: dict[str, Any] = {"running": {}}
NO_PYTHON = {"waiting": {"reason": "CrashLoopBackOff", "message": "python3: not found"}}


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        ({"pod": None}, ("False", "PodMissing", None)),
        ({"pod": _pod(ready=False, sandbox_state=RUNNING)}, ("False", "AgentNotReady", None)),
        ({"pod": _pod(ready=True, sandbox_state=RUNNING)}, ("True", None, None)),
        ({"pod": None, "paused": True}, ("False", None, None)),
        (
            {"pod": _pod(ready=True, sandbox_state=RUNNING), "paused": True},
            ("False", "Pausing", None),
        ),
        ({"pod": None, "invalid": "bad"}, ("False", None, "InvalidSpec")),
        ({"pod": None, "refused": "quota"}, ("False", None, "CreateFailed")),
        (
            {"pod": _pod(ready=False, sandbox_state=NO_PYTHON)},
            ("False", None, "RuntimeMissingPython"),
        ),
        ({"pod": None, "deleting": True}, ("False", "Terminating", None)),
    ],
)
def test_sandbox(observed: dict[str, Any], expected: tuple[str, str | None, str | None]) -> None:
    o = sandbox_status.Observed(
        **{"generation": 4, "paused": False, "deleting": False, "ephemeral": True, **observed}
    )
    status = sandbox_status.build_status(SandboxStatus(), o, 8080, NOW)
    assert status.observed_generation == 4
    assert _kstatus(status.conditions) == expected


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"phase": "Queued", "reason": "SandboxStarting"}, ("False", "SandboxStarting", None)),
        ({"phase": "Running", "reason": "Started"}, ("False", "Started", None)),
        ({"phase": "Succeeded", "reason": "Succeeded"}, ("True", None, None)),
        ({"phase": "Failed", "reason": "NonZeroExit"}, ("False", None, "NonZeroExit")),
        ({"phase": "TimedOut", "reason": "TimedOut"}, ("False", None, "TimedOut")),
        ({"phase": "Cancelled", "reason": "Cancelled"}, ("False", None, "Cancelled")),
    ],
)
def test_execution(changes: dict[str, Any], expected: tuple[str, str | None, str | None]) -> None:
    status = execution.build_status(ExecutionStatus(), changes, 2, NOW)
    assert status.observed_generation == 2
    assert _kstatus(status.conditions) == expected


def test_execution_ready_clears_reconciling_when_it_ends() -> None:
    running = execution.build_status(
        ExecutionStatus(), {"phase": "Running", "reason": "Started"}, 1, NOW
    )
    done = execution.build_status(running, {"phase": "Succeeded", "reason": "Succeeded"}, 1, NOW)
    assert {c.type for c in done.conditions} == {"Ready", "Scheduled", "Complete", "Succeeded"}


R = SnapshotReason


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        (
            snapshot_status.Observed(waiting=(R.SANDBOX_NOT_READY, "x")),
            ("False", R.SANDBOX_NOT_READY, None),
        ),
        (snapshot_status.Observed(created=True, volume_snapshot={}), ("False", R.CREATING, None)),
        (
            snapshot_status.Observed(
                created=True, volume_snapshot={"status": {"readyToUse": True}}
            ),
            ("True", None, None),
        ),
        (
            snapshot_status.Observed(failure=(R.UNSUPPORTED, "no API")),
            ("False", None, R.UNSUPPORTED),
        ),
        (snapshot_status.Observed(created=True), ("False", None, R.VOLUME_SNAPSHOT_MISSING)),
    ],
)
def test_snapshot(
    observed: snapshot_status.Observed, expected: tuple[str, str | None, str | None]
) -> None:
    status = snapshot_status.build_status(SnapshotStatus(), observed, 3, NOW)
    assert status.observed_generation == 3
    assert _kstatus(status.conditions) == expected
