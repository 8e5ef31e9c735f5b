"""A Sandbox's status: pure functions from observed pod and claim state to
conditions, phase and the status model."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sandbox_operator.api.common import Condition
from sandbox_operator.api.sandbox import SandboxPhase, SandboxStatus
from sandbox_operator.api.sandbox import SandboxReason as R
from sandbox_operator.builders import sandbox_status as c
from sandbox_operator.builders.conditions import Cond, merge

RUNNING, STARTING, FAILED = SandboxPhase.RUNNING, SandboxPhase.STARTING, SandboxPhase.FAILED
PENDING, PAUSED = SandboxPhase.PENDING, SandboxPhase.PAUSED


def _compute(observed: c.Observed) -> tuple[SandboxPhase, dict[str, Cond | None]]:
    conds = c.compute(observed)
    return c.phase_of(conds), conds


def _observed(pod: dict[str, Any] | None, **kw: Any) -> c.Observed:
    base: dict[str, Any] = dict(
        generation=3,
        paused=False,
        deleting=False,
        ephemeral=False,
        pod=pod,
    )
    base.update(kw)
    return c.Observed(**base)


def _pod(
    *,
    scheduled: bool = True,
    ready: bool = False,
    agent_ready: bool = False,
    sandbox_state: dict[str, Any] | None = None,
    phase: str = "Running",
    restarts: int = 0,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "p"},
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True" if scheduled else "False"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
            "initContainerStatuses": [
                {"name": "agent", "ready": agent_ready, "state": {"running": {}}}
            ],
            "containerStatuses": [
                {
                    "name": "sandbox",
                    "ready": True,
                    "restartCount": restarts,
                    "state": sandbox_state or {"running": {}},
                }
            ],
        },
    }


def _by_type(conds: dict[str, Cond | None]) -> dict[str, Cond]:
    return {kind: cond for kind, cond in conds.items() if cond is not None}


def test_ready_when_pod_and_agent_are_ready() -> None:
    phase, conds = _compute(_observed(_pod(ready=True, agent_ready=True)))
    assert phase == RUNNING
    assert _by_type(conds)["Ready"] == Cond(
        "Ready", "True", R.READY, "agent and runner are serving"
    )


def test_files_not_written_hold_ready_and_say_why() -> None:
    why = "writing spec.files 'a/b' failed: not a directory"
    phase, conds = _compute(_observed(_pod(ready=True, agent_ready=True), files_problem=why))
    assert phase == STARTING
    assert _by_type(conds)["Ready"] == Cond("Ready", "False", R.FILES_NOT_WRITTEN, why)
    assert _by_type(conds)["AgentReady"].status == "True"
    # Only a serving sandbox writes files: before that, its own reason stands.
    _, conds = _compute(_observed(_pod(ready=False), files_problem=why))
    assert _by_type(conds)["Ready"].reason == R.AGENT_NOT_READY


def test_a_stopping_pod_is_not_ready_though_its_containers_still_are() -> None:
    pod = _pod(ready=True, agent_ready=True)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    phase, conds = _compute(_observed(pod))
    assert phase == STARTING
    assert _by_type(conds)["Ready"] == Cond(
        "Ready", "False", R.POD_TERMINATING, "the pod is stopping; a new one follows"
    )


def test_starting_while_agent_not_ready() -> None:
    phase, conds = _compute(_observed(_pod(ready=False)))
    assert phase == STARTING
    assert _by_type(conds)["AgentReady"].status == "False"
    assert _by_type(conds)["Ready"].reason == R.AGENT_NOT_READY


def test_missing_python_is_named() -> None:
    state = {
        "waiting": {
            "reason": "RunContainerError",
            "message": 'exec: "python3": executable file not found in $PATH',
        }
    }
    phase, conds = _compute(_observed(_pod(sandbox_state=state)))
    assert phase == FAILED
    ready = _by_type(conds)["Ready"]
    assert ready.reason == R.RUNTIME_NO_PYTHON
    assert "python3 >= 3.9" in ready.message


def test_crash_loop_is_failed_not_starting() -> None:
    state = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    phase, conds = _compute(_observed(_pod(sandbox_state=state, restarts=3)))
    assert phase == FAILED
    assert _by_type(conds)["Ready"].reason == R.RUNTIME_FAILED


def test_image_pull_failure() -> None:
    state = {"waiting": {"reason": "ErrImagePull", "message": "not found"}}
    _, conds = _compute(_observed(_pod(sandbox_state=state)))
    assert _by_type(conds)["Ready"].reason == R.IMAGE_PULL


def test_unschedulable() -> None:
    pod = _pod()
    pod["status"]["conditions"][0] = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/1 nodes: Insufficient memory",
    }
    phase, conds = _compute(_observed(pod))
    assert phase == PENDING
    assert _by_type(conds)["Ready"] == Cond(
        "Ready", "False", R.UNSCHEDULABLE, "0/1 nodes: Insufficient memory"
    )


def test_paused_and_pausing() -> None:
    phase, conds = _compute(_observed(None, paused=True))
    assert phase == PAUSED
    assert _by_type(conds)["Paused"].status == "True"
    phase, conds = _compute(_observed(_pod(), paused=True))
    assert _by_type(conds)["Paused"].reason == R.PAUSING


def test_invalid_spec_wins() -> None:
    phase, conds = _compute(_observed(None, invalid="spec.runtime: unknown runtime 'x'"))
    assert phase == FAILED
    message = "spec.runtime: unknown runtime 'x'"
    assert _by_type(conds) == {
        "Ready": Cond("Ready", "False", R.INVALID_SPEC, message),
        "Stalled": Cond("Stalled", "True", R.INVALID_SPEC, message),
    }


def test_workspace_condition_comes_from_the_pod() -> None:
    _, conds = _compute(_observed(_pod()))
    assert _by_type(conds)["WorkspaceReady"].reason == R.CLAIM_BOUND
    pod = _pod(scheduled=False)
    pod["status"]["conditions"][0].update(
        reason="Unschedulable", message="pod has unbound immediate PersistentVolumeClaims"
    )
    _, conds = _compute(_observed(pod))
    workspace = _by_type(conds)["WorkspaceReady"]
    assert workspace.status == "False"
    assert "PersistentVolumeClaims" in workspace.message
    _, conds = _compute(_observed(None))
    assert _by_type(conds)["WorkspaceReady"].status == "Unknown"
    _, conds = _compute(_observed(None, ephemeral=True))
    assert _by_type(conds)["WorkspaceReady"].reason == R.EPHEMERAL


def test_merge_keeps_transition_time_while_status_holds() -> None:
    first = merge([], {"Ready": Cond("Ready", "False", "A")}, 1, "t1")
    assert first[0].last_transition_time == "t1"
    same = merge(first, {"Ready": Cond("Ready", "False", "B", "other reason")}, 2, "t2")
    assert same[0].last_transition_time == "t1"
    assert same[0].observed_generation == 2
    assert same[0].reason == "B"
    flipped = merge(same, {"Ready": Cond("Ready", "True", "C")}, 2, "t3")
    assert flipped[0].last_transition_time == "t3"


def test_merge_removes_only_what_it_says_no_longer_applies() -> None:
    previous = [
        Condition(type="Ready", status="True", reason="A"),
        Condition(type="AgentReady", status="True", reason="A"),
        Condition(type="Example.com/Audited", status="True", reason="Tool"),
    ]
    merged = merge(previous, {"AgentReady": None, "Ready": Cond("Ready", "False", "B")}, 1, "t")
    # AgentReady was declared not to apply; the foreign condition is kept as it was.
    assert [c.type for c in merged] == ["Ready", "Example.com/Audited"]
    assert merged[1] == previous[2]
    with pytest.raises(ValueError, match="computed for type"):
        merge([], {"Ready": Cond("AgentReady", "True", "A")}, 1, "t")


def test_every_condition_type_is_named_in_every_observation() -> None:
    """No condition can vanish by omission: compute() names each type, applying or not."""
    observations = [
        _observed(None, invalid="bad"),
        _observed(None, paused=True),
        _observed(_pod(ready=True, agent_ready=True)),
        _observed(None, refused="403 Forbidden: quota"),
    ]
    names = {kind.value for kind in c.C} - c.REPORTED
    for observed in observations:
        assert set(c.compute(observed)) == names


def test_a_paused_sandbox_reports_its_bound_claim() -> None:
    claim = {"metadata": {"name": "x-workspace"}, "status": {"phase": "Bound"}}
    _, conds = _compute(_observed(None, paused=True, claim=claim))
    assert _by_type(conds)["WorkspaceReady"].status == "True"
    assert "PodScheduled" not in _by_type(conds)


def test_a_pending_claim_says_why() -> None:
    claim = {"metadata": {"name": "x-workspace"}, "status": {"phase": "Pending"}}
    problem = "StorageClass 'nope' does not exist"
    phase, conds = _compute(
        _observed(None, claim=claim, claim_problem=problem, awaiting_claim=True)
    )
    assert phase == PENDING
    workspace = _by_type(conds)["WorkspaceReady"]
    assert (workspace.status, workspace.reason) == ("False", R.CLAIM_PENDING)
    assert problem in workspace.message
    assert _by_type(conds)["Ready"].reason == R.WORKSPACE_PENDING


def test_an_evicted_pod_is_described_as_evicted_whatever_its_phase() -> None:
    message = "Pod ephemeral local storage usage exceeds the total limit of containers 64Mi. "
    for phase in ("Failed", "Succeeded"):
        pod = _pod(phase=phase)
        pod["status"]["conditions"].append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": message,
            }
        )
        described = c.describe_pod_end(pod)
        assert described.startswith("evicted by the kubelet")
        assert "ephemeral local storage" in described
    pod = _pod(phase="Failed")
    pod["status"].update(reason="Evicted", message="The node was low on resource: memory.")
    assert (
        c.describe_pod_end(pod) == "evicted by the kubelet: The node was low on resource: memory."
    )
    assert c.describe_pod_end(_pod(phase="Succeeded")) == "pod Succeeded"


def test_status_is_built_through_the_model() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    status = c.build_status(
        SandboxStatus(), _observed(_pod(ready=True, agent_ready=True)), 8080, now, image="img"
    )
    assert status.phase == RUNNING
    assert status.image == "img"
    with pytest.raises(TypeError, match="restarts"):
        c.build_status(SandboxStatus(), _observed(None), 8080, now, restarts=1)


def test_a_pod_stuck_on_an_unbound_claim_is_noticed_after_the_patience() -> None:
    def pod(status: str, message: str, since: str) -> dict[str, object]:
        cond = {"type": "PodScheduled", "status": status, "message": message}
        return {"status": {"conditions": [{**cond, "lastTransitionTime": since}]}}

    now = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    patience = timedelta(seconds=15)
    message = "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    assert c.stuck_on_unbound_claim(pod("False", message, "2026-01-01T00:00:00Z"), now, patience)
    assert not c.stuck_on_unbound_claim(
        pod("False", message, "2026-01-01T00:00:50Z"), now, patience
    )
    assert not c.stuck_on_unbound_claim(
        pod("False", "0/1 nodes are available: insufficient cpu", "2026-01-01T00:00:00Z"),
        now,
        patience,
    )
    assert not c.stuck_on_unbound_claim(pod("True", "", "2026-01-01T00:00:00Z"), now, patience)


def test_a_sandbox_without_room_in_a_quota_is_pending_and_says_why() -> None:
    why = "exceeded SandboxQuota team: sandboxes limited to 2, used 2, requested 1"
    phase, conds = _compute(_observed(None, quota=why))
    ready = _by_type(conds)["Ready"]
    assert (phase, ready.status, ready.reason, ready.message) == (
        SandboxPhase.PENDING,
        "False",
        R.QUOTA_EXCEEDED,
        why,
    )
    # Nothing of a pod or a claim applies to a sandbox that was not let in; it
    # goes ahead by itself when room is made (kstatus: Reconciling, not Stalled).
    assert set(_by_type(conds)) == {"Ready", "Reconciling"}


@pytest.mark.parametrize(
    ("total_mib", "free_mib", "was_full", "full"),
    [
        (1024, 500, False, False),
        (1024, 11, False, False),  # just over 1%
        (1024, 10, False, True),  # under 1%
        (1024, 40, True, True),  # once full, it stays so until 5% is free
        (1024, 52, True, False),
        (64, 0.9, False, True),  # small workspaces: at least 1 MiB ...
        (64, 3, True, True),  # ... and 4 MiB to clear
        (64, 4, True, False),
    ],
)
def test_a_workspace_is_full_below_one_percent_and_free_again_at_five(
    total_mib: int, free_mib: float, was_full: bool, full: bool
) -> None:
    total, free = total_mib * c.MIB, int(free_mib * c.MIB)
    cond = c.workspace_full(total, free, was_full=was_full)
    assert (cond is not None) == full
    if cond is not None:
        assert (cond.type, cond.status, cond.reason) == ("WorkspaceFull", "True", R.NO_SPACE_LEFT)
        assert f"{total_mib} MiB" in cond.message
        assert "ENOSPC" in cond.message
        # The message does not move with the free bytes: no status write while it stays full.
        assert c.workspace_full(total, 0, was_full=True) == cond


@pytest.mark.parametrize(
    ("before", "after", "grew"),
    [
        (3, 10, 7),
        (5, 5, 0),
        (10, 2, None),  # the container restarted: its new cgroup counts from zero
        (None, 4, None),  # the first look, or a mount that does not show it
        (4, None, None),
    ],
)
def test_counters_grow_or_set_a_new_baseline(
    before: int | None, after: int | None, grew: int | None
) -> None:
    assert c.grown(before, after) == grew


def test_a_refused_fork_is_reported_until_a_look_finds_none() -> None:
    assert c.pid_limit_reached(0) is None
    cond = c.pid_limit_reached(3)
    assert cond is not None
    assert (cond.type, cond.status, cond.reason) == ("PidLimitReached", "True", R.FORK_REFUSED)
    # The same message however many were refused: a bomb that goes on writes no status.
    assert c.pid_limit_reached(5000) == cond


@pytest.mark.parametrize(
    ("periods", "throttled", "was", "set_"),
    [
        (300, 150, False, True),  # half the periods: throttled
        (300, 149, False, False),
        (300, 40, True, True),  # once throttled, it stays so down to 10%
        (300, 29, True, False),
        (5, 5, False, False),  # it barely ran (idle after a burst): not throttled
        (5, 5, True, False),
    ],
)
def test_cpu_throttling_comes_at_half_the_periods_and_goes_below_a_tenth(
    periods: int, throttled: int, was: bool, set_: bool
) -> None:
    cond = c.cpu_throttled(periods, throttled, "200m", was=was)
    assert (cond is not None) == set_
    if cond is not None:
        assert (cond.type, cond.status, cond.reason) == ("CpuThrottled", "True", R.CPU_LIMIT)
        assert "200m" in cond.message
        assert c.cpu_throttled(1000, 1000, "200m", was=True) == cond
