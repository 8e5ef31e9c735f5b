"""Condition logic: pure functions from observed pod state to phase and reasons."""

from __future__ import annotations

from typing import Any

from sandbox_operator import conditions as c


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


def _by_type(conds: list[c.Cond]) -> dict[str, c.Cond]:
    return {cond.type: cond for cond in conds}


def test_ready_when_pod_and_agent_are_ready() -> None:
    phase, conds = c.compute(_observed(_pod(ready=True, agent_ready=True)))
    assert phase == c.RUNNING
    assert _by_type(conds)["Ready"] == c.Cond(
        "Ready", "True", c.REASON_READY, "agent and runner are serving"
    )


def test_starting_while_agent_not_ready() -> None:
    phase, conds = c.compute(_observed(_pod(ready=False)))
    assert phase == c.STARTING
    assert _by_type(conds)["AgentReady"].status == "False"
    assert _by_type(conds)["Ready"].reason == c.REASON_AGENT_NOT_READY


def test_missing_python_is_named() -> None:
    state = {
        "waiting": {
            "reason": "RunContainerError",
            "message": 'exec: "python3": executable file not found in $PATH',
        }
    }
    phase, conds = c.compute(_observed(_pod(sandbox_state=state)))
    assert phase == c.FAILED
    ready = _by_type(conds)["Ready"]
    assert ready.reason == c.REASON_RUNTIME_NO_PYTHON
    assert "python3 >= 3.9" in ready.message


def test_crash_loop_is_failed_not_starting() -> None:
    state = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    phase, conds = c.compute(_observed(_pod(sandbox_state=state, restarts=3)))
    assert phase == c.FAILED
    assert _by_type(conds)["Ready"].reason == c.REASON_RUNTIME_FAILED


def test_image_pull_failure() -> None:
    state = {"waiting": {"reason": "ErrImagePull", "message": "not found"}}
    _, conds = c.compute(_observed(_pod(sandbox_state=state)))
    assert _by_type(conds)["Ready"].reason == c.REASON_IMAGE_PULL


def test_unschedulable() -> None:
    pod = _pod()
    pod["status"]["conditions"][0] = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/1 nodes: Insufficient memory",
    }
    phase, conds = c.compute(_observed(pod))
    assert phase == c.PENDING
    assert _by_type(conds)["Ready"] == c.Cond(
        "Ready", "False", c.REASON_UNSCHEDULABLE, "0/1 nodes: Insufficient memory"
    )


def test_paused_and_pausing() -> None:
    phase, conds = c.compute(_observed(None, paused=True))
    assert phase == c.PAUSED
    assert _by_type(conds)["Paused"].status == "True"
    phase, conds = c.compute(_observed(_pod(), paused=True))
    assert _by_type(conds)["Paused"].reason == c.REASON_PAUSING


def test_invalid_spec_wins() -> None:
    phase, conds = c.compute(_observed(None, invalid="spec.runtime: unknown runtime 'x'"))
    assert phase == c.FAILED
    assert conds == [
        c.Cond("Ready", "False", c.REASON_INVALID_SPEC, "spec.runtime: unknown runtime 'x'")
    ]


def test_workspace_condition_comes_from_the_pod() -> None:
    _, conds = c.compute(_observed(_pod()))
    assert _by_type(conds)["WorkspaceReady"].reason == c.REASON_CLAIM_BOUND
    pod = _pod(scheduled=False)
    pod["status"]["conditions"][0].update(
        reason="Unschedulable", message="pod has unbound immediate PersistentVolumeClaims"
    )
    _, conds = c.compute(_observed(pod))
    workspace = _by_type(conds)["WorkspaceReady"]
    assert workspace.status == "False"
    assert "PersistentVolumeClaims" in workspace.message
    _, conds = c.compute(_observed(None))
    assert _by_type(conds)["WorkspaceReady"].status == "Unknown"
    _, conds = c.compute(_observed(None, ephemeral=True))
    assert _by_type(conds)["WorkspaceReady"].reason == c.REASON_EPHEMERAL


def test_merge_keeps_transition_time_while_status_holds() -> None:
    first = c.merge([], [c.Cond("Ready", "False", "A")], 1, "t1")
    assert first[0]["lastTransitionTime"] == "t1"
    same = c.merge(first, [c.Cond("Ready", "False", "B", "other reason")], 2, "t2")
    assert same[0]["lastTransitionTime"] == "t1"
    assert same[0]["observedGeneration"] == 2
    assert same[0]["reason"] == "B"
    flipped = c.merge(same, [c.Cond("Ready", "True", "C")], 2, "t3")
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_a_pod_stuck_on_an_unbound_claim_is_noticed_after_the_patience() -> None:
    from datetime import UTC, datetime, timedelta

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
